"""Shared pieces of the server tests (a pytest plugin: test modules list it in `pytest_plugins`).

`chat_server` is one real uvicorn server on 127.0.0.1 (free port, background thread) over the
embedded model, shared by every server test module of the run and always stopped at the end. Tests
reach the engine through `chat_server.engine` / `chat_server.state` (same process).
"""

from __future__ import annotations

import asyncio
import json
import queue
import subprocess
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import websockets

from radixserve import AsyncEngine, EngineConfig
from radixserve.server import BackgroundServer, ServerConfig
from radixserve.server.owners import OWNER_HEADER, Owner

TEST_MAX_MESSAGE_BYTES = 64 * 1024
FRAME_TIMEOUT_S = 60.0
# The owner secret the tests' sessions belong to: sent as X-Session-Owner by rest_client and as the
# `owner` field of WebSocket session frames (OWNED).
TEST_OWNER = "server-tests-owner-secret"
OWNED = {"owner": TEST_OWNER}
TEST_OWNER_KEY = Owner.of(TEST_OWNER)  # for reaching the sessions in the store directly


@pytest.fixture(scope="session")
def chat_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    web = tmp_path_factory.mktemp("web")
    (web / "index.html").write_text("<!doctype html><title>radixserve test ui</title>")
    (web / "app.js").write_text("console.log('ui');")
    # every system prompt the shared server's tests send gets its own metrics label (the default 10
    # would fold a later test's prompt into "other", depending on which tests ran before it)
    config = ServerConfig(port=0, web_dir=web, max_message_bytes=TEST_MAX_MESSAGE_BYTES, max_sessions=256,
                          shutdown_grace_s=1.0, system_prompt_labels=1000)
    with BackgroundServer(lambda: AsyncEngine(EngineConfig(num_blocks=256)), config) as srv:
        yield srv


@pytest.fixture(scope="session")
def tiny_chat_server() -> Iterator[BackgroundServer]:
    """A real server on 127.0.0.1 over the tiny random-weight chat model (a tokenizer and a ChatML
    template: tests/tiny_models.py): fast end-to-end tests of structured output and tool calls."""
    from tiny_models import tiny_chat_model_dir

    model = str(tiny_chat_model_dir("llama"))
    # a label per system prompt, as chat_server has: whichever tests ran first must not fold a later
    # test's prompt into "other"
    config = ServerConfig(port=0, web_dir=None, shutdown_grace_s=0.5, system_prompt_labels=1000)
    with BackgroundServer(lambda: AsyncEngine(EngineConfig(model=model, num_blocks=512)), config) as srv:
        yield srv


def on_server_loop(srv: BackgroundServer, coro: Coroutine[Any, Any, Any], timeout: float = 120.0) -> Any:
    """Run a coroutine on the server's event loop (the engine's outputs are delivered there)."""
    assert srv.state.loop is not None
    return asyncio.run_coroutine_threadsafe(coro, srv.state.loop).result(timeout)


def wait_until(predicate: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@contextmanager
def leaves_no_process(timeout_s: float = 60.0) -> Iterator[Callable[[], list[psutil.Process]]]:
    """Every process started in the block (a Ray cluster's) must be gone within `timeout_s` of its
    end. Yields `started()`, which lists them and records them: call it once they are up, so that
    one re-parented away from this process before the end is still waited for."""
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    seen: dict[int, psutil.Process] = {}

    def started() -> list[psutil.Process]:
        for p in me.children(recursive=True):
            if p.pid not in before:
                seen.setdefault(p.pid, p)
        return list(seen.values())

    try:
        yield started
    finally:
        _, alive = psutil.wait_procs(started(), timeout=timeout_s)
        assert not alive, f"processes left behind: {[p.pid for p in alive]}"


def engine_idle(srv: BackgroundServer) -> bool:
    st = srv.engine.stats()
    return st.num_running == 0 and st.num_waiting == 0 and st.blocks_used == 0


async def recv_frame(ws: Any, timeout: float = FRAME_TIMEOUT_S) -> dict[str, Any]:
    raw = await asyncio.wait_for(ws.recv(), timeout)
    frame = json.loads(raw)
    assert isinstance(frame, dict) and isinstance(frame.get("type"), str), raw
    return frame


async def request(ws: Any, frame: dict[str, Any]) -> dict[str, Any]:
    await ws.send(json.dumps(frame))
    return await recv_frame(ws)


async def chat(ws: Any, session_id: str, content: str, gen_id: str, **extra: Any) -> list[dict[str, Any]]:
    """Send one chat frame (as TEST_OWNER unless `owner` is given); return every frame of that generation
    through `done` (or an error)."""
    return await chat_frames(ws, {"session_id": session_id, "content": content, **extra}, gen_id)


async def chat_frames(ws: Any, fields: dict[str, Any], gen_id: str) -> list[dict[str, Any]]:
    """`chat` with the frame's fields as given (a turn of tool results has no content)."""
    await ws.send(json.dumps({"type": "chat", "gen_id": gen_id, **OWNED, **fields}))
    frames = []
    while True:
        f = await recv_frame(ws)
        assert f.get("gen_id") == gen_id, f
        frames.append(f)
        if f["type"] in ("done", "error"):
            return frames


def rest_client(srv: BackgroundServer, timeout: float = 60.0) -> httpx.Client:
    """An HTTP client of the server whose session requests carry TEST_OWNER."""
    return httpx.Client(base_url=srv.url, timeout=timeout, headers={OWNER_HEADER: TEST_OWNER})


def connect(srv: BackgroundServer, **kw: Any) -> Any:
    return websockets.connect(srv.ws_url, open_timeout=30, **kw)


def raw_request(srv: BackgroundServer, method: str, path: str, headers: dict[str, str],
                body: bytes = b"", http: str = "HTTP/1.1") -> tuple[int, bytes]:
    """One request over a plain socket, headers exactly as given (Host included, or left out): the
    status and the body. A 101 (WebSocket upgrade accepted) returns at once with an empty body."""
    import socket

    lines = [f"{method} {path} {http}", *(f"{k}: {v}" for k, v in headers.items())]
    if "Connection" not in headers:
        lines.append("Connection: close")
    if body:
        lines.append(f"Content-Length: {len(body)}")
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        raw = b""
        while b"\r\n\r\n" not in raw:
            chunk = sock.recv(65536)
            if not chunk:
                break
            raw += chunk
        head, _, body = raw.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if status == 101:
            return status, b""
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")[1:]
                       if line.lower().startswith(b"content-length:")), None)
        while (length is None or len(body) < length) and (chunk := sock.recv(65536)):
            body += chunk
    return status, body


def ws_upgrade_headers(host: str, origin: str | None = None) -> dict[str, str]:
    """The headers of a browser's WebSocket upgrade (Host and Origin as given)."""
    headers = {"Host": host, "Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13",
               "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="}
    if origin is not None:
        headers["Origin"] = origin
    return headers


def write_tiny_chat_model(root: Path, tokenizer_dir: Path, max_positions: int = 2048) -> Path:
    """A random-weight two-layer Llama with the embedded model's vocabulary and tokenizer: loads in
    about a second, for tests that need a second server but no meaningful text. `max_positions` is
    its context length (a long one costs only a larger RoPE table). `tokenizer_dir` may also be a
    GGUF file (the embedded default served as shipped), whose tokenizer is written out."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from radixserve.model.loader import load_tokenizer

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=49152, max_position_embeddings=max_positions, bos_token_id=1,
                      eos_token_id=2, tie_word_embeddings=True, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(root)
    if tokenizer_dir.is_file():
        load_tokenizer(tokenizer_dir).save_pretrained(root)
        return root
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, root / f.name)
    return root


SERVE_STARTUP_S = 300.0  # a `radixserve serve --replicas` child process: Ray and every replica up


def pump_lines(proc: subprocess.Popen[str], out: queue.Queue[str]) -> None:
    """Every line `proc` prints, into `out` (run on a thread: reading blocks)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        out.put(line)


def wait_for_serving_url(proc: subprocess.Popen[str], out: queue.Queue[str], log: list[str]) -> str:
    """The URL a `radixserve serve` child prints once it serves; its output so far is kept in `log`."""
    deadline = time.monotonic() + SERVE_STARTUP_S
    while time.monotonic() < deadline:
        try:
            line = out.get(timeout=1.0)
        except queue.Empty:
            assert proc.poll() is None, f"serve exited with {proc.returncode}:\n{''.join(log)}"
            continue
        log.append(line)
        if "radixserve: serving at " in line:
            return line.split("serving at ", 1)[1].split()[0]
    raise AssertionError(f"serve did not start in {SERVE_STARTUP_S:.0f} s:\n{''.join(log)}")
