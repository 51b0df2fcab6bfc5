"""The peers scenario's HTTP driver: sends a chat workload to one server's /v1/chat/completions,
streamed, and keeps per request its time to first token, its end, its usage and its reply text.

The turns go out as scale-out's driver sends them (scaleout/client.py `run_turns`: `concurrency`
clients, turn k of every conversation before any turn k + 1, a turn after its conversation's previous
reply, whose text joins the history). `body` shapes each request for the
server under test (servers.request_body: how it spells a forced length).

TTFT is the time from sending to the first chunk carrying reply text; the token counts are the
usage the last chunk reports (`stream_options.include_usage`), never counted from chunks (a chunk
may carry several tokens, or none while a multi-byte character is incomplete).

Invariants: a run returns one record per request or raises, naming the request (an HTTP error, a
stream without usage or without text); it is bounded by `timeout_s`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from radixserve_bench.agents.client import sse_events
from radixserve_bench.scaleout.client import run_turns
from radixserve_bench.scaleout.plan import ChatSession, ChatWorkload, Message

Body = Callable[[list[Message], int], dict[str, Any]]  # (messages, forced length) -> request body


@dataclass(frozen=True)
class StreamRecord:
    session_id: str
    turn: int
    send_s: float  # after the run's start
    ttft_s: float
    e2e_s: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None  # None: the server does not report it
    text: str
    finish: str | None

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first over the time from the first to the last; None for one token."""
        span = self.e2e_s - self.ttft_s
        return (self.completion_tokens - 1) / span if self.completion_tokens > 1 and span > 0 else None


@dataclass(frozen=True)
class StreamRun:
    workload: str
    duration_s: float  # first send to last reply
    records: tuple[StreamRecord, ...]


def read_chunk(event: dict[str, Any], parts: list[str], usage: dict[str, Any]) -> tuple[bool, str | None]:
    """Folds one chat.completion.chunk into the reply's text parts and usage: (carried text, finish)."""
    text, finish = False, None
    for choice in event.get("choices") or []:
        content = (choice.get("delta") or {}).get("content")
        if content:
            parts.append(content)
            text = True
        finish = choice.get("finish_reason") or finish
    if event.get("usage"):
        usage.update(event["usage"])
    return text, finish


async def stream_one(client: httpx.AsyncClient, body: dict[str, Any], where: str) -> tuple[float, dict[str, Any], str,
                                                                                           str | None, float]:
    """(ttft s, usage, text, finish reason, e2e s) of one streamed request."""
    parts: list[str] = []
    usage: dict[str, Any] = {}
    first: float | None = None
    finish: str | None = None
    sent = time.monotonic()
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{where}: HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}")
        async for event in sse_events(r):
            if "error" in event and not event.get("choices"):
                raise RuntimeError(f"{where}: stream error: {str(event['error'])[:300]}")
            text, done = read_chunk(event, parts, usage)
            if text and first is None:
                first = time.monotonic()
            finish = done or finish
    end = time.monotonic()
    if first is None:
        raise RuntimeError(f"{where}: the stream carried no reply text")
    if "completion_tokens" not in usage:
        raise RuntimeError(f"{where}: the stream reported no usage (stream_options.include_usage)")
    return first - sent, usage, "".join(parts), finish, end - sent


async def drive_streamed(client: httpx.AsyncClient, w: ChatWorkload, body: Body, timeout_s: float,
                         on_record: Callable[[StreamRecord], None] | None = None) -> StreamRun:
    replies: dict[str, list[str]] = {s.session_id: [] for s in w.sessions}
    records: list[StreamRecord] = []
    start = time.monotonic()

    async def send(s: ChatSession, k: int) -> None:
        sent = time.monotonic() - start
        ttft, usage, text, finish, e2e = await stream_one(
            client, body(s.messages(k, replies[s.session_id]), s.max_tokens), f"{w.name}: {s.session_id} turn {k}")
        replies[s.session_id].append(text)
        details = usage.get("prompt_tokens_details") or {}
        record = StreamRecord(s.session_id, k, sent, ttft, e2e, int(usage.get("prompt_tokens", 0)),
                              int(usage["completion_tokens"]),
                              int(details["cached_tokens"]) if details.get("cached_tokens") is not None else None,
                              text, finish)
        records.append(record)
        if on_record is not None:
            on_record(record)

    await run_turns(w, send, timeout_s)
    return StreamRun(w.name, time.monotonic() - start, tuple(sorted(records, key=lambda r: r.send_s)))


async def measure(url: str, w: ChatWorkload, body: Body, timeout_s: float,
                  on_record: Callable[[StreamRecord], None] | None = None) -> StreamRun:
    limits = httpx.Limits(max_connections=w.concurrency + 2, max_keepalive_connections=w.concurrency + 2)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        return await drive_streamed(client, w, body, timeout_s, on_record)
