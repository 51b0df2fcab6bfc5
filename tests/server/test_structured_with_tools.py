"""A structured final answer beside tools, through the official `openai` client against real servers on
127.0.0.1: `response_format` with `tools` under `auto` (strict tools or not) is one grammar of either calls
or the schema's answer, and the reply reads as what it is (a JSON answer is content with finish_reason
"stop", calls are `tool_calls` with "tool_calls"), whole and streamed, `.parse` included; under
`required` / a named function the reply is the call; under `none` the answer; a regex beside active tools
is the 400 naming its field. The Responses API's `text.format` and the Messages API's
`output_config.format` join tools the same way. Thinking models (a tiny Qwen3 whose prompt opens the
thinking, a tiny gpt-oss with harmony) get the same grammar from the first token: no reasoning, the
answer or the call.

The tiny random-weight models write noise, so only the grammar makes a reply parse; which branch a reply
takes is chosen with `logit_bias` on its first token (a call opens with a marker no answer starts with),
which changes no grammar: each branch is checked on what the server makes of it."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from radixserve.server import BackgroundServer

pytest.register_assert_rewrite("server_testkit", "reasoning_kit")
from reasoning_kit import Replies  # noqa: E402
from server_testkit import engine_idle, wait_until  # noqa: E402
from tool_fixtures import SCHEMAS, TOOLS  # noqa: E402

pytest_plugins = ["server_testkit", "reasoning_kit"]

ASK = [{"role": "user", "content": "What is the weather in Paris? Answer as JSON."}]
VERDICT = {"type": "object", "required": ["verdict", "score"], "additionalProperties": False,
           "properties": {"verdict": {"enum": ["yes", "no"]}, "score": {"type": "integer", "minimum": 0, "maximum": 9}}}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "Verdict", "schema": VERDICT, "strict": True}}
STRICT_TOOLS = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
MAX_TOKENS = 120


class Verdict(BaseModel):
    verdict: str = Field(pattern="^(yes|no)$", max_length=3)
    score: int = Field(ge=0, le=9)


class Add(BaseModel):
    """Add two digits."""

    a: int = Field(ge=0, le=9)
    b: int = Field(ge=0, le=9)


def client_of(srv: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def first_token(srv: BackgroundServer, text: str) -> dict[str, int]:
    """A logit_bias that makes `text`'s first token the reply's first (where the grammar allows it)."""
    return {str(srv.engine.tokenizer(text, add_special_tokens=False)["input_ids"][0]): 100}


def answer(content: str | None) -> Any:
    value = json.loads(content or "")
    jsonschema.validate(value, VERDICT)
    return value


def check_calls(calls: list[tuple[str, str]], schemas: dict[str, Any] = SCHEMAS, most: int = 99) -> None:
    assert 1 <= len(calls) <= most, calls
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), schemas[name])


def streamed(chunks: Any) -> tuple[str, list[tuple[str, str]], str | None]:
    """(content, [(name, arguments)], finish_reason) of a streamed choice, fragments joined."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for c in chunk.choices:
            content += c.delta.content or ""
            for frag in c.delta.tool_calls or ():
                call = calls.setdefault(frag.index, [frag.function.name, ""])
                call[1] += frag.function.arguments or ""
            finish = c.finish_reason or finish
    return content, [(n, a) for n, a in (calls[i] for i in sorted(calls))], finish


def no_leaks(srv: BackgroundServer) -> None:
    wait_until(lambda: engine_idle(srv), what="the engine idle with no blocks held")


# ---- the tiny chat model (hermes calls) ---------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tools", [TOOLS, STRICT_TOOLS], ids=["plain", "strict"])
def test_auto_replies_with_the_answer_or_with_calls(tiny_chat_server: BackgroundServer, tools: list[Any],
                                                    stream: bool) -> None:
    """The 400 of old is gone: under auto the reply is the schema's answer or calls, as the model picks."""
    srv = tiny_chat_server
    client = client_of(srv)
    kw: dict[str, Any] = dict(model=srv.state.model_name, messages=ASK, tools=tools, response_format=RESPONSE_FORMAT,
                              max_tokens=MAX_TOKENS, temperature=1.0, seed=5)
    for opening, parallel in (("{", True), ("<tool_call>", True), ("<tool_call>", False)):
        made = client.chat.completions.create(**kw, parallel_tool_calls=parallel, stream=stream,
                                              logit_bias=first_token(srv, opening))
        if stream:
            content, calls, finish = streamed(made)
        else:
            choice = made.choices[0]
            content, finish = choice.message.content or "", choice.finish_reason
            calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
        if opening == "{":
            assert finish == "stop" and calls == [], (content, calls)
            answer(content)
        else:
            assert finish == "tool_calls" and content == "", (content, calls)
            check_calls(calls, most=99 if parallel else 1)
    no_leaks(srv)


def test_parse_reads_the_answer_or_the_calls(tiny_chat_server: BackgroundServer) -> None:
    """The Agents SDK's / pydantic-ai's shape: a pydantic output type beside strict function tools."""
    srv = tiny_chat_server
    client = client_of(srv)
    kw: dict[str, Any] = dict(model=srv.state.model_name, messages=ASK, response_format=Verdict,
                              tools=[openai.pydantic_function_tool(Add)], max_tokens=MAX_TOKENS, temperature=1.0,
                              seed=2)
    done = client.chat.completions.parse(**kw, logit_bias=first_token(srv, "{"))
    message = done.choices[0].message
    assert done.choices[0].finish_reason == "stop" and isinstance(message.parsed, Verdict) and not message.tool_calls
    called = client.chat.completions.parse(**kw, logit_bias=first_token(srv, "<tool_call>"))
    message = called.choices[0].message
    assert called.choices[0].finish_reason == "tool_calls" and message.parsed is None and message.tool_calls
    assert all(isinstance(c.function.parsed_arguments, Add) for c in message.tool_calls)
    with client.chat.completions.stream(**kw, logit_bias=first_token(srv, "{")) as s:
        final = s.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, Verdict)
    no_leaks(srv)


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_wins_and_none_answers(tiny_chat_server: BackgroundServer, stream: bool) -> None:
    """required / named: this reply is the call (the schema is for a later final answer); none: the answer.
    Biased towards an answer, the forced reply is a call all the same."""
    srv = tiny_chat_server
    client = client_of(srv)
    kw: dict[str, Any] = dict(model=srv.state.model_name, messages=ASK, tools=TOOLS, response_format=RESPONSE_FORMAT,
                              max_tokens=MAX_TOKENS, temperature=1.0, seed=1, logit_bias=first_token(srv, "{"),
                              stream=stream)
    add = {"type": "function", "function": {"name": "add"}}
    for choice, allowed in (("required", SCHEMAS), (add, {"add": SCHEMAS["add"]})):
        made = client.chat.completions.create(**kw, tool_choice=choice, parallel_tool_calls=False)
        content, calls, finish = streamed(made) if stream else (
            made.choices[0].message.content or "",
            [(c.function.name, c.function.arguments) for c in made.choices[0].message.tool_calls or ()],
            made.choices[0].finish_reason)
        assert finish == "tool_calls" and content == "", (content, calls)
        check_calls(calls, allowed, most=1)
    made = client.chat.completions.create(**{**kw, "logit_bias": first_token(srv, "<tool_call>")}, tool_choice="none")
    content, calls, finish = streamed(made) if stream else (made.choices[0].message.content, [],
                                                            made.choices[0].finish_reason)
    assert finish == "stop" and calls == []
    answer(content)
    no_leaks(srv)


def test_a_regex_beside_active_tools_is_a_400_naming_it(tiny_chat_server: BackgroundServer) -> None:
    srv = tiny_chat_server
    client = client_of(srv)
    kw: dict[str, Any] = dict(model=srv.state.model_name, messages=ASK, tools=TOOLS, max_tokens=8)
    for choice in ("auto", "required"):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**kw, tool_choice=choice, extra_body={"guided_regex": "[a-z]+"})
        error = e.value.body
        assert isinstance(error, dict) and error["param"] == "guided_regex", error
        assert "regex" in error["message"] and "tool_choice" in error["message"]
    out = client.chat.completions.create(**kw, tool_choice="none", temperature=0, extra_body={"guided_regex": "[a-z]+"})
    assert out.choices[0].message.content and out.choices[0].message.content.isalpha()


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_responses_text_format_and_anthropic_output_config_join_tools_alike(tiny_chat_server: BackgroundServer,
                                                                          choice: str) -> None:
    """The same rule on the other APIs (their answer fields reach the pipeline as the structured output):
    each reply is a valid answer or valid calls, and under `required` calls."""
    import anthropic

    srv = tiny_chat_server
    client = client_of(srv)
    functions = [{"type": "function", **t["function"]} for t in TOOLS]
    for seed in range(2):
        r = client.responses.create(model=srv.state.model_name, input="Weather in Paris?", tools=functions,
                                    tool_choice=choice, temperature=1.0, max_output_tokens=MAX_TOKENS,
                                    text={"format": {"type": "json_schema", "name": "Verdict", "schema": VERDICT,
                                                     "strict": True}}, extra_body={"seed": seed})
        calls = [(o.name, o.arguments) for o in r.output if o.type == "function_call"]
        if calls or choice == "required":
            check_calls(calls)
        else:
            answer(r.output_text)
    messages = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=120)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    for seed in range(2):
        m = messages.messages.create(model=srv.state.model_name, max_tokens=MAX_TOKENS, tools=tools,
                                     tool_choice={"type": "any" if choice == "required" else "auto"},
                                     messages=[{"role": "user", "content": "Weather in Paris?"}],
                                     extra_body={"output_config": {"format": {"type": "json_schema", "schema": VERDICT}},
                                                 "temperature": 1.0, "seed": seed})
        uses = [(b.name, json.dumps(b.input)) for b in m.content if b.type == "tool_use"]
        if uses or choice == "required":
            assert m.stop_reason == "tool_use"
            check_calls(uses)
        else:
            assert m.stop_reason == "end_turn"
            answer("".join(b.text for b in m.content if b.type == "text"))
    no_leaks(srv)


# ---- thinking models: the grammar from the first token ----------------------------------------------

Servers = Callable[[str], BackgroundServer]
ReplyMaker = Callable[[BackgroundServer], Replies]


@pytest.mark.parametrize(("kind", "opening"), [("qwen3_opened", "<tool_call>"), ("harmony", "<|channel|>")])
def test_thinking_models_answer_or_call_without_reasoning(reasoning_servers: Servers, replies: ReplyMaker,
                                                          kind: str, opening: str) -> None:
    """A prompt that opens the thinking (Qwen3-Thinking's template) would have the reply read as reasoning
    unless the grammar writes it from its first token; gpt-oss's answer is its bare JSON, its call the
    commentary-channel message."""
    srv = reasoning_servers(kind)
    recorded = replies(srv)
    client = client_of(srv)
    kw: dict[str, Any] = dict(model=srv.state.model_name, messages=ASK, tools=TOOLS, response_format=RESPONSE_FORMAT,
                              max_tokens=MAX_TOKENS, temperature=1.0, seed=4)
    done = client.chat.completions.create(**kw, logit_bias=first_token(srv, "{"))
    grammar = recorded.requests[-1].params.structured
    assert grammar is not None and (grammar.grammar or "").startswith("start: calls | answer")
    choice = done.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls, choice
    assert getattr(choice.message, "reasoning_content", None) is None
    answer(choice.message.content)
    content, calls, finish = streamed(client.chat.completions.create(**kw, logit_bias=first_token(srv, opening),
                                                                     parallel_tool_calls=False, stream=True))
    assert finish == "tool_calls" and content == "", (content, calls)
    check_calls(calls, most=1)
    no_leaks(srv)
