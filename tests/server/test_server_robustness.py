"""Hostile and broken clients: hundreds of malformed frames and bodies, auth, origins, startup and
shutdown. The server must answer every bad input with an error, stay up, and leak nothing."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from radixserve import AsyncEngine, EngineConfig
from radixserve.server import BackgroundServer, ServerConfig, build_app
from radixserve.server.runner import RadixUvicornServer, uvicorn_config

pytest.register_assert_rewrite("server_testkit")
from server_testkit import (  # noqa: E402
    OWNED,
    TEST_MAX_MESSAGE_BYTES,
    connect,
    raw_request,
    recv_frame,
    request,
    rest_client,
    wait_until,
    write_tiny_chat_model,
    ws_upgrade_headers,
)

pytest_plugins = ["server_testkit"]
pytestmark = pytest.mark.slow


def malformed_frames(rng: random.Random, session_id: str) -> list[tuple[str | bytes, str | None]]:
    """(frame, expected error code or None for "any error")."""
    frames: list[tuple[str | bytes, str | None]] = []
    for _ in range(40):
        frames.append((rng.randbytes(rng.randint(1, 300)), "binary_frame"))
    while len(frames) < 80:
        text = "".join(rng.choice('{}[]":,abc\\ 0-9\u00e9\U0001f600') for _ in range(rng.randint(1, 60)))
        try:
            json.loads(text)
        except ValueError:
            frames.append((text, "bad_json"))
    for value in ([], [1, 2], "text", 3, 1.5, None, True):
        frames.append((json.dumps(value), "not_an_object"))
    frames += [("NaN", "bad_json"), ('{"type": "ping", "x": Infinity}', "bad_json"), ("[" * 20000, "bad_json")]
    for t in ("hello", "CHAT", "session.delete", "", "chat ", "auth.ok", "pong"):
        frames.append((json.dumps({"type": t}), "unknown_type" if t else "invalid_field"))
    for t in (None, 5, [], {}, True):
        frames.append((json.dumps({"type": t}) if t is not None else json.dumps({"kind": "ping"}),
                       "missing_field" if t is None else "invalid_field"))
    ok = {"type": "chat", "session_id": session_id, "content": "hi", "gen_id": "g", **OWNED}
    for key in ("session_id", "content", "gen_id"):
        frames.append((json.dumps({k: v for k, v in ok.items() if k != key}), "missing_field"))
        for bad in (5, None, [], {"a": 1}, True, 1.5):
            frames.append((json.dumps({**ok, key: bad}), "invalid_field"))
    frames.append((json.dumps({**ok, "content": ""}), "invalid_field"))
    frames.append((json.dumps({**ok, "gen_id": "x" * 65}), "invalid_field"))
    for sampling in ([], "hot", {"temperature": -1}, {"temperature": 9}, {"top_p": 0}, {"max_tokens": 0},
                     {"max_tokens": "5"}, {"seed": 1.5}, {"stop": "x" * 300}, {"stop": [1]}, {"wat": 1},
                     {"temperature": True}, {"top_k": -3}, {"max_tokens": 10**9}):
        code = "context_too_long" if sampling == {"max_tokens": 10**9} else "invalid_field"
        frames.append((json.dumps({**ok, "sampling": sampling}), code))
    for sid in ["", "nope", "a" * 200, "../../etc/passwd", "%00", session_id + "x", session_id[:-1], "\u0000",
                "' OR 1=1 --", session_id.upper() if session_id.upper() != session_id else "Z" + session_id]:
        frames.append((json.dumps({**ok, "session_id": sid}), "invalid_field" if sid == "" else "unknown_session"))
        frames.append((json.dumps({"type": "session.resume", "session_id": sid, **OWNED}),
                       "invalid_field" if sid == "" else "unknown_session"))
    for bad in (5, None, []):
        frames.append((json.dumps({"type": "session.create", "system_prompt": bad}) if bad is not None
                       else json.dumps({"type": "session.create", "sampling": "x"}), "invalid_field"))
    frames += [(json.dumps({"type": "cancel"}), "missing_field"), (json.dumps({"type": "cancel", "gen_id": 3}),
               "invalid_field"), (json.dumps({"type": "cancel", "gen_id": "none-running"}), "unknown_gen_id")]
    frames.append(("x" * (TEST_MAX_MESSAGE_BYTES + 1), "too_large"))
    frames.append((json.dumps({"type": "ping", "pad": "y" * TEST_MAX_MESSAGE_BYTES}), "too_large"))
    frames.append(("\u00e9" * (TEST_MAX_MESSAGE_BYTES // 2 + 1), "too_large"))
    frames.append((json.dumps({**ok, "content": "z" * (2 * TEST_MAX_MESSAGE_BYTES)}), "too_large"))
    return frames


def malformed_http(rng: random.Random, sid: str, model: str) -> list[tuple[str, str, Any, int]]:
    """(method, path, raw body or JSON-able, expected status)."""
    big = "x" * (TEST_MAX_MESSAGE_BYTES + 10)
    out: list[tuple[str, str, Any, int]] = []
    for body in (b"not json", b"[1,2]", b"", b"\xff\xfe", b'{"system_prompt": 5}', b'{"sampling": {"top_p": 7}}',
                 b'{"sampling": []}', json.dumps({"system_prompt": big}).encode()):
        out.append(("POST", "/v1/sessions", body, 413 if len(body) > TEST_MAX_MESSAGE_BYTES else 400))
    for body in ({}, {"content": 5}, {"content": ""}, {"content": "hi", "stream": "yes"},
                 {"content": "hi", "sampling": {"max_tokens": -1}}, {"content": "hi", "sampling": {"bad": 1}}, [1],
                 {"content": "hi", "sampling": {"max_tokens": 10**9}}):
        out.append(("POST", f"/v1/sessions/{sid}/messages", json.dumps(body).encode(), 400))
    for body in ({}, {"at_message": -1}, {"at_message": "1"}, {"at_message": 999}, {"at_message": 1.0}):
        out.append(("POST", f"/v1/sessions/{sid}/fork", json.dumps(body).encode(), 400))
    for _ in range(10):
        bad = "".join(rng.choice("abcdefXYZ0123456789-_") for _ in range(rng.randint(1, 40)))
        out.append(("GET", f"/v1/sessions/{bad}", None, 404))
        out.append(("POST", f"/v1/sessions/{bad}/messages", b'{"content": "hi"}', 404))
    msgs = [{"role": "user", "content": "hi"}]
    base = {"model": model, "messages": msgs, "max_tokens": 2}
    for patch in ({"model": None}, {"model": 5}, {"messages": None}, {"messages": "hi"}, {"messages": []},
                  {"messages": [{}]}, {"messages": [{"role": "robot", "content": "x"}]},
                  {"messages": [{"role": "user"}]},
                  {"messages": [{"role": "user", "content": 5}]},
                  {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
                  {"messages": [5]}, {"n": 0}, {"n": 1000}, {"n": "2"}, {"temperature": -1}, {"temperature": "1"},
                  {"top_p": 2}, {"top_p": 0}, {"max_tokens": 0}, {"max_tokens": "5"}, {"max_completion_tokens": -2},
                  {"stop": 5}, {"stop": [""]}, {"stop": ["a"] * 9}, {"seed": "x"}, {"stream": "yes"},
                  {"stream_options": 5}, {"logprobs": "yes"}, {"top_logprobs": 2},
                  {"logprobs": True, "top_logprobs": 21}, {"presence_penalty": 2.5}, {"frequency_penalty": "x"},
                  {"repetition_penalty": 0}, {"logit_bias": {"x": 1}},
                  {"response_format": {"type": "xml"}}, {"guided_choice": []}, {"tools": [{"type": "function"}]},
                  {"max_tokens": 10**7}, {"messages": [{"role": "user", "content": "hi", "tool_calls": [{}]}]}):
        body = {k: v for k, v in {**base, **patch}.items() if v is not None}
        out.append(("POST", "/v1/chat/completions", json.dumps(body).encode(), 400))
    out.append(("POST", "/v1/chat/completions", json.dumps({**base, "model": "other"}).encode(), 404))
    out += [("POST", "/v1/chat/completions", b"{", 400), ("POST", "/v1/chat/completions", big.encode(), 413),
            ("GET", "/v1/chat/completions", None, 405), ("DELETE", "/v1/models", None, 405)]
    return out


def test_hundreds_of_malformed_inputs_each_get_an_error(chat_server) -> None:  # noqa: ANN001
    rng = random.Random(20240611)
    http = rest_client(chat_server, timeout=30)
    sid = http.post("/v1/sessions", json={"sampling": {"temperature": 0}}).json()["id"]
    frames = malformed_frames(rng, sid)
    bodies = malformed_http(rng, sid, chat_server.state.model_name)
    assert len(frames) + len(bodies) >= 200

    async def run() -> int:
        answered = 0
        async with connect(chat_server, max_size=None) as ws:
            for i, (frame, code) in enumerate(frames):
                await ws.send(frame)
                reply = await recv_frame(ws)
                assert reply["type"] == "error" and reply["message"], (frame[:80], reply)
                if code is not None:
                    assert reply["code"] == code, (frame[:80], reply)
                answered += 1
                if i % 25 == 0:  # the connection stays usable throughout
                    assert (await request(ws, {"type": "ping"}))["type"] == "pong"
            assert (await request(ws, {"type": "ping", "req": "end"})) == {"type": "pong", "req": "end"}
        return answered

    assert asyncio.run(run()) == len(frames)
    for method, path, body, status in bodies:
        r = http.request(method, path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == status, (method, path, body[:100] if body else body, r.text[:300])
        err = r.json()["error"]
        assert err["message"] and err["code"] and err["type"], r.text
    assert http.get("/health").status_code == 200
    assert http.get(f"/v1/sessions/{sid}").json()["messages"] == []  # refused turns left nothing behind
    chat_server.engine.check_integrity()
    assert chat_server.engine.leaked_blocks() == 0


def test_api_key_over_http_and_websocket(chat_server) -> None:  # noqa: ANN001
    cfg = chat_server.state.config
    cfg.api_key = "s3cret"
    try:
        http = httpx.Client(base_url=chat_server.url, timeout=30)
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
            r = http.get("/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
        assert http.get("/metrics").status_code == 401
        assert http.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert http.get("/health").status_code == 200 and http.get("/").status_code == 200

        async def run() -> None:
            async with connect(chat_server) as ws:  # no key: the first frame must authenticate
                reply = await request(ws, {"type": "ping"})
                assert reply["code"] == "unauthorized"
                with pytest.raises(websockets.ConnectionClosed) as closed:
                    await recv_frame(ws, timeout=10)
                assert closed.value.rcvd.code == 1008
            async with websockets.connect(chat_server.ws_url + "?api_key=nope") as ws:
                assert (await recv_frame(ws))["code"] == "unauthorized"
            async with websockets.connect(chat_server.ws_url + "?api_key=s3cret") as ws:
                assert (await request(ws, {"type": "ping"}))["type"] == "pong"
            async with connect(chat_server) as ws:
                assert (await request(ws, {"type": "auth", "api_key": "s3cret", "req": 1})) == \
                    {"type": "auth.ok", "req": 1}
                assert (await request(ws, {"type": "ping"}))["type"] == "pong"

        asyncio.run(run())
    finally:
        cfg.api_key = None


def test_prompt_length_limit_applies_everywhere(chat_server) -> None:  # noqa: ANN001
    cfg, limit = chat_server.state.config, 40
    http = rest_client(chat_server, timeout=30)
    sid = http.post("/v1/sessions", json={"system_prompt": "S"}).json()["id"]
    cfg.max_prompt_tokens = limit
    try:
        long_text = "many words " * 30
        for stream in (False, True):  # refused before any stream opens
            r = http.post(f"/v1/sessions/{sid}/messages", json={"content": long_text, "stream": stream})
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_too_long"
            assert str(limit) in r.json()["error"]["message"]
        for stream in (False, True):
            r = http.post("/v1/chat/completions", json={"model": chat_server.state.model_name, "stream": stream,
                                                        "messages": [{"role": "user", "content": long_text}]})
            assert r.status_code == 400 and str(limit) in r.json()["error"]["message"]

        async def run() -> dict[str, Any]:
            async with connect(chat_server) as ws:
                return await request(ws, {"type": "chat", "session_id": sid, "content": long_text, "gen_id": "g",
                                          **OWNED})

        err = asyncio.run(run())
        assert (err["type"], err["code"], err["gen_id"]) == ("error", "context_too_long", "g")
        assert http.get(f"/v1/sessions/{sid}").json()["messages"] == []  # the refused turn left nothing
    finally:
        cfg.max_prompt_tokens = None


def test_websocket_origin_check(chat_server) -> None:  # noqa: ANN001
    cfg = chat_server.state.config
    same = chat_server.url

    async def opens(origin: str) -> bool:
        try:
            async with websockets.connect(chat_server.ws_url, origin=origin) as ws:  # type: ignore[arg-type]
                return (await request(ws, {"type": "ping"}))["type"] == "pong"
        except websockets.InvalidStatus as e:
            assert e.response.status_code == 403
            return False

    assert asyncio.run(opens(same))
    assert not asyncio.run(opens("http://evil.example"))
    assert not asyncio.run(opens("null"))
    cfg.allowed_origins = ["http://evil.example"]
    try:
        assert asyncio.run(opens("http://evil.example"))
        assert not asyncio.run(opens("http://other.example"))
    finally:
        cfg.allowed_origins = []


def test_dns_rebinding_host_is_refused_everywhere(chat_server) -> None:  # noqa: ANN001
    """A page on evil.example whose name was rebound to 127.0.0.1 sends Host: evil.example:PORT (and its
    own, matching Origin). Nothing may answer it: not the API, not /health, /metrics or the UI."""
    port = chat_server.port
    sessions_before = len(chat_server.state.sessions)
    for host in (f"evil.example:{port}", "evil.example", f"0.0.0.0:{port}", f"127.0.0.1.evil.example:{port}",
                 f"localhost.evil.example:{port}", f"[::2]:{port}"):
        origin = f"http://{host}"
        for method, path in [("GET", "/v1/sessions"), ("GET", "/health"), ("GET", "/metrics"), ("GET", "/"),
                             ("GET", "/app.js"), ("GET", "/v1/cache/stats"), ("POST", "/v1/sessions")]:
            status, body = raw_request(chat_server, method, path, {"Host": host, "Origin": origin},
                                       b"{}" if method == "POST" else b"")
            assert status == 421, (host, method, path, status, body[:200])
            err = json.loads(body)["error"]
            assert err["code"] == "forbidden_host" and "--allowed-hosts" in err["message"], err
        status, body = raw_request(chat_server, "GET", "/v1/chat/ws", ws_upgrade_headers(host, origin))
        assert status == 421 and json.loads(body)["error"]["code"] == "forbidden_host", (host, status, body)
        status, _ = raw_request(chat_server, "GET", "/v1/chat/ws", ws_upgrade_headers(host))  # no Origin either
        assert status == 421
    status, body = raw_request(chat_server, "GET", "/health", {}, http="HTTP/1.0")  # no Host at all
    assert status == 421 and json.loads(body)["error"]["code"] == "forbidden_host"
    assert len(chat_server.state.sessions) == sessions_before
    # the loopback names, with or without the port, in any case
    for host in (f"127.0.0.1:{port}", "127.0.0.1", f"localhost:{port}", "LocalHost", f"[::1]:{port}", "[::1]"):
        status, body = raw_request(chat_server, "GET", "/health", {"Host": host})
        assert status == 200 and json.loads(body)["status"] == "ok", (host, status, body)
        status, _ = raw_request(chat_server, "GET", "/v1/chat/ws", ws_upgrade_headers(host, f"http://{host}"))
        assert status == 101, host


def test_cross_site_state_changes_are_refused(chat_server) -> None:  # noqa: ANN001
    """A foreign page can POST text/plain without a CORS preflight; the server must not act on it."""
    http = httpx.Client(base_url=chat_server.url, timeout=60)
    model, port = chat_server.state.model_name, chat_server.port
    sessions_before, stats_before = len(chat_server.state.sessions), chat_server.engine.stats()
    completion = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    for origin in ("http://evil.example", f"http://evil.example:{port}", "null", f"http://localhost:{port}",
                   f"https://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"):
        for method, path, body in [("POST", "/v1/sessions", "{}"), ("POST", "/v1/chat/completions", completion),
                                   ("POST", "/v1/sessions/x/messages", '{"content": "hi"}'),
                                   ("DELETE", "/v1/sessions/x", None), ("PUT", "/v1/sessions", "{}"),
                                   ("PATCH", "/v1/sessions/x", "{}"), ("POST", "/", "{}")]:
            r = http.request(method, path, content=body, headers={"Origin": origin, "Content-Type": "text/plain"})
            assert r.status_code == 403, (origin, method, path, r.status_code, r.text[:200])
            assert r.json()["error"]["code"] == "forbidden_origin" and origin in r.json()["error"]["message"]
        status, body = raw_request(chat_server, "GET", "/v1/chat/ws", ws_upgrade_headers(f"127.0.0.1:{port}", origin))
        assert status == 403 and json.loads(body)["error"]["code"] == "forbidden_origin", (origin, status)
    assert len(chat_server.state.sessions) == sessions_before
    assert chat_server.engine.stats().prompt_tokens == stats_before.prompt_tokens  # nothing reached the engine
    # a foreign page may still read what CORS lets it read: GET is not refused for its Origin
    assert http.get("/health", headers={"Origin": "http://evil.example"}).status_code == 200
    # same-origin browser requests and requests without an Origin (curl, SDKs) work
    for headers in ({"Origin": f"http://127.0.0.1:{port}"}, {}):
        r = http.post("/v1/sessions", content="{}", headers={**headers, "Content-Type": "text/plain"})
        assert r.status_code == 201, (headers, r.text)
        r = http.post("/v1/chat/completions", content=completion,
                      headers={**headers, "Content-Type": "application/json"})
        assert r.status_code == 200, (headers, r.text)
    status, _ = raw_request(chat_server, "GET", "/v1/chat/ws",
                            ws_upgrade_headers(f"localhost:{port}", f"http://localhost:{port}"))
    assert status == 101


def test_allowed_hosts_and_origins_widen_the_checks(chat_server, tmp_path: Path) -> None:  # noqa: ANN001
    model = write_tiny_chat_model(tmp_path / "tiny", Path(chat_server.engine.engine.model_dir))
    config = ServerConfig(port=0, web_dir=None, allowed_hosts=["chat.example", "pinned.example:1"],
                          allowed_origins=["http://app.example"])
    with BackgroundServer(lambda: AsyncEngine(EngineConfig(model=str(model), num_blocks=64)), config) as srv:
        port, http = srv.port, httpx.Client(base_url=srv.url, timeout=30)
        for host, status in [(f"chat.example:{port}", 200), ("CHAT.example", 200), (f"127.0.0.1:{port}", 200),
                             (f"evil.example:{port}", 421), ("pinned.example:1", 200),
                             (f"pinned.example:{port}", 421), (f"sub.chat.example:{port}", 421)]:
            assert raw_request(srv, "GET", "/v1/sessions", {"Host": host})[0] == status, host
        # same origin on an allowed host name
        same = {"Host": f"chat.example:{port}", "Origin": f"http://chat.example:{port}"}
        assert raw_request(srv, "POST", "/v1/sessions", same, b"{}")[0] == 201
        assert raw_request(srv, "GET", "/v1/chat/ws", ws_upgrade_headers(same["Host"], same["Origin"]))[0] == 101
        # a listed origin passes, with its CORS headers; others are refused
        r = http.post("/v1/sessions", json={}, headers={"Origin": "http://app.example"})
        assert r.status_code == 201 and r.headers["access-control-allow-origin"] == "http://app.example"
        pre = http.options("/v1/sessions", headers={"Origin": "http://app.example", "Access-Control-Request-Method":
                                                    "POST", "Access-Control-Request-Headers": "content-type"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://app.example"
        assert http.post("/v1/sessions", json={}, headers={"Origin": "http://other.example"}).status_code == 403
        assert raw_request(srv, "GET", "/v1/chat/ws",
                           ws_upgrade_headers(f"127.0.0.1:{port}", "http://app.example"))[0] == 101
        srv.config.allowed_hosts = ["*"]  # any Host; Origins are still checked
        assert raw_request(srv, "GET", "/health", {"Host": "anything.example"})[0] == 200
        assert raw_request(srv, "POST", "/v1/sessions", {"Host": "anything.example", "Origin": "http://evil.example"},
                           b"{}")[0] == 403


def test_health_is_503_until_loaded_and_reports_load_failure() -> None:
    release = threading.Event()

    def slow_broken_factory() -> AsyncEngine:
        release.wait(30)
        raise RuntimeError("no weights here")

    config = ServerConfig(port=0, web_dir=None)
    app = build_app(slow_broken_factory, config)
    server = RadixUvicornServer(uvicorn_config(app, config), app.state.server)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, what="uvicorn start")
        url = f"http://127.0.0.1:{server.bound_port}"
        r = httpx.get(url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        r = httpx.get(url + "/v1/models")
        assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"
        release.set()
        wait_until(lambda: app.state.server.ready.is_set(), what="load failure")
        r = httpx.get(url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "error" and "no weights here" in r.json()["detail"]
    finally:
        release.set()
        server.should_exit = True
        thread.join(30)
    assert not thread.is_alive()


def test_shutdown_finishes_streams_cleanly(chat_server, tmp_path: Path) -> None:  # noqa: ANN001
    model = write_tiny_chat_model(tmp_path / "tiny", Path(chat_server.engine.engine.model_dir))
    srv = BackgroundServer(lambda: AsyncEngine(EngineConfig(model=str(model), num_blocks=256)),
                           ServerConfig(port=0, web_dir=None, shutdown_grace_s=0.5))
    srv.start()
    stopper = threading.Thread(target=srv.stop)
    try:
        async def run() -> dict[str, Any]:
            async with connect(srv) as ws:
                sid = (await request(ws, {"type": "session.create", **OWNED}))["session"]["id"]
                await ws.send(json.dumps({"type": "chat", "session_id": sid, "content": "go", "gen_id": "g", **OWNED,
                                          "sampling": {"max_tokens": 1900, "temperature": 1.0}}))
                frame = await recv_frame(ws)
                assert frame["type"] == "start", frame
                stopper.start()
                while frame["type"] != "done":
                    frame = await recv_frame(ws)
                return frame

        t0 = time.monotonic()
        done = asyncio.run(run())
        stopper.join(30)
        assert not stopper.is_alive() and time.monotonic() - t0 < 30
        assert done["finish_reason"] == "abort"  # 1900 tokens outlast the 0.5 s grace period
        assert srv.engine.leaked_blocks() == 0 and not srv.engine.engine.requests
        with pytest.raises(httpx.TransportError):
            httpx.get(srv.url + "/health", timeout=2)
    finally:
        srv.stop()
