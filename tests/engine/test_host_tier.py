"""The host-memory tier end to end, against transformers as the oracle (greedy, fp32, token for
token) on tiny random-weight models of every supported architecture: prefixes written back to the
host tier under device pressure and loaded back on a hit (whole and ending mid-block), swap
preemption forced by a tiny device pool, aborts while blocks move between tiers, and bad settings.
Every test ends with the integrity check over both pools and 0 leaked blocks in either.
"""

from __future__ import annotations

import pytest
from test_engine import ARCHS, GREEDY, assert_clean, assert_matches, make_llm, random_prompts
from tiny_models import tiny_model_dir

from radixserve import LLM, SamplingParams
from radixserve.config import EngineConfig
from radixserve.core import BlockCopy, CopyKind
from radixserve.model.host_kv import HostKVCache, _runs
from radixserve.model.kv_cache import KVCache, KVLayout
from radixserve.scheduler.preemption import PRIOR_COPY_BYTES_PER_S, PRIOR_PREFILL_TOKENS_PER_S

OVERLAP = [pytest.param(True, id="overlap"), pytest.param(False, id="sync")]


def tiered(arch: str, **kw) -> LLM:
    # no growth reserve at admission (scheduler/admission.py): the tiny pools must preempt
    return make_llm(arch, **({"num_blocks": 12, "host_cache_mb": 64.0, "new_token_ratio": 0.0} | kw))


@pytest.mark.parametrize("overlap", OVERLAP)
@pytest.mark.parametrize("arch", ARCHS)
def test_written_back_prefixes_load_back_and_match_transformers(arch: str, overlap: bool) -> None:
    # 12 blocks of 16 hold 192 tokens: the second set of prompts evicts the first to the host tier
    llm = tiered(arch, overlap=overlap)
    first, second = random_prompts([70, 90], seed=21), random_prompts([110, 110], seed=22)
    assert_matches(arch, llm, first)
    for prompt in second:  # each takes 8 of the 12 blocks: together they push all of `first` out
        assert_matches(arch, llm, [prompt])
    st = llm.engine.stats()
    assert st.written_back_blocks > 0 and st.host_blocks_free < st.host_blocks_total
    again = assert_matches(arch, llm, first)
    # every prompt token but the last is a hit, and what the device no longer held came from the host
    assert [o.usage.cached_tokens for o in again] == [len(p) - 1 for p in first]
    assert [o.usage.host_cached_tokens for o in again] == [len(p) - 1 for p in first]
    st = llm.engine.stats()
    assert st.loaded_blocks > 0 and st.host_cached_tokens == sum(o.usage.host_cached_tokens for o in again)
    assert st.computed_tokens == sum(len(p) for p in first + second) + len(first)  # nothing recomputed


@pytest.mark.parametrize("arch", ARCHS)
def test_load_back_ending_mid_block(arch: str) -> None:
    llm = tiered(arch)
    base = random_prompts([75], seed=23)[0]
    assert_matches(arch, llm, [base])
    assert_matches(arch, llm, random_prompts([95, 85], seed=24))  # pushes `base` to the host tier
    assert llm.engine.stats().written_back_blocks > 0
    cuts = (21, 37, 50)  # inside blocks 1, 2 and 3
    branches = [base[:k] + random_prompts([7], seed=k)[0] for k in cuts]
    outs = assert_matches(arch, llm, branches)
    assert [o.usage.cached_tokens for o in outs] == list(cuts)
    assert outs[0].usage.host_cached_tokens > 0


@pytest.mark.parametrize("overlap", OVERLAP)
@pytest.mark.parametrize("arch", ARCHS)
def test_swap_preemption_in_a_tiny_pool(arch: str, overlap: bool) -> None:
    # 8 blocks of 16 hold 128 tokens; six 40-token prompts growing by 16 need 24 blocks at once
    llm = tiered(arch, num_blocks=8, max_num_batched_tokens=48, preemption_mode="swap", overlap=overlap)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    assert_matches(arch, llm, random_prompts([40] * 6, seed=3), params)
    st = llm.engine.stats()
    assert st.preemptions > 0 and st.swaps_out == st.preemptions and st.swaps_in == st.swaps_out
    assert st.loaded_blocks > 0


def test_recompute_mode_never_swaps_and_auto_swaps_when_cheaper() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = random_prompts([40] * 6, seed=3)
    recompute = tiered("llama", num_blocks=8, max_num_batched_tokens=48, preemption_mode="recompute")
    assert_matches("llama", recompute, prompts, params)
    assert recompute.engine.stats().preemptions > 0 and recompute.engine.stats().swaps_out == 0
    auto = tiered("llama", num_blocks=8, max_num_batched_tokens=48)
    costs = auto.engine.scheduler.costs
    assert costs.swap_is_cheaper(40, 3)  # copying 3 tiny blocks twice beats recomputing 40 tokens
    assert_matches("llama", auto, prompts, params)
    assert auto.engine.stats().swaps_out > 0
    # the estimate follows what this machine measured, not the priors
    assert costs.prefill_tokens_per_s != PRIOR_PREFILL_TOKENS_PER_S and costs.copy_bytes_per_s != PRIOR_COPY_BYTES_PER_S


def test_a_full_host_tier_falls_back_to_dropping_and_recompute() -> None:
    # a host tier of ~2 blocks cannot hold the evicted prefixes: they are dropped, outputs stay right
    llm = LLM(model=str(tiny_model_dir("llama")), block_size=16, num_blocks=8, max_num_batched_tokens=48)
    per_block = llm.engine.runner.kv_layout().bytes_per_block
    small = tiered("llama", num_blocks=8, max_num_batched_tokens=48, host_cache_mb=2.5 * per_block / 2**20,
                   preemption_mode="swap")
    assert small.engine.stats().host_blocks_total == 2
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    assert_matches("llama", small, random_prompts([40] * 6, seed=5), params)
    assert_matches("llama", small, random_prompts([40] * 6, seed=5), params)
    st = small.engine.stats()
    assert st.host_dropped_blocks > 0 and st.preemptions > st.swaps_out


def test_aborts_while_blocks_move_between_tiers_leak_nothing() -> None:
    """With overlap, abort requests in the step right after their load-back (or swap-out) was queued,
    and a request that waits swapped out: nothing leaks in either pool, the rest match transformers."""
    llm = tiered("llama", num_blocks=8, max_num_batched_tokens=48, preemption_mode="swap", overlap=True)
    engine = llm.engine
    base = random_prompts([60], seed=31)[0]
    assert_matches("llama", llm, [base])
    assert_matches("llama", llm, random_prompts([100], seed=32))  # base goes to the host tier
    loads = engine.stats().loaded_blocks
    rid = engine.add_request(base + [5, 6, 7], GREEDY)
    for _ in range(20):
        engine.step()
        if engine.stats().loaded_blocks > loads:
            break
    assert engine.stats().loaded_blocks > loads
    engine.abort(rid)  # its load-back is queued ahead of a step still in flight
    engine.check_integrity()
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in random_prompts([40] * 6, seed=33)]
    aborted = set()
    for _ in range(400):
        if not engine.has_unfinished():
            break
        engine.step()
        for seq in engine.scheduler.waiting:
            if seq.swapped_node is not None and seq.request.request_id not in aborted:
                engine.abort(seq.request.request_id)
                aborted.add(seq.request.request_id)
                engine.check_integrity()
                break
    assert aborted and not engine.has_unfinished()
    assert len(aborted) < len(ids)
    assert_clean(llm)
    engine.tree.clear()
    assert engine.pool.num_free == engine.pool.num_blocks
    assert engine.host_pool is not None and engine.host_pool.num_free == engine.host_pool.num_blocks


@pytest.mark.parametrize("kw, message", [
    ({"host_cache_mb": -1.0}, "host_cache_mb \\(--host-cache-mb\\) must be >= 0"),
    ({"preemption_mode": "swap"}, "needs the host tier"),
    ({"preemption_mode": "sometimes"}, "unknown preemption_mode"),
    ({"host_cache_mb": 8.0, "enable_prefix_cache": False}, "prefix cache"),
])
def test_bad_settings_are_refused(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kw)


def test_a_host_tier_larger_than_the_host_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="more host memory than this machine can pin"):
        make_llm("llama", host_cache_mb=float(2**40))


def test_copies_batch_only_when_independent() -> None:
    D, H, L = CopyKind.DEVICE, CopyKind.TO_HOST, CopyKind.TO_DEVICE
    copies = [BlockCopy(H, 1, 0), BlockCopy(H, 2, 1), BlockCopy(H, 3, 0),  # host block 0 reused: new run
              BlockCopy(L, 0, 5), BlockCopy(D, 5, 6), BlockCopy(D, 6, 7)]  # 6 is written, then read: new run
    assert [(k, s, d) for k, s, d in _runs(copies)] == [
        (H, [1, 2], [0, 1]), (H, [3], [0]), (L, [0], [5]), (D, [5], [6]), (D, [6], [7])]


def test_host_cache_round_trip_keeps_every_byte() -> None:
    import torch

    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.float32)
    kv = KVCache(layout, 6, torch.device("cpu"))
    kv.data.copy_(torch.randn_like(kv.data))
    before = kv.data.clone()
    host = HostKVCache(kv, 4)
    host.apply([BlockCopy(CopyKind.TO_HOST, 1, 3), BlockCopy(CopyKind.TO_HOST, 4, 0)])
    kv.data[:, :, [1, 4]] = 0
    host.apply([BlockCopy(CopyKind.TO_DEVICE, 3, 2), BlockCopy(CopyKind.TO_DEVICE, 0, 5)])
    assert torch.equal(kv.data[:, :, 2], before[:, :, 1]) and torch.equal(kv.data[:, :, 5], before[:, :, 4])
    done = host.completed()
    assert done.blocks == {CopyKind.TO_HOST: 2, CopyKind.TO_DEVICE: 2} and done.seconds[CopyKind.TO_HOST] > 0
