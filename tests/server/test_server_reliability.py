"""Reliability reproductions against a real server on 127.0.0.1: one request must not wedge the server,
fail other clients' generations, or outlive its cancel; /health tells a dead or stalled engine.

A small server over a tiny random-weight model (the embedded model's tokenizer) serves the tests that
need their own pool or health settings; the cancel race runs on the shared embedded-model server.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from radixserve import AsyncEngine, EngineConfig
from radixserve.server import BackgroundServer, ServerConfig

pytest.register_assert_rewrite("server_testkit")
from server_testkit import (  # noqa: E402
    OWNED,
    connect,
    engine_idle,
    on_server_loop,
    recv_frame,
    request,
    wait_until,
    write_tiny_chat_model,
)

pytest_plugins = ["server_testkit"]
pytestmark = pytest.mark.slow

POOL_BLOCKS = 64  # x 16 tokens: a 1,024-token context


@pytest.fixture(scope="module")
def tiny_server(chat_server: BackgroundServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    model = write_tiny_chat_model(tmp_path_factory.mktemp("tiny"), Path(chat_server.engine.engine.model_dir))
    config = ServerConfig(port=0, web_dir=None, health_stall_s=1.0)
    with BackgroundServer(lambda: AsyncEngine(EngineConfig(model=str(model), num_blocks=POOL_BLOCKS)), config) as srv:
        yield srv


def completion(srv: BackgroundServer, content: str, timeout: float = 60.0, **extra: Any) -> httpx.Response:
    body = {"model": srv.state.model_name, "messages": [{"role": "user", "content": content}], **extra}
    return httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=timeout)


def prompt_tokens(srv: BackgroundServer, content: str) -> int:
    assert srv.state.formatter is not None
    return len(srv.state.formatter.prompt_tokens([{"role": "user", "content": content}]))


def test_pool_sized_prompt_after_a_mid_block_hit_does_not_wedge_the_server(tiny_server: BackgroundServer) -> None:
    """Reproduction 1: any chat, then one whose prompt is 1,023 tokens with max_tokens 1. Its cached
    prefix (the chat template's opening) ended mid-block; it needed one block more than the pool and
    every later request hung behind it while /health said ok."""
    assert completion(tiny_server, "hi", max_tokens=1).status_code == 200
    words = 990
    while prompt_tokens(tiny_server, "a" + " a" * words) < POOL_BLOCKS * 16 - 1:
        words += 1
    content = "a" + " a" * words
    assert prompt_tokens(tiny_server, content) == POOL_BLOCKS * 16 - 1
    r = completion(tiny_server, content, max_tokens=1)
    assert r.status_code == 200, r.text
    assert completion(tiny_server, "and after it?", max_tokens=2).status_code == 200
    assert httpx.get(tiny_server.url + "/health").status_code == 200
    wait_until(lambda: engine_idle(tiny_server), what="idle engine")
    assert tiny_server.engine.engine.stats_totals.stalled_steps == 0


@pytest.mark.parametrize("hostile", [{"temperature": 1e-300}, {"temperature": 1e-45},
                                     {"n": 2, "seed": 2**63 - 1, "temperature": 1.0}])
def test_hostile_sampling_values_fail_no_one(tiny_server: BackgroundServer, hostile: dict[str, Any]) -> None:
    """Reproduction 2: these passed validation, the engine step raised, and every in-flight request
    of every client got a 500. Now each is served, and so is the request running beside it."""
    async def run() -> tuple[list[int], list[str | None]]:
        async with httpx.AsyncClient(base_url=tiny_server.url, timeout=60) as client:
            body = {"model": tiny_server.state.model_name, "max_tokens": 40, "temperature": 0,
                    "messages": [{"role": "user", "content": "keep talking"}]}
            bystander = asyncio.create_task(client.post("/v1/chat/completions", json=body))
            await asyncio.sleep(0.2)
            hostile_body = {**body, "max_tokens": 8, **hostile}
            r = await client.post("/v1/chat/completions", json=hostile_body)
            b = await bystander
            return [r.status_code, b.status_code], [c["finish_reason"] for c in b.json()["choices"]]

    statuses, bystander_finish = asyncio.run(run())
    assert statuses == [200, 200] and bystander_finish == ["length"]


def test_hostile_temperature_in_a_websocket_frame(tiny_server: BackgroundServer) -> None:
    async def run() -> list[dict[str, Any]]:
        async with connect(tiny_server) as ws:
            created = await request(ws, {"type": "session.create", **OWNED})
            sid = created["session"]["id"]
            text = json.dumps({"type": "chat", "session_id": sid, "content": "hi", "gen_id": "g", **OWNED,
                               "sampling": {"temperature": 1e-45, "max_tokens": 4}})
            assert '"temperature": 1e-45' in text  # the float survives the JSON round trip as it is
            await ws.send(text)
            frames = []
            while not frames or frames[-1]["type"] not in ("done", "error"):
                frames.append(await recv_frame(ws))
            return frames

    frames = asyncio.run(run())
    assert frames[-1]["type"] == "done" and frames[-1]["finish_reason"] == "length"


def test_cancel_in_the_same_write_as_its_chat_wins(chat_server: BackgroundServer) -> None:
    """Reproduction 5: a chat frame and its cancel read together: the cancel aborted an id the engine
    had not been given yet, and the generation ran its full length (3 of 3 trials)."""
    async def run() -> list[dict[str, Any]]:
        dones = []
        async with connect(chat_server) as ws:
            for trial in range(3):  # a fresh session each time: the same prompt, which does not end at once
                sid = (await request(ws, {"type": "session.create", **OWNED}))["session"]["id"]
                gen = f"race-{trial}"
                chat = json.dumps({"type": "chat", "session_id": sid, "content": "Count to a thousand.",
                                   "gen_id": gen, **OWNED, "sampling": {"max_tokens": 400, "temperature": 0}})
                cancel = json.dumps({"type": "cancel", "gen_id": gen})
                send_in_one_write(ws, chat, cancel)
                while (f := await recv_frame(ws))["type"] != "done":
                    assert f["type"] in ("start", "delta"), f
                dones.append(f)
        return dones

    for done in asyncio.run(run()):
        assert done["finish_reason"] == "abort" and done["usage"]["completion_tokens"] <= 1, done
    wait_until(lambda: engine_idle(chat_server), what="idle engine after the cancels")


def send_in_one_write(ws: Any, *texts: str) -> None:
    """Text frames in one TCP write, so the server reads them together (as the issue's client did)."""
    for text in texts:
        ws.protocol.send_text(text.encode())
    ws.transport.write(b"".join(ws.protocol.data_to_send()))


def test_health_reports_a_stalled_engine(tiny_server: BackgroundServer) -> None:
    runner = tiny_server.engine.engine.runner
    release = threading.Event()
    real_run = runner.run

    def hung_run(batch: Any, pending: Any = None, asked: Any = None) -> Any:
        release.wait(30)
        return real_run(batch, pending, asked)

    runner.run = hung_run  # a forward that hangs (a stuck kernel, a deadlock)
    try:
        pending = threading.Thread(target=completion, args=(tiny_server, "hello"), kwargs={"max_tokens": 2})
        pending.start()
        wait_until(lambda: httpx.get(tiny_server.url + "/health").status_code == 503, timeout=20,
                   what="/health to notice the stall")
        body = httpx.get(tiny_server.url + "/health").json()
        assert body["status"] == "unhealthy" and "no progress" in body["detail"]
    finally:
        release.set()
        runner.run = real_run
    pending.join(60)
    wait_until(lambda: httpx.get(tiny_server.url + "/health").status_code == 200, what="healthy again")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_health_reports_a_dead_engine_thread(chat_server: BackgroundServer, tmp_path: Path) -> None:
    class EngineThreadDeath(BaseException):
        """Not an Exception: nothing in the step loop may catch it, so the thread dies."""

    model = write_tiny_chat_model(tmp_path / "tiny", Path(chat_server.engine.engine.model_dir))
    with BackgroundServer(lambda: AsyncEngine(EngineConfig(model=str(model), num_blocks=16)),
                          ServerConfig(port=0, web_dir=None)) as srv:
        assert httpx.get(srv.url + "/health").status_code == 200

        def die() -> None:
            raise EngineThreadDeath()

        srv.engine.engine.step = die  # type: ignore[method-assign]
        on_server_loop(srv, _start_one(srv))
        wait_until(lambda: httpx.get(srv.url + "/health").status_code == 503, what="/health to notice")
        assert "stopped" in httpx.get(srv.url + "/health").json()["detail"]


async def _start_one(srv: BackgroundServer) -> None:
    """Queue one request (so the engine thread steps), give up on it after half a second."""
    from radixserve import SamplingParams

    agen = srv.engine.generate([1, 2, 3], SamplingParams(max_tokens=1))
    try:
        await asyncio.wait_for(agen.__anext__(), 0.5)
    except asyncio.TimeoutError:
        pass
    finally:
        await agen.aclose()
