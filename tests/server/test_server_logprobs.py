"""OpenAI `logprobs` / `top_logprobs` on /v1/chat/completions: the bodies (streamed and not) through
the official `openai` client against a real server, the validation, and the body builder's edge
cases (-inf, split characters, no tokenizer, more alternatives than asked) without a server."""

from __future__ import annotations

import functools
import json
import math
import threading
from typing import Any

import httpx
import openai
import pytest

from radixserve.core import TokenLogprob
from radixserve.model.embedded import embedded_model_dir
from radixserve.model.loader import load_tokenizer
from radixserve.server.pipeline.logprobs import LOGPROB_FLOOR, TokenTexts, json_logprob, logprobs_body

pytest.register_assert_rewrite("server_testkit")
pytest_plugins = ["server_testkit"]

MESSAGES = [{"role": "system", "content": "You are a geography tutor."},
            {"role": "user", "content": "Name three rivers of Europe."}]
TOL = 1e-4  # logprobs of the same greedy request computed twice (cache hit vs prefill) may differ in last bits


@functools.lru_cache(maxsize=1)
def tokenizer() -> Any:
    return load_tokenizer(embedded_model_dir())


@pytest.fixture(scope="module")
def client(chat_server) -> openai.OpenAI:  # noqa: ANN001
    return openai.OpenAI(base_url=chat_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def check_entries(entries: list[Any], top: int, greedy: bool) -> None:
    """What holds for every token's entry whatever the text: shape, bounds, ordering, argmax."""
    for e in entries:
        assert e.logprob <= 0.0 and e.bytes is not None
        if "\ufffd" not in e.token:
            assert bytes(e.bytes).decode("utf-8") == e.token
        assert len(e.top_logprobs) == top
        values = [t.logprob for t in e.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0.0 for v in values)
        assert sum(math.exp(v) for v in values) <= 1.0 + 1e-5  # alternatives are distinct tokens of one distribution
        for t in e.top_logprobs:  # the chosen token among the alternatives: the same logprob
            if (t.token, t.bytes) == (e.token, e.bytes):
                assert t.logprob == pytest.approx(e.logprob, abs=TOL)
        if top:
            assert e.logprob <= values[0] + TOL  # nothing beats the most likely token
            if greedy:  # the chosen token is the argmax: its logprob is the top one
                assert e.logprob == pytest.approx(values[0], abs=TOL)
                assert e.token in [t.token for t in e.top_logprobs if t.logprob >= values[0] - TOL]


def rebuilt_text(entries: list[Any], finish_reason: str) -> str:
    """The content from the tokens' bytes (a finishing EOS token is not content)."""
    if finish_reason == "stop":
        entries = entries[:-1]
    return b"".join(bytes(e.bytes) for e in entries).decode("utf-8", "replace")  # may end mid-character


@pytest.mark.slow
@pytest.mark.parametrize("top", [0, 3])
def test_greedy_logprobs_cover_every_token_and_agree_streamed_or_not(client, chat_server, top: int) -> None:  # noqa: ANN001
    model = chat_server.state.model_name
    kw: dict[str, Any] = dict(model=model, messages=MESSAGES, max_tokens=16, temperature=0, logprobs=True,
                              top_logprobs=top)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    entries = choice.logprobs.content
    assert len(entries) == r.usage.completion_tokens > 0
    check_entries(entries, top, greedy=True)
    assert rebuilt_text(entries, choice.finish_reason) == choice.message.content

    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    streamed: list[Any] = []
    for c in chunks:
        if not c.choices:
            continue
        ch = c.choices[0]
        if ch.delta.role or ch.finish_reason:  # the role chunk and the finish chunk carry no tokens
            assert ch.logprobs is None
        if ch.logprobs is not None:
            assert ch.logprobs.content  # a chunk with logprobs has at least one token
            streamed += ch.logprobs.content
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert len(streamed) == chunks[-1].usage.completion_tokens == len(entries)
    for s, e in zip(streamed, entries):
        assert (s.token, s.bytes) == (e.token, e.bytes)
        assert s.logprob == pytest.approx(e.logprob, abs=TOL)
        assert [t.token for t in s.top_logprobs] == [t.token for t in e.top_logprobs]
        assert [t.logprob for t in s.top_logprobs] == pytest.approx([t.logprob for t in e.top_logprobs], abs=TOL)


@pytest.mark.slow
def test_each_of_n_samples_gets_its_own_logprobs(client, chat_server) -> None:  # noqa: ANN001
    model = chat_server.state.model_name
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0.7, top_p=0.9, seed=3, n=3,
                                       logprobs=True, top_logprobs=2)
    assert [c.index for c in r.choices] == [0, 1, 2]
    total = 0
    for c in r.choices:
        entries = c.logprobs.content
        check_entries(entries, 2, greedy=False)
        assert rebuilt_text(entries, c.finish_reason) == c.message.content
        total += len(entries)
    assert total == r.usage.completion_tokens
    # sampled with temperature and top_p, yet the logprobs are the raw distribution's: a greedy request's
    # first token has the same alternatives with the same values
    g = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1, temperature=0, logprobs=True,
                                       top_logprobs=2)
    first = g.choices[0].logprobs.content[0]
    for c in r.choices:
        alts = c.logprobs.content[0].top_logprobs
        assert [t.token for t in alts] == [t.token for t in first.top_logprobs]
        assert [t.logprob for t in alts] == pytest.approx([t.logprob for t in first.top_logprobs], abs=TOL)


@pytest.mark.slow
def test_no_logprobs_unless_asked(client, chat_server) -> None:  # noqa: ANN001
    model = chat_server.state.model_name
    for extra in ({}, {"logprobs": False}, {"logprobs": None, "top_logprobs": None}):
        r = httpx.post(chat_server.url + "/v1/chat/completions", timeout=60,
                       json={"model": model, "messages": MESSAGES, "max_tokens": 3, **extra})
        assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None, extra
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3, stream=True))
    assert all(c.choices[0].logprobs is None for c in chunks)


@pytest.mark.slow
def test_a_request_gets_the_alternatives_it_asked_for_when_batched_with_others(client, chat_server) -> None:  # noqa: ANN001
    """The engine computes one k for a whole step (the largest asked); each response keeps its own."""
    model = chat_server.state.model_name
    results: dict[int, Any] = {}

    def ask(top: int) -> None:
        results[top] = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=24, temperature=0,
                                                      logprobs=True, top_logprobs=top)

    threads = [threading.Thread(target=ask, args=(top,)) for top in (0, 5, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(results) == [0, 1, 5]
    for top, r in results.items():
        assert all(len(e.top_logprobs) == top for e in r.choices[0].logprobs.content), top


@pytest.mark.slow
@pytest.mark.parametrize(("extra", "param"), [
    ({"logprobs": "yes"}, "logprobs"),
    ({"logprobs": 1}, "logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 2.0}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": False, "top_logprobs": 0}, "top_logprobs"),
])
def test_invalid_logprobs_requests_are_refused(chat_server, extra: dict[str, Any], param: str) -> None:  # noqa: ANN001
    body = {"model": chat_server.state.model_name, "messages": MESSAGES, "max_tokens": 2, **extra}
    for stream in (False, True):
        r = httpx.post(chat_server.url + "/v1/chat/completions", json={**body, "stream": stream}, timeout=60)
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == "invalid_field" and err["param"] == param
        assert param in err["message"]


@pytest.mark.slow
def test_openai_client_sees_the_refusal(client, chat_server) -> None:  # noqa: ANN001
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=chat_server.state.model_name, messages=MESSAGES, top_logprobs=3)
    body = e.value.body
    assert isinstance(body, dict) and body["param"] == "top_logprobs" and "logprobs" in body["message"]


# -- the body builder, without a server ---------------------------------------------------------

def test_non_finite_and_tiny_logprobs_become_the_floor_and_stay_valid_json() -> None:
    assert json_logprob(-math.inf) == json_logprob(math.nan) == json_logprob(-1e30) == LOGPROB_FLOOR == -9999.0
    assert json_logprob(-0.25) == -0.25 and json_logprob(0.0) == 0.0
    lps = [TokenLogprob(5, -math.inf, ((7, -0.1), (5, -math.inf), (9, -math.inf)))]
    body = logprobs_body(lps, TokenTexts(None))
    text = json.dumps(body, allow_nan=False)  # raises on inf/nan
    entry = json.loads(text)["content"][0]
    assert entry["logprob"] == -9999.0 and [t["logprob"] for t in entry["top_logprobs"]] == [-0.1, -9999.0, -9999.0]


def test_an_empty_list_gives_empty_content() -> None:
    assert logprobs_body(None, TokenTexts(None)) == {"content": []}


def test_without_a_tokenizer_tokens_are_shown_by_id() -> None:
    assert TokenTexts(None)(42) == ("token_id:42", list(b"token_id:42"))


@pytest.mark.parametrize("text", ["Hello, world .", " café ☃ 日本語 🙂", "  spaced\n\ncode: `x = 1`"])
def test_token_bytes_rebuild_the_text_even_across_split_characters(text: str) -> None:
    tok = tokenizer()
    texts = TokenTexts(tok)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert b"".join(bytes(texts(i)[1]) for i in ids).decode("utf-8") == text
    for i in ids:
        token, raw = texts(i)
        assert token == tok.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if "\ufffd" not in token:
            assert bytes(raw).decode("utf-8") == token


def test_special_and_unknown_ids() -> None:
    tok = tokenizer()
    texts = TokenTexts(tok)
    eos = tok.eos_token_id
    assert texts(eos) == (tok.eos_token, list(tok.eos_token.encode()))
    beyond = len(tok) + 10  # e.g. a padded vocabulary row the model can still score
    assert texts(beyond)[0] == f"token_id:{beyond}"
