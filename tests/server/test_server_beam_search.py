"""Beam search through the real server's OpenAI endpoint (`use_beam_search`): the choices are the
engine's best beams in order, nothing leaks, and every bad combination is a clear 400."""

from __future__ import annotations

import httpx
import pytest

from radixserve.engine.beam_drivers import beam_search_async
from radixserve.engine.beam_search import BeamSearchParams
from radixserve.server.tenants import DEFAULT_TENANT, cache_namespace

pytest.register_assert_rewrite("server_testkit")
from server_testkit import engine_idle, on_server_loop, wait_until  # noqa: E402

pytest_plugins = ["server_testkit"]
pytestmark = pytest.mark.slow

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a primary colour."}]


@pytest.fixture(scope="module")
def http(chat_server) -> httpx.Client:  # noqa: ANN001
    with httpx.Client(base_url=chat_server.url, timeout=120) as client:
        yield client


def post(http: httpx.Client, srv, **fields) -> httpx.Response:  # noqa: ANN001
    body = {"model": srv.state.model_name, "messages": MESSAGES, "max_tokens": 12, "use_beam_search": True} | fields
    return http.post("/v1/chat/completions", json=body)


def engine_beams(srv, width: int, max_tokens: int) -> list[str]:  # noqa: ANN001
    tok = srv.engine.tokenizer
    ids = list(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False))
    # in the cache namespace of the open server's callers, so the API's search after it hits its prompt
    namespace = cache_namespace(DEFAULT_TENANT, None, srv.state.config.cache_sharing)
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, cache_namespace=namespace)
    out = on_server_loop(srv, beam_search_async(srv.engine, ids, params))
    return [b.text for b in out.beams]


@pytest.mark.parametrize("n, width", [(2, 4), (3, None), (1, 1)])
def test_choices_are_the_best_beams_in_order(http, chat_server, n: int, width: int | None) -> None:  # noqa: ANN001
    expected = engine_beams(chat_server, width or n, 12)[:n]
    fields = {"n": n} | ({"beam_width": width} if width else {})
    r = post(http, chat_server, temperature=0, **fields)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["message"]["content"] for c in body["choices"]] == expected
    assert [c["index"] for c in body["choices"]] == list(range(n))
    assert all(c["finish_reason"] in ("stop", "length") for c in body["choices"])
    u = body["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] and 0 < u["completion_tokens"] <= 12 * n
    assert u["prompt_tokens_details"]["cached_tokens"] >= u["prompt_tokens"] - 1  # engine_beams ran it before
    wait_until(lambda: engine_idle(chat_server), what="the engine to go idle")
    assert chat_server.engine.leaked_blocks() == 0
    chat_server.engine.check_integrity()


@pytest.mark.parametrize("fields, param", [
    ({"beam_width": 0}, "beam_width"), ({"beam_width": 33}, "beam_width"), ({"n": 0}, "n"), ({"n": 33}, "n"),
    ({"n": 4, "beam_width": 2}, "n"), ({"temperature": 0.7}, "temperature"), ({"top_p": 0.5}, "top_p"),
    ({"top_k": 5}, "top_k"), ({"min_p": 0.1}, "min_p"), ({"stream": True}, "stream"), ({"logprobs": True}, "logprobs"),
    ({"stop": ["x"]}, "stop"), ({"use_beam_search": "yes"}, "use_beam_search"), ({"beam_width": 2.5}, "beam_width"),
    ({"length_penalty": "long"}, "length_penalty"), ({"use_beam_search": False, "beam_width": 2}, "beam_width"),
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"frequency_penalty": -1}, "frequency_penalty"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"), ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
])
def test_bad_values_are_a_clear_400(http, chat_server, fields: dict, param: str) -> None:  # noqa: ANN001
    r = post(http, chat_server, **fields)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"]
    assert engine_idle(chat_server)
