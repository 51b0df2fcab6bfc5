"""Soak: 48 concurrent clients against a small pool for a bounded time, mixing chats, cancels, abrupt
disconnects, malformed frames, hostile sampling values, OpenAI and REST requests, large logprobs
requests — while hostile neighbours flood the most urgent priority an ordinary caller may send (under
--policy priority), hold hundreds of silent and trickling connections, flood session creation from
another address, and send structured-output attacks from a third (grammar chains that overflowed the
compile's stack, lexer-blow-up regexes, GBNF that outlasts the compile timeout, open schemas).

Every well-formed request must finish (done / 200) or get a clear error (an error frame or JSON error
with a code, never a 500); afterwards the engine is idle with 0 blocks used or leaked, the integrity
check passes, the process's memory is back within 10% of its idle value, and nothing was logged at
ERROR or with a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import json
import logging
import random
import resource
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from radixserve import AsyncEngine, EngineConfig
from radixserve.server import BackgroundServer, ServerConfig

pytest.register_assert_rewrite("server_testkit")
from server_testkit import OWNED, connect, engine_idle, wait_until, write_tiny_chat_model  # noqa: E402

pytest_plugins = ["server_testkit"]
pytestmark = pytest.mark.slow

CLIENTS = 48
PRIORITY_FLOODERS = 2
MAX_QUEUE_WAIT_S = 5.0  # the bound on any wait behind the priority flood (20 s by default)
HOSTILE_CONNECTIONS = 200  # half silent, half trickling a request head a byte at a time
SESSION_FLOOD = 400  # session creations from another address (127.0.0.2), as fast as they are answered
HEADER_TIMEOUT_S = 3.0
# (n, max_tokens) of the large logprobs requests, with top_logprobs 20: over the entry cap or under it
LOGPROBS_ASKS = [(16, 600), (16, 10**4), (16, 8), (4, 16), (1, 24), (1, None)]
ACTIONS_PER_CLIENT = 5
SOAK_DEADLINE_S = 90.0
STRUCTURED_ROUNDS = 8  # rounds of the structured-output attacks, at most (the soak's end stops them)
COMPILE_TIMEOUT_S = 2.0  # the soak server's grammar compile timeout: the slow GBNF outlasts it
HOSTILE_SAMPLING = [{"temperature": 1e-300}, {"temperature": 1e-45}, {"seed": 2**63 - 1, "temperature": 1.0},
                    {"top_p": 1e-45, "temperature": 1.0}, {"top_k": 10**9, "temperature": 2.0}, {}]
MALFORMED = ["{", "[]", '{"type":"nope"}', '{"type":"chat"}', '{"type":"cancel","gen_id":"missing"}',
             '{"type":"chat","session_id":"x","content":"hi","gen_id":"g"}', "[" * 5000, '{"type": 5}',
             '{"type":"session.resume","session_id":"\\ud800"}']
WELL_FORMED_FINISH = {"stop", "length", "abort"}


class ErrorLog(logging.Handler):
    """Every record at ERROR or above, or carrying a traceback, from any logger."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR or record.exc_info:
            self.records.append(record)


SOAK_RSS_GROWTH_BUDGET = 160 << 20


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def settled_rss() -> int:
    """RSS once garbage is collected and freed heap is handed back to the OS (glibc keeps freed
    arenas otherwise, which is not memory the server holds)."""
    gc.collect()
    with contextlib.suppress(OSError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return rss_bytes()


@pytest.fixture()
def soak_server(chat_server: BackgroundServer, tmp_path: Path) -> Iterator[BackgroundServer]:
    model = write_tiny_chat_model(tmp_path / "tiny", Path(chat_server.engine.engine.model_dir))
    config = ServerConfig(port=0, web_dir=None, max_generations_per_connection=4, header_timeout_s=HEADER_TIMEOUT_S,
                          body_timeout_s=HEADER_TIMEOUT_S)
    engine = EngineConfig(model=str(model), num_blocks=48, max_num_batched_tokens=256, policy="priority",
                          max_queue_wait_s=MAX_QUEUE_WAIT_S, grammar_compile_timeout_s=COMPILE_TIMEOUT_S,
                          grammar_cache_mb=4)  # compiled grammars kept are a bounded cache, not what RSS checks
    with BackgroundServer(lambda: AsyncEngine(engine), config) as srv:
        yield srv


class Client:
    def __init__(self, srv: BackgroundServer, index: int, tally: Counter[str]) -> None:
        self.srv, self.rng, self.tally = srv, random.Random(index), tally
        self.index = index

    def sampling(self) -> dict[str, Any]:
        return {"max_tokens": self.rng.randint(1, 24), **self.rng.choice(HOSTILE_SAMPLING)}

    async def run(self) -> None:
        for step in range(ACTIONS_PER_CLIENT):
            action = self.rng.choice([self.ws_chat, self.ws_chat, self.ws_cancel, self.ws_disconnect, self.ws_malformed,
                                      self.openai, self.openai_logprobs, self.openai_stream_disconnect, self.rest])
            await action(f"c{self.index}-{step}")

    async def new_session(self, ws: Any) -> str:
        await ws.send(json.dumps({"type": "session.create", "system_prompt": "You are terse.", **OWNED}))
        frame = json.loads(await ws.recv())
        assert frame["type"] == "session.created", frame
        return str(frame["session"]["id"])

    async def generation(self, ws: Any, gen_id: str) -> dict[str, Any]:
        """Frames of one generation up to its done or error frame (which is returned)."""
        while True:
            frame = json.loads(await asyncio.wait_for(ws.recv(), 60))
            if frame.get("gen_id") != gen_id:
                continue
            if frame["type"] in ("done", "error"):
                return frame

    def check_end(self, frame: dict[str, Any]) -> None:
        if frame["type"] == "done":
            assert frame["finish_reason"] in WELL_FORMED_FINISH, frame
            self.tally[f"done:{frame['finish_reason']}"] += 1
        else:  # a clear error: a code and a message, never an internal one
            assert frame["code"] not in ("internal", "generation_failed") and frame["message"], frame
            self.tally[f"error:{frame['code']}"] += 1

    async def ws_chat(self, gen_id: str) -> None:
        async with connect(self.srv) as ws:
            sid = await self.new_session(ws)
            for turn in range(2):
                await ws.send(json.dumps({"type": "chat", "session_id": sid, "content": f"turn {turn}",
                                          "gen_id": f"{gen_id}-{turn}", **OWNED, "sampling": self.sampling()}))
                self.check_end(await self.generation(ws, f"{gen_id}-{turn}"))

    async def ws_cancel(self, gen_id: str) -> None:
        async with connect(self.srv) as ws:
            sid = await self.new_session(ws)
            await ws.send(json.dumps({"type": "chat", "session_id": sid, "content": "talk", "gen_id": gen_id,
                                      **OWNED, "sampling": {"max_tokens": 200}}))
            await asyncio.sleep(self.rng.random() * 0.5)
            await ws.send(json.dumps({"type": "cancel", "gen_id": gen_id}))
            end = await self.generation(ws, gen_id)
            if end["type"] == "error":  # the cancel may land after the generation ended
                assert end["code"] == "unknown_gen_id", end
                end = {"type": "done", "finish_reason": "length"}
            self.check_end(end)

    async def ws_disconnect(self, gen_id: str) -> None:
        ws = await connect(self.srv)
        sid = await self.new_session(ws)
        await ws.send(json.dumps({"type": "chat", "session_id": sid, "content": "talk", "gen_id": gen_id,
                                  **OWNED, "sampling": {"max_tokens": 200}}))
        await asyncio.sleep(self.rng.random() * 0.5)
        ws.transport.abort()  # no close handshake: the peer just vanishes
        self.tally["disconnect"] += 1

    async def ws_malformed(self, gen_id: str) -> None:
        async with connect(self.srv) as ws:
            for text in self.rng.sample(MALFORMED, 4):
                await ws.send(text)
                frame = json.loads(await asyncio.wait_for(ws.recv(), 60))
                assert frame["type"] == "error" and frame["code"] and frame["code"] != "internal", frame
                self.tally["malformed"] += 1
            await ws.send(json.dumps({"type": "ping"}))
            assert json.loads(await asyncio.wait_for(ws.recv(), 60))["type"] == "pong"

    def openai_body(self, **extra: Any) -> dict[str, Any]:
        return {"model": self.srv.state.model_name, "messages": [{"role": "user", "content": "hello"}],
                **self.sampling(), **extra}

    async def openai(self, gen_id: str) -> None:
        async with httpx.AsyncClient(base_url=self.srv.url, timeout=60) as client:
            r = await client.post("/v1/chat/completions", json=self.openai_body(n=self.rng.randint(1, 3)))
            assert r.status_code == 200 or (r.status_code < 500 and r.json()["error"]["code"]), r.text
            self.tally[f"openai:{r.status_code}"] += 1

    async def openai_logprobs(self, gen_id: str) -> None:
        """Large logprobs requests: answered, or refused up front by the entry cap (never a stall)."""
        n, max_tokens = self.rng.choice(LOGPROBS_ASKS)
        body = self.openai_body(n=n, logprobs=True, top_logprobs=20)
        if max_tokens is None:
            del body["max_tokens"]  # unset: clamped to what the cap allows
        else:
            body["max_tokens"] = max_tokens
        async with httpx.AsyncClient(base_url=self.srv.url, timeout=60) as client:
            r = await client.post("/v1/chat/completions", json=body)
        if r.status_code == 200:
            choice = r.json()["choices"][0]
            assert len(choice["logprobs"]["content"][0]["top_logprobs"]) == 20, choice
        else:
            assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_logprobs", r.text
        self.tally[f"logprobs:{r.status_code}"] += 1

    async def openai_stream_disconnect(self, gen_id: str) -> None:
        async with httpx.AsyncClient(base_url=self.srv.url, timeout=60) as client:
            body = self.openai_body(stream=True, max_tokens=200)
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                async for _ in r.aiter_lines():
                    break  # leave after the first chunk
        self.tally["stream-disconnect"] += 1

    async def rest(self, gen_id: str) -> None:
        headers = {"X-Session-Owner": OWNED["owner"]}
        async with httpx.AsyncClient(base_url=self.srv.url, timeout=60, headers=headers) as client:
            sid = (await client.post("/v1/sessions", json={})).json()["id"]
            r = await client.post(f"/v1/sessions/{sid}/messages", json={"content": "hi", "sampling": self.sampling()})
            assert r.status_code == 200, r.text
            assert r.json()["finish_reason"] in WELL_FORMED_FINISH
            self.tally["rest:200"] += 1


async def priority_flood(srv: BackgroundServer, stop: asyncio.Event, tally: Counter[str]) -> None:
    """Requests at the most urgent priority an ordinary caller may send, back to back; beyond it, a 400."""
    low = srv.config.priority_range[0]
    body = {"model": srv.state.model_name, "messages": [{"role": "user", "content": "me first"}], "max_tokens": 8}
    async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
        r = await client.post("/v1/chat/completions", json={**body, "priority": -(2**31)})
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
        while not stop.is_set():
            r = await client.post("/v1/chat/completions", json={**body, "priority": low})
            assert r.status_code == 200, r.text
            tally["priority-flood:200"] += 1


async def hostile_connection(srv: BackgroundServer, trickle: bool, tally: Counter[str]) -> None:
    """A silent or trickling connection: the server must close it within the header timeout."""
    reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
    opened = time.monotonic()
    head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 64
    closed = False
    try:
        for i in range(int(HEADER_TIMEOUT_S * 10) + 40):
            if trickle and i % 5 == 0:
                with contextlib.suppress(ConnectionError):
                    writer.write(head[i // 5:i // 5 + 1])
            try:
                closed = not await asyncio.wait_for(reader.read(4096), 0.1) or reader.at_eof()
            except asyncio.TimeoutError:
                continue
            except ConnectionResetError:  # closed with our trickled bytes unread: a reset, still a close
                closed = True
            if closed:
                break
        assert closed, "a hostile connection was still open long after the header timeout"
        assert time.monotonic() - opened <= HEADER_TIMEOUT_S + 3.0
        tally["hostile-closed"] += 1
    finally:
        writer.close()


async def session_flood(srv: BackgroundServer, tally: Counter[str]) -> None:
    """Another owner creating sessions from another address as fast as it is answered."""
    transport = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
    headers = {"X-Session-Owner": "soak-session-flood-owner-secret-0123456789"}
    async with httpx.AsyncClient(base_url=srv.url, timeout=60, transport=transport, headers=headers) as client:
        for _ in range(SESSION_FLOOD):
            r = await client.post("/v1/sessions", json={"system_prompt": "flood"})
            assert r.status_code == 201 or (r.status_code == 429 and r.headers["retry-after"]
                                            and r.json()["error"]["code"] in ("rate_limited", "too_many_sessions")), r.text
            tally[f"session-flood:{r.status_code}"] += 1


def structured_attacks(model: str, n: int) -> list[dict[str, Any]]:
    """Issue 43's structured-output attacks: a grammar chain and a $ref chain that overflowed the
    compile's native stack, a lexer-blow-up regex (a fresh one each round), a GBNF chain whose conversion
    outlasts the compile timeout, and an open schema a small model rambles in."""
    chain = "start: r0\n" + "\n".join(f'r{i}: "a" r{i + 1}' for i in range(5000)) + '\nr5000: "b"\n'
    gbnf = "root ::= r0\n" + "\n".join(f'r{i} ::= r{i + 1} "a"' for i in range(4000)) + '\nr4000 ::= "a"\n'
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(5000)}
    defs["d5000"] = {"type": "integer"}
    base = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "temperature": 1.0}
    open_schema = {"type": "object", "properties": {"result": {"type": "integer"}}}
    return [{**base, "structured_outputs": {"grammar": chain}},
            {**base, "response_format": {"type": "json_schema",
                                         "json_schema": {"name": "r", "schema": {"$defs": defs, "$ref": "#/$defs/d0"}}}},
            {**base, "structured_outputs": {"regex": f"((b{{{n}}}){{100}}){{100}}"}},
            {**base, "structured_outputs": {"grammar": gbnf}},
            {**base, "response_format": {"type": "json_schema",
                                         "json_schema": {"name": "o", "strict": True, "schema": open_schema}}}]


async def structured_attacker(srv: BackgroundServer, stop: asyncio.Event, tally: Counter[str]) -> None:
    """One client (127.0.0.3) sending the structured attacks back to back until the soak ends: each is
    answered (a reply, which may end in "error") or refused clearly (400, or 429 while its compile runs)."""
    transport = httpx.AsyncHTTPTransport(local_address="127.0.0.3")
    async with httpx.AsyncClient(base_url=srv.url, timeout=60, transport=transport) as client:
        for n in range(50, 50 + STRUCTURED_ROUNDS):
            for body in structured_attacks(srv.state.model_name, n):
                if stop.is_set():
                    return
                r = await client.post("/v1/chat/completions", json=body)
                if r.status_code == 200:
                    reason = r.json()["choices"][0]["finish_reason"]
                    assert reason in ("stop", "length", "error"), r.text
                    tally[f"structured:{reason}"] += 1
                else:
                    assert (r.status_code, r.json()["error"]["code"]) in ((400, "invalid_field"), (429, "rate_limited")), \
                        r.text[:300]
                    tally[f"structured:{r.status_code}"] += 1


def test_soak_many_hostile_clients_on_a_small_pool(soak_server: BackgroundServer) -> None:
    errors = ErrorLog()
    logging.getLogger().addHandler(errors)
    try:
        # warm up (first requests allocate caches and compile paths), then take the idle baseline
        asyncio.run(Client(soak_server, 999, Counter()).ws_chat("warm"))
        warm = {"model": soak_server.state.model_name, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4, "response_format": {"type": "json_object"}}  # builds llguidance's tokenizer, once
        assert httpx.post(soak_server.url + "/v1/chat/completions", json=warm, timeout=60).status_code == 200
        wait_until(lambda: engine_idle(soak_server), what="idle before the soak")
        idle_rss = settled_rss()
        tally: Counter[str] = Counter()

        victim_headers = {"X-Session-Owner": OWNED["owner"]}
        victim = httpx.post(soak_server.url + "/v1/sessions", json={}, headers=victim_headers).json()["id"]

        async def soak() -> None:
            stop = asyncio.Event()
            floods = [asyncio.create_task(priority_flood(soak_server, stop, tally)) for _ in range(PRIORITY_FLOODERS)]
            floods.append(asyncio.create_task(structured_attacker(soak_server, stop, tally)))
            hostile = [hostile_connection(soak_server, i % 2 == 1, tally) for i in range(HOSTILE_CONNECTIONS)]
            clients = [Client(soak_server, i, tally).run() for i in range(CLIENTS)]
            try:
                await asyncio.wait_for(asyncio.gather(*clients, *hostile, session_flood(soak_server, tally)),
                                       SOAK_DEADLINE_S)
            finally:
                stop.set()
                await asyncio.wait_for(asyncio.gather(*floods), 60)

        started = time.monotonic()
        asyncio.run(soak())
        elapsed = time.monotonic() - started
        assert httpx.get(f"{soak_server.url}/v1/sessions/{victim}", headers=victim_headers).status_code == 200
        wait_until(lambda: engine_idle(soak_server), timeout=30, what="idle after the soak")
        soak_server.engine.check_integrity()
        assert soak_server.engine.leaked_blocks() == 0 and soak_server.engine.stats().blocks_used == 0
        after_rss = settled_rss()
    finally:
        logging.getLogger().removeHandler(errors)
    print(f"soak: {CLIENTS} clients in {elapsed:.1f} s, {dict(tally)}, rss {idle_rss >> 20} -> {after_rss >> 20} MiB")
    assert sum(v for k, v in tally.items() if k.startswith("done:")) >= CLIENTS, tally
    assert tally["hostile-closed"] == HOSTILE_CONNECTIONS and tally["priority-flood:200"] >= PRIORITY_FLOODERS, tally
    assert tally["session-flood:429"] > 0 and tally["session-flood:201"] > 0, tally
    assert tally["structured:error"] > 0 and tally["structured:400"] > 0, tally  # blow-ups ended, slow ones refused
    # an absolute budget (what 10% of the process's idle RSS allowed while the shared server held the fp32
    # default): the same soak grows 92-95 MiB beside an fp32 shared server and 121-135 MiB beside the Q4_1
    # default, whose smaller baseline would have cut a relative budget to 104 MiB
    assert after_rss - idle_rss <= SOAK_RSS_GROWTH_BUDGET, (idle_rss, after_rss)
    assert not errors.records, [f"{r.name}: {r.getMessage()}" for r in errors.records]
    assert "radixserve_stalled_steps_total 0.0" in httpx.get(soak_server.url + "/metrics").text
