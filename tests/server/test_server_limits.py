"""Resource bounds against a real server: a WebSocket client that stops reading, HTTP clients that
hang up on a non-streaming generation, and session memory (count, bytes, context-sized history).

One server over a tiny random-weight model with a long context (32,768 tokens of KV blocks), so a
256 KB system prompt fits and a long generation is cheap and never ends by itself early (greedy decoding
of this model does not reach EOS)."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import websockets

from radixserve import AsyncEngine, EngineConfig
from radixserve.server import BackgroundServer, ServerConfig
from radixserve.server.owners import OWNER_HEADER

pytest.register_assert_rewrite("server_testkit")
from server_testkit import (  # noqa: E402
    OWNED,
    TEST_OWNER,
    TEST_OWNER_KEY,
    connect,
    engine_idle,
    request,
    rest_client,
    wait_until,
    write_tiny_chat_model,
)

pytestmark = pytest.mark.slow

SEND_BUFFER = 256 * 1024
BIG_SYSTEM_PROMPT = ("Section break\n" + "-" * 64 + "\n") * 3200  # 256 KB in ~13k tokens: fits the context
LONG = {"temperature": 0, "max_tokens": 4000}


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    from radixserve.model.embedded import embedded_model_dir

    model = write_tiny_chat_model(tmp_path_factory.mktemp("tiny-long"), embedded_model_dir(), max_positions=65536)
    config = ServerConfig(port=0, web_dir=None, max_message_bytes=512 * 1024, ws_send_buffer_bytes=SEND_BUFFER,
                          shutdown_grace_s=0.5)
    with BackgroundServer(lambda: AsyncEngine(EngineConfig(model=str(model), num_blocks=2048)), config) as srv:
        yield srv


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def aborted(srv: BackgroundServer) -> int:
    return int(srv.engine.stats().requests_finished.get("abort", 0))


def slow_client_drops(srv: BackgroundServer) -> float:
    counter = getattr(srv.state.metrics, "ws_slow_client_disconnects", None)
    return counter._value.get() if counter is not None else 0.0


def test_websocket_client_that_never_reads_is_disconnected(tiny_server) -> None:  # noqa: ANN001
    http = rest_client(tiny_server)
    big = http.post("/v1/sessions", json={"system_prompt": BIG_SYSTEM_PROMPT})
    assert big.status_code == 201, big.text
    big_id = big.json()["id"]
    gen_id = http.post("/v1/sessions", json={}).json()["id"]
    aborted_before, rss_before, drops_before = aborted(tiny_server), rss_bytes(), slow_client_drops(tiny_server)

    async def run() -> tuple[Any, int]:
        # A small receive buffer and a one-frame client queue: the client stops pulling data off the
        # socket almost at once, as a stalled browser tab would. No compression: the repetitive
        # prompt would shrink to nothing on the wire and fit in the kernel's socket buffers.
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", tiny_server.port))
        sock.setblocking(False)
        async with websockets.connect(tiny_server.ws_url, sock=sock, max_queue=1, max_size=None, open_timeout=30,
                                      ping_interval=None, close_timeout=5, compression=None) as ws:
            await ws.send(json.dumps({"type": "chat", "session_id": gen_id, "content": "go", "gen_id": "g",
                                      **OWNED, "sampling": LONG}))
            try:
                for i in range(1000):
                    frame = {"type": "session.resume", "session_id": big_id, **OWNED} if i % 2 else \
                        {"type": "ping", "req": "p" * 1000, "pad": "x" * 10000}
                    await asyncio.wait_for(ws.send(json.dumps(frame)), 3)
            except (asyncio.TimeoutError, websockets.ConnectionClosed):
                pass  # the server stopped reading: it has dropped us
            # the server works through the flood; give it time to drop us (or, unbounded, to pile it all up)
            deadline = time.monotonic() + 20
            while slow_client_drops(tiny_server) == drops_before and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.5)
            held = rss_bytes() - rss_before  # before the client reads anything back
            received, deadline = 0, time.monotonic() + 60
            with pytest.raises(websockets.ConnectionClosed) as closed:
                while received < 300 * 2**20 and time.monotonic() < deadline:
                    received += len(await asyncio.wait_for(ws.recv(), 30))
            return closed.value.rcvd, held

    rcvd, held = asyncio.run(run())
    assert rcvd is not None and rcvd.code == 1008 and "send buffer" in rcvd.reason, rcvd
    assert slow_client_drops(tiny_server) == drops_before + 1
    assert held < 64 * 2**20, f"the server held {held / 2**20:.0f} MB for a client that does not read"
    wait_until(lambda: engine_idle(tiny_server), timeout=10, what="the dropped client's generation aborted")
    assert aborted(tiny_server) == aborted_before + 1
    session = tiny_server.state.sessions.get(gen_id, TEST_OWNER_KEY)
    wait_until(lambda: session.busy is None, what="the aborted turn recorded")
    assert session.messages[-1].finish_reason == "abort"
    assert tiny_server.engine.leaked_blocks() == 0

    async def still_serving() -> dict[str, Any]:
        async with connect(tiny_server) as ws:
            return await request(ws, {"type": "ping", "req": 1})

    assert asyncio.run(still_serving()) == {"type": "pong", "req": 1}


def hang_up_after(url: str, path: str, body: dict[str, Any], seconds: float) -> None:
    with httpx.Client(base_url=url, timeout=seconds, headers={OWNER_HEADER: TEST_OWNER}) as client, \
            pytest.raises(httpx.ReadTimeout):
        client.post(path, json=body)  # the client gives up and closes the connection


def test_openai_non_streaming_client_disconnect_aborts(tiny_server) -> None:  # noqa: ANN001
    before = aborted(tiny_server)
    body = {"model": tiny_server.state.model_name, "n": 4, "max_tokens": 4000, "temperature": 0,
            "messages": [{"role": "user", "content": "Write a very long story."}]}
    hang_up_after(tiny_server.url, "/v1/chat/completions", body, 1.5)
    t0 = time.monotonic()
    wait_until(lambda: engine_idle(tiny_server), timeout=5, what="generation aborted after the client left")
    assert time.monotonic() - t0 < 5 and aborted(tiny_server) == before + 1
    assert tiny_server.engine.leaked_blocks() == 0


def test_session_non_streaming_client_disconnect_aborts(tiny_server) -> None:  # noqa: ANN001
    http = rest_client(tiny_server)
    sid = http.post("/v1/sessions", json={"sampling": {"temperature": 0}}).json()["id"]
    before = aborted(tiny_server)
    hang_up_after(tiny_server.url, f"/v1/sessions/{sid}/messages",
                  {"content": "Tell me everything.", "sampling": {"max_tokens": 4000}}, 1.5)
    wait_until(lambda: engine_idle(tiny_server), timeout=5, what="generation aborted after the client left")
    assert aborted(tiny_server) == before + 1
    wait_until(lambda: not http.get(f"/v1/sessions/{sid}").json()["busy"], timeout=5, what="session free")
    r = http.post(f"/v1/sessions/{sid}/messages", json={"content": "Short now.", "sampling": {"max_tokens": 3}})
    assert r.status_code == 200, r.text
    messages = http.get(f"/v1/sessions/{sid}").json()["messages"]
    assert [m.get("finish_reason") for m in messages if m["role"] == "assistant"] == ["abort", "length"]


def test_system_prompt_that_leaves_no_room_is_refused_at_creation(tiny_server) -> None:  # noqa: ANN001
    http = rest_client(tiny_server)
    context = tiny_server.engine.max_model_len
    too_long = " hi" * (context + 10)  # one token per " hi"
    r = http.post("/v1/sessions", json={"system_prompt": too_long})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_too_long", r.text
    assert str(context) in r.json()["error"]["message"]
    cfg = tiny_server.state.config
    cfg.max_prompt_tokens = 50
    try:
        r = http.post("/v1/sessions", json={"system_prompt": " hi" * 60})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_too_long"

        async def ws_create() -> dict[str, Any]:
            async with connect(tiny_server) as ws:
                return await request(ws, {"type": "session.create", "system_prompt": " hi" * 60, "req": 7})

        err = asyncio.run(ws_create())
        assert (err["type"], err["code"], err["req"]) == ("error", "context_too_long", 7)
        assert http.post("/v1/sessions", json={"system_prompt": " hi" * 10}).status_code == 201
    finally:
        cfg.max_prompt_tokens = None


def test_session_byte_budget_evicts_least_recently_used(tiny_server) -> None:  # noqa: ANN001
    http = rest_client(tiny_server)
    store = tiny_server.state.sessions
    old_budget = store.max_bytes
    store.max_bytes = 400_000
    try:
        prompt = "Sessions must fit in the budget. " * 1000  # ~33 KB of text, ~7k tokens
        ids = []
        for i in range(12):
            r = http.post("/v1/sessions", json={"system_prompt": f"{i} {prompt}"})
            assert r.status_code == 201, r.text
            ids.append(r.json()["id"])
            assert store.total_bytes <= store.max_bytes
        assert http.get(f"/v1/sessions/{ids[0]}").status_code == 404  # the oldest went first
        assert http.get(f"/v1/sessions/{ids[-1]}").status_code == 200
        assert store.total_bytes == sum(s.footprint() for s in store)
    finally:
        store.max_bytes = old_budget
