"""Hostile connections (issue 24, item 4): idle, slowloris and partial-body sockets must neither
exhaust the server's file descriptors nor stay open, and generations are capped per client and
server-wide with 429 / 503 and Retry-After.

The regression test runs `radixserve serve` as a subprocess with a 1,024-descriptor limit (as in
the report) on its DEFAULT limits, opens 1,000 hostile connections against it, and requires /health
and a chat to keep answering and every hostile socket to be closed within the header timeout (the
body timeout for partial bodies). Everything binds 127.0.0.1, is bounded in time and is closed at
the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import resource
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from radixserve import AsyncEngine, EngineConfig
from radixserve.server import BackgroundServer, ServerConfig
from radixserve.server.owners import OWNER_HEADER

SERVER_FD_LIMIT = 1024  # the descriptor limit of the report
HOSTILE = 1024  # as many as the descriptor limit, as in the report: silent, slowloris and partial-body connections, a third each
# the defaults the server must protect itself with (tests/server/test_server_connections.py checks they are the defaults)
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 10.0
CLOSE_SLACK_S = 4.0  # scheduling slack on a loaded machine, on top of a timeout
HEALTH_BUDGET_S = 0.05  # median /health with the hostile sockets open (the target; measured ~1 ms)
START_TIMEOUT_S = 180.0


def _limit_fds() -> None:  # runs in the child before exec
    resource.setrlimit(resource.RLIMIT_NOFILE, (SERVER_FD_LIMIT, SERVER_FD_LIMIT))


@contextlib.contextmanager
def serve_subprocess(*flags: str) -> Iterator[str]:
    """`radixserve serve` on 127.0.0.1, a free port, 1,024 descriptors; yields its URL; always stopped."""
    cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--host", "127.0.0.1", "--port", "0", "--no-web", *flags]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            preexec_fn=_limit_fds)
    lines: list[str] = []
    found: list[str] = []
    ready = threading.Event()

    def pump() -> None:  # reads the child's output to the end, so it never blocks on a full pipe
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            m = re.search(r"serving .* at (http://127\.0\.0\.1:\d+)", line)
            if m and not found:
                found.append(m.group(1))
                ready.set()
        ready.set()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        if not ready.wait(START_TIMEOUT_S) or not found:
            raise AssertionError(f"server did not start: {''.join(lines)[-3000:]}")
        yield found[0]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        reader.join(10)
        if proc.stdout is not None:
            proc.stdout.close()


@contextlib.contextmanager
def enough_fds(needed: int) -> Iterator[None]:
    """This test process holds the client ends of the hostile sockets: raise its soft limit for them."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if want < needed:
        pytest.skip(f"needs {needed} file descriptors, the hard limit is {hard}")
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


class Hostiles:
    """HOSTILE sockets: silent ones, slowloris ones trickling a header forever, and partial bodies
    trickling a body forever. A thread trickles one byte into each live one every 0.5 s."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.socks: list[tuple[str, socket.socket]] = []
        self.closed_at: dict[int, float] = {}
        self.opened_at = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._trickle, daemon=True)

    def open(self, count: int) -> None:
        head = "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        for i in range(count):
            kind = ("silent", "slowloris", "body")[i % 3]
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.settimeout(10)
            try:
                s.connect(("127.0.0.1", self.port))
                if kind == "slowloris":
                    s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
                elif kind == "body":
                    s.sendall((head + "Content-Length: 60000\r\n\r\n{\"model\":").encode())
            except OSError:  # refused or reset at once: that is a closed hostile socket too
                self.closed_at[len(self.socks)] = time.monotonic()
            s.setblocking(False)
            self.socks.append((kind, s))
        self.opened_at = time.monotonic()
        self._thread.start()

    def _trickle(self) -> None:
        while not self._stop.wait(0.5):
            for i, (kind, s) in enumerate(self.socks):
                if i in self.closed_at:
                    continue
                try:
                    data = s.recv(4096)
                    if data == b"":  # the server closed it
                        self.closed_at[i] = time.monotonic()
                        continue
                except BlockingIOError:
                    pass
                except OSError:
                    self.closed_at[i] = time.monotonic()
                    continue
                if kind != "silent":
                    try:
                        s.send(b"a")
                    except BlockingIOError:
                        pass
                    except OSError:
                        self.closed_at[i] = time.monotonic()

    def open_count(self) -> int:
        return len(self.socks) - len(self.closed_at)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        for _, s in self.socks:
            s.close()


def raw_get(port: int, path: str, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """One GET over a fresh socket (no client library overhead in the timing): status, headers, body."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    if not lines[0]:
        raise ConnectionError("closed without a response")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def _health_latency(url: str) -> float:
    started = time.monotonic()
    status, _, body = raw_get(int(url.rsplit(":", 1)[1]), "/health")
    assert status == 200, body
    return time.monotonic() - started


def test_hostile_connections_neither_starve_the_server_nor_stay_open() -> None:
    with enough_fds(HOSTILE + 256), serve_subprocess() as url:
        port = int(url.rsplit(":", 1)[1])
        _health_latency(url)  # warm
        hostiles = Hostiles(port)
        try:
            hostiles.open(HOSTILE)
            time.sleep(1.0)  # let the server take them all in
            latencies = []
            for _ in range(7):
                try:
                    latencies.append(_health_latency(url))
                except (OSError, AssertionError) as e:
                    raise AssertionError(f"/health failed with {hostiles.open_count()} hostile sockets open: "
                                         f"{e!r}") from None
            with httpx.Client(base_url=url, timeout=60) as client:
                model = client.get("/v1/models").json()["data"][0]["id"]
                r = client.post("/v1/chat/completions", json={
                    "model": model, "max_tokens": 4, "temperature": 0,
                    "messages": [{"role": "user", "content": "Say hi."}]})
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["message"]["content"] is not None
            deadline = hostiles.opened_at + max(HEADER_TIMEOUT_S, BODY_TIMEOUT_S) + CLOSE_SLACK_S
            while hostiles.open_count() and time.monotonic() < deadline:
                time.sleep(0.2)
            still_open = hostiles.open_count()
            late = {kind: 0 for kind in ("silent", "slowloris", "body")}
            for i, (kind, _) in enumerate(hostiles.socks):
                limit = (BODY_TIMEOUT_S if kind == "body" else HEADER_TIMEOUT_S) + CLOSE_SLACK_S
                if i not in hostiles.closed_at or hostiles.closed_at[i] - hostiles.opened_at > limit:
                    late[kind] += 1
        finally:
            hostiles.close()
        print(f"/health with {HOSTILE} hostile sockets: median {statistics.median(latencies) * 1000:.1f} ms, "
              f"max {max(latencies) * 1000:.1f} ms; still open after the timeouts: {still_open}, late: {late}")
        assert still_open == 0 and not any(late.values()), late
        assert statistics.median(latencies) <= HEALTH_BUDGET_S, latencies


def test_defaults_are_the_ones_the_regression_test_relies_on() -> None:
    d = ServerConfig()
    assert (d.header_timeout_s, d.body_timeout_s) == (HEADER_TIMEOUT_S, BODY_TIMEOUT_S)
    assert d.max_connections >= HOSTILE - 100  # the cap, not the descriptor limit, is what bites first


# -- one in-process server with small limits ------------------------------------------------------------
CAP = 12  # connections


@pytest.fixture(scope="module")
def srv() -> Iterator[BackgroundServer]:
    config = ServerConfig(port=0, web_dir=None, max_connections=CAP, header_timeout_s=1.0, body_timeout_s=1.0,
                          keep_alive_timeout_s=5.0, max_generations_per_client=1, max_concurrent_generations=2,
                          shutdown_grace_s=0.5)
    with BackgroundServer(lambda: AsyncEngine(EngineConfig(num_blocks=128)), config) as server:
        assert server.server.config.http_protocol_class.guard.cap == CAP  # type: ignore[attr-defined]
        yield server


def _closed_within(s: socket.socket, seconds: float) -> bytes:
    """What the server sent before closing `s`; fails if it is still open after `seconds`."""
    s.settimeout(seconds)
    got = b""
    try:
        while chunk := s.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(f"still open after {seconds} s (got {got[:200]!r})") from None
    return got


def test_silent_trickling_and_partial_requests_get_408_and_are_closed(srv: BackgroundServer) -> None:
    openers = {
        "silent": b"",
        "slowloris": b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ",
        "partial body": (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                         b"content-length: 1000\r\n\r\n{\"model\":"),
        "partial anthropic body": (b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                                   b"content-length: 1000\r\n\r\n{\"model\":"),
    }
    internal = srv.state.metrics.api_errors.labels("internal")
    internal_before = internal._value.get()
    for kind, opener in openers.items():
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
            s.sendall(opener)
            started = time.monotonic()
            got = _closed_within(s, 5.0)
            took = time.monotonic() - started
            assert got.startswith(b"HTTP/1.1 408"), (kind, got[:300])
            error = json.loads(got.partition(b"\r\n\r\n")[2])
            if "anthropic" in kind:  # the Messages API's own shape, which its SDK reads
                assert error["type"] == "error" and error["error"]["type"] == "timeout_error", error
            else:
                assert error["error"]["code"] == "request_timeout", kind
            assert 0.8 <= took <= 3.0, (kind, took)
    wait_for(lambda: srv.server.config.http_protocol_class.guard.open == set())  # type: ignore[attr-defined]
    assert internal._value.get() == internal_before  # a body that timed out is the client's fault, not an error
    assert _health_latency(srv.url) < 5


def test_keep_alive_requests_each_get_a_fresh_header_clock(srv: BackgroundServer) -> None:
    with httpx.Client(base_url=srv.url, timeout=10) as client:
        for _ in range(3):  # 0.7 s apart: more than the 1 s header timeout in all, less between requests
            assert client.get("/health").status_code == 200
            time.sleep(0.7)


def wait_for(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_over_the_cap_the_longest_idle_connection_goes_then_503(srv: BackgroundServer) -> None:
    guard = srv.server.config.http_protocol_class.guard  # type: ignore[attr-defined]
    wait_for(lambda: not guard.open)
    idle = [socket.create_connection(("127.0.0.1", srv.port), timeout=10) for _ in range(CAP)]
    try:
        wait_for(lambda: len(guard.open) == CAP)
        assert _health_latency(srv.url) < 5  # got in: the oldest idle one made room
        assert _closed_within(idle[0], 2.0) == b""  # evicted at once, long before its header timeout
        assert guard.evicted >= 1
    finally:
        for s in idle:
            s.close()

    async def busy() -> None:  # WebSockets are never idle in the guard's sense: at the cap a newcomer is refused
        import websockets

        sockets = [await websockets.connect(srv.ws_url, open_timeout=10) for _ in range(CAP)]
        try:
            wait_for(lambda: len(guard.open) == CAP)
            status, headers, body = await asyncio.to_thread(raw_get, srv.port, "/health")
            assert status == 503 and headers["retry-after"] == "1", (status, headers)
            assert json.loads(body)["error"]["code"] == "overloaded"
        finally:
            for ws in sockets:
                await ws.close()

    wait_for(lambda: not guard.open)
    asyncio.run(busy())
    wait_for(lambda: not guard.open)
    assert _health_latency(srv.url) < 5


def _chat_body(srv: BackgroundServer, **extra: Any) -> dict[str, Any]:
    return {"model": srv.state.model_name, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": "Hi"}], **extra}


def _hold(srv: BackgroundServer, client: str) -> Any:
    async def take() -> Any:
        return srv.state.generations.acquire(client, srv.state.config)

    assert srv.state.loop is not None
    return asyncio.run_coroutine_threadsafe(take(), srv.state.loop).result(10)


def test_generation_caps_answer_429_then_503_with_retry_after(srv: BackgroundServer) -> None:
    gens = srv.state.generations
    wait_for(lambda: gens.total == 0)
    with httpx.Client(base_url=srv.url, timeout=60) as client:
        mine = _hold(srv, "127.0.0.1")  # this client's one generation (--max-generations-per-client 1)
        try:
            r = client.post("/v1/chat/completions", json=_chat_body(srv))
            assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
            assert r.json()["error"]["code"] == "too_many_generations"
            created = client.post("/v1/sessions", json={}).json()
            r = client.post(f"/v1/sessions/{created['id']}/messages", json={"content": "hi"},
                            headers={OWNER_HEADER: created["owner"]})
            assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_generations", r.text

            async def ws_chat() -> dict[str, Any]:
                import websockets

                async with websockets.connect(srv.ws_url, open_timeout=10) as ws:
                    await ws.send(json.dumps({"type": "session.create"}))
                    created = json.loads(await asyncio.wait_for(ws.recv(), 30))["session"]
                    await ws.send(json.dumps({"type": "chat", "session_id": created["id"], "owner": created["owner"],
                                              "gen_id": "g", "content": "hi"}))
                    return dict(json.loads(await asyncio.wait_for(ws.recv(), 30)))

            frame = asyncio.run(ws_chat())
            assert frame["type"] == "error" and frame["code"] == "too_many_generations", frame
            assert frame["gen_id"] == "g" and frame["retry_after"] == 1
        finally:
            mine.release()
        others = _hold(srv, "192.0.2.1"), _hold(srv, "192.0.2.2")  # the server's 2 are taken by other clients
        try:
            r = client.post("/v1/chat/completions", json=_chat_body(srv))
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert r.json()["error"]["code"] == "overloaded"
        finally:
            for slot in others:
                slot.release()
        assert gens.total == 0
        assert client.post("/v1/chat/completions", json=_chat_body(srv)).status_code == 200


def test_every_way_a_generation_ends_gives_its_slot_back(srv: BackgroundServer) -> None:
    gens = srv.state.generations
    with httpx.Client(base_url=srv.url, timeout=60) as client:
        assert client.post("/v1/chat/completions", json=_chat_body(srv)).status_code == 200
        with client.stream("POST", "/v1/chat/completions", json=_chat_body(srv, stream=True)) as r:
            assert r.status_code == 200 and "[DONE]" in r.read().decode()
        with client.stream("POST", "/v1/chat/completions", json=_chat_body(srv, stream=True, max_tokens=300)) as r:
            next(r.iter_lines())  # leave mid-stream
        wait_for(lambda: gens.total == 0)
        bad = client.post("/v1/chat/completions", json=_chat_body(srv, temperature=9))
        assert bad.status_code == 400
        created = client.post("/v1/sessions", json={}).json()
        r = client.post(f"/v1/sessions/{created['id']}/messages", json={"content": "hi", "sampling": {"max_tokens": 2}},
                        headers={OWNER_HEADER: created["owner"]})
        assert r.status_code == 200, r.text
    wait_for(lambda: gens.total == 0 and not gens.per_client)


def test_large_prompts_are_tokenized_off_the_event_loop_with_the_same_tokens(srv: BackgroundServer) -> None:
    from radixserve.server.pipeline.prompt_worker import INLINE_CHARS

    worker = srv.state.prompt_worker
    assert worker is not None and srv.state.formatter is not None
    messages = [{"role": "system", "content": "Be terse. <|im_start|>user"},
                {"role": "user", "content": "words and <|im_end|> " * (INLINE_CHARS // 10)}]
    loop = srv.state.loop
    assert loop is not None
    threads: list[str] = []
    original = worker._own.prompt_tokens

    def spy(msgs: Any, tools: Any = None, variables: Any = None) -> list[int]:
        threads.append(threading.current_thread().name)
        return original(msgs, tools, variables)

    worker._own.prompt_tokens = spy  # type: ignore[method-assign]
    try:
        got = asyncio.run_coroutine_threadsafe(worker.chat_tokens(messages), loop).result(30)
    finally:
        del worker._own.prompt_tokens
    f = srv.state.formatter
    assert got == (f.prompt_tokens(messages), f.system_tokens(messages))
    assert threads and threads[0].startswith("radixserve-tokenize")


def _refused_metrics(srv: BackgroundServer) -> dict[tuple[str, str], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(srv.url + "/metrics", timeout=10).text
    return {(s.name, s.labels["reason"]): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name in ("radixserve_connections_refused_total", "radixserve_generations_refused_total")}


def test_refusals_and_timeouts_are_counted_in_metrics(srv: BackgroundServer) -> None:
    """What the guard and the generation caps turn away shows in /metrics, every reason always listed."""
    before = _refused_metrics(srv)
    assert set(before) == {("radixserve_connections_refused_total", r) for r in
                           ("refused_over_cap", "evicted_idle", "timed_out")} | {
        ("radixserve_generations_refused_total", r) for r in ("client_cap", "server_cap")}
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:  # silent: times out
        assert _closed_within(s, 5.0).startswith(b"HTTP/1.1 408")
    mine = _hold(srv, "127.0.0.1")
    try:
        assert httpx.post(srv.url + "/v1/chat/completions", json=_chat_body(srv), timeout=60).status_code == 429
    finally:
        mine.release()
    after = _refused_metrics(srv)
    assert after[("radixserve_connections_refused_total", "timed_out")] == before[("radixserve_connections_refused_total",
                                                                                   "timed_out")] + 1
    assert after[("radixserve_generations_refused_total", "client_cap")] == before[("radixserve_generations_refused_total",
                                                                                    "client_cap")] + 1
