"""The host-memory tier seen through a real server: usage on every API (OpenAI, streamed and not;
session turns over REST, SSE and WebSocket), GET /v1/cache/stats and /metrics.

One server over a tiny random-weight model (the embedded model's tokenizer) with a 24-block device
pool, a 4 MiB host tier and swap preemption (and one with a 32-block host tier, for drops). Two
prompts of ~300 tokens ("a flood") push everything else out of the device pool into the host tier,
so the next request that shares an earlier prefix loads it back; concurrent long generations
overflow the pool and are swapped out and back in.
Greedy decoding of this model does not reach EOS, so every generation runs its max_tokens.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from radixserve import AsyncEngine, EngineConfig
from radixserve.server import BackgroundServer, ServerConfig

pytest.register_assert_rewrite("server_testkit")
from server_testkit import (  # noqa: E402
    OWNED,
    connect,
    engine_idle,
    request,
    rest_client,
    wait_until,
    write_tiny_chat_model,
)
from server_testkit import chat as ws_chat  # noqa: E402

pytestmark = pytest.mark.slow

POOL_BLOCKS = 24  # x 16 tokens: 384 tokens of KV on the device
HOST_MB = 4.0  # 1,024 blocks of this model: nothing is dropped from this server's host tier
FLOOD_TOKENS = 300
GREEDY = {"temperature": 0, "max_tokens": 2}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from radixserve.model.embedded import embedded_model_dir

    return str(write_tiny_chat_model(tmp_path_factory.mktemp("tiny-host"), embedded_model_dir()))


def serve(model: str, host_cache_mb: float) -> BackgroundServer:
    engine = EngineConfig(model=model, num_blocks=POOL_BLOCKS, host_cache_mb=host_cache_mb, preemption_mode="swap",
                          new_token_ratio=0.0)  # no growth reserve at admission: swaps must happen
    return BackgroundServer(lambda: AsyncEngine(engine), ServerConfig(port=0, web_dir=None))


@pytest.fixture(scope="module")
def srv(model_dir: str) -> Iterator[BackgroundServer]:
    with serve(model_dir, HOST_MB) as server:
        yield server


def text_of(srv: BackgroundServer, tag: str, tokens: int, system: str | None = None) -> str:
    """A user message of about `tokens` prompt tokens (system prompt and template included) that
    shares no prefix with another tag's."""
    assert srv.state.formatter is not None
    words = [f"{tag}{i}" for i in range(tokens)]
    head = [{"role": "system", "content": system}] if system is not None else []
    while len(srv.state.formatter.prompt_tokens([*head, {"role": "user", "content": " ".join(words)}])) > tokens:
        words.pop()
    return " ".join(words)


def completion(srv: BackgroundServer, messages: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=120,
                   json={"model": srv.state.model_name, "messages": messages, **GREEDY, **extra})
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def flood(srv: BackgroundServer, tag: str) -> None:
    """Fill the device pool twice over with prompts of their own: every earlier prefix is evicted,
    written back to the host tier."""
    before = srv.engine.stats().written_back_blocks
    for part in ("a", "b"):
        completion(srv, [{"role": "user", "content": text_of(srv, f"{tag}{part}x", FLOOD_TOKENS)}])
    assert srv.engine.stats().written_back_blocks > before


def system_prompt(tag: str) -> str:
    """A system prompt of ~100 tokens, its own per test (the server's cache outlives each test): only
    the chat template's opening tokens are shared with other prompts."""
    return f"[{tag}] " + ("You are a host tier test assistant. " * 12).strip()


# a first request may find the template's opening (a few tokens, less than a block) in the host tier
OPENING = 16


def assert_host_hit(usage: dict[str, Any], at_least: int) -> None:
    """`usage` (of a turn or of OpenAI's prompt_tokens_details plus prompt_tokens) loaded at least
    `at_least` of its cached tokens back from the host tier."""
    assert at_least <= usage["host_cached_tokens"] <= usage["cached_tokens"] < usage["prompt_tokens"], usage


def test_openai_usage_reports_tokens_loaded_from_the_host(srv: BackgroundServer) -> None:
    system = system_prompt("openai")

    def ask(content: str, **extra: Any) -> dict[str, Any]:
        return completion(srv, [{"role": "system", "content": system}, {"role": "user", "content": content}], **extra)

    first = ask("first")["usage"]
    assert first["prompt_tokens_details"]["host_cached_tokens"] < OPENING
    flood(srv, "oa")
    usage = ask("second")["usage"]
    # the whole system prompt was a hit, and only the template's opening was still on the device
    assert_host_hit({**usage["prompt_tokens_details"], "prompt_tokens": usage["prompt_tokens"]},
                    first["prompt_tokens"] - OPENING)
    flood(srv, "ob")
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")
    chunks = list(client.chat.completions.create(
        model=srv.state.model_name, messages=[{"role": "system", "content": system}, {"role": "user", "content": "3"}],
        max_tokens=2, temperature=0, stream=True, stream_options={"include_usage": True}))
    streamed = chunks[-1].usage
    assert streamed is not None and streamed.prompt_tokens_details is not None
    cached = streamed.prompt_tokens_details.cached_tokens or 0
    host = getattr(streamed.prompt_tokens_details, "host_cached_tokens", None)  # the extension field, kept by the SDK
    assert isinstance(host, int) and first["prompt_tokens"] - OPENING <= host <= cached


def test_session_turns_report_tokens_loaded_from_the_host(srv: BackgroundServer) -> None:
    """A conversation whose user paused: its history went to the host tier, the next turn loads it back."""
    system = system_prompt("session")
    with rest_client(srv) as http:
        sid = http.post("/v1/sessions", json={"system_prompt": system, "sampling": GREEDY}).json()["id"]
        first = http.post(f"/v1/sessions/{sid}/messages", json={"content": "first"}).json()
        assert first["usage"]["host_cached_tokens"] < OPENING
        flood(srv, "rs")
        second = http.post(f"/v1/sessions/{sid}/messages", json={"content": "second"}).json()
        # the whole first turn (prompt and reply) came back from the host tier
        assert_host_hit(second["usage"], first["usage"]["prompt_tokens"] - OPENING)
        stored = http.get(f"/v1/sessions/{sid}").json()["messages"]
        assert stored[-1]["usage"] == second["usage"]
        flood(srv, "ss")
        with http.stream("POST", f"/v1/sessions/{sid}/messages", json={"content": "third", "stream": True}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        start, done = events[0], events[-1]
        assert start["type"] == "start" and done["type"] == "done"
        assert_host_hit(done["usage"], second["usage"]["prompt_tokens"] - OPENING)
        assert start["host_cached_tokens"] == done["usage"]["host_cached_tokens"]

    async def over_websocket() -> tuple[int, dict[str, Any], dict[str, Any]]:
        async with connect(srv) as ws:
            created = await request(ws, {"type": "session.create", "system_prompt": system_prompt("ws"), **OWNED})
            wsid = created["session"]["id"]
            frames = await ws_chat(ws, wsid, "first", "g1", sampling=GREEDY)
            assert frames[-1]["type"] == "done" and frames[-1]["usage"]["host_cached_tokens"] < OPENING
            first_prompt = frames[-1]["usage"]["prompt_tokens"]
            await asyncio.to_thread(flood, srv, "ws")
            frames = await ws_chat(ws, wsid, "second", "g2", sampling=GREEDY)
            return first_prompt, frames[0], frames[-1]

    first_prompt, start, done = asyncio.run(over_websocket())
    assert start["type"] == "start" and done["type"] == "done", (start, done)
    assert_host_hit(done["usage"], first_prompt - OPENING)
    assert start["host_cached_tokens"] == done["usage"]["host_cached_tokens"]


def scrape(srv: BackgroundServer) -> dict[str, float]:
    text = httpx.get(srv.url + "/metrics", timeout=30).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(radixserve_\S+) (\S+)$", text, re.MULTILINE)}


def cache_stats(srv: BackgroundServer) -> dict[str, Any]:
    wait_until(lambda: engine_idle(srv), what="idle engine")
    r = httpx.get(srv.url + "/v1/cache/stats", timeout=30)
    assert r.status_code == 200
    body: dict[str, Any] = r.json()
    return body


def test_cache_stats_and_metrics_show_the_host_tier(srv: BackgroundServer) -> None:
    before = cache_stats(srv)
    ask = [{"role": "system", "content": system_prompt("stats")}, {"role": "user", "content": "one"}]
    completion(srv, ask)
    flood(srv, "st")
    hit = completion(srv, ask)["usage"]["prompt_tokens_details"]["host_cached_tokens"]
    assert hit > 0
    s = cache_stats(srv)
    host, was = s["host"], before["host"]
    assert host["enabled"] is True
    b = host["blocks"]
    assert b["total"] > 0 and 0 <= b["free"] < b["total"] and b["used"] == b["total"] - b["free"]
    assert s["host_cached_tokens"] == host["hit_tokens"] == was["hit_tokens"] + hit
    assert host["nodes"] > 0 and host["tokens"] > 0  # the floods' prompts now live only in host memory
    for copies in ("write_back", "load_back"):
        now, then = host[copies], was[copies]
        assert now["blocks"] > then["blocks"] and now["seconds"] >= then["seconds"] >= 0, copies
        assert now["bytes"] % now["blocks"] == 0 and now["bytes"] > then["bytes"], copies
    # every block is the same size, whichever way it went
    block_bytes = {host[c]["bytes"] // host[c]["blocks"] for c in ("write_back", "load_back")}
    assert len(block_bytes) == 1, block_bytes
    assert host["dropped_blocks"] == 0  # the host tier is far larger than what was written back
    assert s["cached_tokens"] >= s["host_cached_tokens"]

    m = scrape(srv)  # the engine is idle: /metrics and /v1/cache/stats read the same counters
    assert m["radixserve_prompt_tokens_cached_host_total"] == s["host_cached_tokens"]
    assert m["radixserve_prompt_tokens_cached_total"] == s["cached_tokens"]
    for copies in ("write_back", "load_back"):
        for unit in ("blocks", "bytes", "seconds"):
            assert m[f"radixserve_host_{copies}_{unit}_total"] == pytest.approx(host[copies][unit]), (copies, unit)
    assert m["radixserve_host_dropped_blocks_total"] == host["dropped_blocks"]
    assert m['radixserve_host_kv_blocks{state="used"}'] == b["used"]
    assert m['radixserve_host_kv_blocks{state="free"}'] == b["free"]
    assert m["radixserve_host_kv_blocks_total"] == b["total"]


def test_swap_preemption_shows_in_swaps(srv: BackgroundServer) -> None:
    """Six generations of ~150 tokens want 2.5 times the device pool: some are swapped out to the
    host tier and every one of them back in."""
    before = cache_stats(srv)

    async def run() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=300) as client:
            bodies = [{"model": srv.state.model_name, "temperature": 0, "max_tokens": 120,
                       "messages": [{"role": "user", "content": text_of(srv, f"sw{i}x", 40)}]} for i in range(6)]
            rs = await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies))
            return [r.json() for r in rs]

    for body in asyncio.run(run()):
        assert body["choices"][0]["finish_reason"] == "length", body
    s = cache_stats(srv)
    out = s["swaps"]["out"] - before["swaps"]["out"]
    assert out > 0, s
    assert s["swaps"]["in"] - before["swaps"]["in"] == out  # all finished: every swapped one came back
    assert s["preemptions"] - before["preemptions"] >= out
    m = scrape(srv)
    assert m['radixserve_swaps_total{direction="out"}'] == s["swaps"]["out"]
    assert m['radixserve_swaps_total{direction="in"}'] == s["swaps"]["in"]
    assert s["host"]["write_back"]["blocks"] > before["host"]["write_back"]["blocks"]  # swap-out copies



def test_a_full_host_tier_drops_blocks(model_dir: str) -> None:
    """A 32-block host tier (128 KiB of this model) holds one flood prompt (19 blocks), not two: the
    least recently used is dropped to make room for the next, and the server says so."""
    with serve(model_dir, 32 * 4096 / 2**20) as small:
        flood(small, "dr")
        flood(small, "ds")
        s = cache_stats(small)
        host = s["host"]
        assert host["enabled"] is True and host["blocks"]["total"] == 32
        assert host["dropped_blocks"] > 0 and host["blocks"]["used"] > 0 and host["nodes"] > 0, host
        assert host["write_back"]["blocks"] >= host["dropped_blocks"] + host["blocks"]["used"]
        m = scrape(small)
        assert m["radixserve_host_dropped_blocks_total"] == host["dropped_blocks"]
        assert m['radixserve_host_kv_blocks{state="used"}'] == host["blocks"]["used"]
