"""pydantic-ai run unmodified against the server: an agent with a tool whose final answer is a `Report`
given as a `ToolOutput` (an output tool the model calls) and one given as a `NativeOutput` (the API's own
structured output: chat `response_format`, Responses `text.format`), each through `OpenAIChatModel` and
`OpenAIResponsesModel` with an `OpenAIProvider` pointed at the server.

Tool use is forced pydantic-ai's way: per-step model settings (a callable, which pydantic-ai trusts to
adapt `tool_choice` across steps) name the tool on the first request (with NativeOutput: a forced call
beside the answer's schema) and then ask for the answer (`step_settings`); `UsageLimits(request_limit=...)`
bounds the loop. The run must end with a `Report` after the tool ran and its return went back to the
model. Over the tiny random chat model.

The same loop through a transport that takes a call's id out of the server's replies must fail.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx2
import pytest

from radixserve.server import BackgroundServer

pydantic_ai = pytest.importorskip("pydantic_ai")
openai_models = pytest.importorskip("pydantic_ai.models.openai")
openai_provider = pytest.importorskip("pydantic_ai.providers.openai")

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


def ai_model(srv: BackgroundServer, api: str, http_client: Any = None) -> Any:
    provider = openai_provider.OpenAIProvider(base_url=openai_base(srv), api_key="x", http_client=http_client)
    kind = openai_models.OpenAIResponsesModel if api == "responses" else openai_models.OpenAIChatModel
    return kind(model_name(srv), provider=provider)


def step_settings(output: str) -> Any:
    """Per-step model settings: the first request must call get_weather; after it a NativeOutput agent
    leaves the choice to the model (tools beside the answer's schema, `tool_choice` "auto"), and a
    ToolOutput agent asks for its answer with `ToolOrOutput(function_tools=[])`, pydantic-ai's way to
    keep only the output tool (its answer is a tool call too: with get_weather still offered under a
    required choice the random model would go on calling it)."""

    def settings(ctx: Any) -> Any:
        if ctx.run_step <= 1:
            choice: dict[str, Any] = {"tool_choice": ["get_weather"]}
        elif output == "ToolOutput":
            choice = {"tool_choice": pydantic_ai.ToolOrOutput(function_tools=[])}
        else:
            choice = {}
        return pydantic_ai.ModelSettings(max_tokens=MAX_TOKENS, temperature=0, **choice)

    return settings


async def agent_loop(srv: BackgroundServer, api: str, output: str, http_client: Any = None) -> None:
    """The agent's whole run, checked: what each test below runs, with the provider's default HTTP
    client or through a TamperingTransport."""
    runs = ToolRuns()
    get_weather = runs.functions()[0]
    output_type = pydantic_ai.ToolOutput(Report) if output == "ToolOutput" else pydantic_ai.NativeOutput(Report)
    agent = pydantic_ai.Agent(ai_model(srv, api, http_client), output_type=output_type, instructions=INSTRUCTIONS,
                              tools=[get_weather], model_settings=step_settings(output))
    async with agent:  # pydantic-ai's way to close the provider's HTTP client at the end
        result = await agent.run("What is the weather in Paris?",
                                 usage_limits=pydantic_ai.UsageLimits(request_limit=MAX_TURNS))
    assert isinstance(result.output, Report), result.output
    assert runs.ran() == {"get_weather"}
    messages = result.all_messages()
    calls = [p for m in messages for p in m.parts if isinstance(p, pydantic_ai.ToolCallPart)
             and p.tool_name == "get_weather"]
    returns = [p for m in messages for p in m.parts if isinstance(p, pydantic_ai.ToolReturnPart)
               and p.tool_name == "get_weather"]
    assert len(calls) == len(returns) == len(runs.calls)
    assert [r.tool_call_id for r in returns] == [c.tool_call_id for c in calls] and all(c.tool_call_id for c in calls)
    # the answer came from a request that carried the tool's return
    assert sum(isinstance(m, pydantic_ai.messages.ModelResponse) for m in messages) >= 2


@pytest.mark.parametrize("output", ["ToolOutput", "NativeOutput"])
@pytest.mark.parametrize("api", ["chat", "responses"])
def test_agent_tool_then_structured_output(agent_server: BackgroundServer, api: str, output: str) -> None:
    asyncio.run(agent_loop(agent_server, api, output))


# What pydantic-ai needs of each API to send a tool's return back: the call's id (Responses: a
# function_call item's `call_id`, chat: a tool call's `id`).
NEEDED = {"responses": drop_key("function_call", "call_id"), "chat": drop_key("function", "id")}


@pytest.mark.parametrize("dropped", [False, True], ids=["intact", "dropped"])
@pytest.mark.parametrize("api", ["chat", "responses"])
def test_agent_loop_fails_when_server_drops_call_id(agent_server: BackgroundServer, api: str, dropped: bool) -> None:
    """The loop above through a transport that takes the call id out of the server's replies fails
    (and through the same transport untouched succeeds): the test catches a server that drops it."""
    transport = TamperingTransport(NEEDED[api] if dropped else None)

    async def through_transport() -> None:
        async with httpx2.AsyncClient(transport=transport, timeout=120) as http_client:
            await agent_loop(agent_server, api, "NativeOutput", http_client)

    if not dropped:
        asyncio.run(through_transport())
        return
    # chat: the reply no longer validates; Responses: pydantic-ai makes up an id the server refuses
    with pytest.raises((pydantic_ai.UnexpectedModelBehavior, pydantic_ai.ModelHTTPError),
                       match="validation error" if api == "chat" else "call_id"):
        asyncio.run(through_transport())
    assert transport.seen.edited >= 1
