"""Issue 43's structured-output attacks, each against a real server on 127.0.0.1: a grammar chain that
overflowed llguidance's native stack (every API that takes a constraint), a regex whose lexer blows up
(memory kept per request), slow GBNF grammars from one client while another needs a compile, and a
schema whose key order another request's schema used to decide.

Each request is bounded (max_tokens, client timeouts); the server runs the tiny random-weight chat
model with a 2 s compile timeout, so a grammar that outlasts it costs the test 2 s, not 10.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import json
import resource
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from tiny_models import tiny_chat_model_dir

from radixserve import AsyncEngine, EngineConfig
from radixserve.server import BackgroundServer, ServerConfig

COMPILE_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def srv() -> Iterator[BackgroundServer]:
    model = str(tiny_chat_model_dir("llama"))
    engine = EngineConfig(model=model, num_blocks=256, grammar_compile_timeout_s=COMPILE_TIMEOUT_S)
    with BackgroundServer(lambda: AsyncEngine(engine), ServerConfig(port=0, web_dir=None, shutdown_grace_s=0.5)) as s:
        yield s


def lark_chain(rules: int) -> str:
    return "start: r0\n" + "\n".join(f'r{i}: "a" r{i + 1}' for i in range(rules)) + f'\nr{rules}: "b"\n'


def ref_chain(refs: int) -> dict[str, Any]:
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(refs)}
    defs[f"d{refs}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def gbnf_chain(rules: int) -> str:
    """GBNF whose conversion to Lark is quadratic (one rule of the chain marked terminal per pass)."""
    return "root ::= r0\n" + "\n".join(f'r{i} ::= r{i + 1} "a"' for i in range(rules)) + f'\nr{rules} ::= "a"\n'


def chat(srv: BackgroundServer, **fields: Any) -> dict[str, Any]:
    return {"model": srv.state.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "temperature": 0, **fields}


def settled_rss() -> int:
    gc.collect()
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def test_every_api_survives_a_grammar_chain_that_overflowed_the_native_stack(srv: BackgroundServer) -> None:
    chain = ref_chain(5000)
    attacks = [
        ("/v1/chat/completions", chat(srv, structured_outputs={"grammar": lark_chain(5000)})),
        ("/v1/chat/completions", chat(srv, response_format={"type": "json_schema",
                                                            "json_schema": {"name": "x", "schema": chain}})),
        ("/v1/completions", {"model": srv.state.model_name, "prompt": "hi", "max_tokens": 8, "guided_json": chain}),
        ("/v1/messages", {"model": srv.state.model_name, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                          "output_config": {"format": {"type": "json_schema", "schema": chain}}}),
    ]
    with httpx.Client(base_url=srv.url, timeout=120) as client:
        for path, body in attacks:
            r = client.post(path, json=body)  # before: SIGSEGV, this very process gone
            assert r.status_code == 200 or (r.status_code == 400 and r.json()["error"]["code"] == "invalid_field"), \
                (path, r.status_code, r.text[:300])
        assert client.get("/health").status_code == 200


def test_lexer_blowup_regexes_end_their_replies_and_leave_no_memory_behind(srv: BackgroundServer) -> None:
    grammars = srv.engine.engine.grammars
    with httpx.Client(base_url=srv.url, timeout=120) as client:
        client.post("/v1/chat/completions", json=chat(srv, structured_outputs={"regex": "((b{49}){100}){100}"}))
        before, evicted = settled_rss(), grammars.stats.evictions
        reasons = []
        for n in range(50, 62):  # a fresh regex each time: before, +160 MB each, kept with the cached grammar
            r = client.post("/v1/chat/completions",
                            json=chat(srv, structured_outputs={"regex": f"((b{{{n}}}){{100}}){{100}}"}))
            assert r.status_code == 200, r.text  # before: a 500 carrying llguidance's parser state
            reasons.append(r.json()["choices"][0]["finish_reason"])
        after = settled_rss()
    assert reasons == ["error"] * len(reasons)  # the limit ends that reply alone, never a "stop"
    assert grammars.stats.evictions - evicted == len(reasons)
    assert after <= before * 1.10, (before >> 20, after >> 20)


def test_one_clients_slow_grammars_do_not_deny_another_its_compile(srv: BackgroundServer) -> None:
    slow = chat(srv, structured_outputs={"grammar": gbnf_chain(4000)})  # ~8 s to convert alone
    victim = chat(srv, max_tokens=24, response_format={"type": "json_schema", "json_schema": {"name": "v", "schema": {
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}})

    async def run() -> tuple[list[httpx.Response], httpx.Response]:
        attacker = httpx.AsyncClient(base_url=srv.url, timeout=120,
                                     transport=httpx.AsyncHTTPTransport(local_address="127.0.0.2"))
        async with attacker, httpx.AsyncClient(base_url=srv.url, timeout=120) as client:
            flood = [asyncio.create_task(attacker.post("/v1/chat/completions", json=slow)) for _ in range(3)]
            await asyncio.sleep(0.5)  # the attacker's compiles are under way
            answer = await client.post("/v1/chat/completions", json=victim)
            return list(await asyncio.gather(*flood)), answer

    flood, answer = asyncio.run(run())
    assert answer.status_code == 200, answer.text  # before: 400 "did not compile within 10 s"
    assert json.loads(answer.json()["choices"][0]["message"]["content"]) in ({"ok": True}, {"ok": False})
    statuses = sorted(r.status_code for r in flood)
    assert statuses == [400, 429, 429], [r.text[:200] for r in flood]  # one compile per client; the rest wait their turn
    slow_one = next(r for r in flood if r.status_code == 400).json()["error"]
    assert slow_one["param"] == "structured_outputs.grammar" and f"within {COMPILE_TIMEOUT_S:g} s" in slow_one["message"]
    assert srv.engine.engine.grammars.pool.workers_lost >= 1  # the timed-out compile was killed, not left running


def test_a_schemas_key_order_is_its_own(srv: BackgroundServer) -> None:
    def schema(*names: str) -> dict[str, Any]:
        return {"type": "object", "properties": {n: {"type": "boolean"} for n in names}, "required": list(names)}

    with httpx.Client(base_url=srv.url, timeout=120) as client:
        for names in (("b", "a"), ("a", "b")):  # before: the second got the first one's cached order
            fmt = {"type": "json_schema", "json_schema": {"name": "o", "strict": True, "schema": schema(*names)}}
            r = client.post("/v1/chat/completions", json=chat(srv, max_tokens=32, response_format=fmt))
            assert r.status_code == 200, r.text
            assert tuple(json.loads(r.json()["choices"][0]["message"]["content"])) == names
