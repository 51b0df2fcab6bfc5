"""The OpenAI Agents SDK (`openai-agents`) run unmodified against the server: an `Agent` with two function
tools and a pydantic `output_type`, through `OpenAIResponsesModel` (the Responses API, the SDK's default
model) and `OpenAIChatCompletionsModel` (chat completions), each by `Runner.run` and `Runner.run_streamed`.

Tool use is forced the SDK's own way (`ModelSettings(tool_choice=...)`; the default `reset_tool_choice`
sends no tool_choice once a tool ran, so the turn after is the SDK's usual "tools beside the output
schema" request) and the loop is bounded by `max_turns`. The loop must end with a `Report` as its final
output after at least one tool actually ran and its output went back to the model. Over the tiny
random chat model, whose calls and answers are whatever the grammar admits.

The same loop through a transport that takes a call's id out of the server's replies must fail: the
tests catch a server that drops what the SDK needs.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx2
import pytest

from radixserve.server import BackgroundServer

agents = pytest.importorskip("agents")
openai = pytest.importorskip("openai")

pytest.register_assert_rewrite("agent_kit")
from agent_kit import (  # noqa: E402
    INSTRUCTIONS,
    MAX_TOKENS,
    MAX_TURNS,
    Report,
    TamperingTransport,
    ToolRuns,
    drop_key,
    model_name,
    openai_base,
)

pytest_plugins = ["agent_kit"]

agents.set_tracing_disabled(True)  # the SDK would export traces to OpenAI's servers


def sdk_model(client: Any, srv: BackgroundServer, api: str) -> Any:
    if api == "responses":
        return agents.OpenAIResponsesModel(model=model_name(srv), openai_client=client)
    return agents.OpenAIChatCompletionsModel(model=model_name(srv), openai_client=client)


def weather_agent(model: Any, runs: ToolRuns, tool_choice: str) -> Any:
    return agents.Agent(name="weather", instructions=INSTRUCTIONS, model=model, output_type=Report,
                        tools=[agents.function_tool(f) for f in runs.functions()],
                        model_settings=agents.ModelSettings(tool_choice=tool_choice, temperature=0,
                                                            max_tokens=MAX_TOKENS))


async def run_agent(agent: Any, streamed: bool) -> tuple[Any, list[str]]:
    """The run's result and, streamed, the kinds of run items the stream reported as they came."""
    if not streamed:
        return await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=MAX_TURNS), []
    result = agents.Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=MAX_TURNS)
    items = [event.item.type async for event in result.stream_events() if event.type == "run_item_stream_event"]
    return result, items


def assert_completed_with_tools(result: Any, runs: ToolRuns) -> None:
    assert isinstance(result.final_output, Report), result.final_output
    assert runs.calls, "no tool ran"
    calls = [i for i in result.new_items if isinstance(i, agents.ToolCallItem)]
    outputs = [i for i in result.new_items if isinstance(i, agents.ToolCallOutputItem)]
    assert len(calls) == len(outputs) == len(runs.calls), result.new_items
    # every output answered its call (by the call's id), which the model's next turn then read
    call_ids = [c.raw_item.call_id for c in calls]
    assert [o.raw_item["call_id"] for o in outputs] == call_ids and all(call_ids)
    assert len(result.raw_responses) >= 2  # the tool round trip, then the answer


async def agent_loop(srv: BackgroundServer, api: str, streamed: bool, http_client: Any = None) -> None:
    """The agent's whole run, checked: what each test below runs, with the SDK's default HTTP client or
    through a TamperingTransport."""
    runs = ToolRuns()
    # "required" lets the model pick either tool; a named choice forces that one
    tool_choice = "get_weather" if streamed else "required"
    async with openai.AsyncOpenAI(base_url=openai_base(srv), api_key="x", max_retries=0, timeout=120,
                                  http_client=http_client) as client:
        agent = weather_agent(sdk_model(client, srv, api), runs, tool_choice)
        result, streamed_items = await run_agent(agent, streamed)
    assert_completed_with_tools(result, runs)
    if streamed:
        assert runs.ran() == {"get_weather"}
        assert "tool_call_item" in streamed_items and "tool_call_output_item" in streamed_items, streamed_items


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
@pytest.mark.parametrize("api", ["responses", "chat"])
def test_agent_tools_and_output_type(agent_server: BackgroundServer, api: str, streamed: bool) -> None:
    asyncio.run(agent_loop(agent_server, api, streamed))


# What the SDK needs of each API: a call's id, by which its output goes back (Responses: a function_call
# item's `call_id`; chat: a tool call's `id`). Without it the SDK refuses to run the tool.
NEEDED = {"responses": drop_key("function_call", "call_id"), "chat": drop_key("function", "id")}


@pytest.mark.parametrize("dropped", [False, True], ids=["intact", "dropped"])
@pytest.mark.parametrize("api", ["responses", "chat"])
def test_agent_loop_fails_when_server_drops_call_id(agent_server: BackgroundServer, api: str, dropped: bool) -> None:
    """The loop above through a transport that takes the call id out of the server's replies fails
    (and through the same transport untouched succeeds): the test catches a server that drops it."""
    transport = TamperingTransport(NEEDED[api] if dropped else None)

    async def through_transport() -> None:
        async with httpx2.AsyncClient(transport=transport, timeout=120) as http_client:
            await agent_loop(agent_server, api, streamed=True, http_client=http_client)

    if not dropped:
        asyncio.run(through_transport())
        return
    with pytest.raises(agents.ModelBehaviorError, match="call ID"):  # the SDK's own refusal
        asyncio.run(through_transport())
    assert transport.seen.edited >= 1  # the call's id was taken out of the stream
