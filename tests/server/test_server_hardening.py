"""Red-team findings of issue 24, items 9 and 10, against a real server (tiny model, 127.0.0.1):

- 9: `{"type":"ping","req":1e999}` was answered with `"req":Infinity`, which strict JSON parsers
  reject. Numbers that overflow to infinity are refused on input, and nothing the server emits may
  hold a non-finite number.
- 10: two Host headers were checked by the last one (RFC 9112: answer 400); a refused WebSocket
  upgrade and an invalid-UTF-8 text frame each logged an ERROR with a traceback (now one INFO line);
  client-chosen owner secrets shorter than 128 bits were accepted (now refused).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from radixserve import AsyncEngine, EngineConfig
from radixserve.server import BackgroundServer, ServerConfig
from radixserve.server.owners import OWNER_HEADER

pytest.register_assert_rewrite("server_testkit")
from server_testkit import connect, request, write_tiny_chat_model, ws_upgrade_headers  # noqa: E402

pytestmark = pytest.mark.slow


def strict_loads(text: str | bytes) -> Any:
    """json.loads as strict parsers (browsers' JSON.parse, Go, serde) read it: no NaN or Infinity."""
    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    from radixserve.model.embedded import embedded_model_dir

    model = write_tiny_chat_model(tmp_path_factory.mktemp("tiny-hardening"), embedded_model_dir())
    config = ServerConfig(port=0, web_dir=None, shutdown_grace_s=0.5)
    with BackgroundServer(lambda: AsyncEngine(EngineConfig(model=str(model), num_blocks=64)), config) as server:
        yield server


def raw_exchange(srv: BackgroundServer, head_lines: list[str], body: bytes = b"") -> tuple[int, bytes]:
    """Send a request whose header lines are exactly `head_lines` (repeats allowed); status and body."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
        close = [] if any(line.lower().startswith("connection:") for line in head_lines) else ["Connection: close"]
        sock.sendall(("\r\n".join([*head_lines, *close, f"Content-Length: {len(body)}"])
                      + "\r\n\r\n").encode("latin-1") + body)
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head, _, rest = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), rest


# -- item 9: strict JSON ----------------------------------------------------------------------------

def test_non_finite_numbers_are_refused_and_never_emitted(srv: BackgroundServer) -> None:
    """Measured: {"type":"ping","req":1e999} was answered with "req": Infinity."""
    async def run() -> list[str]:
        async with connect(srv) as ws:
            out = []
            for frame in ('{"type":"ping","req":1e999}', '{"type":"ping","req":-1e999}',
                          '{"type":"ping","req":{"a":[1e400]}}', '{"type":"ping","req":1e308}'):
                await ws.send(frame)
                out.append(await asyncio.wait_for(ws.recv(), 30))
            return out

    replies = [strict_loads(text) for text in asyncio.run(run())]  # raises on Infinity
    for reply in replies[:3]:
        assert (reply["type"], reply["code"]) == ("error", "bad_json") and "req" not in reply, reply
        assert "finite" in reply["message"]
    assert replies[3] == {"type": "pong", "req": 1e308}  # large but finite numbers are fine
    with httpx.Client(base_url=srv.url, timeout=60, headers={OWNER_HEADER: "A" * 22 + "strict-json"}) as http:
        for path, body in [("/v1/sessions", b'{"sampling":{"temperature":1e999}}'),
                           ("/v1/chat/completions", b'{"model":"m","messages":[],"temperature":-1e999}')]:
            r = http.post(path, content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == 400 and strict_loads(r.content)["error"]["code"] == "bad_json", r.text


def test_every_json_the_server_writes_is_strict() -> None:
    from radixserve.server.http_util import dumps, sse
    from radixserve.server.validation import ApiError, parse_json_text

    for bad in (float("inf"), float("-inf"), float("nan")):
        with pytest.raises(ValueError):
            dumps({"req": bad})
        with pytest.raises(ValueError):
            sse({"x": [bad]})
    for text in ("1e999", "[-1e999]", '{"a": 1E400}', "NaN", "-Infinity"):
        with pytest.raises(ApiError) as e:
            parse_json_text(text, 1000)
        assert e.value.code == "bad_json" and "finite" in e.value.message
    assert parse_json_text("[1e308, -0.0, 5]", 1000) == [1e308, -0.0, 5]


# -- item 10: Host headers, quiet logs, owner secrets ---------------------------------------------

def test_two_host_headers_are_refused_with_400(srv: BackgroundServer) -> None:
    """Measured: a request with two Host headers was checked by the last one."""
    mine = f"127.0.0.1:{srv.port}"
    for hosts in (["evil.example", mine], [mine, "evil.example"], [mine, mine]):
        lines = [f"Host: {h}" for h in hosts]
        status, body = raw_exchange(srv, ["GET /health HTTP/1.1", *lines])
        assert status == 400 and strict_loads(body)["error"]["code"] == "invalid_host", (hosts, body)
        upgrade = {k: v for k, v in ws_upgrade_headers(mine).items() if k != "Host"}
        status, _ = raw_exchange(srv, ["GET /v1/chat/ws HTTP/1.1", *lines, *(f"{k}: {v}" for k, v in upgrade.items())])
        assert status == 400, hosts
    assert raw_exchange(srv, ["GET /health HTTP/1.1", f"Host: {mine}"])[0] == 200


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture()
def server_log() -> Iterator[Records]:
    """What the server logs (uvicorn's and ours), at INFO and above, during the test."""
    handler = Records()
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "radixserve.server")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        for lg, level in zip(loggers, levels):
            lg.removeHandler(handler)
            lg.setLevel(level)


def masked_frame(opcode: int, payload: bytes) -> bytes:
    mask = os.urandom(4)
    assert len(payload) < 126
    return bytes([0x80 | opcode, 0x80 | len(payload)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def test_refused_upgrades_and_invalid_utf8_log_one_info_line(srv: BackgroundServer, server_log: Records) -> None:
    """Measured: each refused upgrade and each invalid-UTF-8 frame logged an ERROR with a traceback."""
    mine = f"127.0.0.1:{srv.port}"
    for headers in (ws_upgrade_headers(mine, "http://evil.example"), ws_upgrade_headers("evil.example")):
        status, _ = raw_exchange(srv, ["GET /v1/chat/ws HTTP/1.1", *(f"{k}: {v}" for k, v in headers.items())])
        assert status in (403, 421)
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
        head = "\r\n".join(["GET /v1/chat/ws HTTP/1.1", *(f"{k}: {v}" for k, v in ws_upgrade_headers(mine).items())])
        sock.sendall((head + "\r\n\r\n").encode())
        raw = b""
        while b"\r\n\r\n" not in raw:
            raw += sock.recv(4096)
        assert raw.startswith(b"HTTP/1.1 101"), raw
        sock.sendall(masked_frame(0x1, b'{"type":"ping","x":"\xff\xfe"}'))  # a text frame that is not UTF-8
        rest = raw.partition(b"\r\n\r\n")[2]
        while len(rest) < 4:
            chunk = sock.recv(4096)
            if not chunk:
                break
            rest += chunk
        assert rest[0] == 0x88 and int.from_bytes(rest[2:4], "big") == 1007, rest  # close: invalid payload data
    asyncio.run(asyncio.sleep(0.5))  # the server logs after answering
    bad = [r for r in server_log.records if r.levelno >= logging.WARNING or r.exc_info or "\n" in r.getMessage()]
    assert not bad, [(r.levelname, r.getMessage(), bool(r.exc_info)) for r in bad]
    said = " | ".join(r.getMessage() for r in server_log.records)
    assert "UTF-8" in said, said  # still logged, at INFO, on one line


def test_owner_secrets_shorter_than_128_bits_are_refused(srv: BackgroundServer) -> None:
    """Measured: a client-chosen owner secret of 16 characters (96 bits) was accepted."""
    short, ok = "a-21-character-secret", "a-22-character-secret0"  # 126 and 132 bits of URL-safe base64
    assert len(short) == 21 and len(ok) == 22
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        for secret in ("x" * 16, short):
            r = http.post("/v1/sessions", json={}, headers={OWNER_HEADER: secret})
            assert r.status_code == 400 and r.json()["error"]["param"] == OWNER_HEADER, r.text
            assert "128 bits" in r.json()["error"]["message"]
        r = http.post("/v1/sessions", json={}, headers={OWNER_HEADER: ok})
        assert r.status_code == 201 and r.json()["owner"] == ok
        minted = http.post("/v1/sessions", json={}).json()["owner"]
        assert len(minted) >= 22  # what the server mints itself is long enough

    async def run() -> list[dict[str, Any]]:
        async with connect(srv) as ws:
            return [await request(ws, {"type": "session.create", "owner": short}),
                    await request(ws, {"type": "session.resume", "session_id": "x", "owner": "y" * 16}),
                    await request(ws, {"type": "session.create", "owner": ok})]

    made_short, resumed, made = asyncio.run(run())
    assert (made_short["type"], made_short["code"]) == ("error", "invalid_field") and "128 bits" in made_short["message"]
    assert (resumed["type"], resumed["code"]) == ("error", "invalid_field")
    assert made["type"] == "session.created"
