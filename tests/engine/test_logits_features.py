"""The per-request logits features through the engine's one seam (engine/features.py), on the tiny
chat model, greedily: allowed_token_ids leaves only its ids; bad_words' token sequences never appear
(one-token words anywhere, longer ones where their earlier tokens were just generated); min_tokens
holds EOS and stop ids back until that many tokens, even where they would win every draw. The intake
refuses ids outside the vocabulary naming the field. Which requests may draft is derived from the
features, and a drafting request's verification obeys its masks: the same tokens as without drafts,
drafts proposed, the rule kept.
"""

from __future__ import annotations

from typing import Any

import pytest
from tiny_models import tiny_chat_model_dir, tiny_model_dir

from radixserve.config import EngineConfig
from radixserve.engine.engine import LLMEngine
from radixserve.engine.token_rules import bad_words_ids
from radixserve.errors import FieldError
from radixserve.sampling_params import SamplingParams
from radixserve.structured import StructuredOutput

PROMPT = [5, 17, 40, 9, 33, 21, 8, 60]


def engine(**overrides: Any) -> LLMEngine:
    config: dict[str, Any] = dict(model=str(tiny_chat_model_dir("llama")), num_blocks=128, max_num_seqs=8)
    return LLMEngine(EngineConfig(**{**config, **overrides}))


def greedy(**fields: Any) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 12, **fields})


def generate(e: LLMEngine, prompt: list[int], params: SamplingParams) -> tuple[list[int], str | None]:
    """The request's generated ids (streamed deltas joined) and its finish reason."""
    rid = e.add_request(prompt, params)
    tokens: list[int] = []
    reason = None
    while e.has_unfinished():
        for out in e.step():
            if out.request_id == rid:
                assert out.error is None, out.error
                tokens += out.outputs[0].token_ids
                reason = out.outputs[0].finish_reason
    assert e.leaked_blocks() == 0
    return tokens, reason


def contains(tokens: list[int], word: tuple[int, ...]) -> bool:
    return any(tuple(tokens[i:i + len(word)]) == word for i in range(len(tokens) - len(word) + 1))


@pytest.mark.parametrize("overlap", [False, True])
def test_allowed_token_ids_leave_only_those_ids(overlap: bool) -> None:
    e = engine(overlap=overlap)
    free, _ = generate(e, PROMPT, greedy(ignore_eos=True))
    one = next(t for t in range(10, 200) if t not in free)
    assert generate(e, PROMPT, greedy(allowed_token_ids=[one])) == ([one] * 12, "length")
    some = [t for t in range(10, 200) if t not in free][:3]
    got, _ = generate(e, PROMPT, greedy(allowed_token_ids=some))
    assert len(got) == 12 and set(got) <= set(some)


@pytest.mark.parametrize("overlap", [False, True])
def test_bad_words_are_never_generated(overlap: bool) -> None:
    e = engine(overlap=overlap)
    free, _ = generate(e, PROMPT, greedy(ignore_eos=True))
    tokenizer = e.tokenizer
    # a one-token word the free run generates: masked at every draw
    single = next(word for t in free if (word := tokenizer.decode([t])).strip() and (t,) in bad_words_ids(tokenizer, [word]))
    # a two-token word the free run generates: its second token is masked right after its first
    pair = next(word for i in range(len(free) - 1) if (word := tokenizer.decode(free[i:i + 2])).strip()
                and tuple(free[i:i + 2]) in bad_words_ids(tokenizer, [word]))
    for bad in (single, pair):
        banned = bad_words_ids(tokenizer, [bad])
        assert any(contains(free, word) for word in banned)
        got, _ = generate(e, PROMPT, greedy(ignore_eos=True, bad_words=[bad]))
        assert len(got) == 12 and not any(contains(got, word) for word in banned), (bad, banned, got)


@pytest.mark.parametrize("overlap", [False, True])
def test_min_tokens_holds_eos_and_stop_ids_back(overlap: bool) -> None:
    e = engine(overlap=overlap)
    eos = min(e.eos_token_ids)
    assert generate(e, PROMPT, greedy(logit_bias={eos: 100.0})) == ([eos], "stop")  # EOS wins every draw
    got, reason = generate(e, PROMPT, greedy(logit_bias={eos: 100.0}, min_tokens=5))
    assert reason == "stop" and len(got) == 6 and eos not in got[:5] and got[5] == eos
    stop = 77
    got, reason = generate(e, PROMPT, greedy(logit_bias={stop: 100.0}, stop_token_ids=[stop], min_tokens=3))
    assert reason == "stop" and got[3:] == [stop] and stop not in got[:3]
    # ignore_eos: EOS neither ends the reply nor is held back; the stop id still is
    got, reason = generate(e, PROMPT, greedy(logit_bias={eos: 100.0}, ignore_eos=True, min_tokens=3, max_tokens=4))
    assert (got, reason) == ([eos] * 4, "length")


@pytest.mark.parametrize("overlap", [False, True])
def test_min_tokens_holds_stop_strings_back(overlap: bool) -> None:
    """A stop string counts only once the reply has min_tokens tokens, and only where it ends after the
    text those tokens made before (vLLM's rule): " fox" wins every draw, stop "fox" ends the reply at
    the first token without min_tokens, at the third with min_tokens 3."""
    e = engine(overlap=overlap)
    fox = e.tokenizer.encode(" fox", add_special_tokens=False)
    assert len(fox) == 1
    texts = {}
    for min_tokens in (0, 3):
        rid = e.add_request(PROMPT, greedy(logit_bias={fox[0]: 100.0}, stop=["fox"], min_tokens=min_tokens))
        text, tokens, reason = "", 0, None
        while e.has_unfinished():
            for out in e.step():
                if out.request_id == rid:
                    text, tokens, reason = text + out.outputs[0].text, tokens + len(out.outputs[0].token_ids), \
                        out.outputs[0].finish_reason
        texts[min_tokens] = (text, tokens, reason)
    assert texts[0] == (" ", 1, "stop")
    assert texts[3] == (" fox fox ", 3, "stop")


def test_the_intake_refuses_ids_outside_the_vocabulary_naming_the_field() -> None:
    e = engine()
    vocab = e.spec.vocab_size
    for name, value in (("allowed_token_ids", [3, vocab]), ("stop_token_ids", [vocab + 7]), ("logit_bias", {vocab: 1.0})):
        with pytest.raises(FieldError, match=name) as refused:
            e.add_request(PROMPT, greedy(**{name: value}))
        assert refused.value.param == name
    bare = LLMEngine(EngineConfig(model=str(tiny_model_dir("llama")), num_blocks=64))
    assert bare.tokenizer is None
    with pytest.raises(FieldError, match="bad_words"):
        bare.add_request(PROMPT, greedy(bad_words=["x"]))
    assert not e.requests and not bare.requests


def test_which_requests_may_draft_is_derived_from_the_features() -> None:
    e = engine(num_speculative_tokens=4)
    vetoed = {f.applies for f in e.features.all if not f.allows_drafts}
    assert set(e.scheduler.drafts.vetoes) == vetoed
    cases = {
        "structured": (greedy(structured=StructuredOutput(regex="[ab]+")), False),
        "penalties": (greedy(presence_penalty=0.5), False),
        "prompt_logprobs": (greedy(prompt_logprobs=1), False),
        "min_tokens": (greedy(min_tokens=2), True),
        "bad_words": (greedy(bad_words=["ab"]), True),
        "allowed_token_ids": (greedy(allowed_token_ids=[10, 11]), True),
        "plain": (greedy(), True),
    }
    for name, (params, drafts) in cases.items():
        seq = e.requests[e.add_request(PROMPT, params)].sequences[0]
        assert e.scheduler.drafts.eligible(seq) is drafts, name


@pytest.mark.parametrize("overlap", [False, True])
def test_verification_obeys_the_masks(overlap: bool) -> None:
    """A repeating prompt makes prompt lookup draft; each rule's masks cover the verifying rows, so
    the tokens equal those without drafts, and the rule holds."""
    on, off = engine(num_speculative_tokens=4, overlap=overlap), engine(num_speculative_tokens=0, overlap=overlap)
    cycle = [40, 41, 42, 43]
    prompt = cycle * 6
    for params in (greedy(allowed_token_ids=cycle[:2], max_tokens=16),
                   greedy(allowed_token_ids=cycle, bad_words=[on.tokenizer.decode(cycle[1:3])], max_tokens=16),
                   greedy(allowed_token_ids=cycle, min_tokens=16, max_tokens=16)):
        drafted, plain = generate(on, prompt, params), generate(off, prompt, params)
        assert drafted == plain
        assert set(drafted[0]) <= set(params.allowed_token_ids or ())
        for word in bad_words_ids(on.tokenizer, params.bad_words):
            assert not contains(drafted[0], word)
    assert sum(on.stats().spec_proposed.values()) > 0 and sum(off.stats().spec_proposed.values()) == 0
