"""Every family beyond Llama's shape through the engine, against transformers' greedy `generate`
(fp32, token for token): cold and warm cache, hits ending mid-block, chunked prefill crossing the
sliding window, preemption, forks, speculation, and seeded sampling inside a mixed batch. Prompts
are longer than every sliding window (tiny_models.TINY_WINDOW), so windows are exercised everywhere.
"""

from __future__ import annotations

import pytest
from test_engine import NEIGHBOURS, assert_clean, random_prompts, reference
from tiny_models import FAMILY_CONFIGS, tiny_model_dir

from radixserve import LLM, SamplingParams

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def make(arch: str, **kw: object) -> LLM:
    # blocks of 4 and a 12-token step budget: prefill chunks end mid-block and cross the 8-token window;
    # sliding-window layers in paged blocks, cached at token granularity (their window-state layout,
    # which resumes at checkpoints like a hybrid's, is tested in test_hybrid_families.py)
    kw = {"block_size": 4, "num_blocks": 160, "max_num_batched_tokens": 12, "sliding_window_kv": "all"} | kw
    return LLM(model=str(tiny_model_dir(arch)), **kw)


def check(arch: str, llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list:
    outs = llm.generate(prompts, params)
    for p, o in zip(prompts, outs):
        for c in o.outputs:
            assert c.token_ids == reference(arch, tuple(p), params.max_tokens), f"{arch}: a {len(p)}-token prompt"
    assert_clean(llm)
    return outs


@pytest.mark.parametrize("arch", sorted(FAMILY_CONFIGS))
def test_family_matches_transformers_through_every_cache_path(arch: str) -> None:
    llm = make(arch, num_speculative_tokens=4)
    prompts = random_prompts([11, 23, 37], seed=11)
    cold = check(arch, llm, prompts)
    assert [o.usage.cached_tokens for o in cold] == [0, 0, 0]
    warm = check(arch, llm, prompts)  # drafted from the cached replies: speculation is exercised too
    assert [o.usage.cached_tokens for o in warm] == [len(p) - 1 for p in prompts]
    assert llm.engine.stats().spec_accepted.get("tree", 0) > 0
    branches = [prompts[2][:k] + random_prompts([7], seed=k)[0] for k in (6, 13)]  # hits ending mid-block
    for k, out in zip((6, 13), check(arch, llm, branches)):
        assert out.usage.cached_tokens >= k
    fork = llm.generate([prompts[1]], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, n=2,
                                                     ignore_eos=True))[0]
    assert [c.token_ids for c in fork.outputs] == [reference(arch, tuple(prompts[1]), NEW_TOKENS)] * 2
    assert_clean(llm)


@pytest.mark.parametrize("arch", sorted(FAMILY_CONFIGS))
def test_family_survives_preemption_and_samples_reproducibly(arch: str) -> None:
    # 24 blocks of 4 hold 96 tokens; four 23-token prompts growing by 16 need 40 blocks at once
    llm = make(arch, num_blocks=24, new_token_ratio=0.0)
    prompts = random_prompts([23] * 4, seed=12)
    check(arch, llm, prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert llm.engine.stats().preemptions > 0
    check_seeded_in_a_mixed_batch(llm, prompts)


def check_seeded_in_a_mixed_batch(llm: LLM, prompts: list[list[int]]) -> None:
    """A seeded n = 2 request samples the same tokens alone and beside NEIGHBOURS (prompts[1:])."""
    seeded = SamplingParams(temperature=1.0, top_k=40, max_tokens=12, n=2, seed=5, ignore_eos=True)
    alone = [c.token_ids for c in llm.generate([prompts[0]], seeded)[0].outputs]
    for other, params in zip(prompts[1:], NEIGHBOURS):
        llm.engine.add_request(other, params)  # queued first: they run in the same steps
    mixed = [c.token_ids for c in llm.generate([prompts[0]], seeded)[0].outputs]
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert alone == mixed and alone[0] != alone[1]
    assert_clean(llm)
