"""Prompt logprobs (SamplingParams.prompt_logprobs) through the engine: every prompt token's logprob
and its top alternatives equal transformers' log-softmax of the same prompt (fp32, the oracle), on a
cold prompt, on a prompt the cache already holds, across prefill chunks, with overlap on and off,
beside other requests, and after a preemption; the cache is still filled for later requests."""

from __future__ import annotations

import pytest
import torch
from tiny_models import hf_model, tiny_model_dir

from radixserve import EngineConfig, LLMEngine, SamplingParams
from radixserve.core import RequestOutput, TokenLogprob

ARCH = "llama"
TOP = 3


def engine(**overrides: object) -> LLMEngine:
    config = dict(model=str(tiny_model_dir(ARCH)), num_blocks=64, block_size=4, max_num_seqs=8,
                  dtype="float32", max_num_batched_tokens=32)
    return LLMEngine(EngineConfig(**{**config, **overrides}))  # type: ignore[arg-type]


def reference(prompt: list[int], top: int) -> list[tuple[float, list[int], list[float]]]:
    """transformers' (logprob of token j, top ids, top logprobs) for j = 1..len-1, float64 softmax."""
    with torch.no_grad():
        logits = hf_model(tiny_model_dir(ARCH))(torch.tensor([prompt])).logits[0].double()
    lsm = torch.log_softmax(logits, dim=-1)
    out = []
    for j in range(1, len(prompt)):
        values, ids = lsm[j - 1].topk(top)
        out.append((lsm[j - 1, prompt[j]].item(), ids.tolist(), values.tolist()))
    return out


def run(eng: LLMEngine, prompts: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[RequestOutput]]:
    for rid, (prompt, params) in prompts.items():
        eng.add_request(prompt, params, request_id=rid)
    outs: dict[str, list[RequestOutput]] = {rid: [] for rid in prompts}
    for _ in range(500):
        if not eng.has_unfinished():
            break
        for out in eng.step():
            outs[out.request_id].append(out)
    assert not eng.has_unfinished()
    eng.check_integrity()
    assert eng.leaked_blocks() == 0
    return outs


def the_entries(outs: list[RequestOutput]) -> list[TokenLogprob | None]:
    carried = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
    assert len(carried) == 1, "the entries come exactly once"
    assert outs[0].prompt_logprobs is not None, "with the request's first output"
    return carried[0]


def check(entries: list[TokenLogprob | None], prompt: list[int], top: int) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for entry, token, (logprob, ids, values) in zip(entries[1:], prompt[1:], reference(prompt, top)):
        assert entry is not None and entry.token_id == token
        assert entry.logprob == pytest.approx(logprob, abs=1e-4)
        assert [t for t, _ in entry.top] == ids
        assert [v for _, v in entry.top] == pytest.approx(values, abs=1e-4)


PROMPT = [1, *range(7, 60, 2)]  # 28 tokens: several chunks of 32-token steps shared with others, 7 blocks


@pytest.mark.parametrize("overlap", [False, True])
def test_prompt_logprobs_equal_transformers_cold_and_cached(overlap: bool) -> None:
    eng = engine(overlap=overlap)
    plain = SamplingParams(max_tokens=3, temperature=0.0)
    asking = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=TOP)
    cold = run(eng, {"cold": (PROMPT, asking), "beside": ([1, 5, 6, 7, 8, 9, 10], plain)})
    check(the_entries(cold["cold"]), PROMPT, TOP)
    assert all(o.prompt_logprobs is None for o in cold["beside"]), "only the asking request gets them"
    assert run(eng, {"hit": (PROMPT, plain)})["hit"][-1].usage.cached_tokens >= len(PROMPT) - 4, \
        "the asking request's prompt was cached for those that come after it"
    cached = run(eng, {"again": (PROMPT, asking)})["again"]
    check(the_entries(cached), PROMPT, TOP)
    assert cached[-1].usage.cached_tokens == 0, "an asking request computes its whole prompt"
    # the generated tokens do not depend on whether prompt logprobs were asked
    tokens = [t for o in cold["cold"] for c in o.outputs for t in c.token_ids]
    assert tokens == [t for o in cached for c in o.outputs for t in c.token_ids]


def test_zero_alternatives_n_samples_and_a_one_token_prompt() -> None:
    eng = engine()
    outs = run(eng, {"k0": (PROMPT, SamplingParams(max_tokens=2, temperature=1.0, n=3, seed=5, prompt_logprobs=0)),
                     "one": ([1], SamplingParams(max_tokens=2, prompt_logprobs=2))})
    entries = the_entries(outs["k0"])
    check(entries, PROMPT, 0)
    assert all(e is None or e.top == () for e in entries)
    assert the_entries(outs["one"]) == [None]


def test_preempted_request_keeps_one_entry_per_prompt_token() -> None:
    """A pool too small for everyone: recompute preemption reruns prompts; no position is asked twice
    and none is skipped."""
    eng = engine(num_blocks=12, preemption_mode="recompute")
    asking = SamplingParams(max_tokens=12, temperature=0.0, prompt_logprobs=1, ignore_eos=True)
    prompts = {f"r{i}": ([1, *range(10 + i, 30 + i)], asking) for i in range(3)}
    outs = run(eng, prompts)
    assert eng.stats().preemptions > 0, "the pool was meant to force a preemption"
    for rid, (prompt, _) in prompts.items():
        check(the_entries(outs[rid]), prompt, 1)


def test_the_offline_api_keeps_them() -> None:
    from radixserve import LLM

    llm = LLM(model=str(tiny_model_dir(ARCH)), num_blocks=64, block_size=4, dtype="float32")
    out = llm.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2))[0]
    assert out.prompt_logprobs is not None
    check(out.prompt_logprobs, PROMPT, 2)
