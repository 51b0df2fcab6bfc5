"""The scale-out scenario's HTTP driver: sends a chat workload to a running application's
/v1/chat/completions as OpenAI clients would, and reads the cluster's statistics once every replica
has reported the run.

`concurrency` clients take (conversation, turn) pairs from one queue in send order; a turn waits for
its conversation's previous reply, whose text joins the history as an assistant message. Greedy
(temperature 0), non-streaming, `max_tokens` per turn. Each record keeps the replica that served it
(`x-radixserve-replica`) and the response's usage.

Invariants: a run returns one record per request or raises (an HTTP error names the request and
status); it is bounded by `timeout_s`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx

from radixserve_bench.scaleout.plan import ChatSession, ChatWorkload

REPLICA_HEADER = "x-radixserve-replica"


@dataclass(frozen=True)
class ChatRecord:
    session_id: str
    turn: int
    replica: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    send_s: float  # after the run's start
    e2e_s: float


@dataclass(frozen=True)
class ChatRun:
    workload: str
    duration_s: float  # first send to last reply
    records: tuple[ChatRecord, ...]


async def run_turns(w: ChatWorkload, send: Callable[[ChatSession, int], Awaitable[None]], timeout_s: float) -> None:
    """`send(session, turn)` for every turn of `w`: `w.concurrency` clients take them from one queue in
    send order, and a turn waits for its conversation's previous one (the module docstring's loop)."""
    queue: deque[tuple[ChatSession, int]] = deque(w.order())
    done = {(s.session_id, k): asyncio.Event() for s, k in queue}

    async def worker() -> None:
        while queue:
            s, k = queue.popleft()
            if k:
                await done[(s.session_id, k - 1)].wait()
            await send(s, k)
            done[(s.session_id, k)].set()

    try:
        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(min(w.concurrency, len(queue))))), timeout_s)
    except asyncio.TimeoutError:
        raise RuntimeError(f"{w.name}: the run exceeded {timeout_s:.0f} s") from None


async def drive_chat(client: httpx.AsyncClient, w: ChatWorkload, model: str, timeout_s: float,
                     on_record: Callable[[ChatRecord], None] | None = None) -> ChatRun:
    replies: dict[str, list[str]] = {s.session_id: [] for s in w.sessions}
    records: list[ChatRecord] = []
    start = time.monotonic()

    async def send(s: ChatSession, k: int) -> None:
        body = {"model": model, "messages": s.messages(k, replies[s.session_id]), "max_tokens": s.max_tokens,
                "temperature": 0}
        sent = time.monotonic()
        r = await client.post("/v1/chat/completions", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"{w.name}: {s.session_id} turn {k}: HTTP {r.status_code}: {r.text[:300]}")
        data = r.json()
        replies[s.session_id].append(data["choices"][0]["message"].get("content") or "")
        usage = data["usage"]
        record = ChatRecord(s.session_id, k, r.headers.get(REPLICA_HEADER, ""), usage["prompt_tokens"],
                            usage["prompt_tokens_details"]["cached_tokens"], usage["completion_tokens"],
                            sent - start, time.monotonic() - sent)
        records.append(record)
        if on_record is not None:
            on_record(record)

    await run_turns(w, send, timeout_s)
    duration = time.monotonic() - start
    if len(records) != w.num_requests:
        raise RuntimeError(f"{w.name}: {len(records)} of {w.num_requests} requests recorded")
    return ChatRun(w.name, duration, tuple(sorted(records, key=lambda r: r.send_s)))


async def model_name(client: httpx.AsyncClient) -> str:
    r = await client.get("/v1/models")
    r.raise_for_status()
    return str(r.json()["data"][0]["id"])


async def settled_stats(client: httpx.AsyncClient, requests: int, wait_s: float = 20.0,
                        poll_s: float = 0.25) -> tuple[dict[str, Any], bool]:
    """GET /v1/cache/stats once the replicas' reports (every ClusterConfig.stats_period_s) count at least
    `requests` finished requests, in the totals and in the per-replica rows alike; (the last stats
    read, False) if they never do within `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        r = await client.get("/v1/cache/stats")
        r.raise_for_status()
        stats: dict[str, Any] = r.json()
        # the totals and the per-replica rows are read one after the other: both must count the run
        if stats.get("requests", 0) >= requests and sum(rep["requests"] for rep in stats.get("replicas", [])) >= requests:
            return stats, True
        if time.monotonic() >= deadline:
            return stats, False
        await asyncio.sleep(poll_s)
