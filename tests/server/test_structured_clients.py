"""Structured output through real clients against a real server on 127.0.0.1: the official `openai`
client's `.parse` (greedy, sampled, n > 1, streamed), `json_object`, vLLM's `structured_outputs` and
`guided_*` fields, LangChain's `with_structured_output`, WebSocket and REST session turns, and the
400s that name the parameter path (the server's own checks and the engine's compile errors alike).

Fast tests run the tiny random-weight chat model (tests/tiny_models.py): its text is noise, so only
the constraint can make a reply parse, and the schemas bound every string and number so a reply ends
well within max_tokens. `json_object` (any object: its strings are unbounded, and a random model
rarely closes one) is asked of the embedded SmolLM2 in the `slow` tests, which want realistic replies.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from radixserve.server import BackgroundServer

pytest.register_assert_rewrite("server_testkit")
from server_testkit import OWNED, chat, connect, engine_idle, request, rest_client, wait_until  # noqa: E402

pytest_plugins = ["server_testkit"]

ASK = [{"role": "user", "content": "Describe a pet as JSON."}]
MAX_TOKENS = 160
JSON_OBJECT_TOKENS = 256  # an open object, asked of the embedded model


class Pet(BaseModel):
    name: str = Field(min_length=1, max_length=8)
    kind: Literal["cat", "dog", "bird"]
    age: int = Field(ge=0, le=30)


# closed, as `.parse` sends it (strict): an open object lets a random model add keys without end
PET_SCHEMA = {**Pet.model_json_schema(), "additionalProperties": False}
POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                          "ok": {"type": "boolean"}},
         "required": ["x", "ok"], "additionalProperties": False}
PET_FORMAT = {"type": "json_schema", "json_schema": {"name": "Pet", "schema": PET_SCHEMA, "strict": True}}




def client_of(srv: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def no_leaks(srv: BackgroundServer) -> None:
    wait_until(lambda: engine_idle(srv), what="the engine idle with no blocks held")


def check_pets(completion: Any, n: int = 1) -> None:
    assert len(completion.choices) == n
    for choice in completion.choices:
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, Pet), choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PET_SCHEMA)


# -- the openai client ---------------------------------------------------------------------------------------

def test_parse_returns_the_model_instance_greedy_sampled_and_forked(tiny_chat_server: BackgroundServer) -> None:
    client, model = client_of(tiny_chat_server), tiny_chat_server.state.model_name
    check_pets(client.chat.completions.parse(model=model, messages=ASK, response_format=Pet, max_tokens=MAX_TOKENS,
                                             temperature=0))
    for seed in range(3):
        check_pets(client.chat.completions.parse(model=model, messages=ASK, response_format=Pet,
                                                 max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, n=2), n=2)
    with client.chat.completions.stream(model=model, messages=ASK, response_format=Pet, max_tokens=MAX_TOKENS,
                                        temperature=0.8, seed=11) as stream:
        check_pets(stream.get_final_completion())
    no_leaks(tiny_chat_server)


def test_json_object_and_vllm_fields_constrain_the_reply(tiny_chat_server: BackgroundServer) -> None:
    client, model = client_of(tiny_chat_server), tiny_chat_server.state.model_name

    def reply(temperature: float = 0.0, **extra: Any) -> str:
        out = client.chat.completions.create(model=model, messages=ASK, max_tokens=MAX_TOKENS, temperature=temperature,
                                             seed=3, extra_body=extra.pop("extra_body", None), **extra)
        assert out.choices[0].finish_reason == "stop", out.choices[0]
        return out.choices[0].message.content or ""

    for temperature in (0.0, 1.0):
        jsonschema.validate(json.loads(reply(temperature, extra_body={"structured_outputs": {"json": POINT}})), POINT)
        jsonschema.validate(json.loads(reply(temperature, extra_body={"guided_json": json.dumps(POINT)})), POINT)
        for field in ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}, {"guided_regex": "[0-9]{3}-[a-z]{2}"}):
            assert re.fullmatch("[0-9]{3}-[a-z]{2}", reply(temperature, extra_body=field))
        for field in ({"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
                      {"guided_choice": ["yes", "no", "maybe"]}):
            assert reply(temperature, extra_body=field) in ("yes", "no", "maybe")
        for grammar in ('start: "red" | "green" | "blue"', 'root ::= "red" | "green" | "blue"'):  # Lark, GBNF
            for field in ({"structured_outputs": {"grammar": grammar}}, {"guided_grammar": grammar}):
                assert reply(temperature, extra_body=field) in ("red", "green", "blue")
    stream = client.chat.completions.create(model=model, messages=ASK, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, response_format=PET_FORMAT)  # type: ignore[arg-type]
    Pet.model_validate_json("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
    no_leaks(tiny_chat_server)


def test_langchain_structured_output(tiny_chat_server: BackgroundServer) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(base_url=tiny_chat_server.url + "/v1", api_key="x", model=tiny_chat_server.state.model_name,
                                      max_tokens=MAX_TOKENS, temperature=0, max_retries=0, timeout=120)
    pet = llm.with_structured_output(Pet, method="json_schema").invoke("Describe a pet.")
    assert isinstance(pet, Pet)
    raw = llm.with_structured_output(PET_SCHEMA, method="json_schema").invoke("Describe a pet.")
    jsonschema.validate(raw, PET_SCHEMA)
    no_leaks(tiny_chat_server)


# -- sessions: WebSocket and REST ------------------------------------------------------------------------

def test_session_turns_with_response_format_reply_in_json(tiny_chat_server: BackgroundServer) -> None:
    async def over_ws() -> tuple[str, dict[str, Any]]:
        async with connect(tiny_chat_server) as ws:
            created = await request(ws, {"type": "session.create", "sampling": {"temperature": 0}, **OWNED})
            sid = created["session"]["id"]
            frames = await chat(ws, sid, "A pet, please.", "g1", response_format=PET_FORMAT,
                                sampling={"max_tokens": MAX_TOKENS})
            bad = await chat(ws, sid, "A pet, please.", "g2", guided_choice=[])
            uncompiled = await chat(ws, sid, "A pet, please.", "g3", guided_grammar="start: ((")
            return "".join(f["text"] for f in frames if f["type"] == "delta"), {"done": frames[-1], "bad": bad[-1],
                                                                                "uncompiled": uncompiled[-1]}

    text, frames = asyncio.run(over_ws())
    assert frames["done"]["type"] == "done" and frames["done"]["finish_reason"] == "stop"
    Pet.model_validate_json(text)
    assert frames["bad"]["type"] == "error" and frames["bad"]["code"] == "invalid_field"
    assert frames["bad"]["message"].startswith("guided_choice")
    assert frames["uncompiled"]["code"] == "invalid_field" and frames["uncompiled"]["message"].startswith("guided_grammar")

    http = rest_client(tiny_chat_server, timeout=120)
    sid = http.post("/v1/sessions", json={"sampling": {"temperature": 0.7, "seed": 5}}).json()["id"]
    for body in ({"response_format": PET_FORMAT}, {"structured_outputs": {"json": POINT}}):
        r = http.post(f"/v1/sessions/{sid}/messages", json={"content": "JSON, please.", "sampling":
                                                            {"max_tokens": MAX_TOKENS}, **body})
        assert r.status_code == 200 and r.json()["finish_reason"] == "stop", r.text
        assert isinstance(json.loads(r.json()["message"]["content"]), dict)
    r = http.post(f"/v1/sessions/{sid}/messages", json={"content": "hi", "response_format": {"type": "xml"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.type"
    r = http.post(f"/v1/sessions/{sid}/messages", json={"content": "hi", "structured_outputs": {"regex": "(x"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs.regex", r.text
    assert len(http.get(f"/v1/sessions/{sid}").json()["messages"]) == 4  # the refused turns left no trace
    # the constraint was the turn's alone: the next plain turn runs unconstrained
    r = http.post(f"/v1/sessions/{sid}/messages", json={"content": "Now in words.", "sampling": {"max_tokens": 4}})
    assert r.status_code == 200
    no_leaks(tiny_chat_server)


# -- errors ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": POINT}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "response_format, guided_regex"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "grammar": "start: \"a\""}}, "structured_outputs"),
    ({"guided_json": POINT, "use_beam_search": True, "temperature": 0}, "guided_json"),
    # refused when the engine compiles them
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"guided_grammar": "start: (("}, "guided_grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "Bad", "schema": {"type": "no-such-type"}}}},
     "response_format.json_schema.schema"),
])
def test_bad_structured_fields_are_400s_naming_the_parameter(tiny_chat_server: BackgroundServer, extra: dict[str, Any],
                                                             param: str) -> None:
    body = {"model": tiny_chat_server.state.model_name, "messages": ASK, "max_tokens": 8, **extra}
    for stream in (False,) if "use_beam_search" in extra else (False, True):  # refused before a stream opens
        r = httpx.post(tiny_chat_server.url + "/v1/chat/completions", json={**body, "stream": stream}, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["code"], err["param"], err["type"]) == ("invalid_field", param, "invalid_request_error"), err
    no_leaks(tiny_chat_server)


# -- the embedded model ---------------------------------------------------------------------------------------

@pytest.mark.slow
def test_embedded_model_parse_and_json_object(chat_server: BackgroundServer) -> None:
    client, model = client_of(chat_server), chat_server.state.model_name
    messages = [{"role": "system", "content": "You answer in JSON."},
                {"role": "user", "content": "Invent a pet: its name, kind (cat, dog or bird) and age in years."}]
    check_pets(client.chat.completions.parse(model=model, messages=messages, response_format=Pet, max_tokens=64,
                                             temperature=0))
    check_pets(client.chat.completions.parse(model=model, messages=messages, response_format=Pet, max_tokens=64,
                                             temperature=0.9, seed=1, n=3), n=3)
    for temperature, seed in ((0.0, None), (0.7, 4)):
        out = client.chat.completions.create(model=model, messages=messages, max_tokens=JSON_OBJECT_TOKENS,
                                             temperature=temperature, seed=seed, response_format={"type": "json_object"})
        assert out.choices[0].finish_reason == "stop", out.choices[0]
        assert isinstance(json.loads(out.choices[0].message.content or ""), dict)
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(base_url=chat_server.url + "/v1", api_key="x", model=model, temperature=0,
                                      max_tokens=JSON_OBJECT_TOKENS, max_retries=0, timeout=120)
    assert isinstance(llm.with_structured_output(Pet, method="json_schema").invoke(messages[1]["content"]), Pet)
    obj = llm.with_structured_output(PET_SCHEMA, method="json_mode").invoke(messages[1]["content"] + " Answer in JSON.")
    assert isinstance(obj, dict)
    no_leaks(chat_server)


@pytest.mark.slow
def test_embedded_model_session_turns_in_json_object(chat_server: BackgroundServer) -> None:
    http = rest_client(chat_server, timeout=120)
    sid = http.post("/v1/sessions", json={"system_prompt": "You answer in JSON.", "sampling": {"temperature": 0}}).json()["id"]
    r = http.post(f"/v1/sessions/{sid}/messages", json={"content": "A pet with a name and a kind.",
                                                        "response_format": {"type": "json_object"},
                                                        "sampling": {"max_tokens": JSON_OBJECT_TOKENS}})
    assert r.status_code == 200 and r.json()["finish_reason"] == "stop", r.text
    assert isinstance(json.loads(r.json()["message"]["content"]), dict)

    async def over_ws() -> list[dict[str, Any]]:
        async with connect(chat_server) as ws:
            return await chat(ws, sid, "Another one.", "j1", structured_outputs={"json_object": True},
                              sampling={"max_tokens": JSON_OBJECT_TOKENS})

    frames = asyncio.run(over_ws())
    assert frames[-1]["type"] == "done" and frames[-1]["finish_reason"] == "stop", frames[-1]
    assert isinstance(json.loads("".join(f["text"] for f in frames if f["type"] == "delta")), dict)
    no_leaks(chat_server)


def test_compile_figures_count_each_request_once_and_refusals_at_once(tiny_chat_server: BackgroundServer) -> None:
    """A new constraint is one compile and no cache hit (compiled off the event loop, then found by the
    request's own check); the same constraint again is one hit; a refused one shows in the figures
    at once, though it never reaches an engine step."""
    def figures() -> dict[str, Any]:
        return dict(httpx.get(tiny_chat_server.url + "/v1/cache/stats", timeout=30).json()["structured_output"])

    client, model = client_of(tiny_chat_server), tiny_chat_server.state.model_name
    fresh = {"structured_outputs": {"regex": "(yes|no) [0-9]{2} " + uuid.uuid4().hex[:8]}}  # never compiled before
    before = figures()
    client.chat.completions.create(model=model, messages=ASK, max_tokens=24, extra_body=fresh)
    after_one = figures()
    assert (after_one["compiles"], after_one["compile_cache_hits"]) == (before["compiles"] + 1,
                                                                        before["compile_cache_hits"])
    client.chat.completions.create(model=model, messages=ASK, max_tokens=24, extra_body=fresh)
    after_two = figures()
    assert (after_two["compiles"], after_two["compile_cache_hits"]) == (after_one["compiles"],
                                                                        after_one["compile_cache_hits"] + 1)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=ASK, max_tokens=4, extra_body={"guided_regex": "(unclosed"})
    assert figures()["compile_failures"] == after_two["compile_failures"] + 1
    no_leaks(tiny_chat_server)
