"""LangChain's `ChatOpenAI` against the server: `.bind_tools(...)` with a tool_choice, a tool round trip
(ToolMessage back), and `.with_structured_output(Model, method="function_calling")` returning the
parsed model. Over the tiny random chat model, where the forced tool_choice's constraint makes every
call parse and validate; skipped only when langchain-openai is not installed.
"""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

from radixserve.server import BackgroundServer

langchain_openai = pytest.importorskip("langchain_openai")
messages = pytest.importorskip("langchain_core.messages")

pytest.register_assert_rewrite("server_testkit")

pytest_plugins = ["server_testkit"]

CITY = {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": CITY}, "required": ["city"], "additionalProperties": False}}}


class Person(BaseModel):
    """A person named in the text."""

    name: Literal["Ada", "Alan", "Grace"]
    age: int = Field(ge=0, le=99)




def chat_model(srv: BackgroundServer, **kw: object) -> object:
    return langchain_openai.ChatOpenAI(base_url=srv.url + "/v1", api_key="x", model=srv.state.model_name,
                                       temperature=0, max_tokens=120, max_retries=0, timeout=120, **kw)


def test_bind_tools_and_round_trip(tiny_chat_server: BackgroundServer) -> None:
    llm = chat_model(tiny_chat_server)
    ask = messages.HumanMessage("What is the weather in Paris?")
    for choice in ("get_weather", "required", "any"):  # LangChain's names for a named and a required call
        reply = llm.bind_tools([WEATHER], tool_choice=choice).invoke([ask])  # type: ignore[attr-defined]
        assert reply.tool_calls, (choice, reply)
        for call in reply.tool_calls:
            assert call["name"] == "get_weather" and call["id"]
            jsonschema.validate(call["args"], WEATHER["function"]["parameters"])
    results = [messages.ToolMessage(json.dumps({"temp_c": 21}), tool_call_id=c["id"]) for c in reply.tool_calls]
    final = llm.bind_tools([WEATHER], tool_choice="none").invoke([ask, reply, *results])  # type: ignore[attr-defined]
    assert not final.tool_calls and isinstance(final.content, str)
    streamed = None
    for chunk in llm.bind_tools([WEATHER], tool_choice="get_weather").stream([ask]):  # type: ignore[attr-defined]
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed is not None and streamed.tool_calls and streamed.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(streamed.tool_calls[0]["args"], WEATHER["function"]["parameters"])


def test_with_structured_output_function_calling(tiny_chat_server: BackgroundServer) -> None:
    structured = chat_model(tiny_chat_server).with_structured_output(Person, method="function_calling")  # type: ignore[attr-defined]
    person = structured.invoke("Ada Lovelace was 36 years old.")
    assert isinstance(person, Person)
    raw = chat_model(tiny_chat_server).with_structured_output(Person, method="function_calling", include_raw=True)  # type: ignore[attr-defined]
    out = raw.invoke("Grace Hopper was 85.")
    assert out["parsing_error"] is None and isinstance(out["parsed"], Person)
