"""LangGraph's prebuilt ReAct agent (`langgraph.prebuilt.create_react_agent`) over LangChain's `ChatOpenAI`
run unmodified against the server's chat completions: one tool round trip (the model's call, the
ToolNode's result, the model's reply to it), then the agent's `response_format` step, which asks the
same model for a `Report` by structured output. Invoked whole and streamed (`ChatOpenAI(streaming=True)`,
`graph.stream(...)`).

The tool is forced LangGraph's way, with a dynamic model (a callable picking the bound model per call):
the first call must be get_weather, the call after its result may not call tools. `recursion_limit`
bounds the graph. Over the tiny random chat model.
"""

from __future__ import annotations

import warnings
from typing import Any

import httpx2
import pytest

from radixserve.server import BackgroundServer

langchain_openai = pytest.importorskip("langchain_openai")
lc_messages = pytest.importorskip("langchain_core.messages")
lc_tools = pytest.importorskip("langchain_core.tools")
prebuilt = pytest.importorskip("langgraph.prebuilt")

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


def react_agent(srv: BackgroundServer, runs: ToolRuns, streaming: bool, http_client: Any = None) -> Any:
    llm = langchain_openai.ChatOpenAI(base_url=openai_base(srv), api_key="x", model=model_name(srv), temperature=0,
                                      max_tokens=MAX_TOKENS, max_retries=0, timeout=120, streaming=streaming,
                                      http_client=http_client)
    tools = [lc_tools.tool(f) for f in runs.functions()]

    def pick_model(state: Any, runtime: Any) -> Any:
        answered = any(isinstance(m, lc_messages.ToolMessage) for m in state["messages"])
        return llm.bind_tools(tools, tool_choice="none" if answered else "get_weather")

    with warnings.catch_warnings():
        # LangGraph 1.x points to langchain.agents.create_agent; the prebuilt agent is what it still ships
        warnings.simplefilter("ignore", DeprecationWarning)
        return prebuilt.create_react_agent(pick_model, tools, prompt=INSTRUCTIONS, response_format=Report)


def react_loop(srv: BackgroundServer, streaming: bool, http_client: Any = None) -> None:
    """The agent's whole run, checked: what each test below runs, with ChatOpenAI's default HTTP client
    or through a TamperingTransport."""
    runs = ToolRuns()
    agent = react_agent(srv, runs, streaming, http_client)
    ask = {"messages": [lc_messages.HumanMessage("What is the weather in Paris?")]}
    config = {"recursion_limit": 2 * MAX_TURNS}
    if streaming:
        state: dict[str, Any] = {}
        nodes = []
        for update in agent.stream(ask, config, stream_mode="updates"):
            for node, delta in update.items():
                nodes.append(node)
                if delta:
                    state.setdefault("messages", []).extend(delta.get("messages", []))
                    state.update({k: v for k, v in delta.items() if k != "messages"})
        assert nodes[:3] == ["agent", "tools", "agent"], nodes
        messages = state["messages"]
    else:
        state = agent.invoke(ask, config)
        messages = state["messages"][1:]
    ai_call, result, reply = messages[:3]
    assert [c["name"] for c in ai_call.tool_calls] == ["get_weather"] and ai_call.tool_calls[0]["id"]
    assert runs.calls == [("get_weather", ai_call.tool_calls[0]["args"])]
    assert isinstance(result, lc_messages.ToolMessage) and result.tool_call_id == ai_call.tool_calls[0]["id"]
    assert result.content == f"{ai_call.tool_calls[0]['args']['city']}: sunny, 21 C"
    assert isinstance(reply, lc_messages.AIMessage) and not reply.tool_calls
    assert isinstance(state["structured_response"], Report), state


@pytest.mark.parametrize("streaming", [False, True], ids=["invoke", "stream"])
def test_react_agent_tool_round_trip(agent_server: BackgroundServer, streaming: bool) -> None:
    react_loop(agent_server, streaming)


@pytest.mark.parametrize("dropped", [False, True], ids=["intact", "dropped"])
def test_react_loop_fails_when_server_drops_tool_call_id(agent_server: BackgroundServer, dropped: bool) -> None:
    """The loop above through a transport that takes the tool call's `id` out of the server's streamed
    chunks fails (and through the same transport untouched succeeds)."""
    transport = TamperingTransport(drop_key("function", "id") if dropped else None)
    with httpx2.Client(transport=transport, timeout=120) as http_client:
        if not dropped:
            react_loop(agent_server, True, http_client)
            return
        with pytest.raises(TypeError, match="get_weather"):  # the ToolNode, handed a call without an id
            react_loop(agent_server, True, http_client)
        assert transport.seen.edited >= 1
