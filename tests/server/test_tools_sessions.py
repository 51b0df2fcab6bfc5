"""Tool calling in chat sessions (REST, SSE and WebSocket) and in the offline API (`LLM.chat(tools=...)`,
`LLM.session(tools=...)`), over the tiny random chat model.

A forced tool_choice (required or named) constrains the reply to a call, so these hold whatever the
random model says: the call parses, its arguments validate, the session keeps it and its result in
its token history, and every turn's tokens extend the previous turn's (never re-tokenized).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest

from radixserve.chat.tool_calls import ToolCallOutput
from radixserve.engine.llm import LLM
from radixserve.sampling_params import SamplingParams
from radixserve.server import BackgroundServer
from radixserve.server.owners import OWNER_HEADER

pytest.register_assert_rewrite("server_testkit")
from server_testkit import OWNED, TEST_OWNER, TEST_OWNER_KEY, chat_frames, connect, engine_idle, recv_frame, wait_until  # noqa: E402
from tiny_models import tiny_chat_model_dir  # noqa: E402
from tool_fixtures import ADD, SCHEMAS, TOOLS  # noqa: E402

pytest_plugins = ["server_testkit"]

NAMED = {"type": "function", "function": {"name": "get_weather"}}
SAMPLING = {"temperature": 0, "max_tokens": 120}




@pytest.fixture(scope="module")
def http(tiny_chat_server: BackgroundServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=tiny_chat_server.url, timeout=120, headers={OWNER_HEADER: TEST_OWNER}) as client:
        yield client


def valid_call(call: dict[str, Any], name: str | None = None) -> None:
    assert call["type"] == "function" and call["id"].startswith("call_")
    fn = call["function"]
    assert fn["name"] in SCHEMAS and (name is None or fn["name"] == name)
    jsonschema.validate(json.loads(fn["arguments"]), SCHEMAS[fn["name"]])


def session_tokens(tiny_chat_server: BackgroundServer, sid: str) -> list[int]:
    _, store = tiny_chat_server.state.require_chat()
    return store.get(sid, TEST_OWNER_KEY).tokens.tolist()


def test_rest_round_trip_keeps_calls_and_results_in_the_tokens(tiny_chat_server: BackgroundServer, http: httpx.Client) -> None:
    r = http.post("/v1/sessions", json={"system_prompt": "You can call tools.", "tools": TOOLS, "sampling": SAMPLING})
    assert r.status_code == 201, r.text
    session = r.json()
    assert [t["function"]["name"] for t in session["tools"]] == ["get_weather", "add"]
    sid, start = session["id"], session_tokens(tiny_chat_server, session["id"])
    assert session["num_tokens"] == len(start) > 0

    r = http.post(f"/v1/sessions/{sid}/messages", json={"content": "Weather in Paris?", "tool_choice": NAMED})
    assert r.status_code == 200, r.text
    first = r.json()
    assert first["finish_reason"] == "tool_calls" and first["message"]["tool_calls"]
    for call in first["message"]["tool_calls"]:
        valid_call(call, "get_weather")
    after_call = session_tokens(tiny_chat_server, sid)
    assert after_call[:len(start)] == start

    answers = [{"tool_call_id": c["id"], "content": '{"temp_c": 21}'} for c in first["message"]["tool_calls"]]
    r = http.post(f"/v1/sessions/{sid}/messages", json={"tool_results": answers, "tool_choice": "none",
                                                         "sampling": {"max_tokens": 6}})
    assert r.status_code == 200, r.text
    second = r.json()
    assert "tool_calls" not in second["message"] and second["finish_reason"] in ("stop", "length")
    # the call's turn was served from the cache: all but its closing tokens, in whole blocks
    assert second["usage"]["cached_tokens"] >= len(after_call) - tiny_chat_server.engine.block_size - 2
    after_result = session_tokens(tiny_chat_server, sid)
    assert after_result[:len(after_call)] == after_call  # appended, never re-tokenized

    history = http.get(f"/v1/sessions/{sid}").json()["messages"]
    assert [m["role"] for m in history] == ["user", "assistant"] + ["tool"] * len(answers) + ["assistant"]
    assert history[1]["tool_calls"] == first["message"]["tool_calls"]
    assert [m["tool_call_id"] for m in history[2:-1]] == [a["tool_call_id"] for a in answers]
    wait_until(lambda: engine_idle(tiny_chat_server), what="the engine to go idle")


def test_session_tool_refusals(tiny_chat_server: BackgroundServer, http: httpx.Client) -> None:
    sid = http.post("/v1/sessions", json={"tools": TOOLS, "sampling": SAMPLING}).json()["id"]
    bad = [({"content": "hi", "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
           ({"tool_results": [{"tool_call_id": "call_x", "content": "1"}]}, "tool_results[0].tool_call_id"),
           ({"content": "hi", "tool_results": [{"tool_call_id": "call_x", "content": "1"}]}, "tool_results"),
           ({"tool_results": []}, "tool_results")]
    for body, param in bad:
        r = http.post(f"/v1/sessions/{sid}/messages", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = http.post("/v1/sessions", json={"tools": [{"type": "function", "function": {"name": "bad name"}}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].function.name"
    # a first message may bring the tools; later ones may repeat them, not change them
    plain = http.post("/v1/sessions", json={"sampling": SAMPLING}).json()["id"]
    r = http.post(f"/v1/sessions/{plain}/messages", json={"content": "Add 1 and 2.", "tools": TOOLS,
                                                           "tool_choice": "required"})
    assert r.status_code == 200 and r.json()["finish_reason"] == "tool_calls", r.text
    assert [t["function"]["name"] for t in http.get(f"/v1/sessions/{plain}").json()["tools"]] == ["get_weather", "add"]
    r = http.post(f"/v1/sessions/{plain}/messages", json={"content": "again", "tools": [ADD]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_sse_streams_tool_call_events(tiny_chat_server: BackgroundServer, http: httpx.Client) -> None:
    sid = http.post("/v1/sessions", json={"tools": TOOLS, "sampling": SAMPLING}).json()["id"]
    events = []
    with http.stream("POST", f"/v1/sessions/{sid}/messages",
                     json={"content": "Add 2 and 3.", "tool_choice": "required", "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    assert events[0]["type"] == "start" and events[-1]["type"] == "done"
    done = events[-1]
    assert done["finish_reason"] == "tool_calls" and done["tool_calls"]
    joined: dict[int, dict[str, Any]] = {}
    for ev in events:
        if ev["type"] == "tool_call":
            if ev["index"] not in joined:
                joined[ev["index"]] = {"id": ev["id"], "name": ev["name"], "arguments": ""}
            joined[ev["index"]]["arguments"] += ev["arguments"]
    assert [(c["id"], c["name"]) for c in joined.values()] == \
        [(c["id"], c["function"]["name"]) for c in done["tool_calls"]]
    for i, call in enumerate(done["tool_calls"]):
        valid_call(call)
        assert json.loads(joined[i]["arguments"]) == json.loads(call["function"]["arguments"])


def test_websocket_call_then_result(tiny_chat_server: BackgroundServer) -> None:
    async def run() -> None:
        async with connect(tiny_chat_server) as ws:
            await ws.send(json.dumps({"type": "session.create", "tools": TOOLS, "sampling": SAMPLING, **OWNED}))
            created = await recv_frame(ws)
            assert created["type"] == "session.created", created
            sid = created["session"]["id"]
            frames = await chat_frames(ws, {"session_id": sid, "content": "Weather in Rome?", "tool_choice": NAMED}, "g1")
            done = frames[-1]
            assert done["type"] == "done" and done["finish_reason"] == "tool_calls", frames
            first = [f for f in frames if f["type"] == "tool_call"][0]
            assert first["index"] == 0 and first["name"] == "get_weather" and first["id"] == done["tool_calls"][0]["id"]
            for call in done["tool_calls"]:
                valid_call(call, "get_weather")
            results = [{"tool_call_id": c["id"], "content": "sunny"} for c in done["tool_calls"]]
            frames = await chat_frames(ws, {"session_id": sid, "tool_results": results, "tool_choice": "none",
                                     "sampling": {"max_tokens": 4}}, "g2")
            assert frames[-1]["type"] == "done" and frames[-1]["finish_reason"] in ("stop", "length"), frames
            bad = await chat_frames(ws, {"session_id": sid, "tool_results": results}, "g3")
            assert bad[-1]["type"] == "error" and bad[-1]["code"] == "invalid_field", bad  # answered already
            assert "tool_results[0].tool_call_id" in bad[-1]["message"]

    asyncio.run(run())




# -- the offline API ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model=str(tiny_chat_model_dir("llama")), num_blocks=256)


def test_llm_chat_with_tools(llm: LLM) -> None:
    ask = [{"role": "user", "content": "Add 1 and 2."}]
    params = SamplingParams(max_tokens=120, temperature=0)
    out = llm.chat(ask, params, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}})[0]
    sample = out.outputs[0]
    assert isinstance(sample, ToolCallOutput) and sample.finish_reason == "tool_calls" and sample.tool_calls
    for call in sample.tool_calls:
        assert call.name == "add"
        jsonschema.validate(json.loads(call.arguments), SCHEMAS["add"])
    # n > 1, sampled: each sample parsed on its own
    many = llm.chat(ask, SamplingParams(max_tokens=120, temperature=1.0, seed=5, n=2), tools=TOOLS,
                    tool_choice="required", parallel_tool_calls=False)[0]
    assert [len(o.tool_calls) for o in many.outputs] == [1, 1]  # type: ignore[attr-defined]
    # the call and its result in the history; tool_choice none: text
    history = [*ask, {"role": "assistant", "content": None, "tool_calls": [c.openai_dict() for c in sample.tool_calls]},
               *({"role": "tool", "tool_call_id": c.id, "content": "3"} for c in sample.tool_calls)]
    final = llm.chat(history, SamplingParams(max_tokens=4, temperature=0), tools=TOOLS, tool_choice="none")[0]
    assert final.outputs[0].tool_calls == [] and final.outputs[0].finish_reason in ("stop", "length")  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="tool_choice"):
        llm.chat(ask, params, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})


def test_llm_session_with_tools(llm: LLM) -> None:
    session = llm.session("You can call tools.", SamplingParams(max_tokens=120, temperature=0), tools=TOOLS)
    start = list(session.token_ids)
    out = session.send("Weather in Oslo?", tool_choice=NAMED)
    sample = out.outputs[0]
    assert isinstance(sample, ToolCallOutput) and sample.tool_calls and sample.finish_reason == "tool_calls"
    assert session.messages[-1]["tool_calls"][0]["id"] == sample.tool_calls[0].id
    after_call = list(session.token_ids)
    assert after_call[:len(start)] == start
    session.send_tool_results({c.id: '{"temp_c": 3}' for c in sample.tool_calls}, tool_choice="none",
                              params=SamplingParams(max_tokens=4, temperature=0))
    assert session.token_ids[:len(after_call)] == after_call  # appended, never re-tokenized
    assert [m["role"] for m in session.messages][-2:] == ["tool", "assistant"]
    with pytest.raises(ValueError, match="answer calls"):
        session.send_tool_results({"call_nope": "x"})


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral", "mistral-args"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_every_format_forces_a_valid_call_through_the_tiny_model(llm: LLM, parser: str, choice: str) -> None:
    """Each family's call syntax, forced by tool_choice through the model itself (greedy and sampled):
    the reply parses with that family's parser and the arguments validate against the tool's schema."""
    from radixserve.chat.tool_calls import ChatTools
    from radixserve.chat.tools import FORMATS, ToolChoice
    from radixserve.chat.tools.mistral import MistralFormat

    fmt = MistralFormat(args_syntax=True) if parser == "mistral-args" else FORMATS[parser]
    fmt = fmt.for_tokenizer(llm.tokenizer)
    picked = ToolChoice("named", "add") if choice == "named" else ToolChoice("required")
    tools = ChatTools.of(TOOLS, picked, False, fmt)
    prompt = llm.formatter.prompt_tokens([{"role": "user", "content": "Add 1 and 2."}], tools.template_tools())
    for params in (SamplingParams(max_tokens=120, temperature=0),
                   SamplingParams(max_tokens=120, temperature=1.0, seed=3, n=2)):
        out = tools.read(llm.generate([prompt], tools.constrain(params))[0])
        for sample in out.outputs:
            assert isinstance(sample, ToolCallOutput) and sample.finish_reason == "tool_calls", (parser, sample.text)
            assert len(sample.tool_calls) == 1 and (choice == "required" or sample.tool_calls[0].name == "add")
            call = sample.tool_calls[0]
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert llm.engine.leaked_blocks() == 0


def test_auto_with_a_strict_tool_constrains_the_call_once_the_model_opens_it(
        llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """auto + `strict`: free text until the model writes the format's call opener, then the call is
    constrained. The random tiny model would never write the opener itself, so its first steps are
    steered onto it (every logit but the opener's next token set to -inf after the grammar's mask);
    what follows is the model's and the grammar's alone, and the arguments validate."""
    from radixserve.chat.tool_calls import ChatTools
    from radixserve.engine.grammar import book as grammar_book

    strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
    tools = ChatTools.of(strict, None, False, llm.formatter.tool_format)
    trigger = tools.format.trigger()
    assert trigger is not None and tools.constrain(SamplingParams()).structured is not None
    opener = llm.tokenizer.encode(trigger, add_special_tokens=False)
    real_apply, steps = grammar_book.apply_token_bitmask, [0]

    def open_a_call(logits: Any, masks: Any) -> None:
        real_apply(logits, masks)
        if steps[0] < len(opener):
            kept = logits[:, opener[steps[0]]].clone()
            logits.fill_(float("-inf"))
            logits[:, opener[steps[0]]] = kept
        steps[0] += 1

    monkeypatch.setattr(grammar_book, "apply_token_bitmask", open_a_call)
    out = llm.chat([{"role": "user", "content": "Weather in Oslo?"}], SamplingParams(max_tokens=120, temperature=0),
                   tools=strict, tool_choice="auto", parallel_tool_calls=False)[0].outputs[0]
    assert isinstance(out, ToolCallOutput) and steps[0] > len(opener)
    assert out.finish_reason == "tool_calls" and len(out.tool_calls) == 1, out.text
    jsonschema.validate(json.loads(out.tool_calls[0].arguments), SCHEMAS[out.tool_calls[0].name])
