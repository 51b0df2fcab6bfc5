"""Sliding window, attention sinks and logit softcap in the Triton kernels, against the torch references.

Runs under TRITON_INTERPRET=1 on CPU tensors (tests/conftest.py), with test_kernels.py's paged batches:
shuffled blocks, NaN in table padding and past each sequence's end, outputs starting as NaN. On top of
that, every cache slot below the lowest key a sequence's queries may see through the window is NaN
in the kernel's copy (the reference reads a clean one): a kernel that loads a key outside the window
instead of skipping it shows NaN. Scores are made large (q scaled up) so that a softcap changes them.
"""

from __future__ import annotations

import itertools
import math
import re

import pytest
import torch
from test_kernels import BF16, F16, F32, PagedBatch, as_fp8, assert_matches, dequantized, make_paged

from radixserve import kernels
from radixserve.kernels import common
from radixserve.kernels.common import LaunchConfig
from radixserve.kernels.decode import auto_num_splits, decode_configs, plan_decode
from radixserve.kernels.reference import paged_decode_attention_reference, paged_extend_attention_reference
from radixserve.model.attention import AttentionMetadata
from radixserve.model.triton_backend import TritonAttentionBackend

Q_GAIN = 3.0  # scores ~ N(0, 9): well past small softcaps, and sinks sometimes win, sometimes not


def poisoned_below(batch: PagedBatch, firsts: list[int]) -> PagedBatch:
    """A copy whose slots at positions < firsts[b] of sequence b are NaN (sequences share no block);
    FP8 caches are poisoned before they are quantized (a NaN row quantizes to NaN)."""
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    block_size = k_cache.shape[1]
    for b, first in enumerate(firsts):
        pos = torch.arange(first)
        blocks = batch.block_table[b].long()[pos // block_size]
        for cache in (k_cache, v_cache):
            cache[blocks, pos % block_size] = float("nan")
    return PagedBatch(k_cache, v_cache, batch.block_table, batch.seq_lens)


def random_sinks(gen: torch.Generator, hq: int, dtype: torch.dtype, with_sinks: bool) -> torch.Tensor | None:
    return (2 * torch.randn(hq, generator=gen)).to(dtype) if with_sinks else None


DECODE_CASES = [
    # dtype, Hq, Hkv, D, block_size, seq_lens, num_splits, window, sinks, softcap
    (F32, 4, 2, 64, 16, [1, 16, 33, 90], None, 5, False, None),  # window inside one block
    (F32, 4, 2, 64, 16, [17, 40, 90], 3, 17, False, None),  # window crossing block boundaries, 3 splits
    (F16, 8, 2, 64, 16, [300], None, 24, False, None),  # far past the window: the splits share its span
    (F16, 8, 2, 64, 32, [300, 5], 4, 40, False, None),  # more splits than the window has tiles
    (F32, 4, 1, 64, 16, [1, 20, 70], 1, None, True, None),  # sinks in the single split's online softmax
    (BF16, 8, 2, 64, 16, [1, 20, 70], 3, None, True, None),  # sinks in the merge
    (F32, 4, 2, 64, 16, [33, 5], 2, None, False, 2.0),  # softcap alone
    (F32, 4, 4, 64, 16, [50, 9], 1, 10, True, None),  # window and sinks
    (BF16, 8, 1, 128, 16, [150, 3], 2, 32, True, 5.0),  # all three, GQA 8
    (F16, 6, 2, 96, 32, [64, 129], None, 31, True, 10.0),  # all three, GQA 3, padded head_dim
]


def _decode_case(dtype, hq, hkv, d, bs, lens, window, with_sinks, fp8=False):
    gen = torch.Generator().manual_seed(hash((hq, hkv, d, bs, tuple(lens), window)) % 2**31)
    clean = make_paged(gen, F32 if fp8 else dtype, hkv, d, bs, lens)
    q = (Q_GAIN * torch.randn(len(lens), hq, d, generator=gen)).to(dtype)
    sinks = random_sinks(gen, hq, dtype, with_sinks)
    # the decoding query sits at position len - 1 and sees keys from len - window on
    seen = poisoned_below(clean, [max(0, n - window) for n in lens]) if window else clean
    return (q, as_fp8(clean), as_fp8(seen), sinks) if fp8 else (q, clean, seen, sinks)


@pytest.mark.parametrize("dtype,hq,hkv,d,bs,lens,splits,window,with_sinks,softcap", DECODE_CASES)
def test_decode_variants_match_reference(dtype, hq, hkv, d, bs, lens, splits, window, with_sinks, softcap):
    q, clean, seen, sinks = _decode_case(dtype, hq, hkv, d, bs, lens, window, with_sinks)
    out = torch.full_like(q, float("nan"))
    scale = d**-0.5
    kernels.paged_decode_attention(q, seen.k_cache, seen.v_cache, seen.block_table, seen.seq_lens, scale,
                                   num_splits=splits, out=out, window=window, sinks=sinks, softcap=softcap)
    ref = paged_decode_attention_reference(q, clean.k_cache, clean.v_cache, clean.block_table, clean.seq_lens, scale,
                                           window=window, sinks=sinks, softcap=softcap)
    assert_matches(out, ref)


@pytest.mark.parametrize("dtype,hq,hkv,d,bs,lens,splits,window,with_sinks,softcap",
                         [DECODE_CASES[i] for i in (1, 5, 8)])
def test_decode_variants_read_fp8_rows(dtype, hq, hkv, d, bs, lens, splits, window, with_sinks, softcap):
    q, clean, seen, sinks = _decode_case(dtype, hq, hkv, d, bs, lens, window, with_sinks, fp8=True)
    out = torch.full_like(q, float("nan"))
    tail = (seen.block_table, seen.seq_lens, d**-0.5)
    kernels.paged_decode_attention(q, seen.k_cache, seen.v_cache, *tail, num_splits=splits, out=out, window=window,
                                   sinks=sinks, softcap=softcap)
    plain = dequantized(clean, dtype)
    assert_matches(out, paged_decode_attention_reference(q, plain.k_cache, plain.v_cache, *tail, window=window,
                                                         sinks=sinks, softcap=softcap))


def test_decode_splits_are_sized_by_the_window_not_the_context():
    """A long context under a short window gets the window's split count (each split then walks a
    share of the window); without a window the same bound asks for many more."""
    cpu = torch.device("cpu")
    q = torch.zeros(1, 4, 64)
    cache = torch.zeros(2, 16, 1, 64)
    args = (q, cache, cache, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 0.125)
    (cfg,) = decode_configs(F32, 64, True)
    long = 10**5
    windowed = plan_decode(*args, max_seq_len=long, window=100).splits_for(cfg)
    assert windowed == auto_num_splits(1, 1, 100 + cfg.block_n - 1, cfg.block_n, cpu)
    assert plan_decode(*args, max_seq_len=long).splits_for(cfg) > windowed
    assert plan_decode(*args, max_seq_len=50, window=100).splits_for(cfg) == auto_num_splits(1, 1, 50, cfg.block_n,
                                                                                             cpu)


def test_one_decode_plan_serves_any_lengths_up_to_its_bound():
    """As in a CUDA graph: the plan is made once for a bound on the lengths, then replayed with other
    live lengths (each row splits its own window at run time), sinks of another layer included."""
    gen = torch.Generator().manual_seed(5)
    hq, hkv, d, bs, window = 4, 2, 64, 16, 100
    batch = make_paged(gen, F32, hkv, d, bs, [400, 400])
    q = (Q_GAIN * torch.randn(2, hq, d, generator=gen))
    sinks = random_sinks(gen, hq, F32, True)
    scale = d**-0.5
    plan = plan_decode(q, batch.k_cache, batch.v_cache, batch.block_table, batch.seq_lens, scale,
                       max_seq_len=512, window=window, sinks=sinks, softcap=6.0)
    assert plan.splits_for(plan.configs[0]) > 1, "the replay should exercise the merge"
    for lens in ([1, 400], [150, 7], [101, 100]):
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        layer_sinks = random_sinks(gen, hq, F32, True)
        out = plan(q, batch.k_cache, batch.v_cache, batch.block_table, seq_lens, torch.full_like(q, float("nan")),
                   sinks=layer_sinks)
        assert_matches(out, paged_decode_attention_reference(q, batch.k_cache, batch.v_cache, batch.block_table,
                                                             seq_lens, scale, window=window, sinks=layer_sinks,
                                                             softcap=6.0))


EXTEND_CASES = [
    # dtype, Hq, Hkv, D, block_size, query_lens, prefix_lens, window, sinks, softcap, config
    (F32, 4, 2, 64, 16, [20, 1, 5], [40, 63, 0], 7, False, None, None),  # window narrower than a tile's rows
    (F32, 4, 2, 64, 16, [24, 3], [50, 10], 40, False, None, None),  # masked, unmasked and masked key stretches
    (F16, 8, 2, 64, 32, [33, 1], [17, 64], 17, False, None, LaunchConfig(32, 32, 4, 1)),  # crossing blocks
    (BF16, 8, 1, 64, 16, [30], [45], 32, False, None, LaunchConfig(64, 16, 4, 1)),  # a chunk across the window edge
    (F32, 4, 4, 64, 16, [9, 4], [0, 17], 1000, False, None, None),  # a window wider than every sequence
    (F32, 4, 2, 64, 16, [10], [20], 1, True, None, None),  # window 1: each token sees itself (and its sink)
    (F32, 4, 2, 64, 16, [9, 1, 4], [40, 3, 17], None, True, None, None),  # sinks alone
    (F16, 4, 2, 64, 16, [12, 1], [20, 31], None, False, 3.0, None),  # softcap alone
    (BF16, 8, 2, 128, 16, [16, 1], [40, 47], 20, True, 5.0, None),  # all three
    (F32, 6, 2, 96, 16, [25, 2], [16, 70], 9, True, 4.0, LaunchConfig(32, 16, 4, 1)),  # all three, GQA 3, D 96
]


def _extend_case(dtype, hq, hkv, d, bs, qlens, prefixes, window, with_sinks, fp8=False):
    gen = torch.Generator().manual_seed(hash((hq, hkv, d, bs, tuple(qlens), window)) % 2**31)
    totals = [n + p for n, p in zip(qlens, prefixes)]
    clean = make_paged(gen, F32 if fp8 else dtype, hkv, d, bs, totals)
    cu = torch.tensor([0, *itertools.accumulate(qlens)], dtype=torch.int32)
    q = (Q_GAIN * torch.randn(sum(qlens), hq, d, generator=gen)).to(dtype)
    sinks = random_sinks(gen, hq, dtype, with_sinks)
    # the first new token, at position prefix, sees the lowest keys: from prefix - window + 1 on
    seen = poisoned_below(clean, [max(0, p - window + 1) for p in prefixes]) if window else clean
    return (q, cu, as_fp8(clean), as_fp8(seen), sinks) if fp8 else (q, cu, clean, seen, sinks)


@pytest.mark.parametrize("dtype,hq,hkv,d,bs,qlens,prefixes,window,with_sinks,softcap,config", EXTEND_CASES)
def test_extend_variants_match_reference(dtype, hq, hkv, d, bs, qlens, prefixes, window, with_sinks, softcap, config):
    q, cu, clean, seen, sinks = _extend_case(dtype, hq, hkv, d, bs, qlens, prefixes, window, with_sinks)
    out = torch.full_like(q, float("nan"))
    scale = d**-0.5
    kernels.paged_extend_attention(q, seen.k_cache, seen.v_cache, seen.block_table, cu, seen.seq_lens, scale,
                                   config=config, out=out, window=window, sinks=sinks, softcap=softcap)
    ref = paged_extend_attention_reference(q, clean.k_cache, clean.v_cache, clean.block_table, cu, clean.seq_lens,
                                           scale, window=window, sinks=sinks, softcap=softcap)
    assert_matches(out, ref)


@pytest.mark.parametrize("dtype,hq,hkv,d,bs,qlens,prefixes,window,with_sinks,softcap,config",
                         [EXTEND_CASES[i] for i in (1, 8, 9)])
def test_extend_variants_read_fp8_rows(dtype, hq, hkv, d, bs, qlens, prefixes, window, with_sinks, softcap, config):
    q, cu, clean, seen, sinks = _extend_case(dtype, hq, hkv, d, bs, qlens, prefixes, window, with_sinks, fp8=True)
    out = torch.full_like(q, float("nan"))
    tail = (seen.block_table, cu, seen.seq_lens, d**-0.5)
    kernels.paged_extend_attention(q, seen.k_cache, seen.v_cache, *tail, config=config, out=out, window=window,
                                   sinks=sinks, softcap=softcap)
    plain = dequantized(clean, dtype)
    assert_matches(out, paged_extend_attention_reference(q, plain.k_cache, plain.v_cache, *tail, window=window,
                                                         sinks=sinks, softcap=softcap))


def test_reference_formulas_on_a_hand_sized_case():
    """The reference's variants on one query, two keys, checked against the formulas written out."""
    q = torch.tensor([[[1.0, 0.0]]])  # one new token at position 1 (after a prefix of 1), one head, D=2
    cache_k = torch.zeros(1, 16, 1, 2)
    cache_v = torch.zeros(1, 16, 1, 2)
    cache_k[0, 0, 0] = torch.tensor([2.0, 0.0])
    cache_k[0, 1, 0] = torch.tensor([-1.0, 0.0])
    cache_v[0, 0, 0] = torch.tensor([1.0, 0.0])
    cache_v[0, 1, 0] = torch.tensor([0.0, 1.0])
    table = torch.zeros(1, 1, dtype=torch.int32)
    lens = torch.tensor([2], dtype=torch.int32)
    cu = torch.tensor([0, 1], dtype=torch.int32)
    scale, cap, sink = 0.5, 0.75, 0.3
    s = [cap * math.tanh(scale * 2.0 / cap), cap * math.tanh(scale * -1.0 / cap)]
    e = [math.exp(x) for x in s] + [math.exp(sink)]
    want = torch.tensor([e[0], e[1]]) / sum(e)
    got = paged_extend_attention_reference(q, cache_k, cache_v, table, cu, lens, scale, sinks=torch.tensor([sink]),
                                           softcap=cap)
    torch.testing.assert_close(got[0, 0], want)
    # window 1: only the key at the query's own position (1) remains
    got = paged_extend_attention_reference(q, cache_k, cache_v, table, cu, lens, scale, window=1,
                                           sinks=torch.tensor([sink]), softcap=cap)
    torch.testing.assert_close(got[0, 0], torch.tensor([0.0, e[1] / (e[1] + e[2])]))


def _small_inputs():
    q = torch.zeros(2, 4, 64)
    cache = torch.zeros(4, 16, 2, 64)
    return q, cache, cache.clone(), torch.zeros(2, 2, dtype=torch.int32), torch.tensor([3, 5], dtype=torch.int32), 0.1


@pytest.mark.parametrize("kwargs,message", [
    ({"window": 0}, "window must be an int in [1, 2^31)"),
    ({"window": True}, "window must be an int"),
    ({"window": 4.0}, "window must be an int"),
    ({"softcap": 0.0}, "softcap must be a finite number > 0"),
    ({"softcap": math.inf}, "softcap must be a finite number > 0"),
    ({"sinks": torch.zeros(5)}, "sinks must be a contiguous [Hq=4] vector"),
    ({"sinks": torch.zeros(8)[::2]}, "sinks must be a contiguous [Hq=4] vector"),
    ({"sinks": torch.zeros(4, dtype=torch.int32)}, "sinks dtype torch.int32 unsupported"),
])
def test_variants_reject_bad_arguments(kwargs, message):
    q, k_cache, v_cache, table, lens, scale = _small_inputs()
    with pytest.raises(ValueError, match=re.escape(message)):
        kernels.paged_decode_attention(q, k_cache, v_cache, table, lens, scale, **kwargs)
    with pytest.raises(ValueError, match=re.escape(message)):
        kernels.paged_extend_attention(q, k_cache, v_cache, table, torch.tensor([0, 1, 2], dtype=torch.int32), lens,
                                       scale, **kwargs)


def test_a_plan_wants_sinks_exactly_when_made_with_them():
    q, k_cache, v_cache, table, lens, scale = _small_inputs()
    with_sinks = plan_decode(q, k_cache, v_cache, table, lens, scale, sinks=torch.zeros(4))
    without = plan_decode(q, k_cache, v_cache, table, lens, scale)
    with pytest.raises(ValueError, match="sinks must be given exactly when"):
        with_sinks(q, k_cache, v_cache, table, lens)
    with pytest.raises(ValueError, match="sinks must be given exactly when"):
        without(q, k_cache, v_cache, table, lens, sinks=torch.zeros(4))


def test_variant_scalars_feed_a_tanh_softcap():
    """scores_log2's exp2 form of tanh, in torch: the scalars give softcap * tanh(scale * x / softcap) * log2 e."""
    x = torch.linspace(-400.0, 400.0, 2001, dtype=torch.float64)
    score_scale, cap_log2, _ = common.AttentionVariant(softcap=7.0).scalars(0.25)
    capped = (1.0 - 2.0 / (torch.exp2(x * score_scale) + 1.0)) * cap_log2
    torch.testing.assert_close(capped, 7.0 * torch.tanh(0.25 * x / 7.0) * common.LOG2E)
    assert common.AttentionVariant(window=9).scalars(0.25) == (0.25 * common.LOG2E, 0.0, 9)


def _step(gen, query_lens, prefix_lens, block_size, hq, hkv, d):
    """q/k/v for a step's new tokens, a random cache and the metadata the runner would build."""
    totals = [n + p for n, p in zip(query_lens, prefix_lens)]
    num_blocks = sum(-(-t // block_size) for t in totals) + 1
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-t // block_size))] for t in totals]
    width = max(len(t) for t in tables)
    slots = [tables[b][p // block_size] * block_size + p % block_size
             for b, (n, p0) in enumerate(zip(query_lens, prefix_lens)) for p in range(p0, p0 + n)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        cu_seqlens_q=torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32),
        seq_lens=torch.tensor(totals, dtype=torch.int32),
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        query_lens=list(query_lens), seq_lens_host=totals,
    )
    n = sum(query_lens)
    q = Q_GAIN * torch.randn(n, hq, d, generator=gen)
    k, v = torch.randn(n, hkv, d, generator=gen), torch.randn(n, hkv, d, generator=gen)
    cache = torch.randn(2, num_blocks, block_size, hkv, d, generator=gen)
    return q, k, v, cache, meta


@pytest.mark.parametrize("query_lens,prefix_lens", [([1, 9, 1], [40, 23, 0]), ([1, 1], [70, 5])])
def test_backend_passes_variants_through_and_plans_once_per_kind_of_layer(query_lens, prefix_lens):
    """Layers of two kinds (sliding with sinks and softcap; full with sinks) interleaved over one step:
    each kind plans once, every layer launches with its own sinks, each output is the reference's."""
    gen = torch.Generator().manual_seed(sum(prefix_lens))
    hq, hkv, d = 4, 2, 64
    q, k, v, cache, meta = _step(gen, query_lens, prefix_lens, 16, hq, hkv, d)
    backend = TritonAttentionBackend()
    kinds: list[tuple[int | None, float | None]] = [(8, 5.0), (None, None), (8, 5.0), (None, None)]  # window, softcap
    for layer, (window, softcap) in enumerate(kinds):
        sinks = torch.randn(hq, generator=gen)
        got = backend.forward(q, k, v, cache[0], cache[1], meta, 0.125, window=window, sinks=sinks, softcap=softcap)
        # the cache now holds the step's K/V; the reference reads it there
        want = paged_extend_attention_reference(q, cache[0], cache[1], meta.block_table, meta.cu_seqlens_q,
                                                meta.seq_lens, 0.125, window=window, sinks=sinks, softcap=softcap)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5, msg=f"layer {layer}")
    attention_plans = [key for key in meta.plans if key != "store"]
    assert len(attention_plans) == 2, attention_plans
