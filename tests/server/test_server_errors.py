"""Input the JSON layer lets through but the rest of the server must never see (lone surrogates, deep
nesting), and errors that must not leak internals: every answer is a clean API error, the connection
stays usable, and no exception text from a library reaches a client."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any

import httpx
import pytest

pytest.register_assert_rewrite("server_testkit")
from server_testkit import (  # noqa: E402
    OWNED,
    TEST_OWNER,
    chat,
    connect,
    engine_idle,
    recv_frame,
    request,
    rest_client,
    wait_until,
)

pytest_plugins = ["server_testkit"]
pytestmark = pytest.mark.slow

LONE = '"a\\ud800b"'  # JSON text for a string holding a lone (unpaired) UTF-16 surrogate
SECRET = "torch secret detail"


def post_raw(http: httpx.Client, path: str, raw: str) -> httpx.Response:
    return http.post(path, content=raw.encode(), headers={"content-type": "application/json"})


def test_lone_surrogates_are_refused_naming_the_field(chat_server) -> None:  # noqa: ANN001
    http = rest_client(chat_server)
    sid = http.post("/v1/sessions", json={}).json()["id"]
    model = json.dumps(chat_server.state.model_name)
    cases = [
        (f"/v1/sessions/{sid}/messages", f'{{"content": {LONE}}}', "content"),
        (f"/v1/sessions/{sid}/messages", f'{{"content": "ok", "sampling": {{"stop": [{LONE}]}}}}', "sampling.stop[0]"),
        ("/v1/sessions", f'{{"system_prompt": {LONE}}}', "system_prompt"),
        ("/v1/chat/completions", f'{{"model": {model}, "messages": [{{"role": "user", "content": {LONE}}}]}}',
         "messages[0].content"),
        ("/v1/chat/completions", f'{{"model": {model}, "messages": [{{"role": "user", "content": '
         f'[{{"type": "text", "text": {LONE}}}]}}]}}', "messages[0].content[0].text"),
    ]
    for path, raw, field in cases:
        r = post_raw(http, path, raw)
        assert r.status_code == 400, (path, r.status_code, r.text)
        err = r.json()["error"]
        assert err["code"] == "invalid_field" and err["param"] == field and "surrogate" in err["message"], err
    ok = post_raw(http, "/v1/sessions", '{"system_prompt": "\\ud83d\\ude00 paired is fine"}')
    assert ok.status_code == 201 and ok.json()["system_prompt"] == "\U0001f600 paired is fine"
    assert http.get(f"/v1/sessions/{sid}").json()["messages"] == []

    async def run() -> list[dict[str, Any]]:
        async with connect(chat_server) as ws:
            replies = []
            for raw in (f'{{"type": "chat", "session_id": "{sid}", "owner": "{TEST_OWNER}", "gen_id": "g", '
                        f'"content": {LONE}}}',
                        f'{{"type": "session.create", "system_prompt": {LONE}}}',
                        f'{{"type": "ping", "req": {LONE}}}'):
                await ws.send(raw)
                replies.append(await recv_frame(ws))
            replies.append(await request(ws, {"type": "ping", "req": 2}))
            return replies

    *errors, pong = asyncio.run(run())
    for err in errors:
        assert err["type"] == "error" and err["code"] == "invalid_field" and "surrogate" in err["message"], err
        assert "tokeniz" not in err["message"].lower()
    assert pong == {"type": "pong", "req": 2}


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def test_deep_nesting_is_refused_and_the_connection_survives(chat_server) -> None:  # noqa: ANN001
    http = rest_client(chat_server)
    for depth in (100, 963, 5000):
        r = post_raw(http, "/v1/sessions", f'{{"sampling": {nested(depth)}}}')
        assert r.status_code == 400 and r.json()["error"]["code"] == "bad_json", r.text
        assert "nest" in r.json()["error"]["message"]
    assert post_raw(http, "/v1/sessions", f'{{"x": {nested(20)}}}').status_code == 201

    async def run() -> list[dict[str, Any]]:
        async with connect(chat_server) as ws:
            replies = []
            for depth in (100, 963, 5000):
                await ws.send(f'{{"type": "ping", "req": {nested(depth)}}}')
                replies.append(await recv_frame(ws))
            # shallow enough for the parser, but `req` is echoed back: only shallow values are accepted
            await ws.send(f'{{"type": "ping", "req": {nested(40)}}}')
            replies.append(await recv_frame(ws))
            replies.append(await request(ws, {"type": "ping", "req": {"n": [1, {"m": 2}]}}))
            return replies

    *errors, deep_req, pong = asyncio.run(run())
    assert all(e["type"] == "error" and e["code"] == "bad_json" and "req" not in e for e in errors), errors
    assert deep_req["type"] == "error" and deep_req["code"] == "invalid_field" and "req" not in deep_req
    assert pong == {"type": "pong", "req": {"n": [1, {"m": 2}]}}


def test_internal_failures_never_reach_the_client(chat_server, monkeypatch, caplog) -> None:  # noqa: ANN001
    caplog.set_level(logging.ERROR, logger="radixserve.server")
    engine, http = chat_server.engine, rest_client(chat_server)
    sid = http.post("/v1/sessions", json={"sampling": {"temperature": 0, "max_tokens": 3}}).json()["id"]

    async def broken_generate(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(SECRET)
        yield  # an async generator, like the real one

    monkeypatch.setattr(engine, "generate_validated", broken_generate)
    model = chat_server.state.model_name
    messages = [{"role": "user", "content": "hi"}]
    bodies: list[str] = []
    r = http.post(f"/v1/sessions/{sid}/messages", json={"content": "hi"})
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal"
    bodies.append(r.text)
    r = http.post(f"/v1/sessions/{sid}/messages", json={"content": "hi", "stream": True})
    bodies.append(r.text)
    r = http.post("/v1/chat/completions", json={"model": model, "messages": messages})
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal"
    bodies.append(r.text)
    bodies.append(http.post("/v1/chat/completions", json={"model": model, "messages": messages,
                                                          "stream": True}).text)

    async def ws_chat() -> list[dict[str, Any]]:
        async with connect(chat_server) as ws:
            return await chat(ws, sid, "hi", gen_id="g")

    frames = asyncio.run(ws_chat())
    assert frames[-1]["type"] == "error" and frames[-1]["code"] == "internal"
    bodies.append(json.dumps(frames))
    # a failure outside the engine call: preparing the turn itself
    monkeypatch.setattr(chat_server.state.formatter, "append_user", broken_sync)
    r = http.post(f"/v1/sessions/{sid}/messages", json={"content": "hi"})
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal", r.text
    bodies.append(r.text)

    async def ws_prepare() -> dict[str, Any]:
        async with connect(chat_server) as ws:
            return await request(ws, {"type": "chat", "session_id": sid, "content": "hi", "gen_id": "h", **OWNED})

    bodies.append(json.dumps(asyncio.run(ws_prepare())))
    ids = set()
    for body in bodies:
        assert SECRET not in body and "Traceback" not in body and "RuntimeError" not in body, body
        found = re.search(r"internal error; see the server log \(request id ([0-9a-f]{12})\)", body)
        assert found, body
        ids.add(found.group(1))
    assert len(ids) == len(bodies)
    # each failure's traceback is logged once, under the id its client was given
    for rid in ids:
        logged = [rec for rec in caplog.records if rid in rec.getMessage()]
        assert len(logged) == 1 and logged[0].exc_info and SECRET in str(logged[0].exc_info[1]), rid
    monkeypatch.undo()
    wait_until(lambda: engine_idle(chat_server), what="nothing left running")
    assert http.get(f"/v1/sessions/{sid}").json()["busy"] is False


def broken_sync(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError(SECRET)
