"""The Anthropic Messages API as agents use it (issue 48, Deliver 2): what a terminal coding agent
(Claude Code with ANTHROPIC_BASE_URL) and the Anthropic SDK's tool loop send, through the official
`anthropic` client against real servers on 127.0.0.1.

- tools: the SDK's tool runner (`client.beta.messages.tool_runner`, streamed and not) over forced
  calls, a tool that fails (`is_error`) and results as text blocks; every `tool_choice` streamed, with
  `input_json_delta` pieces joining to each call's input;
- `thinking`: enabled, disabled, adaptive (and between_tools) accepted on both endpoints; thinking
  blocks of a thinking model (tests/tiny_models.py's Qwen3-like template) streamed and not, adaptive
  leaving the template's default, `display: "omitted"` emptying them;
- `role: "system"` messages: a leading run joins the system prompt, a later one is rendered where it
  stands, and a template that will not take it is answered with Anthropic's own refusal;
- `max_tokens` past the context: clamped, the reply ending with "model_context_window_exceeded"
  (other APIs still refuse it); a prompt past the context in Anthropic's "prompt is too long" words;
- `stop_sequences` streamed, `metadata`, `ping` events (after `message_start`, and while the engine
  is held before its first output, with a tiny injected interval), `anthropic-beta` headers, `thread`
  refused with the error code the SDK falls back on;
- refusals from the shared code in Anthropic's shape and wording.

The tiny random-weight model's text means nothing: the tests check what holds whatever it says.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from radixserve import AsyncEngine, EngineConfig
from radixserve.core import CompletionOutput, RequestOutput, Timing, Usage
from radixserve.sampling_fields import Api
from radixserve.server import BackgroundServer, ServerConfig
from radixserve.server.anthropic import api as anthropic_api
from radixserve.server.anthropic.heartbeat import paced
from radixserve.server.anthropic.reply import ReplyEvents, message_body, stop_fields
from radixserve.server.anthropic.request import SYSTEM_ROLE_REFUSED, read_thinking, template_messages
from radixserve.server.api_errors import anthropic_error_body
from radixserve.server.pipeline.sampling import build_sampling_params
from radixserve.server.validation import ApiError

pytest.register_assert_rewrite("server_testkit", "reasoning_kit")
from reasoning_kit import Replies  # noqa: E402
from server_testkit import on_server_loop  # noqa: E402
from test_server_anthropic import _sse  # noqa: E402
from tool_fixtures import SCHEMAS, TOOLS  # noqa: E402

pytest_plugins = ["server_testkit", "reasoning_kit"]

ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}
TOO_LONG = re.compile(r"prompt is too long: (\d+) tokens > (\d+) maximum")
# beta names the SDK and Claude Code send: none changes what this server does
BETAS = ["claude-code-20250219", "interleaved-thinking-2025-05-14", "fine-grained-tool-streaming-2025-05-14",
         "context-1m-2025-08-07", "token-efficient-tools-2025-02-19", "model-context-window-exceeded-2025-08-26"]
# ChatML, as the tiny model's, but refusing what stricter templates refuse (Mistral's, Gemma's): a system
# message after the first message, and roles that do not alternate
STRICT_TEMPLATE = (
    "{%- set ns = namespace(last='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' and not loop.first -%}"
    "{{ raise_exception('System messages are only allowed first') }}{%- endif -%}"
    "{%- if message['role'] != 'system' -%}{%- if message['role'] == ns.last -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant') }}{%- endif -%}"
    "{%- set ns.last = message['role'] -%}{%- endif -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


# -- without a server ---------------------------------------------------------------------------

def test_paced_ticks_while_the_source_is_quiet() -> None:
    """Ticks (None) while the source awaits, its items in order; closing ends a pending step."""
    async def run() -> tuple[list[int | None], bool]:
        release = asyncio.Event()
        closed = False

        async def source() -> AsyncIterator[int]:
            nonlocal closed
            try:
                await release.wait()
                yield 1
                yield 2
                await asyncio.Event().wait()  # never: the caller closes the pacing while this is pending
                yield 3
            finally:
                closed = True

        got: list[int | None] = []
        agen = paced(source(), 0.001)
        async for item in agen:
            got.append(item)
            if got.count(None) == 3:
                release.set()
            if item is None and 2 in got:  # quiet again: the step awaiting item 3 is pending
                break
        assert not closed
        await agen.aclose()
        return got, closed

    got, closed = asyncio.run(run())
    assert got[:3] == [None, None, None] and [g for g in got if g is not None] == [1, 2] and got[-1] is None
    assert closed  # closing the pacing closed the source: a stream's engine request is aborted with it


def test_stream_starts_with_a_ping_and_beats_while_quiet() -> None:
    def output(text: str, finish: str | None, usage: Usage) -> RequestOutput:
        return RequestOutput("r", [CompletionOutput(0, [1], text, finish)], usage, Timing(), finished=finish is not None)

    # the engine's first output comes first: message_start with its usage (the cache hit), then a ping
    events = ReplyEvents("m", "model", None)
    first = _sse("".join(events.of(output("Hi", None, Usage(30, 16, 1)))))
    assert [e["type"] for e in first] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert first[0]["message"]["usage"]["cache_read_input_tokens"] == 16
    assert _sse("".join(events.heartbeat(30))) == [{"type": "ping"}]
    # quiet before the first output (a long prefill): the first beat starts the message with what is known
    events = ReplyEvents("m", "model", None, clamped=True)
    beats = _sse("".join(events.heartbeat(30) + events.heartbeat(30)))
    assert [e["type"] for e in beats] == ["message_start", "ping", "ping"]
    assert beats[0]["message"]["usage"] == {"input_tokens": 30, "cache_creation_input_tokens": 0,
                                            "cache_read_input_tokens": 0, "output_tokens": 0}
    rest = _sse("".join(events.of(output("Hi", "length", Usage(30, 16, 1)))))
    assert [e["type"] for e in rest] == ["content_block_start", "content_block_delta", "content_block_stop",
                                         "message_delta", "message_stop"]
    assert rest[-2]["delta"]["stop_reason"] == "model_context_window_exceeded"
    assert rest[-2]["usage"]["cache_read_input_tokens"] == 16  # the final usage, which clients keep
    assert events.heartbeat(30) == []  # nothing after message_stop


def test_stop_reason_of_a_clamped_reply_and_omitted_thinking() -> None:
    cut = CompletionOutput(0, finish_reason="length")
    assert stop_fields(cut, False) == ("max_tokens", None)
    assert stop_fields(cut, False, clamped=True) == ("model_context_window_exceeded", None)
    ended = CompletionOutput(0, finish_reason="stop")
    assert stop_fields(ended, False, clamped=True) == ("end_turn", None)  # a clamp it never reached
    body = message_body("m", "model", None, "Paris.", ended, Usage(), reasoning="It is Paris.", show_thinking=False)
    assert body["content"] == [{"type": "thinking", "thinking": "", "signature": ""}, {"type": "text", "text": "Paris."}]


def test_max_tokens_past_the_context_is_clamped_on_anthropic_only() -> None:
    from radixserve.sampling_fields import SamplingFields

    asked = SamplingFields(max_tokens=32000)
    params = build_sampling_params(asked, prompt_len=90, max_model_len=100, default_max_tokens=None, api=Api.ANTHROPIC)
    assert params.max_tokens == 10
    for api in (Api.CHAT, Api.COMPLETIONS, Api.RESPONSES, Api.SESSION):
        with pytest.raises(ApiError) as e:
            build_sampling_params(asked, prompt_len=90, max_model_len=100, default_max_tokens=None, api=api)
        assert e.value.code == "context_too_long"


def test_every_thinking_config_is_read() -> None:
    assert read_thinking({"type": "enabled", "budget_tokens": 1024}, 2048).variables == {"enable_thinking": True}
    assert read_thinking({"type": "disabled"}).variables == {"enable_thinking": False}
    for kind in ("adaptive", "between_tools"):  # the model decides: the template's default
        assert read_thinking({"type": kind}).variables == {}
    assert not read_thinking({"type": "adaptive", "display": "omitted"}).shown
    assert read_thinking({"type": "enabled", "budget_tokens": 1024, "display": "summarized"}, 4096).shown
    for bad, param in (({"type": "adaptive", "display": "hidden"}, "thinking.display"),
                       ({"type": "enabled", "budget_tokens": 1024}, "thinking.budget_tokens"),  # >= max_tokens
                       ("adaptive", "thinking"), ({"type": "auto"}, "thinking")):
        with pytest.raises(ApiError) as e:
            read_thinking(bad, 1024)
        assert e.value.param == param and f"'{param}'" in e.value.message


def test_system_messages_in_messages_map_to_the_template() -> None:
    turns = [{"role": "system", "content": "Be brief."},
             {"role": "system", "content": [{"type": "text", "text": "Answer in French."}]},
             *ASK, {"role": "assistant", "content": "Il fait beau."},
             {"role": "system", "content": "From now on, answer in English."},
             {"role": "user", "content": "And in Rome?"},
             {"role": "system", "content": "Keep it short."}]  # after the last user turn: still a user's reply
    assert template_messages({"system": "You are terse.", "messages": turns}) == [
        {"role": "system", "content": "You are terse.\n\nBe brief.\n\nAnswer in French."}, *ASK,
        {"role": "assistant", "content": "Il fait beau."},
        {"role": "system", "content": "From now on, answer in English."},
        {"role": "user", "content": "And in Rome?"}, {"role": "system", "content": "Keep it short."}]
    assert template_messages({"messages": turns[1:3]}) == [{"role": "system", "content": "Answer in French."}, *ASK]
    for messages, param in (([{"role": "system", "content": "Only this."}], "messages"),
                            ([{"role": "system", "content": ""}, *ASK], "messages[0].content"),
                            ([{"role": "system", "content": [{"type": "image"}]}, *ASK], "messages[0].content[0].type"),
                            ([*ASK, {"role": "assistant", "content": "It is"}, {"role": "system", "content": "Go on."}],
                             "messages[1].role")):  # a prefill, whatever system message follows it
        with pytest.raises(ApiError) as e:
            template_messages({"messages": messages})
        assert e.value.status == 400 and e.value.param == param, (messages, e.value.message)


def test_anthropic_error_types_of_every_status() -> None:
    for status, kind in ((400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
                         (404, "not_found_error"), (405, "invalid_request_error"), (408, "timeout_error"),
                         (409, "conflict_error"), (413, "request_too_large"), (429, "rate_limit_error"),
                         (500, "api_error"), (503, "overloaded_error"), (504, "timeout_error")):
        body = anthropic_error_body(ApiError("x", "why", status))
        assert body == {"type": "error", "error": {"type": kind, "message": "why"}}, status


# -- the tiny chat model ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tiny_chat_server: BackgroundServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=tiny_chat_server.url, api_key="unused", max_retries=0, timeout=120)


def _model(srv: BackgroundServer) -> str:
    return srv.state.model_name


def _texts(message: Any) -> list[str]:
    return [b.text for b in message.content if b.type == "text"]


def _error(e: anthropic.APIStatusError, kind: str = "invalid_request_error") -> str:
    body = e.body
    assert isinstance(body, dict) and body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind, body
    return str(body["error"]["message"])


def _weather(city: str, unit: str = "celsius") -> list[dict[str, str]]:
    return [{"type": "text", "text": f"21 degrees {unit} in {city}"}]  # a result as text blocks


def _add(a: int, b: int) -> str:
    raise RuntimeError("the adder is down")  # the runner sends it back as an is_error result


@pytest.mark.parametrize("stream", [False, True])
def test_sdk_tool_runner_loop(tiny, tiny_chat_server, stream: bool) -> None:  # noqa: ANN001
    """The SDK's own tool loop: a forced call per turn, run by the runner (a failing tool answered with
    is_error, a result as text blocks), then a turn without tools ends it."""
    weather = anthropic.beta_tool(_weather, name="get_weather", description="Current weather of a city",
                                  input_schema=SCHEMAS["get_weather"])
    add = anthropic.beta_tool(_add, name="add", description="Add two integers", input_schema=SCHEMAS["add"])
    runner = tiny.beta.messages.tool_runner(
        model=_model(tiny_chat_server), max_tokens=200, messages=ASK, tools=[weather, add], stream=stream,
        tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body=GREEDY)
    finals = []
    for turn, item in enumerate(runner):
        if stream:
            partial: dict[int, str] = {}
            for event in item:
                if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                    partial[event.index] = partial.get(event.index, "") + event.delta.partial_json
            final = item.get_final_message()
            for i, text in partial.items():  # the input_json_delta pieces join to each call's input
                assert json.loads(text) == final.content[i].input
        else:
            final = item
        finals.append(final)
        if turn == 0:
            calls = [b for b in final.content if b.type == "tool_use"]
            assert final.stop_reason == "tool_use" and len(calls) == 1, final
            jsonschema.validate(calls[0].input, SCHEMAS[calls[0].name])
            # the tools' results, then an answer in words: the loop ends with the next reply
            runner.set_messages_params(lambda p: {**p, "tool_choice": {"type": "none"}, "max_tokens": 8})
            sent = runner.generate_tool_call_response()  # what the runner sends back next (the SDK's shapes)
            assert sent is not None
            (result,) = sent["content"]
            assert result["tool_use_id"] == calls[0].id and bool(result.get("is_error")) == (calls[0].name == "add")
            if calls[0].name == "get_weather":
                assert result["content"] == _weather(**calls[0].input)
        assert turn < 2, "the runner should have stopped"
    assert len(finals) == 2 and finals[1].stop_reason in ("end_turn", "max_tokens")
    assert all(b.type == "text" for b in finals[1].content)
    assert finals[1].usage.cache_read_input_tokens > 0  # the first turn's prompt was read from the cache


@pytest.mark.parametrize("choice", [{"type": "auto"}, {"type": "any"}, {"type": "tool", "name": "get_weather"},
                                    {"type": "none"}], ids=["auto", "any", "tool", "none"])
def test_every_tool_choice_streamed(tiny, tiny_chat_server, choice: dict[str, Any]) -> None:  # noqa: ANN001
    forced = choice["type"] in ("any", "tool")  # a grammar writes the call: sampled freely, it still parses
    kw: dict[str, Any] = dict(model=_model(tiny_chat_server), messages=ASK, tools=ANTHROPIC_TOOLS,
                              max_tokens=200 if forced else 30, extra_body={"temperature": 1.0} if forced else GREEDY,
                              tool_choice={**choice, "disable_parallel_tool_use": True} if choice["type"] != "none"
                              else choice)
    with tiny.messages.stream(**kw) as s:
        joined: dict[int, str] = {}
        snapshots: list[object] = []
        for event in s:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                joined[event.index] = joined.get(event.index, "") + event.delta.partial_json
            elif event.type == "input_json":  # the SDK's own event for it, with the input parsed so far
                snapshots.append(event.snapshot)
        final = s.get_final_message()
    calls = [b for b in final.content if b.type == "tool_use"]
    if final.stop_reason == "tool_use":  # whole calls (one cut by max_tokens has only its start)
        for b in calls:
            jsonschema.validate(b.input, SCHEMAS[b.name])
            assert b.id.startswith("toolu_") and json.loads(joined[final.content.index(b)]) == b.input
        assert len(calls) == 1 and snapshots and snapshots[-1] == calls[0].input
    if forced:
        assert final.stop_reason == "tool_use" and choice.get("name") in (None, calls[0].name)
    elif choice["type"] == "none":
        assert not calls and final.stop_reason in ("end_turn", "max_tokens")
    else:
        assert final.stop_reason in ("end_turn", "max_tokens", "tool_use") and len(calls) <= 1


THINKINGS: list[dict[str, Any]] = [{"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"},
                                   {"type": "adaptive"}, {"type": "adaptive", "display": "omitted"},
                                   {"type": "between_tools"}]


def test_every_thinking_config_is_accepted(tiny, tiny_chat_server) -> None:  # noqa: ANN001
    """On a template without thinking the configs change nothing; each is taken by both endpoints."""
    model = _model(tiny_chat_server)
    plain = tiny.messages.count_tokens(model=model, messages=ASK).input_tokens
    # a budget needs max_tokens above 1024, past the tiny context (clamped): the reply is made to end at once
    end_now = {"allowed_token_ids": sorted(tiny_chat_server.engine.eos_token_ids)[:1]}
    for thinking in THINKINGS:
        kw: dict[str, Any] = dict(model=model, messages=ASK, thinking=thinking, max_tokens=1030, extra_body=end_now)
        assert tiny.messages.count_tokens(model=model, messages=ASK, thinking=thinking).input_tokens == plain
        r = tiny.messages.create(**kw)
        assert (r.type, r.stop_reason, r.content) == ("message", "end_turn", [])
        with tiny.messages.stream(**kw) as s:
            assert s.get_final_message().stop_reason == "end_turn"
    with pytest.raises(anthropic.BadRequestError) as e:
        tiny.messages.create(model=model, messages=ASK, max_tokens=8, thinking={"type": "adaptive", "display": "x"})
    assert "'thinking.display'" in _error(e.value)


def test_system_messages_inside_messages(tiny, tiny_chat_server) -> None:  # noqa: ANN001
    """A leading run joins the system prompt; a later one is rendered where it stands (ChatML takes it)."""
    model = _model(tiny_chat_server)
    prompts = tiny_chat_server.state.require_prompts()

    def rendered(messages: list[dict[str, Any]]) -> int:
        return len(on_server_loop(tiny_chat_server, prompts.chat_tokens(messages))[0])

    leading = [{"role": "system", "content": "Be brief."}, {"role": "system", "content": "Answer in French."}, *ASK]
    assert tiny.messages.count_tokens(model=model, system="You are terse.", messages=leading).input_tokens == \
        rendered([{"role": "system", "content": "You are terse.\n\nBe brief.\n\nAnswer in French."}, *ASK])
    later = [*ASK, {"role": "assistant", "content": "Il fait beau."},
             {"role": "system", "content": [{"type": "text", "text": "Answer in English from now on."}]},
             {"role": "user", "content": "And in Rome?"}]
    counted = tiny.messages.count_tokens(model=model, messages=later).input_tokens
    assert counted == rendered([*later[:2], {"role": "system", "content": "Answer in English from now on."},
                                later[3]])
    assert counted > tiny.messages.count_tokens(model=model, messages=later[:2] + later[3:]).input_tokens
    r = tiny.messages.create(model=model, messages=later, max_tokens=6, extra_body=GREEDY)
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == counted
    with tiny.messages.stream(model=model, messages=later, max_tokens=6, extra_body=GREEDY) as s:
        again = s.get_final_message()
    assert _texts(again) == _texts(r) and again.usage.cache_read_input_tokens > 0


@pytest.fixture(scope="module")
def strict_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    """The tiny chat model under STRICT_TEMPLATE."""
    from tiny_models import tiny_chat_model_dir

    model = tmp_path_factory.mktemp("strict") / "model"
    shutil.copytree(tiny_chat_model_dir("llama"), model)
    config_file = model / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = STRICT_TEMPLATE
    config_file.write_text(json.dumps(config))
    for extra in ("chat_template.jinja", "chat_template.json"):
        Path(model / extra).unlink(missing_ok=True)
    with BackgroundServer(lambda: AsyncEngine(EngineConfig(model=str(model), num_blocks=64)),
                          ServerConfig(port=0, web_dir=None, shutdown_grace_s=0.5)) as srv:
        yield srv


def test_a_system_message_the_template_refuses_gets_anthropics_refusal(strict_server) -> None:  # noqa: ANN001
    client = anthropic.Anthropic(base_url=strict_server.url, api_key="unused", max_retries=0, timeout=60)
    model = _model(strict_server)
    leading = [{"role": "system", "content": "Be brief."}, *ASK]
    assert client.messages.create(model=model, messages=leading, max_tokens=2).type == "message"
    later = [*ASK, {"role": "assistant", "content": "Sunny."}, {"role": "system", "content": "Be brief."},
             {"role": "user", "content": "And in Rome?"}]
    for call in (lambda: client.messages.create(model=model, messages=later, max_tokens=2),
                 lambda: client.messages.create(model=model, messages=later, max_tokens=2, stream=True),
                 lambda: client.messages.count_tokens(model=model, messages=later)):
        with pytest.raises(anthropic.BadRequestError) as e:
            call()
        assert _error(e.value) == SYSTEM_ROLE_REFUSED
    # what the template refuses for another reason is its own 400, not a 500, and not the system wording
    twice = [*ASK, {"role": "user", "content": "Hello?"}]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=model, messages=twice, max_tokens=2)
    assert "roles must alternate" in _error(e.value)
    after_user = [*ASK, {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello?"}]
    with pytest.raises(anthropic.BadRequestError) as e:  # without the system message it still fails: not its fault
        client.messages.create(model=model, messages=after_user, max_tokens=2)
    assert _error(e.value).startswith("messages: this model's chat template refuses the conversation: ")


def test_the_template_refusing_a_conversation_is_a_400_on_every_api(strict_server) -> None:  # noqa: ANN001
    """What the chat template raises on is the conversation's fault on the OpenAI endpoints too: a 400
    naming `messages` (pipeline/plan.py), not a 500."""
    twice = [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Hello?"}]
    model = _model(strict_server)
    for path, body in (("/v1/chat/completions", {"messages": twice, "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": twice, "max_tokens": 2, "stream": True}),
                       ("/v1/responses", {"input": twice, "max_output_tokens": 2})):
        r = httpx.post(strict_server.url + path, json={"model": model, **body}, timeout=60)
        assert r.status_code == 400, (path, r.text)
        error = r.json()["error"]
        assert error["param"] == "messages" and "roles must alternate" in error["message"], (path, error)


def _prompt_leaving(client: anthropic.Anthropic, model: str, context: int, room: int) -> tuple[list[Any], int]:
    """A conversation whose prompt leaves `room` to 2 × `room` tokens of the context, and its length."""
    def count(k: int) -> int:
        words = [{"role": "user", "content": "The quick brown fox jumps. " * k + "Tell me more."}]
        return int(client.messages.count_tokens(model=model, messages=words).input_tokens)

    lo, hi = 0, 1
    while count(hi) < context - 2 * room:
        lo, hi = hi, hi * 2
    while lo < hi:  # the most padding that still leaves `room`
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if count(mid) <= context - room else (lo, mid - 1)
    n = count(lo)
    assert context - 2 * room <= n <= context - room, (n, context)
    return [{"role": "user", "content": "The quick brown fox jumps. " * lo + "Tell me more."}], n


def test_max_tokens_past_the_context_is_clamped(tiny, tiny_chat_server) -> None:  # noqa: ANN001
    model, context = _model(tiny_chat_server), tiny_chat_server.engine.max_model_len
    messages, n = _prompt_leaving(tiny, model, context, 12)
    room = context - n
    kw: dict[str, Any] = dict(model=model, messages=messages, extra_body={**GREEDY, "ignore_eos": True})
    r = tiny.messages.create(max_tokens=32000, **kw)  # a coding agent's usual max_tokens
    assert (r.stop_reason, r.usage.output_tokens) == ("model_context_window_exceeded", room)
    events = list(tiny.messages.create(max_tokens=32000, stream=True, **kw))
    delta = next(e for e in events if e.type == "message_delta")
    assert delta.delta.stop_reason == "model_context_window_exceeded" and delta.usage.output_tokens == room
    with tiny.messages.stream(max_tokens=32000, **kw) as s:
        assert s.get_final_message().stop_reason == "model_context_window_exceeded"
    # the caller's own max_tokens, the room exactly or less: the reply stops at it, as always
    for max_tokens in (room, room - 1):
        r = tiny.messages.create(max_tokens=max_tokens, **kw)
        assert (r.stop_reason, r.usage.output_tokens) == ("max_tokens", max_tokens)
    # the other APIs keep refusing a max_tokens that does not fit
    openai_body = {"model": model, "messages": messages, "max_tokens": 32000}
    refused = httpx.post(tiny_chat_server.url + "/v1/chat/completions", json=openai_body, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_too_long"


def test_a_prompt_past_the_context_is_too_long_in_anthropics_words(tiny, tiny_chat_server) -> None:  # noqa: ANN001
    model, context = _model(tiny_chat_server), tiny_chat_server.engine.max_model_len
    long = [{"role": "user", "content": "The quick brown fox jumps. " * context}]
    n = tiny.messages.count_tokens(model=model, messages=long).input_tokens  # counting is not refused
    assert n >= context
    for stream in (False, True):
        with pytest.raises(anthropic.BadRequestError) as e:
            tiny.messages.create(model=model, messages=long, max_tokens=32000, stream=stream)
        said = TOO_LONG.fullmatch(_error(e.value))
        assert said is not None and (int(said[1]), int(said[2])) == (n, context - 1), _error(e.value)
    cfg = tiny_chat_server.state.config
    shorter = [{"role": "user", "content": "The quick brown fox jumps. " * 20}]
    m = tiny.messages.count_tokens(model=model, messages=shorter).input_tokens
    limit, cfg.max_prompt_tokens = cfg.max_prompt_tokens, m - 1
    try:
        with pytest.raises(anthropic.BadRequestError) as e:
            tiny.messages.create(model=model, messages=shorter, max_tokens=4)
        said = TOO_LONG.fullmatch(_error(e.value))
        assert said is not None and (int(said[1]), int(said[2])) == (m, m - 1), _error(e.value)
    finally:
        cfg.max_prompt_tokens = limit


def test_stop_sequences_streamed_and_metadata(tiny, tiny_chat_server) -> None:  # noqa: ANN001
    kw: dict[str, Any] = dict(model=_model(tiny_chat_server), messages=ASK, extra_body=GREEDY,
                              metadata={"user_id": "user_0123_account__session_4567"})
    text = "".join(b.text for b in tiny.messages.create(max_tokens=30, **kw).content if b.type == "text")
    at = next(i for i in range(1, len(text) - 1) if text[i:i + 2].isascii() and text[i:i + 2].isalnum())
    stop = text[at:at + 2]
    events = list(tiny.messages.create(max_tokens=30, stop_sequences=["never-generated", stop], stream=True, **kw))
    delta = next(e for e in events if e.type == "message_delta")
    assert (delta.delta.stop_reason, delta.delta.stop_sequence) == ("stop_sequence", stop)
    streamed = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")
    assert streamed == text[:text.index(stop)]
    # the SDK's count_tokens sends no metadata; a client that reuses a message's body for counting does
    assert tiny.messages.count_tokens(model=kw["model"], messages=ASK, extra_body={"metadata": kw["metadata"]})
    for bad, param in (("user-1", "metadata"), ({"user_id": 7}, "metadata.user_id")):
        with pytest.raises(anthropic.BadRequestError) as e:
            tiny.messages.create(model=kw["model"], messages=ASK, max_tokens=2, metadata=bad)
        assert f"'{param}'" in _error(e.value)


def _hold_until_beats(srv: BackgroundServer, monkeypatch: pytest.MonkeyPatch, beats: int) -> list[int]:
    """Hold each engine request until its stream has beaten `beats` times (a prefill that takes
    that long), with a tiny ping interval; the returned list counts the beats."""
    monkeypatch.setattr(anthropic_api, "PING_INTERVAL_S", 0.005)
    seen = [0]
    heartbeat = ReplyEvents.heartbeat

    def counted(self: ReplyEvents, prompt_tokens: int) -> list[str]:
        seen[0] += 1
        return heartbeat(self, prompt_tokens)

    monkeypatch.setattr(ReplyEvents, "heartbeat", counted)
    engine = srv.engine
    original = engine.generate_validated

    async def held(request: Any, request_id: str | None = None, cancelled: Callable[[], bool] | None = None,
                   placement: Any = None) -> AsyncIterator[RequestOutput]:
        start = seen[0]
        while seen[0] < start + beats:
            await asyncio.sleep(0.001)
        agen = original(request, request_id=request_id, cancelled=cancelled, placement=placement)
        try:
            async for out in agen:
                yield out
        finally:
            await agen.aclose()

    monkeypatch.setattr(engine, "generate_validated", held)
    return seen


def test_pings_after_message_start_and_during_a_long_prefill(tiny, tiny_chat_server,  # noqa: ANN001
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(tiny_chat_server)
    body = {"model": model, "messages": ASK, "max_tokens": 4, "stream": True, **GREEDY}

    def raw_events() -> list[dict[str, Any]]:
        with httpx.stream("POST", tiny_chat_server.url + "/v1/messages", json=body, timeout=60) as r:
            return _sse(r.read().decode())

    plain = raw_events()
    assert [e["type"] for e in plain[:2]] == ["message_start", "ping"]  # as Anthropic's streams begin
    counted = tiny.messages.count_tokens(model=model, messages=ASK).input_tokens
    _hold_until_beats(tiny_chat_server, monkeypatch, 4)
    events = raw_events()
    kinds = [e["type"] for e in events]
    after = next(i for i, kind in enumerate(kinds) if i > 0 and kind != "ping")  # the reply's first event
    assert kinds[0] == "message_start" and kinds.count("message_start") == 1 and after - 1 >= 4
    assert events[0]["message"]["usage"]["input_tokens"] == counted  # the prompt, its cache hit not known yet
    final = events[-2]["usage"]
    assert final["input_tokens"] + final["cache_read_input_tokens"] == counted and final["cache_read_input_tokens"] > 0
    # the SDK skips the pings and keeps the final usage over the start's
    with tiny.messages.stream(model=model, messages=ASK, max_tokens=4, extra_body=GREEDY) as s:
        message = s.get_final_message()
    assert message.usage.cache_read_input_tokens > 0 and message.content == [
        b for b in message.content if b.type == "text"]


def test_beta_headers_are_accepted_and_ignored(tiny, tiny_chat_server) -> None:  # noqa: ANN001
    kw: dict[str, Any] = dict(model=_model(tiny_chat_server), messages=ASK, max_tokens=6, extra_body=GREEDY)
    plain = tiny.messages.create(**kw)
    beta = tiny.beta.messages.create(betas=BETAS, **kw)  # POST /v1/messages?beta=true, anthropic-beta: ...
    assert _texts(beta) == _texts(plain) and beta.stop_reason == plain.stop_reason
    with tiny.beta.messages.stream(betas=BETAS, **kw) as s:
        assert _texts(s.get_final_message()) == _texts(plain)
    counted = tiny.beta.messages.count_tokens(model=kw["model"], messages=ASK, betas=BETAS).input_tokens
    assert counted == tiny.messages.count_tokens(model=kw["model"], messages=ASK).input_tokens
    r = httpx.post(tiny_chat_server.url + "/v1/messages", timeout=60, headers={"anthropic-beta": "no-such-beta-2099-01-01",
                                                                              "anthropic-version": "2023-06-01"},
                   json={"model": kw["model"], "messages": ASK, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["type"] == "message"


def test_a_thread_is_refused_with_the_code_the_sdk_falls_back_on(tiny, tiny_chat_server) -> None:  # noqa: ANN001
    """A server-held conversation (`thread`, the message-threads beta) is refused with Anthropic's
    `thread_unsupported_request`, on which the SDK's runner resends whole histories (test_sdk_tool_runner_loop)."""
    with pytest.raises(anthropic.BadRequestError) as e:
        tiny.beta.messages.create(model=_model(tiny_chat_server), messages=ASK, max_tokens=2, thread={"type": "create"},
                                  betas=["message-threads-2026-08-12"])
    assert e.value.error_code == "thread_unsupported_request"
    assert isinstance(e.value.body, dict) and e.value.body["error"]["type"] == "invalid_request_error"
    assert e.value.body["error"]["details"] == {"error_code": "thread_unsupported_request"}
    assert "'thread'" in e.value.body["error"]["message"]


def test_a_coding_agents_first_request(tiny_chat_server) -> None:  # noqa: ANN001
    """As a terminal coding agent opens a session (streamed): its betas, system blocks, tools, metadata,
    adaptive thinking, an effort, a max_tokens far past the context, fields this server does not read."""
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": ",".join(BETAS), "x-app": "cli",
               "user-agent": "claude-cli/2.1.0 (external, cli)", "anthropic-dangerous-direct-browser-access": "true"}
    body = {"model": _model(tiny_chat_server), "max_tokens": 32000, "stream": True, "temperature": 1,
            "system": [{"type": "text", "text": "You are an agent for software engineering."},
                       {"type": "text", "text": "Use the tools to answer."}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "What is the weather in Paris?"}]},
                         {"role": "system", "content": "The user prefers celsius."}],
            "tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "auto"}, "metadata": {"user_id": "user_abc_session_1"},
            "thinking": {"type": "adaptive"}, "output_config": {"effort": "high"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "stop_sequences": ["</answer>"]}
    with httpx.stream("POST", tiny_chat_server.url + "/v1/messages?beta=true", json=body, headers=headers,
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        events = _sse(r.read().decode())
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    assert "error" not in kinds
    assert events[-2]["delta"]["stop_reason"] in ("end_turn", "tool_use", "stop_sequence", "model_context_window_exceeded")


def test_shared_refusals_in_anthropics_shape(tiny, tiny_chat_server) -> None:  # noqa: ANN001
    """Refusals raised by code every API shares reach the SDK as Anthropic's errors, naming the field."""
    model = _model(tiny_chat_server)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"extra_body": {"top_p": 0}}, "top_p"),  # the sampling table's ranges
        ({"tools": [{"name": "f", "input_schema": {"type": 5}}]}, "tools[0].input_schema"),  # the tool checks
        ({"extra_body": {"chat_template_kwargs": {"messages": []}}}, "chat_template_kwargs"),  # template variables
        ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "nope"}}}}, "output_config"),
    ]
    for k, (fields, needle) in enumerate(cases):
        with pytest.raises(anthropic.BadRequestError) as e:
            tiny.messages.create(model=model, messages=ASK, max_tokens=4, **fields)
        assert needle in _error(e.value), (fields, e.value.body)
        if k in (1, 2):  # count_tokens reads the tools and the template variables too
            with pytest.raises(anthropic.BadRequestError) as e:
                tiny.messages.count_tokens(model=model, messages=ASK, **fields)
            assert needle in _error(e.value), (fields, e.value.body)


# -- a thinking model ---------------------------------------------------------------------------

QWEN_REPLY = "<think>\nThe capital of France is Paris.\n</think>\n\nParis."
QWEN_REASONING, QWEN_ANSWER = "The capital of France is Paris.", "Paris."
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


def test_thinking_blocks_through_the_sdk(reasoning_servers: Callable[[str], BackgroundServer],
                                         replies: Callable[[BackgroundServer], Replies]) -> None:
    srv = reasoning_servers("qwen3")
    client = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=120)
    forced = replies(srv)
    kw: dict[str, Any] = dict(model=srv.state.model_name, messages=CAPITAL, max_tokens=2048)
    for thinking in ({"type": "enabled", "budget_tokens": 1024}, {"type": "adaptive"}):
        forced.force(QWEN_REPLY)
        r = client.messages.create(thinking=thinking, **kw)
        assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in r.content] == \
            [("thinking", QWEN_REASONING), ("text", QWEN_ANSWER)]
        assert not forced.prompt_text().endswith("</think>\n\n")  # adaptive: the template's default, thinking on
        forced.force(QWEN_REPLY)
        with client.messages.stream(thinking=thinking, **kw) as s:
            thought = "".join(e.thinking for e in s if e.type == "thinking")  # the SDK's thinking_delta events
            final = s.get_final_message()
        assert thought == QWEN_REASONING and final.content[0].thinking == QWEN_REASONING
        assert final.content[1].text == QWEN_ANSWER
    client.messages.create(thinking={"type": "disabled"}, **{**kw, "max_tokens": 1})
    assert forced.prompt_text().endswith("<think>\n\n</think>\n\n")  # disabled: the template closes it
    omitted = {"type": "adaptive", "display": "omitted"}
    forced.force(QWEN_REPLY)
    r = client.messages.create(thinking=omitted, **kw)
    assert [b.type for b in r.content] == ["thinking", "text"] and r.content[0].thinking == ""
    assert r.content[1].text == QWEN_ANSWER
    forced.force(QWEN_REPLY)
    events = list(client.messages.create(thinking=omitted, stream=True, **kw))
    assert not [e for e in events if e.type == "content_block_delta" and e.delta.type == "thinking_delta"]
    assert [e.content_block.type for e in events if e.type == "content_block_start"] == ["thinking", "text"]
