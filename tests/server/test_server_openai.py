"""The OpenAI-compatible API through the official `openai` client, unmodified, against a real server."""

from __future__ import annotations

import httpx
import openai
import pytest

from radixserve.sampling_params import SamplingParams
from radixserve.server.tenants import DEFAULT_TENANT, cache_namespace

pytest.register_assert_rewrite("server_testkit")
from server_testkit import on_server_loop  # noqa: E402

pytest_plugins = ["server_testkit"]
pytestmark = pytest.mark.slow

MESSAGES = [{"role": "system", "content": "You are a geography tutor."},
            {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(chat_server) -> openai.OpenAI:  # noqa: ANN001
    return openai.OpenAI(base_url=chat_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def engine_greedy(srv, messages, max_tokens: int) -> str:  # noqa: ANN001
    """The engine's own greedy answer for the same conversation, bypassing the HTTP layer."""
    tok = srv.engine.tokenizer
    ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
              add_special_tokens=False)["input_ids"]

    async def run() -> str:
        text = []
        # in the cache namespace of the open server's callers, so the API's request after it hits its prompt
        namespace = cache_namespace(DEFAULT_TENANT, None, srv.state.config.cache_sharing)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, cache_namespace=namespace)
        async for out in srv.engine.generate(ids, params):
            text.append(out.outputs[0].text)
        return "".join(text)

    return on_server_loop(srv, run())


def test_models_lists_the_served_model(client, chat_server) -> None:  # noqa: ANN001
    models = client.models.list().data
    assert [m.id for m in models] == [chat_server.state.model_name]


def test_greedy_matches_engine_and_reports_cached_tokens(client, chat_server) -> None:  # noqa: ANN001
    model = chat_server.state.model_name
    expected = engine_greedy(chat_server, MESSAGES, 8)
    first = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0)
    assert first.choices[0].message.content == expected and first.choices[0].message.role == "assistant"
    assert first.choices[0].finish_reason in ("stop", "length")
    u = first.usage
    assert u.completion_tokens <= 8 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    # the engine call above computed this exact prompt: all but its last token are cached
    assert u.prompt_tokens_details.cached_tokens >= u.prompt_tokens - 1

    stream = client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [first.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == u.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= u.prompt_tokens - 1


def test_n_seed_and_stop(client, chat_server) -> None:  # noqa: ANN001
    model = chat_server.state.model_name
    msgs = [{"role": "user", "content": "Tell me a word."}]
    a = client.chat.completions.create(model=model, messages=msgs, max_tokens=6, temperature=1.0, seed=7, n=2)
    b = client.chat.completions.create(model=model, messages=msgs, max_tokens=6, temperature=1.0, seed=7, n=2)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    greedy = engine_greedy(chat_server, msgs, 12)
    stop_at = greedy.strip().split()[1] if len(greedy.split()) > 1 else greedy.strip()[-2:]
    cut = client.chat.completions.create(model=model, messages=msgs, max_tokens=12, temperature=0, stop=[stop_at])
    assert cut.choices[0].finish_reason == "stop"
    assert stop_at not in cut.choices[0].message.content
    assert greedy.startswith(cut.choices[0].message.content)


def test_invalid_requests_get_openai_errors(client, chat_server) -> None:  # noqa: ANN001
    model = chat_server.state.model_name
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[], max_tokens=4)
    assert e.value.body["code"] == "invalid_field" and e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=MESSAGES, temperature=3)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert e.value.body["code"] == "model_not_found"
    limit = chat_server.engine.max_model_len
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "word " * (limit + 10)}])
    assert e.value.body["code"] == "context_too_long" and str(limit) in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=limit)
    assert e.value.body["code"] == "context_too_long" and str(limit) in e.value.body["message"]
    r = httpx.post(chat_server.url + "/v1/chat/completions", json={"model": model, "messages": MESSAGES,
                                                                   "tools": [{"type": "function"}]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
