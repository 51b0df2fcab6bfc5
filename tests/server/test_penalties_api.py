"""Penalties and logit_bias through a real server on the tiny random-weight chat model: the official
`openai` client sends `logit_bias`, `presence_penalty`, `frequency_penalty` and (vLLM's extension,
through `extra_body`) `repetition_penalty`, and they reach the sampler; WebSocket and REST session
`sampling` objects take them too; a bad value or key is a 400 naming the field, streamed or not, with
nothing left running.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest
from tiny_models import tiny_chat_model_dir

from radixserve.model.loader import load_tokenizer
from radixserve.server import BackgroundServer

pytest.register_assert_rewrite("server_testkit")
from server_testkit import OWNED, chat, connect, engine_idle, request, rest_client, wait_until  # noqa: E402

pytest_plugins = ["server_testkit"]

ASK = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. Hello, how are you today?"}]
FOX = 372  # " fox" in the tiny tokenizer (checked below)
REPEAT = 6


def client_of(srv: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def no_leaks(srv: BackgroundServer) -> None:
    wait_until(lambda: engine_idle(srv), what="the engine idle with no blocks held")


def foxes() -> str:
    tokenizer = load_tokenizer(tiny_chat_model_dir("llama"))
    assert tokenizer.encode(" fox", add_special_tokens=False) == [FOX]
    return str(tokenizer.decode([FOX] * REPEAT))


def test_openai_client_sends_every_penalty(tiny_chat_server: BackgroundServer) -> None:
    client, model = client_of(tiny_chat_server), tiny_chat_server.state.model_name

    def reply(**kw: Any) -> tuple[str, int]:
        r = client.chat.completions.create(model=model, messages=ASK, max_tokens=24, temperature=0, **kw)
        assert r.choices[0].finish_reason == "length"
        return r.choices[0].message.content or "", r.usage.completion_tokens if r.usage else 0

    forced = client.chat.completions.create(model=model, messages=ASK, max_tokens=REPEAT, temperature=0,
                                            logit_bias={str(FOX): 100})
    assert forced.choices[0].message.content == foxes() and forced.usage and forced.usage.completion_tokens == REPEAT
    plain = reply()
    for kw in (dict(presence_penalty=2.0), dict(frequency_penalty=2.0), dict(extra_body={"repetition_penalty": 2.0}),
               dict(presence_penalty=0.5, frequency_penalty=0.5, extra_body={"repetition_penalty": 1.5},
                    logit_bias={"200": 5, "201": -100})):
        penalised = reply(**kw)
        assert penalised != plain and penalised == reply(**kw), kw  # applied, and greedy stays greedy
    streamed = client.chat.completions.create(model=model, messages=ASK, max_tokens=REPEAT, temperature=0, stream=True,
                                              logit_bias={str(FOX): 100})
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == foxes()
    no_leaks(tiny_chat_server)


def test_every_other_endpoint_applies_them(tiny_chat_server: BackgroundServer) -> None:
    """Completions, Responses and Anthropic Messages read the same fields (sampling_fields.py): a +100
    bias makes each greedy reply the biased token repeated, and a bad value is that API's 400."""
    import anthropic

    client, model = client_of(tiny_chat_server), tiny_chat_server.state.model_name
    bias = {str(FOX): 100}
    text = client.completions.create(model=model, prompt="Hello", max_tokens=REPEAT, temperature=0, logit_bias=bias)
    assert text.choices[0].text == foxes()
    response = client.responses.create(model=model, input="Hello", max_output_tokens=REPEAT, temperature=0,
                                       store=False, extra_body={"logit_bias": bias})
    assert response.output_text == foxes()
    claude = anthropic.Anthropic(base_url=tiny_chat_server.url, api_key="unused", max_retries=0)
    message = claude.messages.create(model=model, max_tokens=REPEAT, messages=[{"role": "user", "content": "Hello"}],
                                     extra_body={"temperature": 0, "logit_bias": bias})
    assert message.content[0].type == "text" and message.content[0].text == foxes()
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(model=model, max_tokens=2, messages=[{"role": "user", "content": "Hello"}],
                               extra_body={"repetition_penalty": -5})
    assert "repetition_penalty" in str(refused.value)
    for bad in ({"presence_penalty": 3}, {"logit_bias": {str(FOX): 101}}):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=model, prompt="Hello", max_tokens=2, extra_body=bad)
        assert e.value.body["param"] == next(iter(bad))  # type: ignore[index]
    no_leaks(tiny_chat_server)


def test_session_sampling_objects_take_penalties(tiny_chat_server: BackgroundServer) -> None:
    sampling = {"temperature": 0, "max_tokens": REPEAT, "logit_bias": {str(FOX): 100}, "presence_penalty": 0.5,
                "frequency_penalty": 0.1, "repetition_penalty": 1.0}

    async def over_ws() -> tuple[str, dict[str, Any]]:
        async with connect(tiny_chat_server) as ws:
            created = await request(ws, {"type": "session.create", "sampling": sampling, **OWNED})
            frames = await chat(ws, created["session"]["id"], "Hello", "g1")
            bad = await chat(ws, created["session"]["id"], "Hello", "g2", sampling={"repetition_penalty": 3})
            return "".join(f["text"] for f in frames if f["type"] == "delta"), bad[-1]

    text, bad = asyncio.run(over_ws())
    assert text == foxes()
    assert bad["type"] == "error" and bad["code"] == "invalid_field" and "repetition_penalty" in bad["message"]
    http = rest_client(tiny_chat_server, timeout=120)
    sid = http.post("/v1/sessions", json={"sampling": {"temperature": 0}}).json()["id"]
    r = http.post(f"/v1/sessions/{sid}/messages", json={"content": "Hello", "sampling": sampling})
    assert r.status_code == 200 and r.json()["message"]["content"] == foxes(), r.text
    r = http.post(f"/v1/sessions/{sid}/messages", json={"content": "Hello", "sampling": {"logit_bias": {"x": 1}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
    no_leaks(tiny_chat_server)


@pytest.mark.parametrize("extra, param", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"presence_penalty": "1"}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"), ({"frequency_penalty": "x"}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"repetition_penalty": 2.5}, "repetition_penalty"),
    ({"repetition_penalty": True}, "repetition_penalty"), ({"logit_bias": [1]}, "logit_bias"),
    ({"logit_bias": {"fox": 1}}, "logit_bias"), ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"), ({"logit_bias": {"5": "1"}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"logit_bias": {"512": 1}}, "logit_bias"),  # past the vocabulary: the engine's intake refuses it
])
def test_bad_penalties_are_400s_naming_the_field(tiny_chat_server: BackgroundServer, extra: dict[str, Any],
                                                 param: str) -> None:
    body = {"model": tiny_chat_server.state.model_name, "messages": ASK, "max_tokens": 4, **extra}
    for stream in (False, True):  # refused before a stream opens
        r = httpx.post(tiny_chat_server.url + "/v1/chat/completions", json={**body, "stream": stream}, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["code"], err["param"]) == ("invalid_field", param) and param in err["message"], err
    no_leaks(tiny_chat_server)


def test_beam_search_refuses_penalties_and_takes_neutral_ones(tiny_chat_server: BackgroundServer) -> None:
    body = {"model": tiny_chat_server.state.model_name, "messages": ASK, "max_tokens": 3, "use_beam_search": True,
            "temperature": 0, "n": 2}
    for name, value in (("presence_penalty", 0.5), ("frequency_penalty", -1), ("repetition_penalty", 1.2),
                        ("logit_bias", {"5": 10})):
        r = httpx.post(tiny_chat_server.url + "/v1/chat/completions", json={**body, name: value}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text
    neutral = {"presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1, "logit_bias": {}}
    r = httpx.post(tiny_chat_server.url + "/v1/chat/completions", json={**body, **neutral}, timeout=120)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
    no_leaks(tiny_chat_server)
