"""OpenAI's legacy POST /v1/completions through the official `openai` client against a real server:
the prompt forms and choice order, usage, n with seed, stop, echo, the legacy logprobs shape, streamed
vs not, prompt logprobs equal to transformers' on the tiny model (cold and cached; on chat
completions too), every refusal naming its field, and a client that leaves aborting the engine
requests.

Fast tests run the tiny random-weight chat model (tests/tiny_models.py): its text is noise (partial
UTF-8 characters decode to "\ufffd", ids past the tokenizer's vocabulary show as "token_id:N"), so the
checks that compare text with token texts constrain the reply to ASCII letters. The `slow` tests
run the embedded SmolLM2, for real text.
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from typing import Any

import httpx
import openai
import pytest
import torch

from radixserve.model.loader import load_tokenizer
from radixserve.server import BackgroundServer
from radixserve.server.pipeline.logprobs import TokenTexts

pytest.register_assert_rewrite("server_testkit")
from server_testkit import engine_idle, wait_until  # noqa: E402

pytest_plugins = ["server_testkit"]

TOL = 1e-4  # the engine (fp32 on CPU) against transformers' fp32 log-softmax
WORDS = {"structured_outputs": {"regex": "[a-z]+( [a-z]+)*"}}  # ASCII text whose tokens each decode alone
GREEDY: dict[str, Any] = {"temperature": 0}


def client_of(srv: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(tiny_chat_server: BackgroundServer) -> openai.OpenAI:
    return client_of(tiny_chat_server)


@pytest.fixture(scope="module")
def model(tiny_chat_server: BackgroundServer) -> str:
    return tiny_chat_server.state.model_name


@functools.cache
def tiny_tokenizer() -> Any:
    from tiny_models import tiny_chat_model_dir

    return load_tokenizer(tiny_chat_model_dir("llama"))


@functools.cache
def token_texts() -> TokenTexts:
    """Single tokens' texts as the server shows them (server/pipeline/logprobs.py, tested there)."""
    return TokenTexts(tiny_tokenizer())


def aborted(srv: BackgroundServer) -> int:
    return int(srv.engine.stats().requests_finished.get("abort", 0))


def no_leaks(srv: BackgroundServer) -> None:
    wait_until(lambda: engine_idle(srv), what="the engine idle with no blocks held")
    assert srv.engine.leaked_blocks() == 0


def fresh(text: str) -> str:
    """`text` behind a prefix no other request sent: a prompt the cache does not hold."""
    return f"{uuid.uuid4().hex[:8]} {text}"


def test_prompt_forms_choice_order_and_usage(client, model, tiny_chat_server) -> None:  # noqa: ANN001
    texts = ["The quick brown fox", "Hello, how are you"]
    ids = [tiny_tokenizer().encode(t) for t in texts]
    kw = dict(model=model, max_tokens=6, n=2, extra_body={"ignore_eos": True}, **GREEDY)
    single = [client.completions.create(prompt=t, **kw) for t in texts]
    assert [len(r.choices) for r in single] == [2, 2]
    for r, t in zip(single, ids):
        assert r.object == "text_completion" and r.id.startswith("cmpl-")
        assert r.usage.prompt_tokens == len(t) and r.usage.completion_tokens == 2 * 6  # each sample's, prompt once
        assert r.usage.total_tokens == len(t) + 12
        assert [c.index for c in r.choices] == [0, 1] and all(c.finish_reason == "length" for c in r.choices)
    expected = [c.text for r in single for c in r.choices]  # prompt p's sample s at p * n + s
    assert expected[0] != expected[2], "the two prompts continue differently (else the order is untested)"
    for prompt in (texts, ids):
        r = client.completions.create(prompt=prompt, **kw)
        assert [c.index for c in r.choices] == [0, 1, 2, 3] and [c.text for c in r.choices] == expected
        assert r.usage.prompt_tokens == sum(len(t) for t in ids) and r.usage.completion_tokens == 4 * 6
    r = client.completions.create(prompt=ids[1], **kw)  # one prompt of token ids
    assert [c.text for c in r.choices] == expected[2:]
    # the legacy default max_tokens is 16
    r = client.completions.create(model=model, prompt=texts[0], extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"
    # a repeated (long) prompt is served from the prefix cache, counted once per prompt
    long = fresh("a radix tree shares prefixes " * 12)
    first = client.completions.create(model=model, prompt=[long, long], max_tokens=2)
    again = client.completions.create(model=model, prompt=[long, long], max_tokens=2)
    assert first.usage.prompt_tokens == again.usage.prompt_tokens
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached <= again.usage.prompt_tokens
    no_leaks(tiny_chat_server)


def test_seeded_samples_are_reproducible(client, model) -> None:  # noqa: ANN001
    kw = dict(model=model, prompt=["Once upon", "A cat"], n=3, max_tokens=12, temperature=2.0,
              extra_body={"ignore_eos": True})
    a = client.completions.create(seed=7, **kw)
    b = client.completions.create(seed=7, **kw)
    c = client.completions.create(seed=8, **kw)
    assert len(a.choices) == 6 and [x.text for x in a.choices] == [x.text for x in b.choices]
    assert len({x.text for x in a.choices[:3]}) > 1, "samples of one prompt differ"
    assert [x.text for x in a.choices] != [x.text for x in c.choices]


def test_stop(client, model) -> None:  # noqa: ANN001
    kw = dict(model=model, prompt="The quick brown fox", max_tokens=24, extra_body=WORDS, **GREEDY)
    full = client.completions.create(**kw).choices[0].text
    assert len(full) > 8, full
    stop = full[4:7]
    r = client.completions.create(stop=[stop], **kw)
    assert r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"


def test_echo_with_and_without_logprobs(client, model) -> None:  # noqa: ANN001
    prompt = "Hello, how are you"
    prompt_ids = tiny_tokenizer().encode(prompt)
    kw = dict(model=model, prompt=prompt, max_tokens=5, **GREEDY)
    plain = client.completions.create(**kw).choices[0]
    echoed = client.completions.create(echo=True, **kw)
    assert echoed.choices[0].text == prompt + plain.text and echoed.choices[0].logprobs is None
    r = client.completions.create(echo=True, logprobs=2, **kw)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == prompt + plain.text
    assert len(lp.tokens) == len(prompt_ids) + r.usage.completion_tokens
    assert "".join(lp.tokens[:len(prompt_ids)]) == prompt  # ASCII: each prompt token decodes on its own
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset[:len(prompt_ids)] == [len("".join(lp.tokens[:i])) for i in range(len(prompt_ids))]
    # max_tokens 0 with echo: the prompt alone, its logprobs, nothing generated
    r = client.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    c = r.choices[0]
    assert c.text == prompt and c.finish_reason == "length" and r.usage.completion_tokens == 0
    assert len(c.logprobs.tokens) == len(prompt_ids) == r.usage.prompt_tokens == r.usage.total_tokens
    assert c.logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:len(prompt_ids)], abs=TOL)


def check_legacy(c: Any, k: int) -> None:
    """Shape and bounds of one choice's legacy logprobs, whatever the text."""
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        # the k most likely and the chosen token itself (OpenAI's "up to logprobs + 1")
        assert value <= 0 and 1 <= len(top) <= k + 1 and all(v <= 0 for v in top.values())
        assert token in top and value <= max(top.values()) + TOL


def test_legacy_logprobs_shape(client, model) -> None:  # noqa: ANN001
    r = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=8, logprobs=3, **GREEDY)
    c = r.choices[0]
    assert len(c.logprobs.tokens) == r.usage.completion_tokens
    check_legacy(c, 3)
    # greedy: the chosen token is the most likely one
    assert c.logprobs.token_logprobs == pytest.approx([max(t.values()) for t in c.logprobs.top_logprobs], abs=TOL)
    assert any(len(t) == 3 for t in c.logprobs.top_logprobs)
    # where each token decodes on its own, the offsets point into the text at each token
    r = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=12, logprobs=2,
                                  extra_body=WORDS, **GREEDY)
    c = r.choices[0]
    check_legacy(c, 2)
    shown = c.logprobs.tokens[:-1] if c.finish_reason == "stop" else c.logprobs.tokens  # EOS is not text
    assert "".join(shown) == c.text and len(shown) > 1
    for token, offset in zip(shown, c.logprobs.text_offset):
        assert c.text[offset:offset + len(token)] == token


def test_legacy_top_logprobs_always_hold_the_chosen_token(client, model) -> None:  # noqa: ANN001
    """Issue 43, finding 12: `logprobs: 0` answered `{}` for every token. As OpenAI and vLLM answer, the
    chosen token is always in `top_logprobs`, with its own logprob: up to logprobs + 1 entries."""
    for k in (0, 1):
        r = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=16, logprobs=k,
                                      temperature=1.5, seed=7, echo=True, extra_body=WORDS)
        lp = r.choices[0].logprobs
        assert lp.top_logprobs[0] is None  # the echoed prompt's first token: nothing precedes it
        tops = list(zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]))
        assert len(tops) > 16
        for token, value, top in tops:
            assert token in top and top[token] == pytest.approx(value, abs=TOL), (k, token, top)
            assert 1 <= len(top) <= k + 1
        if k == 0:
            assert all(len(top) == 1 for _, _, top in tops)
        else:  # sampled hot: some chosen tokens are not the most likely one, and are listed beside it
            assert any(len(top) == 2 for _, _, top in tops)


def streamed(srv: BackgroundServer, **fields: Any) -> tuple[dict[int, dict[str, Any]], list[dict[str, Any]]]:
    """Per choice: its text, logprob lists and finish reason, from the chunks; and every chunk."""
    choices: dict[int, dict[str, Any]] = {}
    chunks = []
    with client_of(srv).completions.create(stream=True, **fields) as stream:
        for chunk in stream:
            chunks.append(chunk.model_dump())
            for c in chunk.choices:
                acc = choices.setdefault(c.index, {"text": "", "tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                   "text_offset": [], "finish_reason": None})
                acc["text"] += c.text
                for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    acc[key] += getattr(c.logprobs, key) if c.logprobs is not None else []
                assert acc["finish_reason"] is None, "nothing after a choice's finish"
                acc["finish_reason"] = c.finish_reason
    return choices, chunks


def test_streamed_choices_concatenate_to_the_non_streamed(client, model, tiny_chat_server) -> None:  # noqa: ANN001
    fields = dict(model=model, prompt=["The quick brown fox", "Hello"], n=2, max_tokens=10, echo=True, logprobs=2,
                  **GREEDY)
    whole = client.completions.create(**fields)
    choices, chunks = streamed(tiny_chat_server, stream_options={"include_usage": True}, **fields)
    assert sorted(choices) == [0, 1, 2, 3]
    for c in whole.choices:
        got = choices[c.index]
        assert got["text"] == c.text and got["finish_reason"] == c.finish_reason
        assert got["tokens"] == c.logprobs.tokens and got["text_offset"] == c.logprobs.text_offset
        assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None  # the prompt's first token
        assert got["token_logprobs"][1:] == pytest.approx(c.logprobs.token_logprobs[1:], abs=TOL)
        for top, expected in zip(got["top_logprobs"][1:], c.logprobs.top_logprobs[1:]):
            assert top == pytest.approx(expected, abs=TOL)
    first = {c["index"]: c["text"] for chunk in reversed(chunks) for c in chunk["choices"]}  # each choice's first
    assert first[0].startswith("The quick brown fox") and first[2].startswith("Hello")
    assert all(ch["object"] == "text_completion" and ch["id"] == chunks[0]["id"] for ch in chunks)
    *body, last = chunks
    assert last["choices"] == [] and all(ch["usage"] is None for ch in body)
    assert (last["usage"]["prompt_tokens"], last["usage"]["completion_tokens"]) == \
        (whole.usage.prompt_tokens, whole.usage.completion_tokens)
    # without include_usage: no usage chunk
    _, chunks = streamed(tiny_chat_server, model=model, prompt="Hi", max_tokens=3)
    assert all(ch["choices"] for ch in chunks)


def error_of(client: openai.OpenAI, **fields: Any) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(**fields)
    return info.value


@pytest.mark.parametrize(("fields", "param"), [
    ({"suffix": " end"}, "suffix"),
    ({"best_of": 3}, "best_of"),
    ({"logprobs": 6}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": ["a", 1]}, "prompt"),
    ({"prompt": [[1, 2], "a"]}, "prompt"),
    ({"prompt": [5, 600]}, "prompt"),  # past the tiny vocabulary (512)
    ({"logit_bias": {"600": 1}}, "logit_bias"),  # an id past the vocabulary: the engine names the field
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"prompt": [[5, 6], [7, 100000]]}, "prompt"),
    ({"prompt": [5, -1]}, "prompt"),
    ({"max_tokens": 1024}, "max_tokens"),  # the prompt + max_tokens exceed the 1024-token context
    ({"prompt": [5] * 1024, "max_tokens": None}, "prompt"),  # the prompt alone fills it
    ({"max_tokens": 0}, "max_tokens"),  # 0 only with echo
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # only with stream
    ({"min_tokens": 5}, "min_tokens"),  # over max_tokens (4)
    ({"n": 0}, "n"),
    ({"temperature": 3}, "temperature"),
    ({"echo": "yes"}, "echo"),
    ({"model": "no-such-model"}, "model"),
])
def test_bad_input_is_a_4xx_naming_the_field(client, model, tiny_chat_server, fields, param) -> None:  # noqa: ANN001
    body = {k: v for k, v in {"model": model, "prompt": "Hello", "max_tokens": 4, **fields}.items() if v is not None}
    extra = {k: body.pop(k) for k in list(body) if k not in ("model", "prompt", "max_tokens", "stream")}
    err = error_of(client, extra_body=extra, **body)
    assert err.status_code == (404 if param == "model" else 400), err
    assert err.param == param, err.body
    assert isinstance(err.body, dict) and err.body["message"] and err.body["type"], err.body
    assert engine_idle(tiny_chat_server)


def test_too_many_logprob_entries_is_a_400(client, model) -> None:  # noqa: ANN001
    long = list(range(5, 905))  # 900 tokens x 16 choices x (20 + 1) entries: past the default 131072
    err = error_of(client, model=model, prompt=long, n=16, max_tokens=1, extra_body={"prompt_logprobs": 20})
    assert err.status_code == 400 and err.code == "too_many_logprobs" and err.param == "prompt_logprobs", err.body
    assert "302400" in err.body["message"] and "131072" in err.body["message"]
    # an echo with logprobs counts its prompt for every choice: 16 x 900 x (5 + 1) twice is over too
    err = error_of(client, model=model, prompt=long, n=16, max_tokens=1, echo=True, logprobs=5,
                   extra_body={"prompt_logprobs": 5})
    assert err.code == "too_many_logprobs" and "172800" in err.body["message"], err.body


def test_client_that_leaves_aborts_every_prompt(model, tiny_chat_server) -> None:  # noqa: ANN001
    srv = tiny_chat_server
    body = {"model": model, "prompt": ["Write a long story.", "And another."], "max_tokens": 900, "temperature": 0,
            "ignore_eos": True}
    before = aborted(srv)
    with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                break  # one chunk with text, then hang up
    wait_until(lambda: engine_idle(srv), timeout=10, what="both prompts aborted after the stream closed")
    assert aborted(srv) == before + 2 and srv.engine.leaked_blocks() == 0
    # not streamed: the client gives up waiting
    before = aborted(srv)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + "/v1/completions", json={**body, "n": 2}, timeout=0.5)
    t0 = time.monotonic()
    wait_until(lambda: engine_idle(srv), timeout=10, what="both prompts aborted after the client left")
    assert time.monotonic() - t0 < 10 and aborted(srv) == before + 2 and srv.engine.leaked_blocks() == 0


def reference(prompt: list[int], top: int) -> list[tuple[float, list[int], list[float]]]:
    """transformers' fp32 (logprob of token j, top ids, top logprobs) for j = 1..len-1."""
    from tiny_models import hf_model, tiny_chat_model_dir

    with torch.no_grad():
        logits = hf_model(tiny_chat_model_dir("llama"))(torch.tensor([prompt])).logits[0]
    lsm = torch.log_softmax(logits.float(), dim=-1)
    out = []
    for j in range(1, len(prompt)):
        values, ids = lsm[j - 1].topk(top)
        out.append((lsm[j - 1, prompt[j]].item(), ids.tolist(), values.tolist()))
    return out


def check_prompt_logprobs(items: list[Any], prompt: list[int], top: int) -> None:
    """vLLM's prompt_logprobs list against the reference: the token, its alternatives, their ranks."""
    assert len(items) == len(prompt) and items[0] is None
    for item, token, (logprob, ids, values) in zip(items[1:], prompt[1:], reference(prompt, top)):
        assert item[str(token)]["logprob"] == pytest.approx(logprob, abs=TOL)
        assert item[str(token)]["rank"] == (ids.index(token) + 1 if token in ids else top + 1)
        assert set(item) == {str(token), *map(str, ids)}
        for rank, (tid, value) in enumerate(zip(ids, values), 1):
            assert item[str(tid)]["rank"] == rank and item[str(tid)]["logprob"] == pytest.approx(value, abs=TOL)
        assert all(entry["decoded_token"] == token_texts()(int(tid))[0] for tid, entry in item.items())


def test_prompt_logprobs_equal_transformers_cold_and_cached(client, model) -> None:  # noqa: ANN001
    text = fresh("The quick brown fox jumps over the lazy dog. Hello, how are you today?")
    prompt = tiny_tokenizer().encode(text)
    ref = reference(prompt, 3)
    for attempt in ("cold", "cached"):
        r = client.completions.create(model=model, prompt=text, max_tokens=2, echo=True, logprobs=3,
                                      extra_body={"prompt_logprobs": 3}, **GREEDY)
        c = r.choices[0]
        lp = c.logprobs
        assert r.usage.prompt_tokens == len(prompt) and len(lp.tokens) == len(prompt) + 2
        assert lp.tokens[:len(prompt)] == [token_texts()(t)[0] for t in prompt], attempt
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:len(prompt)] == pytest.approx([x[0] for x in ref], abs=TOL), attempt
        for top, token, (logprob, ids, values) in zip(lp.top_logprobs[1:], prompt[1:], ref):
            shown = {}
            for tid, value in zip(ids, values):  # two ids of one text keep the likelier
                shown.setdefault(token_texts()(tid)[0], value)
            shown.setdefault(token_texts()(token)[0], logprob)  # the prompt token itself, always listed
            assert top == pytest.approx(shown, abs=TOL), attempt
        check_prompt_logprobs(c.model_extra["prompt_logprobs"], prompt, 3)
    # by token ids, several prompts and n: each choice carries its own prompt's, k as asked (0: the token alone)
    ids = [prompt[:9], prompt[4:15]]
    r = client.completions.create(model=model, prompt=ids, n=2, max_tokens=1, extra_body={"prompt_logprobs": 0})
    for c in r.choices:
        check_prompt_logprobs(c.model_extra["prompt_logprobs"], ids[c.index // 2], 0)
        assert c.logprobs is None


def test_chat_prompt_logprobs(client, model, tiny_chat_server) -> None:  # noqa: ANN001
    messages = [{"role": "user", "content": fresh("What is a radix tree?")}]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=3, extra_body={"prompt_logprobs": 2})
    items = r.model_extra["prompt_logprobs"]
    assert len(items) == r.usage.prompt_tokens and items[0] is None
    tok = tiny_tokenizer()
    check_prompt_logprobs(items, tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)), 2)
    plain = client.chat.completions.create(model=model, messages=messages, max_tokens=3)
    assert "prompt_logprobs" not in (plain.model_extra or {})
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=messages, max_tokens=3, stream=True,
                                       extra_body={"prompt_logprobs": 2})
    assert info.value.param == "prompt_logprobs"
    with pytest.raises(openai.BadRequestError) as info:  # a beam search's steps are requests of their own
        client.chat.completions.create(model=model, messages=messages, max_tokens=3, temperature=0,
                                       extra_body={"prompt_logprobs": 0, "use_beam_search": True})
    assert info.value.param == "prompt_logprobs"
    no_leaks(tiny_chat_server)


@pytest.mark.slow
def test_real_text_echo_logprobs_and_stream(chat_server) -> None:  # noqa: ANN001
    client, model = client_of(chat_server), chat_server.state.model_name
    fields = dict(model=model, prompt=["The capital of France is", "def fibonacci(n):"], max_tokens=24, echo=True,
                  logprobs=2, stop=["\n\n"], **GREEDY)
    whole = client.completions.create(**fields)
    choices, _ = streamed(chat_server, **fields)
    for c, prompt in zip(whole.choices, fields["prompt"]):
        assert c.text.startswith(prompt) and choices[c.index]["text"] == c.text
        assert choices[c.index]["tokens"] == c.logprobs.tokens
        check_legacy_real(c)
    assert "Paris" in whole.choices[0].text
    no_leaks(chat_server)


def check_legacy_real(c: Any) -> None:
    lp = c.logprobs
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert "".join(lp.tokens).startswith(c.text)  # byte-level BPE: each token's text is its part (a stop's may run on)
    for token, offset in zip(lp.tokens, lp.text_offset):
        if offset + len(token) <= len(c.text):
            assert c.text[offset:offset + len(token)] == token


@pytest.mark.slow
def test_real_text_stop_and_seeded_samples(chat_server) -> None:  # noqa: ANN001
    client, model = client_of(chat_server), chat_server.state.model_name
    kw = dict(model=model, prompt="Three facts about the Moon:\n1.", max_tokens=32, **GREEDY)
    full = client.completions.create(**kw).choices[0].text
    words = full.split()
    assert len(words) > 4, full
    stop = f" {words[3]}"
    r = client.completions.create(stop=[stop], **kw)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == full[:full.index(stop)]
    seeded = dict(model=model, prompt=["Once upon a time", "My favourite food is"], n=2, max_tokens=16,
                  temperature=1.0, seed=11)
    # each in a namespace of its own, so both compute every token the same way: a repeat that hits the
    # first one's cache computes its prompt's last token in another kernel (a decode, not a prefill),
    # which can move a logit's last bits and so a temperature-1 sample (docs/cpu.md)
    a, b = (client.completions.create(**seeded, extra_body={"cache_salt": salt}) for salt in ("first", "second"))
    assert [c.text for c in a.choices] == [c.text for c in b.choices] and len(a.choices) == 4
    assert a.choices[0].text != a.choices[1].text
    no_leaks(chat_server)
