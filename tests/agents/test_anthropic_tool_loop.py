"""The Anthropic SDK's tool loops run unmodified against the server's Messages API, streamed: the loop its
documentation writes by hand (`client.messages.stream(...)` with tools, each `tool_use` answered by a
`tool_result` block, until the turn ends), and the SDK's own runner
(`client.beta.messages.tool_runner(..., stream=True)` over `@beta_tool` functions), with its default
message thread (a server-held conversation: the server must hold it or refuse `thread` so the SDK sends
whole histories) and with `thread=False`.

Every turn asks for the answer as a `Report` (`output_format`, the SDK's structured output, beside the
tools); the first must call get_weather (`tool_choice` of type "tool" / "any"), the turns after it leave
the choice to the model, whose answer closes and ends the loop with `end_turn`. Loops are bounded by
MAX_TURNS / `max_iterations`. Through a transport that takes out an event or field a loop needs
(`message_delta`, a `tool_use` block's `id`), the loop must fail.
"""

from __future__ import annotations

from typing import Any

import httpx2
import pytest

from radixserve.server import BackgroundServer

anthropic = pytest.importorskip("anthropic")

pytest.register_assert_rewrite("agent_kit")
from agent_kit import (  # noqa: E402
    INSTRUCTIONS,
    MAX_TOKENS,
    MAX_TURNS,
    Report,
    TamperingTransport,
    ToolRuns,
    drop_events,
    drop_key,
    model_name,
)

pytest_plugins = ["agent_kit"]

ASK = "What is the weather in Paris?"
GREEDY = {"temperature": 0}  # this SDK version no longer takes `temperature`; the server still reads it
WEATHER = {"name": "get_weather", "description": "Current weather of a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
                            "required": ["city"], "additionalProperties": False}}


def anthropic_client(srv: BackgroundServer, http_client: Any = None) -> Any:
    return anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0, timeout=120, http_client=http_client)


def streamed_tool_loop(client: Any, srv: BackgroundServer, runs: ToolRuns) -> tuple[list[Any], list[list[str]]]:
    """The hand-written loop: each turn streamed, its tool calls run and answered, until a turn ends
    without one. Returns the replies and each turn's event types."""
    get_weather = runs.functions()[0]
    messages: list[dict[str, Any]] = [{"role": "user", "content": ASK}]
    replies, events = [], []
    for turn in range(MAX_TURNS):
        choice = {"type": "tool", "name": "get_weather"} if turn == 0 else {"type": "auto"}
        with client.messages.stream(model=model_name(srv), max_tokens=MAX_TOKENS, system=INSTRUCTIONS,
                                    messages=messages, tools=[WEATHER], tool_choice=choice, output_format=Report,
                                    extra_body=GREEDY) as stream:
            events.append([event.type for event in stream])
            reply = stream.get_final_message()
        replies.append(reply)
        messages.append({"role": "assistant", "content": reply.content})
        if reply.stop_reason != "tool_use":
            break
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": block.id, "content": get_weather(**block.input)}
            for block in reply.content if block.type == "tool_use"]})
    return replies, events


def hand_loop(srv: BackgroundServer, http_client: Any = None) -> None:
    """The hand-written loop, checked: what the tests below run, with the SDK's default HTTP client or
    through a TamperingTransport."""
    runs = ToolRuns()
    with anthropic_client(srv, http_client) as client:
        replies, events = streamed_tool_loop(client, srv, runs)
    first, last = replies[0], replies[-1]
    assert first.stop_reason == "tool_use" and [b.name for b in first.content if b.type == "tool_use"] == ["get_weather"]
    assert runs.calls and runs.ran() == {"get_weather"}
    assert last.stop_reason == "end_turn" and len(replies) >= 2
    assert isinstance(last.parsed_output, Report), last.content
    for kinds in events:  # each turn streamed as the SDK's accumulator needs it
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
        assert kinds.count("content_block_start") == kinds.count("content_block_stop") >= 1, kinds
    assert "input_json" in events[0]  # the call's arguments arrived as input_json_delta pieces


def runner_loop(srv: BackgroundServer, thread: str, http_client: Any = None) -> None:
    """The SDK's tool runner, checked: what the tests below run. With its default thread the server
    must refuse `thread` the way the SDK recognises (or hold the conversation): a server that ignores
    the field gets only the new tool_result on the next turn, without the tools it asks to call."""
    runs = ToolRuns()
    get_weather = anthropic.beta_tool(runs.functions()[0])
    replies = []
    with anthropic_client(srv, http_client) as client:
        runner = client.beta.messages.tool_runner(
            model=model_name(srv), max_tokens=MAX_TOKENS, system=INSTRUCTIONS, tools=[get_weather],
            messages=[{"role": "user", "content": ASK}], tool_choice={"type": "any"}, output_format=Report,
            extra_body=GREEDY, max_iterations=MAX_TURNS, stream=True, **({"thread": False} if thread == "off" else {}))
        for stream in runner:
            kinds = [event.type for event in stream]
            assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
            replies.append(stream.get_final_message())
            # after the forced first call the model may choose: a call or the Report
            runner.set_messages_params(lambda p: {**p, "tool_choice": {"type": "auto"}})
    assert replies[0].stop_reason == "tool_use" and runs.ran() == {"get_weather"}
    assert replies[-1].stop_reason == "end_turn" and len(replies) >= 2, [r.stop_reason for r in replies]
    assert isinstance(replies[-1].parsed_output, Report), replies[-1].content


def test_streamed_tool_loop(agent_server: BackgroundServer) -> None:
    hand_loop(agent_server)


@pytest.mark.parametrize("thread", ["default", "off"])
def test_beta_tool_runner_streamed(agent_server: BackgroundServer, thread: str) -> None:
    runner_loop(agent_server, thread)


@pytest.mark.parametrize("dropped", [False, True], ids=["intact", "dropped"])
@pytest.mark.parametrize("loop", ["hand", "runner"])
def test_loops_fail_when_server_drops(agent_server: BackgroundServer, loop: str, dropped: bool) -> None:
    """Each loop through a transport that takes out what it needs fails (and through the same transport
    untouched succeeds). The hand-written loop loses `message_delta`, which carries the turn's
    stop_reason; the runner loses a `tool_use` block's `id`, which its tool_result must name."""
    edit = drop_events("message_delta") if loop == "hand" else drop_key("tool_use", "id")
    transport = TamperingTransport(edit if dropped else None)
    with httpx2.Client(transport=transport, timeout=120) as http_client:
        run = (lambda: hand_loop(agent_server, http_client)) if loop == "hand" else \
            (lambda: runner_loop(agent_server, "off", http_client))
        if not dropped:
            run()
            return
        # the hand loop stops at a turn without a stop_reason, its tool call unanswered; the runner's next
        # request sends the call back without an id, which the server refuses
        with pytest.raises(AssertionError if loop == "hand" else anthropic.BadRequestError, match="tool_use"):
            run()
        assert transport.seen.edited + transport.seen.dropped >= 1
