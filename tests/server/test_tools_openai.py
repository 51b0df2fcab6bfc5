"""OpenAI tool calling (`tools`, `tool_choice`, `parallel_tool_calls`, tool history messages) through the
official `openai` client against a real server on 127.0.0.1.

Fast tests run a server over the tiny random chat model (tests/tiny_models.py): its text means
nothing, so what they check is what holds whatever the model says — refusals, plain chat with tool
fields, and `required` / named choices, whose constraint makes the call parse and its arguments
validate. The slow test runs the embedded SmolLM2 for a realistic round trip. The API shaping is
also checked without a server, on recorded Hermes text.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from radixserve.chat.tool_calls import ChatTools
from radixserve.chat.tools import FORMATS, ToolChoice
from radixserve.core import CompletionOutput
from radixserve.server import BackgroundServer, ServerConfig
from radixserve.server.openai_chat.tools import ChoiceDeltas, parse_tools, reply_message, tool_request
from radixserve.server.validation import ApiError

pytest.register_assert_rewrite("server_testkit")
from server_testkit import engine_idle, wait_until  # noqa: E402
from tool_fixtures import ADD, SCHEMAS, TOOLS, WEATHER  # noqa: E402

pytest_plugins = ["server_testkit"]

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_REPLY = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')


def hermes_request(choice: Any = None, parallel: bool = True) -> ChatTools:
    req = tool_request({"tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": parallel}, FORMATS["hermes"])
    assert req is not None
    return req


# -- the API shape, on recorded text (no server) ----------------------------------------------

def test_reply_message_parses_calls_and_sets_finish_reason() -> None:
    message, finish = reply_message(hermes_request(), HERMES_REPLY, "stop")
    assert finish == "tool_calls"
    assert message["content"] == "Let me check."
    calls = message["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    # one call only without parallel calls; plain text is plain text; tool_choice none never parses
    message, _ = reply_message(hermes_request(parallel=False), HERMES_REPLY, "stop")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    assert reply_message(hermes_request(), " Sunny.\n", "stop") == ({"role": "assistant", "content": "Sunny."}, "stop")
    assert reply_message(hermes_request("none"), HERMES_REPLY, "stop")[0] == {"role": "assistant",
                                                                             "content": HERMES_REPLY}
    only_call = HERMES_REPLY.split("\n", 1)[1].rsplit("<tool_call>", 1)[0].strip()
    message, _ = reply_message(hermes_request(), only_call, "stop")
    assert message["content"] is None and len(message["tool_calls"]) == 1


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_streamed_fragments_join_to_the_parsed_calls(piece: int) -> None:
    whole, _ = reply_message(hermes_request(), HERMES_REPLY, "stop")
    deltas = ChoiceDeltas(hermes_request())
    pieces = [HERMES_REPLY[i:i + piece] for i in range(0, len(HERMES_REPLY), piece)]
    out: list[dict[str, Any]] = []
    for k, text in enumerate(pieces):
        out += deltas.of(CompletionOutput(0, [1], text, "stop" if k == len(pieces) - 1 else None), False)
    assert deltas.finish_reason("stop") == "tool_calls"
    content = "".join(d.get("content", "") for d in out)
    assert content.strip() == whole["content"]
    calls: dict[int, dict[str, Any]] = {}
    for d in out:
        for frag in d.get("tool_calls", ()):
            if frag["index"] not in calls:  # the first fragment of a call names it
                assert frag["id"].startswith("call_") and frag["type"] == "function" and frag["function"]["name"]
                calls[frag["index"]] = {"name": frag["function"]["name"], "arguments": ""}
            else:
                assert "id" not in frag and "name" not in frag["function"]
            calls[frag["index"]]["arguments"] += frag["function"]["arguments"]
    assert [calls[i]["name"] for i in sorted(calls)] == [c["function"]["name"] for c in whole["tool_calls"]]
    for i, c in enumerate(whole["tool_calls"]):
        assert json.loads(calls[i]["arguments"]) == json.loads(c["function"]["arguments"])


def test_tool_fields_are_validated() -> None:
    hermes = FORMATS["hermes"]
    cases: list[tuple[dict[str, Any], str]] = [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": "auto"}, "tool_choice"),  # as OpenAI and vLLM answer (issue 43, finding 12)
        ({"tools": [], "tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function"}]}, "tools[0]"),
        ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
         "tools[0].function.parameters.type"),
        ({"tools": "get_weather"}, "tools"),
        ({"functions": [WEATHER["function"]]}, "functions"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ]
    for body, param in cases:
        with pytest.raises(ApiError) as e:
            tool_request(body, hermes)
        assert e.value.status == 400 and e.value.param == param, (body, e.value.message)
    assert tool_request({}, hermes) is None
    none = tool_request({"tools": [], "tool_choice": "none"}, hermes)
    assert none is not None and not none.active and none.template_tools() is None
    named = tool_request({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}}, hermes)
    assert named is not None and named.choice == ToolChoice("named", "add")
    assert [t.name for t in parse_tools(TOOLS)] == ["get_weather", "add"]


def test_tool_call_parser_flag() -> None:
    import argparse

    from radixserve.server.cli import add_server_arguments, server_config_from_args

    p = argparse.ArgumentParser()
    add_server_arguments(p)
    assert server_config_from_args(p.parse_args(["--tool-call-parser", "mistral"])).tool_call_parser == "mistral"
    assert server_config_from_args(p.parse_args([])).tool_call_parser is None
    with pytest.raises(SystemExit):
        p.parse_args(["--tool-call-parser", "nope"])
    with pytest.raises(ValueError, match="tool_call_parser"):
        ServerConfig(tool_call_parser="nope")


# -- a real server over the tiny chat model ----------------------------------------------------



@pytest.fixture(scope="module")
def tiny(tiny_chat_server: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_chat_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _model(srv: BackgroundServer) -> str:
    return srv.state.model_name


def assert_valid_call(call: Any, name: str | None = None) -> dict[str, Any]:
    """An OpenAI tool call that names a known tool (`name` if given) with arguments valid for its schema."""
    assert call.type == "function" and call.id
    assert call.function.name in SCHEMAS and (name is None or call.function.name == name)
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def streamed(stream: Any) -> tuple[str, dict[int, dict[str, Any]], str | None, list[Any]]:
    """(content, calls by index {id, name, arguments}, finish_reason, chunks) of a streamed choice 0."""
    content, calls, finish, chunks = "", {}, None, list(stream)
    for chunk in chunks:
        for c in chunk.choices:
            content += c.delta.content or ""
            for frag in c.delta.tool_calls or ():
                call = calls.setdefault(frag.index, {"id": frag.id, "name": frag.function.name, "arguments": ""})
                if call["id"] is None:
                    raise AssertionError("the first fragment of a call carries its id")
                call["arguments"] += frag.function.arguments or ""
            finish = c.finish_reason or finish
    return content, calls, finish, chunks


def test_plain_chat_accepts_every_tool_field(tiny, tiny_chat_server) -> None:  # noqa: ANN001
    """Clients that always send the tool fields, or a history of calls, get plain chat."""
    history = [*ASK,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21, "sky": "clear"}'}]
    for extra in ({"tools": []}, {"tools": [], "tool_choice": "none"}, {"tools": TOOLS, "tool_choice": "none"},
                  {"tool_choice": "none"}):
        for messages in (ASK, history):
            r = tiny.chat.completions.create(model=_model(tiny_chat_server), messages=messages, max_tokens=4,
                                             temperature=0, **extra)
            assert r.choices[0].message.tool_calls is None and isinstance(r.choices[0].message.content, str)
            assert r.choices[0].finish_reason in ("stop", "length")


def test_refusals_name_the_parameter(tiny, tiny_chat_server) -> None:  # noqa: ANN001
    model = _model(tiny_chat_server)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice"),
        ({"messages": [{"role": "user", "content": "hi", "tool_calls": [{}]}]}, "messages[0].tool_calls"),
        ({"messages": [*ASK, {"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
        ({"messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]},
         "messages[1].tool_calls[0]"),
        ({"tools": TOOLS, "use_beam_search": True}, "tools"),
        ({"functions": [ADD["function"]], "function_call": "auto"}, "functions"),
    ]
    for extra, param in cases:
        body = {"model": model, "messages": ASK, "max_tokens": 4, **extra}
        r = httpx.post(tiny_chat_server.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error", (extra, err)
    assert r.json()["error"]["code"] == "unsupported" and "tools" in err["message"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_calls_parse_and_validate(tiny, tiny_chat_server, choice: str, stream: bool) -> None:  # noqa: ANN001
    """`required` and a named function constrain the reply: a call to a known (the named) tool whose
    arguments validate against its parameters, finish_reason tool_calls; sampled too."""
    tool_choice: Any = {"type": "function", "function": {"name": "add"}} if choice == "named" else "required"
    for temperature, seed in ((0.0, None), (1.0, 3), (1.0, 4)):
        kw = dict(model=_model(tiny_chat_server), messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=200,
                  temperature=temperature, seed=seed)
        if not stream:
            r = tiny.chat.completions.create(**kw)
            c = r.choices[0]
            assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
            for call in c.message.tool_calls:
                assert_valid_call(call, "add" if choice == "named" else None)
            continue
        content, calls, finish, _ = streamed(tiny.chat.completions.create(**kw, stream=True))
        assert finish == "tool_calls" and calls
        for call in calls.values():
            assert call["id"].startswith("call_") and call["name"] in SCHEMAS
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    wait_until(lambda: engine_idle(tiny_chat_server), what="the engine to go idle")


def test_forced_calls_with_n_and_without_parallel_calls(tiny, tiny_chat_server) -> None:  # noqa: ANN001
    r = tiny.chat.completions.create(model=_model(tiny_chat_server), messages=ASK, tools=TOOLS, tool_choice="required",
                                     max_tokens=200, temperature=1.0, seed=11, n=3, parallel_tool_calls=False)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c in r.choices:  # each choice parsed on its own
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
        assert_valid_call(c.message.tool_calls[0])


@pytest.mark.parametrize("stream", [False, True])
def test_round_trip_with_the_tiny_model(tiny, tiny_chat_server, stream: bool) -> None:  # noqa: ANN001
    """call (named) -> tool result -> final answer (tool_choice none: text)."""
    model = _model(tiny_chat_server)
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = tiny.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=200,
                                         temperature=0)
    call = first.choices[0].message.tool_calls[0]
    assert_valid_call(call, "get_weather")
    messages = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'}]
    kw = dict(model=model, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0)
    if stream:
        content, calls, finish, _ = streamed(tiny.chat.completions.create(**kw, stream=True))
        assert not calls and finish in ("stop", "length") and isinstance(content, str)
    else:
        final = tiny.chat.completions.create(**kw)
        assert final.choices[0].message.tool_calls is None and final.choices[0].finish_reason in ("stop", "length")
        assert final.usage.prompt_tokens_details.cached_tokens > 0  # the first request's prompt is cached


# -- the embedded SmolLM2: a realistic round trip ---------------------------------------------

@pytest.fixture(scope="module")
def client(chat_server) -> openai.OpenAI:  # noqa: ANN001
    return openai.OpenAI(base_url=chat_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _round_trip(client: openai.OpenAI, model: str, tool_choice: Any, stream: bool) -> None:
    """Ask, get a call (or, under auto, possibly text), answer it with a tool result, get the final answer."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a helpful assistant with tools."}, *ASK]
    # one call: a greedy 135M model told it may make several repeats the same call up to max_tokens
    kw = dict(model=model, tools=TOOLS, tool_choice=tool_choice, max_tokens=120, temperature=0,
              parallel_tool_calls=False)
    if stream:
        content, calls, finish, chunks = streamed(client.chat.completions.create(messages=messages, stream=True, **kw))
        assert chunks[0].choices[0].delta.role == "assistant"
        assistant: dict[str, Any] = {"role": "assistant", "content": content or None}
        if calls:
            assert finish == "tool_calls"
            assistant["tool_calls"] = [{"id": c["id"], "type": "function",
                                        "function": {"name": c["name"], "arguments": c["arguments"]}}
                                       for c in calls.values()]
        answered = [(c["id"], c["name"], c["arguments"]) for c in calls.values()]
    else:
        r = client.chat.completions.create(messages=messages, **kw)
        msg = r.choices[0].message
        assistant = msg.model_dump(exclude_none=True)
        answered = [(c.id, c.function.name, c.function.arguments) for c in msg.tool_calls or ()]
        assert (r.choices[0].finish_reason == "tool_calls") == bool(answered)
    if tool_choice != "auto":
        assert answered, "a forced tool_choice always calls"
    if not answered:
        return  # auto: the model chose to answer in text
    for _, name, arguments in answered:
        assert name in SCHEMAS
        if tool_choice != "auto":
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    if isinstance(tool_choice, dict):
        assert {name for _, name, _ in answered} == {tool_choice["function"]["name"]}
    messages += [assistant] + [{"role": "tool", "tool_call_id": cid, "content": '{"temp_c": 21, "sky": "clear"}'}
                               for cid, _, _ in answered]
    final = client.chat.completions.create(messages=messages, model=model, tools=TOOLS, max_tokens=40, temperature=0)
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert final.choices[0].message.content or final.choices[0].message.tool_calls


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["auto", "required", "named"])
def test_round_trip_with_smollm2(client, chat_server, tool_choice: Any, stream: bool) -> None:  # noqa: ANN001
    _round_trip(client, chat_server.state.model_name, tool_choice, stream)
