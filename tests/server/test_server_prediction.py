"""OpenAI's Predicted Outputs (`prediction`) and the speculation figures, end to end against a real
server on 127.0.0.1 over the tiny chat model (tests/server_testkit.py): through the official `openai`
client on chat completions (streamed and not) and completions, over the WebSocket and the session
REST API, and in /metrics. A prediction never changes a greedy reply, right or wrong; a right one is
accepted as drafts. Without a server: test_speculation_surface_units.py.

A request's prediction is the first draft source tried, the radix tree the next. The tests that
predict a reply the server gave before run on `uncached`, the same model without the prefix cache,
where nothing but the prediction (and lookup) can draft, so what is counted is the prediction's alone;
the shared `tiny_chat_server` (cache on) shows the tree's drafts."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from radixserve import AsyncEngine, EngineConfig
from radixserve.core import DRAFT_SOURCES
from radixserve.server import BackgroundServer, ServerConfig

pytest.register_assert_rewrite("server_testkit")
from server_testkit import OWNED, chat, connect, recv_frame, rest_client  # noqa: E402
from tool_fixtures import TOOLS  # noqa: E402

from radixserve.server.pipeline.prompt_worker import prediction_ids  # noqa: E402

pytest_plugins = ["server_testkit"]

ASK = [{"role": "system", "content": "You repeat things."}, {"role": "user", "content": "Say the alphabet."}]
REPLY_TOKENS = 24
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": REPLY_TOKENS}


@pytest.fixture(scope="module")
def uncached() -> Iterator[BackgroundServer]:
    """The tiny chat model without the prefix cache: nothing for the tree to draft from."""
    from tiny_models import tiny_chat_model_dir

    model = str(tiny_chat_model_dir("llama"))
    config = ServerConfig(port=0, web_dir=None, shutdown_grace_s=0.5)
    engine = EngineConfig(model=model, num_blocks=512, enable_prefix_cache=False)
    with BackgroundServer(lambda: AsyncEngine(engine), config) as srv:
        yield srv


def client_of(srv: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def content(text: str) -> dict[str, Any]:
    return {"type": "content", "content": text}


def greedy_reply(srv: BackgroundServer, messages: list[dict[str, Any]] = ASK) -> str:
    r = client_of(srv).chat.completions.create(model=srv.state.model_name, messages=messages, **GREEDY)  # type: ignore[call-overload]
    text = r.choices[0].message.content
    assert isinstance(text, str) and text and r.usage.completion_tokens == REPLY_TOKENS
    return text


def prediction_length(srv: BackgroundServer, text: str) -> int:
    """The prediction's tokens, as the server tokenizes it (PromptWorker.encode_prediction)."""
    return len(prediction_ids(srv.engine.tokenizer, text))


def check_prediction_counts(srv: BackgroundServer, usage: Any, *predictions: str) -> tuple[int, int]:
    """OpenAI's counts add up to the prediction's tokens (once per request that had it), and no more
    are accepted than the prediction drafted; returns them."""
    accepted, rejected, spec = details(usage)
    length = sum(prediction_length(srv, p) for p in predictions)
    assert accepted + rejected == spec["prediction_tokens"] == length, (accepted, rejected, spec, length)
    assert accepted <= spec["by_source"]["prediction"]["accepted"] <= spec["by_source"]["prediction"]["proposed"]
    return accepted, rejected


def details(usage: Any) -> tuple[int, int, dict[str, Any]]:
    """(accepted_prediction_tokens, rejected_prediction_tokens, the `speculation` extension)."""
    d = usage.completion_tokens_details
    assert d is not None and d.accepted_prediction_tokens is not None and d.rejected_prediction_tokens is not None
    spec = (d.model_extra or {}).get("speculation")
    assert isinstance(spec, dict) and list(spec["by_source"]) == list(DRAFT_SOURCES), spec
    return d.accepted_prediction_tokens, d.rejected_prediction_tokens, spec


def test_usage_has_the_prediction_counts_on_every_reply(tiny_chat_server: BackgroundServer) -> None:
    client, model = client_of(tiny_chat_server), tiny_chat_server.state.model_name
    r = client.chat.completions.create(model=model, messages=ASK, max_tokens=4)
    accepted, rejected, spec = details(r.usage)
    assert (accepted, rejected) == (0, 0)  # no prediction
    assert spec["by_source"]["prediction"] == {"proposed": 0, "accepted": 0}
    assert 0 <= spec["accepted"] <= spec["proposed"] and spec["accepted"] <= r.usage.completion_tokens
    chunks = list(client.chat.completions.create(model=model, messages=ASK, max_tokens=4, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None and details(chunks[-1].usage)[:2] == (0, 0)


def test_a_request_asked_again_drafts_from_the_tree(tiny_chat_server: BackgroundServer) -> None:
    """With the prefix cache on, the reply a greedy request left in the tree drafts the same request's
    reply next time: `speculation` reports it under `tree`, and OpenAI's prediction counts stay 0."""
    messages = [ASK[0], {"role": "user", "content": "Repeat after me: the tree drafts this."}]
    reply = greedy_reply(tiny_chat_server, messages)
    r = client_of(tiny_chat_server).chat.completions.create(model=tiny_chat_server.state.model_name,
                                                             messages=messages, **GREEDY)  # type: ignore[call-overload]
    assert r.choices[0].message.content == reply
    accepted, rejected, spec = details(r.usage)
    assert (accepted, rejected) == (0, 0) and spec["by_source"]["tree"]["accepted"] > 0, spec
    assert spec["accepted"] == sum(c["accepted"] for c in spec["by_source"].values()) <= r.usage.completion_tokens


def test_a_right_prediction_is_accepted_and_changes_nothing(uncached: BackgroundServer) -> None:
    client, model = client_of(uncached), uncached.state.model_name
    reply = greedy_reply(uncached)
    r = client.chat.completions.create(model=model, messages=ASK, prediction=content(reply), **GREEDY)  # type: ignore[call-overload]
    assert r.choices[0].message.content == reply
    accepted, rejected = check_prediction_counts(uncached, r.usage, reply)
    assert accepted > 0, r.usage
    spec = details(r.usage)[2]
    assert accepted <= spec["accepted"] <= r.usage.completion_tokens and spec["verify_steps"] > 0
    # streamed: the same text in pieces, and the same kind of usage
    chunks = list(client.chat.completions.create(model=model, messages=ASK, prediction=content(reply), stream=True,  # type: ignore[call-overload]
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply
    assert chunks[-1].usage is not None and check_prediction_counts(uncached, chunks[-1].usage, reply)[0] > 0
    # as a list of text parts, split anywhere
    parts = [{"type": "text", "text": reply[:5]}, {"type": "text", "text": reply[5:]}]
    r = client.chat.completions.create(model=model, messages=ASK, prediction={"type": "content", "content": parts},  # type: ignore[call-overload]
                                       **GREEDY)
    assert r.choices[0].message.content == reply and check_prediction_counts(uncached, r.usage, reply)[0] > 0


def test_a_wrong_prediction_changes_nothing(uncached: BackgroundServer) -> None:
    client, model = client_of(uncached), uncached.state.model_name
    reply = greedy_reply(uncached)
    wrong = "Completely unrelated text about gardening and the weather in spring. " * 3
    r = client.chat.completions.create(model=model, messages=ASK, prediction=content(wrong), **GREEDY)  # type: ignore[call-overload]
    assert r.choices[0].message.content == reply
    accepted, rejected = check_prediction_counts(uncached, r.usage, wrong)
    assert rejected > accepted, r.usage  # nearly none of it is in the reply


def test_a_prediction_goes_with_every_other_parameter(uncached: BackgroundServer) -> None:
    """n > 1 with logprobs: the same choices and logprobs as without it, its drafts accepted; with the
    penalties and tools (which draft nothing) the same replies too."""
    client, model = client_of(uncached), uncached.state.model_name
    reply = greedy_reply(uncached)
    ask: dict[str, Any] = {"model": model, "messages": ASK, "n": 2, "logprobs": True, "top_logprobs": 2,
                           "seed": 7, **GREEDY}
    plain = client.chat.completions.create(**ask)
    predicted = client.chat.completions.create(**ask, prediction=content(reply))
    for a, b in zip(plain.choices, predicted.choices, strict=True):
        assert a.message.content == b.message.content == reply
        assert a.logprobs is not None and b.logprobs is not None and a.logprobs.content is not None
        assert [t.token for t in a.logprobs.content] == [t.token for t in b.logprobs.content or []]
        assert [t.logprob for t in a.logprobs.content] == \
            pytest.approx([t.logprob for t in b.logprobs.content or []], abs=1e-3)
    accepted, rejected = check_prediction_counts(uncached, predicted.usage, reply)  # one request, n choices
    assert accepted > 0
    others: dict[str, Any] = {"model": model, "messages": ASK, "presence_penalty": 0.5, "frequency_penalty": 0.2,
                              "tools": TOOLS, "tool_choice": "auto", **GREEDY}
    plain = client.chat.completions.create(**others)
    predicted = client.chat.completions.create(**others, prediction=content(reply))
    assert predicted.choices[0].message == plain.choices[0].message


@pytest.mark.parametrize("value,param", [
    ("text", "prediction"), ({"type": "static", "content": "x"}, "prediction.type"),
    ({"type": "content", "content": 3}, "prediction.content"),
    ({"type": "content", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "prediction.content[0]"),
    ({"type": "content", "content": "word " * 3000}, "prediction"),  # more tokens than the tiny model's context
])
def test_a_malformed_prediction_is_a_400_naming_it(tiny_chat_server: BackgroundServer, value: Any, param: str) -> None:
    client, model = client_of(tiny_chat_server), tiny_chat_server.state.model_name
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=2, prediction=value)
    body: Any = e.value.body
    assert body["param"] == param and body["code"] == "invalid_field" and f"'{param}'" in body["message"], body
    with pytest.raises(openai.BadRequestError) as e:  # streamed: refused before any stream opens
        client.chat.completions.create(model=model, messages=ASK, max_tokens=2, prediction=value, stream=True)
    assert e.value.body["param"] == param  # type: ignore[index]


def test_completions_take_a_prediction(uncached: BackgroundServer) -> None:
    client, model = client_of(uncached), uncached.state.model_name
    prompts = ["The alphabet: a b c", "Numbers: 1 2 3"]
    plain = client.completions.create(model=model, prompt=prompts, max_tokens=REPLY_TOKENS, temperature=0)
    texts = [c.text for c in plain.choices]
    assert details(plain.usage)[:2] == (0, 0)
    r = client.completions.create(model=model, prompt=prompts, max_tokens=REPLY_TOKENS, temperature=0,
                                  extra_body={"prediction": content(texts[0])})
    assert [c.text for c in r.choices] == texts
    accepted, rejected = check_prediction_counts(uncached, r.usage, texts[0], texts[0])  # both prompts had it
    assert accepted > 0
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="x", max_tokens=2, extra_body={"prediction": {"type": "x"}})
    assert e.value.body["param"] == "prediction.type"  # type: ignore[index]


def new_session(http: httpx.Client) -> str:
    r = http.post("/v1/sessions", json={"system_prompt": ASK[0]["content"], "sampling": GREEDY})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def test_rest_session_messages_take_a_prediction(uncached: BackgroundServer) -> None:
    with rest_client(uncached) as http:
        first = http.post(f"/v1/sessions/{new_session(http)}/messages", json={"content": ASK[1]["content"]}).json()
        reply = first["message"]["content"]
        assert first["usage"]["speculation"]["by_source"]["prediction"] == {"proposed": 0, "accepted": 0}
        sid = new_session(http)
        r = http.post(f"/v1/sessions/{sid}/messages", json={"content": ASK[1]["content"], "prediction": content(reply)})
        assert r.status_code == 200, r.text
        assert r.json()["message"]["content"] == reply
        spec = r.json()["usage"]["speculation"]
        assert spec["by_source"]["prediction"]["accepted"] > 0 and spec["accepted"] <= r.json()["usage"]["completion_tokens"]
        kept = http.get(f"/v1/sessions/{sid}").json()["messages"][-1]
        assert kept["usage"]["speculation"] == spec  # the session keeps the reply's figures
        bad = http.post(f"/v1/sessions/{sid}/messages", json={"content": "x", "prediction": {"type": "content"}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prediction.content"
        assert len(http.get(f"/v1/sessions/{sid}").json()["messages"]) == 2  # the refused turn left nothing


def test_websocket_chat_frames_take_a_prediction(uncached: BackgroundServer) -> None:
    with rest_client(uncached) as http:
        plain_sid, sid = new_session(http), new_session(http)

    async def run() -> None:
        async with connect(uncached) as ws:
            frames = await chat(ws, plain_sid, ASK[1]["content"], "plain")
            reply = "".join(f["text"] for f in frames if f["type"] == "delta")
            frames = await chat(ws, sid, ASK[1]["content"], "predicted", prediction=content(reply))
            assert "".join(f["text"] for f in frames if f["type"] == "delta") == reply
            done = frames[-1]
            assert done["type"] == "done", done
            spec = done["usage"]["speculation"]
            assert spec["by_source"]["prediction"]["accepted"] > 0 and list(spec["by_source"]) == list(DRAFT_SOURCES)
            await ws.send(_frame(sid, {"type": "content", "content": [1]}, "bad"))
            err = await recv_frame(ws)
            assert (err["type"], err["code"], err["gen_id"]) == ("error", "invalid_field", "bad")
            assert err["message"].startswith("'prediction.content[0]'"), err

    asyncio.run(run())


def _frame(sid: str, prediction: Any, gen_id: str) -> str:
    return json.dumps({"type": "chat", "gen_id": gen_id, "session_id": sid, "content": "hi", "prediction": prediction,
                       **OWNED})


def metric(text: str, sample: str) -> float:
    m = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.MULTILINE)
    assert m is not None, f"{sample} missing from /metrics"
    return float(m.group(1))


def test_metrics_count_drafts_by_source(uncached: BackgroundServer) -> None:
    def scrape() -> str:
        r = httpx.get(uncached.url + "/metrics", timeout=30)
        assert r.status_code == 200
        return r.text

    before = scrape()
    for fam in ("radixserve_spec_proposed_tokens_total", "radixserve_spec_accepted_tokens_total"):
        for source in DRAFT_SOURCES:
            metric(before, f'{fam}{{source="{source}"}}')  # every source, from the start
    for name in ("radixserve_spec_verify_draws_total", "radixserve_committed_draws_total", "radixserve_tokens_per_step"):
        metric(before, name)
    reply = greedy_reply(uncached)
    client_of(uncached).chat.completions.create(model=uncached.state.model_name, messages=ASK,
                                                         prediction=content(reply), **GREEDY)  # type: ignore[call-overload]
    after = scrape()
    key = 'radixserve_spec_accepted_tokens_total{source="prediction"}'
    assert metric(after, key) > metric(before, key)
    assert metric(after, "radixserve_spec_verify_draws_total") > metric(before, "radixserve_spec_verify_draws_total")
    gen = metric(after, "radixserve_generation_tokens_total") - metric(before, "radixserve_generation_tokens_total")
    draws = metric(after, "radixserve_committed_draws_total") - metric(before, "radixserve_committed_draws_total")
    assert 0 < draws < gen, "drafts accepted: fewer sequence-steps than generated tokens"
    assert metric(after, "radixserve_tokens_per_step") >= 1.0
    stats = httpx.get(uncached.url + "/v1/cache/stats", timeout=30).json()["speculation"]
    assert list(stats["by_source"]) == list(DRAFT_SOURCES) and stats["committed_draws"] >= draws
