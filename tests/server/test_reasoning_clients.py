"""The real clients reading a thinking model's reasoning from this server: the official `openai` client
(chat completions' `reasoning_content`, streamed too; Responses reasoning items, streamed through its
stream helper; a gpt-oss function call through Responses), the `anthropic` client (thinking blocks,
its stream helper, a thinking block sent back) and `langchain-openai` (its Responses path, where its
messages carry the reasoning item as a content block; its chat completions path does not read
`reasoning_content`, the field not being OpenAI's). Over the tiny Qwen3-like and harmony models with
forced replies (reasoning_kit.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from radixserve.server import BackgroundServer

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

pytest.register_assert_rewrite("reasoning_kit")

from reasoning_kit import Replies  # noqa: E402

pytest_plugins = ["server_testkit", "reasoning_kit"]

Servers = Callable[[str], BackgroundServer]
ReplyMaker = Callable[[BackgroundServer], Replies]

REPLIES = {
    "qwen3": "<think>\nThe capital of France is Paris.\n</think>\n\nParis.",
    "harmony": "<|channel|>analysis<|message|>The capital of France is Paris.<|end|><|start|>assistant<|channel|>final"
               "<|message|>Paris.<|return|>",
}
REASONING, ANSWER = "The capital of France is Paris.", "Paris."
ASK = [{"role": "user", "content": "What is the capital of France?"}]
KINDS = ["qwen3", "harmony"]


def openai_client(srv: BackgroundServer) -> Any:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("kind", KINDS)
def test_openai_chat_reads_reasoning_content(kind: str, reasoning_servers: Servers, replies: ReplyMaker) -> None:
    srv = reasoning_servers(kind)
    forced = replies(srv)
    client = openai_client(srv)
    forced.force(REPLIES[kind])
    r = client.chat.completions.create(model=srv.state.model_name, messages=ASK, max_tokens=60,
                                       reasoning_effort="low", extra_body={"chat_template_kwargs": {"x": 1}})
    message = r.choices[0].message
    assert message.content == ANSWER
    assert message.model_extra["reasoning_content"] == REASONING and message.reasoning_content == REASONING
    assert r.usage is not None and r.usage.completion_tokens_details is not None
    assert 0 < r.usage.completion_tokens_details.reasoning_tokens < r.usage.completion_tokens
    forced.force(REPLIES[kind])
    reasoning, content = [], []
    for chunk in client.chat.completions.create(model=srv.state.model_name, messages=ASK, max_tokens=60, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning.append((delta.model_extra or {}).get("reasoning_content") or "")
            content.append(delta.content or "")
    assert ("".join(reasoning), "".join(content)) == (REASONING, ANSWER)


@pytest.mark.parametrize("kind", KINDS)
def test_openai_responses_reads_reasoning_items(kind: str, reasoning_servers: Servers, replies: ReplyMaker) -> None:
    from openai.types.responses import ResponseReasoningItem, ResponseReasoningTextDeltaEvent

    srv = reasoning_servers(kind)
    forced = replies(srv)
    client = openai_client(srv)
    forced.force(REPLIES[kind])
    r = client.responses.create(model=srv.state.model_name, input=ASK[0]["content"], max_output_tokens=60,
                                reasoning={"effort": "medium"})
    item = r.output[0]
    assert isinstance(item, ResponseReasoningItem) and item.content is not None
    assert [c.text for c in item.content] == [REASONING] and item.summary == []
    assert r.output_text == ANSWER and r.reasoning is not None and r.reasoning.effort == "medium"
    assert r.usage is not None and r.usage.output_tokens_details.reasoning_tokens > 0
    forced.force(REPLIES[kind])
    with client.responses.stream(model=srv.state.model_name, input=ASK[0]["content"], max_output_tokens=60) as s:
        pieces = [e.delta for e in s if isinstance(e, ResponseReasoningTextDeltaEvent)]
        final = s.get_final_response()
    assert "".join(pieces) == REASONING and final.output_text == ANSWER
    assert isinstance(final.output[0], ResponseReasoningItem) and final.output[0].content is not None
    assert final.output[0].content[0].text == REASONING
    # the reasoning item goes back as history, as the SDK's users do (`input += response.output`)
    forced.force("Rome.")
    follow = client.responses.create(model=srv.state.model_name, max_output_tokens=20, store=False,
                                     input=[*ASK, *[o.model_dump(exclude_none=True) for o in r.output],
                                            {"role": "user", "content": "And Italy?"}])
    assert follow.output_text == "Rome."


def test_openai_responses_function_call_round_trip(reasoning_servers: Servers, replies: ReplyMaker) -> None:
    """gpt-oss thinks, then calls in harmony's commentary channel: the client gets a reasoning item and a
    function call, and sends the result back."""
    from openai.types.responses import ResponseFunctionToolCall, ResponseReasoningItem

    srv = reasoning_servers("harmony")
    forced = replies(srv)
    client = openai_client(srv)
    tool = {"type": "function", "name": "get_weather", "description": "Weather of a city", "strict": False,
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    forced.force("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
                 'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')
    r = client.responses.create(model=srv.state.model_name, input="Weather in Paris?", tools=[tool],
                                max_output_tokens=100)
    thought, call = r.output
    assert isinstance(thought, ResponseReasoningItem) and isinstance(call, ResponseFunctionToolCall)
    assert call.name == "get_weather" and call.arguments == '{"city": "Paris"}'
    forced.force("Sunny.<|return|>")
    follow = client.responses.create(model=srv.state.model_name, previous_response_id=r.id, tools=[tool],
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "sunny"}], max_output_tokens=20)
    assert follow.output_text == "Sunny."


@pytest.mark.parametrize("kind", KINDS)
def test_anthropic_client_reads_thinking_blocks(kind: str, reasoning_servers: Servers, replies: ReplyMaker) -> None:
    from anthropic.types import TextBlock, ThinkingBlock

    srv = reasoning_servers(kind)
    forced = replies(srv)
    client = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=120)
    forced.force(REPLIES[kind])
    m = client.messages.create(model=srv.state.model_name, max_tokens=2048, messages=ASK,
                               thinking={"type": "enabled", "budget_tokens": 1024})
    thinking, text = m.content
    assert isinstance(thinking, ThinkingBlock) and thinking.thinking == REASONING and thinking.signature == ""
    assert isinstance(text, TextBlock) and text.text == ANSWER
    forced.force(REPLIES[kind])
    with client.messages.stream(model=srv.state.model_name, max_tokens=100, messages=ASK) as s:
        thoughts = [e.thinking for e in s if e.type == "thinking"]
        final = s.get_final_message()
    assert "".join(thoughts) == REASONING
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[0].thinking == REASONING
    # the whole reply goes back as the assistant turn, thinking block and all
    forced.force("Rome.")
    follow = client.messages.create(model=srv.state.model_name, max_tokens=20, messages=[
        *ASK, {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {"role": "user", "content": "And Italy?"}])
    assert [b.text for b in follow.content if isinstance(b, TextBlock)] == ["Rome."]


def test_langchain_openai_reads_reasoning_on_the_responses_path(reasoning_servers: Servers,
                                                                replies: ReplyMaker) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    srv = reasoning_servers("qwen3")
    forced = replies(srv)
    llm = langchain_openai.ChatOpenAI(base_url=srv.url + "/v1", api_key="x", model=srv.state.model_name,
                                      use_responses_api=True, max_tokens=60, max_retries=0, timeout=120)
    forced.force(REPLIES["qwen3"])
    msg = llm.invoke(ASK[0]["content"])
    assert msg.text == ANSWER
    # the Responses output items as content blocks: the reasoning item with its reasoning_text parts
    raw = [b for b in msg.content if isinstance(b, dict) and b.get("type") == "reasoning"]
    assert [p["text"] for b in raw for p in b["content"]] == [REASONING]
    # LangChain's standard blocks: a reasoning block (its `reasoning` is for summaries, which are not
    # written; the reasoning text is in its extras), then the text
    blocks = msg.content_blocks
    assert [b["type"] for b in blocks] == ["reasoning", "text"]
    assert [p["text"] for p in blocks[0]["extras"]["content"]] == [REASONING]
    forced.force(REPLIES["qwen3"])
    streamed = None
    for chunk in llm.stream(ASK[0]["content"]):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed is not None and streamed.text == ANSWER
    assert any(b["type"] == "reasoning" for b in streamed.content_blocks)
