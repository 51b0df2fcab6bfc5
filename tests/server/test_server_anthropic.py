"""The Anthropic Messages API (POST /v1/messages, /v1/messages/count_tokens) through the official
`anthropic` client against a real server on 127.0.0.1.

Fast tests run the tiny random-weight chat model (tests/tiny_models.py): its text means nothing, so
they check what holds whatever it says — the message and event shapes, usage against count_tokens and
the cache, stop reasons, forced tool calls (whose constraint makes the call parse and validate),
refusals in Anthropic's error shape, the API key headers, disconnects. The installed client sends
`temperature` only through `extra_body`. The reply shaping is also checked without a server, on
recorded Hermes text. The slow tests run the embedded SmolLM2 for realistic conversations.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from radixserve.chat.tools import FORMATS, ToolChoice
from radixserve.core import CompletionOutput, RequestOutput, Timing, Usage
from radixserve.server import BackgroundServer
from radixserve.server.anthropic.reply import ReplyEvents, message_body, stop_fields
from radixserve.server.anthropic.request import template_messages
from radixserve.server.anthropic.tools import tool_request
from radixserve.server.validation import ApiError

pytest.register_assert_rewrite("server_testkit")
from server_testkit import engine_idle, wait_until  # noqa: E402
from tool_fixtures import SCHEMAS, TOOLS  # noqa: E402

pytest_plugins = ["server_testkit"]

ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SYSTEM = "You are a terse assistant. " * 12  # a few blocks of tokens: a later turn reads them from the cache
GREEDY = {"temperature": 0}
HERMES_REPLY = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
KEY = "anthropic-tests-key"


# -- the reply shape, on recorded text (no server) ---------------------------------------------

def _sse(text: str) -> list[dict[str, Any]]:
    events = []
    for raw in text.strip().split("\n\n"):
        head, data = raw.split("\n")
        body = json.loads(data.removeprefix("data: "))
        assert head == f"event: {body['type']}"
        events.append(body)
    return events


def _blocks_of(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The content blocks a stream's events build (checking their order as they go; `ping`s may come anywhere)."""
    events = [e for e in events if e["type"] != "ping"]
    assert events[0]["type"] == "message_start" and events[0]["message"]["content"] == []
    assert [e["type"] for e in events[-2:]] == ["message_delta", "message_stop"]
    blocks: list[dict[str, Any]] = []
    args: dict[int, str] = {}
    open_index = None
    for e in events[1:-2]:
        if e["type"] == "content_block_start":
            assert open_index is None and e["index"] == len(blocks)
            open_index = e["index"]
            blocks.append(dict(e["content_block"]))
        elif e["type"] == "content_block_delta":
            assert e["index"] == open_index
            d = e["delta"]
            if d["type"] == "text_delta":
                blocks[open_index]["text"] += d["text"]
            else:
                assert d["type"] == "input_json_delta" and blocks[open_index]["type"] == "tool_use"
                args[open_index] = args.get(open_index, "") + d["partial_json"]
        else:
            assert e["type"] == "content_block_stop" and e["index"] == open_index
            open_index = None
    assert open_index is None
    for i, text in args.items():
        blocks[i]["input"] = json.loads(text)
    return blocks


def _feed(events: ReplyEvents, text: str, piece: int, finish: str = "stop") -> list[dict[str, Any]]:
    pieces = [text[i:i + piece] for i in range(0, len(text), piece)]
    out = []
    for k, p in enumerate(pieces):
        last = k == len(pieces) - 1
        o = CompletionOutput(0, [1], p, finish if last else None)
        out += events.of(RequestOutput("r", [o], Usage(30, 16, k + 1), Timing(), finished=last))
    return _sse("".join(out))


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_streamed_blocks_join_to_the_whole_reply(piece: int) -> None:
    tools = tool_request({"tools": ANTHROPIC_TOOLS}, FORMATS["hermes"])
    whole = message_body("msg_1", "m", tools, HERMES_REPLY, CompletionOutput(0, finish_reason="stop"), Usage(30, 16, 9))
    assert [b["type"] for b in whole["content"]] == ["text", "tool_use", "tool_use"]
    assert whole["content"][0]["text"] == "Let me check."
    assert whole["content"][1]["input"] == {"city": "Paris"} and whole["content"][2]["input"] == {"a": 1, "b": 2}
    assert whole["stop_reason"] == "tool_use" and whole["stop_sequence"] is None
    assert whole["usage"] == {"input_tokens": 14, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 16,
                              "output_tokens": 9}
    events = _feed(ReplyEvents("msg_1", "m", tools), HERMES_REPLY, piece)
    streamed = _blocks_of(events)
    assert [{k: v for k, v in b.items() if k != "id"} for b in streamed] == \
        [{k: v for k, v in b.items() if k != "id"} for b in whole["content"]]
    assert all(b["id"].startswith("toolu_") for b in streamed if b["type"] == "tool_use")
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    # without parallel calls, the first call only, streamed or not
    single = tool_request({"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}},
                          FORMATS["hermes"])
    whole = message_body("m", "m", single, HERMES_REPLY, CompletionOutput(0, finish_reason="stop"), Usage())
    assert [b["type"] for b in whole["content"]] == ["text", "tool_use"]
    assert [b["type"] for b in _blocks_of(_feed(ReplyEvents("m", "m", single), HERMES_REPLY, piece))] == \
        ["text", "tool_use"]
    # tool_choice none: text as generated, never parsed
    none = tool_request({"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "none"}}, FORMATS["hermes"])
    assert _blocks_of(_feed(ReplyEvents("m", "m", none), HERMES_REPLY, piece)) == [{"type": "text", "text": HERMES_REPLY}]


def test_stop_reasons() -> None:
    def reason(finish: str, stop: str | int | None = None, called: bool = False) -> tuple[str, str | None]:
        return stop_fields(CompletionOutput(0, finish_reason=finish, stop_reason=stop), called)

    assert reason("length") == ("max_tokens", None)
    assert reason("length", called=True) == ("max_tokens", None)
    assert reason("stop") == ("end_turn", None)
    assert reason("stop", 7) == ("end_turn", None)  # a stop token id: the model's own end
    assert reason("stop", "END") == ("stop_sequence", "END")
    assert reason("stop", called=True) == ("tool_use", None)
    with pytest.raises(ApiError) as e:
        reason("abort")
    assert e.value.status == 503


def test_messages_and_tools_map_to_the_template() -> None:
    body = {"system": [{"type": "text", "text": "Be ", "cache_control": {"type": "ephemeral"}}, {"type": "text",
                                                                                                 "text": "brief."}],
            "messages": [*ASK,
                         {"role": "assistant", "content": [
                             {"type": "text", "text": "Checking."},
                             {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                             {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Oslo"}}]},
                         {"role": "user", "content": [
                             {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "21C"}]},
                             {"type": "tool_result", "tool_use_id": "toolu_2", "content": "down", "is_error": True},
                             {"type": "text", "text": "Thanks."}]}]}
    assert template_messages(body) == [
        {"role": "system", "content": "Be brief."}, *ASK,
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "toolu_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "21C"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: down"},
        {"role": "user", "content": "Thanks."}]
    for messages, param in (([{"role": ["user"], "content": "hi"}], "messages[0].role"),
                            ([{"role": "user", "content": []}], "messages[0].content"),
                            ([{"role": "user", "content": [{"type": {}}]}], "messages[0].content[0].type"),
                            ([{"role": "user", "content": [{"type": "tool_result"}]}], "messages[0].content[0].tool_use_id"),
                            ([*ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f"}]}, *ASK],
                             "messages[1].content[0]"),
                            ([{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}, *ASK],
                             "messages[0].content[0].type"),
                            # a result for a call the assistant turn before it never made
                            ([*ASK, {"role": "assistant", "content": "No call."},
                              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9"}]}],
                             "messages[2].content")):
        with pytest.raises(ApiError) as e:
            template_messages({"messages": messages})
        assert e.value.status == 400 and e.value.param == param, (messages, e.value.message)
    hermes = FORMATS["hermes"]
    for choice, mode in (({"type": "auto"}, ToolChoice("auto")), ({"type": "any"}, ToolChoice("required")),
                         ({"type": "tool", "name": "add"}, ToolChoice("named", "add")),
                         ({"type": "none"}, ToolChoice("none"))):
        tools = tool_request({"tools": ANTHROPIC_TOOLS, "tool_choice": choice}, hermes)
        assert tools is not None and tools.choice == mode and tools.parallel
    tools = tool_request({"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "any", "disable_parallel_tool_use": True}},
                         hermes)
    assert tools is not None and not tools.parallel
    cases: list[tuple[dict[str, Any], str]] = [
        ({"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"tools": ANTHROPIC_TOOLS, "tool_choice": "auto"}, "tool_choice"),
        ({"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": ["any"]}}, "tool_choice"),
        ({"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "any", "disable_parallel_tool_use": "yes"}},
         "tool_choice.disable_parallel_tool_use"),
        ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"name": "bad name!", "input_schema": {"type": "object"}}]}, "tools[0].name"),
        ({"tools": [{"name": "f", "input_schema": {"type": 5}}]}, "tools[0].input_schema.type"),
        ({"tools": ANTHROPIC_TOOLS * 2}, "tools"),
    ]
    for fields, param in cases:
        with pytest.raises(ApiError) as e:
            tool_request(fields, hermes)
        assert e.value.status == 400 and e.value.param == param, (fields, e.value.message)


# -- a real server over the tiny chat model ----------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tiny_chat_server: BackgroundServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=tiny_chat_server.url, api_key="unused", max_retries=0, timeout=120)


def _model(srv: BackgroundServer) -> str:
    return srv.state.model_name


def _text(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def _check_usage(client: anthropic.Anthropic, message: Any, created: int = 0, **request: Any) -> None:
    """input_tokens + cache_creation_input_tokens + cache_read_input_tokens is the prompt's length, as
    count_tokens gives it; `created` tokens were a cache_control pin's, made for this request."""
    u = message.usage
    counted = client.messages.count_tokens(**request).input_tokens
    assert u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens == counted
    assert u.cache_creation_input_tokens == created


def test_create_and_stream_with_a_system_prompt(tiny, tiny_chat_server) -> None:  # noqa: ANN001
    kw: dict[str, Any] = dict(model=_model(tiny_chat_server), max_tokens=12, messages=ASK, extra_body=GREEDY)
    for system in (SYSTEM, [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]):
        r = tiny.messages.create(system=system, **kw)
        assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
        assert r.model == _model(tiny_chat_server) and r.stop_reason in ("end_turn", "max_tokens")
        assert r.usage.output_tokens <= 12 and [b.type for b in r.content] in (["text"], [])
        # the mark pins the system prompt (docs/pins.md): the request that made the pin has its tokens as
        # created, although the unmarked request before it had cached the whole prefix already
        pins = httpx.get(f"{tiny_chat_server.url}/v1/cache/pins", timeout=30).json()["data"]
        assert [p["origin"] for p in pins] == ([] if system == SYSTEM else ["cache_control"])
        _check_usage(tiny, r, sum(p["tokens"] for p in pins), model=kw["model"], system=system, messages=ASK)
        with tiny.messages.stream(system=system, **kw) as stream:
            streamed = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert streamed == _text(final) == _text(r)  # greedy: the same reply
        assert final.stop_reason == r.stop_reason and final.usage.output_tokens == r.usage.output_tokens
        assert final.usage.cache_read_input_tokens > 0  # the same prompt again: read from the cache
        _check_usage(tiny, final, model=kw["model"], system=system, messages=ASK)
    events = list(tiny.messages.create(system=SYSTEM, stream=True, **kw))
    _blocks_of([e.to_dict() for e in events])  # the event order
    for p in pins:  # the shared server keeps no pin
        assert httpx.delete(f"{tiny_chat_server.url}/v1/cache/pins/{p['id']}", timeout=30).status_code == 200


def test_multi_turn_reads_the_cache(tiny, tiny_chat_server) -> None:  # noqa: ANN001
    model = _model(tiny_chat_server)
    system = "You answer in French. " * 10
    first = tiny.messages.create(model=model, system=system, max_tokens=8, messages=ASK, extra_body=GREEDY)
    messages = [*ASK, {"role": "assistant", "content": _text(first) or "Oui."},
                {"role": "user", "content": "And in Rome?"}]
    second = tiny.messages.create(model=model, system=system, max_tokens=8, messages=messages, extra_body=GREEDY)
    assert second.usage.cache_read_input_tokens >= 16  # at least the first turn's first block
    _check_usage(tiny, second, model=model, system=system, messages=messages)


def test_count_tokens_counts_tools_as_rendered(tiny, tiny_chat_server) -> None:  # noqa: ANN001
    model = _model(tiny_chat_server)
    plain = tiny.messages.count_tokens(model=model, messages=ASK).input_tokens
    with_tools = tiny.messages.count_tokens(model=model, messages=ASK, tools=ANTHROPIC_TOOLS).input_tokens
    tools_off = tiny.messages.count_tokens(model=model, messages=ASK, tools=ANTHROPIC_TOOLS,
                                           tool_choice={"type": "none"}).input_tokens
    assert with_tools > plain == tools_off > 0
    r = tiny.messages.create(model=model, messages=ASK, tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"},
                             max_tokens=200, extra_body=GREEDY)
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == with_tools


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequences_and_max_tokens(tiny, tiny_chat_server, stream: bool) -> None:  # noqa: ANN001
    kw: dict[str, Any] = dict(model=_model(tiny_chat_server), messages=ASK, extra_body=GREEDY)
    free = tiny.messages.create(max_tokens=30, **kw)
    text = _text(free)
    # a later piece of the greedy reply, printable: asked as a stop sequence the reply ends just before it
    at = next(i for i in range(1, len(text) - 1) if text[i:i + 2].isascii() and text[i:i + 2].isalnum())
    stop = text[at:at + 2]

    def ask(**extra: Any) -> Any:
        if not stream:
            return tiny.messages.create(**kw, **extra)
        with tiny.messages.stream(**kw, **extra) as s:
            return s.get_final_message()

    r = ask(max_tokens=30, stop_sequences=["never-generated", stop])
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", stop)
    assert _text(r) == text[:text.index(stop)]
    r = ask(max_tokens=3)
    assert (r.stop_reason, r.stop_sequence, r.usage.output_tokens) == ("max_tokens", None, 3)


def _assert_tool_use(block: Any, name: str | None = None) -> None:
    assert block.type == "tool_use" and block.id.startswith("toolu_") and block.name in SCHEMAS
    assert name is None or block.name == name
    jsonschema.validate(block.input, SCHEMAS[block.name])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "add"}], ids=["any", "tool"])
def test_forced_tool_calls_validate(tiny, tiny_chat_server, choice: dict[str, Any], stream: bool) -> None:  # noqa: ANN001
    kw: dict[str, Any] = dict(model=_model(tiny_chat_server), messages=ASK, tools=ANTHROPIC_TOOLS, tool_choice=choice,
                              max_tokens=200)
    for temperature in (0.0, 1.0):
        if stream:
            events = list(tiny.messages.create(stream=True, extra_body={"temperature": temperature}, **kw))
            blocks = _blocks_of([e.to_dict() for e in events])  # input_json_delta pieces joined and parsed
            with tiny.messages.stream(extra_body={"temperature": temperature}, **kw) as s:
                r = s.get_final_message()
            assert events[-2].delta.stop_reason == "tool_use"
            for b in blocks:
                assert b["type"] == "tool_use" and b["id"].startswith("toolu_")
                jsonschema.validate(b["input"], SCHEMAS[b["name"]])
        else:
            r = tiny.messages.create(extra_body={"temperature": temperature}, **kw)
        assert r.stop_reason == "tool_use" and r.content
        for block in r.content:
            _assert_tool_use(block, choice.get("name"))
    wait_until(lambda: engine_idle(tiny_chat_server), what="the engine to go idle")


def test_disable_parallel_tool_use_keeps_one_call(tiny, tiny_chat_server) -> None:  # noqa: ANN001
    for temperature in (0.0, 1.0, 1.0):
        r = tiny.messages.create(model=_model(tiny_chat_server), messages=ASK, tools=ANTHROPIC_TOOLS, max_tokens=200,
                                 tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                 extra_body={"temperature": temperature})
        assert r.stop_reason == "tool_use" and len(r.content) == 1
        _assert_tool_use(r.content[0])


@pytest.mark.parametrize("stream", [False, True])
def test_tool_result_round_trip(tiny, tiny_chat_server, stream: bool) -> None:  # noqa: ANN001
    """call (forced) -> tool_result -> a text answer (tool_choice none), the first turn read from the cache."""
    model = _model(tiny_chat_server)
    first = tiny.messages.create(model=model, messages=ASK, tools=ANTHROPIC_TOOLS, max_tokens=200, extra_body=GREEDY,
                                 tool_choice={"type": "tool", "name": "get_weather"})
    call = first.content[0]
    _assert_tool_use(call, "get_weather")
    messages = [*ASK, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": '{"temp_c": 21}'},
                                             {"type": "tool_result", "tool_use_id": call.id, "is_error": True,
                                              "content": [{"type": "text", "text": "rate limited"}]}]}]
    kw: dict[str, Any] = dict(model=model, messages=messages, tools=ANTHROPIC_TOOLS, tool_choice={"type": "none"},
                              max_tokens=8, extra_body=GREEDY)
    if stream:
        with tiny.messages.stream(**kw) as s:
            final = s.get_final_message()
    else:
        final = tiny.messages.create(**kw)
    assert final.stop_reason in ("end_turn", "max_tokens") and all(b.type == "text" for b in final.content)
    assert final.usage.cache_read_input_tokens > 0  # the first request's prompt is cached
    _check_usage(tiny, final, model=model, messages=messages, tools=ANTHROPIC_TOOLS, tool_choice={"type": "none"})


def test_output_config_format_constrains_the_reply(tiny, tiny_chat_server) -> None:  # noqa: ANN001
    schema = SCHEMAS["add"]
    r = tiny.messages.create(model=_model(tiny_chat_server), messages=ASK, max_tokens=100, extra_body=GREEDY,
                             output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(_text(r)), schema)
    # beside a forced tool choice the call wins this turn (docs/structured_output.md): a tool_use block
    forced = tiny.messages.create(model=_model(tiny_chat_server), messages=ASK, max_tokens=100, tools=ANTHROPIC_TOOLS,
                                  tool_choice={"type": "any"}, extra_body=GREEDY,
                                  output_config={"format": {"type": "json_schema", "schema": schema}})
    assert forced.stop_reason == "tool_use" and [b.type for b in forced.content] == ["tool_use"], forced


def _anthropic_error(e: anthropic.APIStatusError, kind: str) -> str:
    body = e.body
    assert isinstance(body, dict) and body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind, body
    return str(body["error"]["message"])


def test_bad_input_is_refused_in_anthropic_errors(tiny, tiny_chat_server) -> None:  # noqa: ANN001
    model = _model(tiny_chat_server)
    url = tiny_chat_server.url + "/v1/messages"
    r = httpx.post(url, json={"model": model, "messages": ASK}, timeout=60)
    assert r.status_code == 400 and r.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "missing required field 'max_tokens'"}}
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    bad: list[tuple[dict[str, Any], str]] = [
        ({"messages": [{"role": "tool", "content": "Be brief."}, *ASK]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [image, {"type": "text", "text": "What is this?"}]}]},
         "messages[0].content[0].type"),
        ({"extra_body": {"temperature": 2.5}}, "temperature"),  # [0, 2] on every API (sampling_fields.py)
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"messages": [*ASK, {"role": "assistant", "content": "It is"}]}, "prefill"),
        ({"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
        ({"stop_sequences": [""]}, "stop_sequences"),
    ]  # a max_tokens past the context is clamped (tests/server/test_anthropic_agents.py)
    for fields, needle in bad:
        kw: dict[str, Any] = {"model": model, "max_tokens": 4, "messages": ASK, **fields}
        with pytest.raises(anthropic.BadRequestError) as e:
            tiny.messages.create(**kw)
        assert needle in _anthropic_error(e.value, "invalid_request_error"), fields
    with pytest.raises(anthropic.NotFoundError) as nf:
        tiny.messages.create(model="claude-nope", max_tokens=4, messages=ASK)
    assert "claude-nope" in _anthropic_error(nf.value, "not_found_error")
    with pytest.raises(anthropic.NotFoundError):
        tiny.messages.count_tokens(model="claude-nope", messages=ASK)
    missing = httpx.post(url + "/nope", json={}, timeout=60)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    # the OpenAI endpoints keep OpenAI's shape
    r = httpx.post(tiny_chat_server.url + "/v1/chat/completions", json={"model": "nope", "messages": ASK}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_caps_and_body_limit_answer_in_anthropic_errors(tiny, tiny_chat_server) -> None:  # noqa: ANN001
    cfg = tiny_chat_server.state.config
    kw: dict[str, Any] = dict(model=_model(tiny_chat_server), max_tokens=4, messages=ASK)
    caps = cfg.max_generations_per_client, cfg.max_concurrent_generations
    try:
        cfg.max_generations_per_client = 0
        with pytest.raises(anthropic.RateLimitError) as limited:
            tiny.messages.create(**kw)
        _anthropic_error(limited.value, "rate_limit_error")
        assert limited.value.response.headers["retry-after"] == "1"
        cfg.max_generations_per_client, cfg.max_concurrent_generations = caps[0], 0
        with pytest.raises(anthropic.APIStatusError) as full:
            tiny.messages.create(**kw)
        assert full.value.status_code == 503
        _anthropic_error(full.value, "overloaded_error")
        # count_tokens generates nothing but tokenizes as much: under the same caps (issue 43, finding 8)
        with pytest.raises(anthropic.APIStatusError) as counting:
            tiny.messages.count_tokens(model=kw["model"], messages=ASK)
        assert counting.value.status_code == 503
        _anthropic_error(counting.value, "overloaded_error")
    finally:
        cfg.max_generations_per_client, cfg.max_concurrent_generations = caps
    big = "x" * (cfg.max_message_bytes + 1)
    r = httpx.post(tiny_chat_server.url + "/v1/messages", timeout=60,
                   json={**kw, "messages": [{"role": "user", "content": big}]})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"


def test_api_key_in_x_api_key_or_bearer(tiny_chat_server) -> None:  # noqa: ANN001
    url, model = tiny_chat_server.url, _model(tiny_chat_server)
    kw: dict[str, Any] = dict(model=model, max_tokens=2, messages=ASK)
    tiny_chat_server.state.config.api_key = KEY
    try:
        bearer = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)  # this client version sends Bearer
        assert bearer.messages.create(**kw).type == "message"
        x_api_key = anthropic.Anthropic(base_url=url, api_key=None, default_headers={"x-api-key": KEY}, max_retries=0)
        assert x_api_key.messages.create(**kw).type == "message"
        assert x_api_key.messages.count_tokens(model=model, messages=ASK).input_tokens > 0
        for wrong in (anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0),
                      anthropic.Anthropic(base_url=url, api_key=None, default_headers={"x-api-key": "wrong"},
                                          max_retries=0)):
            with pytest.raises(anthropic.AuthenticationError) as e:
                wrong.messages.create(**kw)
            assert "API key" in _anthropic_error(e.value, "authentication_error")
        # elsewhere either header works too, and errors keep OpenAI's shape
        assert httpx.get(url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200
        assert httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert httpx.get(url + "/v1/models").json()["error"]["code"] == "unauthorized"
    finally:
        tiny_chat_server.state.config.api_key = None


def test_a_disconnected_stream_aborts_the_generation(tiny_chat_server) -> None:  # noqa: ANN001
    def aborted() -> int:
        return int(tiny_chat_server.engine.stats().requests_finished.get("abort", 0))

    before = aborted()
    body = {"model": _model(tiny_chat_server), "max_tokens": 900, "stream": True, "messages": ASK, **GREEDY}
    with httpx.stream("POST", tiny_chat_server.url + "/v1/messages", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line == "event: content_block_delta":
                break
    wait_until(lambda: engine_idle(tiny_chat_server), what="the generation aborted after the client left")
    assert aborted() == before + 1


# -- the embedded SmolLM2: realistic conversations ---------------------------------------------

@pytest.fixture(scope="module")
def smol(chat_server) -> anthropic.Anthropic:  # noqa: ANN001
    return anthropic.Anthropic(base_url=chat_server.url, api_key="unused", max_retries=0, timeout=120)


@pytest.mark.slow
def test_smollm2_conversation(smol, chat_server) -> None:  # noqa: ANN001
    model = chat_server.state.model_name
    system = "You are a helpful assistant. Answer in one short sentence."
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    r = smol.messages.create(model=model, system=system, max_tokens=40, messages=ask, extra_body=GREEDY)
    assert "Paris" in _text(r) and r.stop_reason in ("end_turn", "max_tokens")
    with smol.messages.stream(model=model, system=system, max_tokens=40, messages=ask, extra_body=GREEDY) as s:
        assert "".join(s.text_stream) == _text(r)
        assert s.get_final_message().usage.cache_read_input_tokens > 0
    messages = [*ask, {"role": "assistant", "content": _text(r)}, {"role": "user", "content": "And of Italy?"}]
    second = smol.messages.create(model=model, system=system, max_tokens=40, messages=messages, extra_body=GREEDY)
    assert second.usage.cache_read_input_tokens >= r.usage.input_tokens + r.usage.cache_read_input_tokens - 16
    _check_usage(smol, second, model=model, system=system, messages=messages)
    stopped = smol.messages.create(model=model, system=system, max_tokens=40, messages=ask, extra_body=GREEDY,
                                   stop_sequences=["Paris"])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "Paris")
    assert "Paris" not in _text(stopped) and _text(r).startswith(_text(stopped))


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_smollm2_tool_round_trip(smol, chat_server, stream: bool) -> None:  # noqa: ANN001
    model = chat_server.state.model_name
    kw: dict[str, Any] = dict(model=model, system="You are a helpful assistant with tools.", tools=ANTHROPIC_TOOLS,
                              max_tokens=120, extra_body=GREEDY)
    choice = {"type": "any", "disable_parallel_tool_use": True}
    if stream:
        with smol.messages.stream(messages=ASK, tool_choice=choice, **kw) as s:
            first = s.get_final_message()
    else:
        first = smol.messages.create(messages=ASK, tool_choice=choice, **kw)
    assert first.stop_reason == "tool_use"
    calls = [b for b in first.content if b.type == "tool_use"]
    assert len(calls) == 1
    _assert_tool_use(calls[0])
    messages = [*ASK, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id,
                                              "content": '{"temp_c": 21, "sky": "clear"}'}]}]
    final = smol.messages.create(messages=messages, **kw)
    assert final.stop_reason in ("end_turn", "max_tokens", "tool_use") and final.content
    assert final.usage.cache_read_input_tokens > 0
