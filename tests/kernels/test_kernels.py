"""The Triton kernels against the torch references, under TRITON_INTERPRET=1 on CPU tensors.

Each case draws fresh random caches and queries. Physical blocks are shuffled, some sequences share
blocks (copy-on-write prefixes), table padding points at a NaN-filled block and cache slots past each
sequence's end hold NaN, so a missing mask anywhere shows up as NaN in the output. Outputs start as
NaN, so an element the kernel never writes shows up too. The grid is chosen, not crossed: every
GQA ratio, block size, dtype, boundary length and split count appears in some case.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from radixserve import kernels
from radixserve.kernels import fp8_format
from radixserve.kernels.common import LaunchConfig
from radixserve.kernels.decode import auto_num_splits
from radixserve.kernels.reference import (
    paged_decode_attention_reference,
    paged_extend_attention_reference,
    store_kv_reference,
)

ROOT = Path(__file__).resolve().parents[2]
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@dataclass
class PagedBatch:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor


def make_paged(gen, dtype, num_kv_heads, head_dim, block_size, seq_lens, share=()) -> PagedBatch:
    """Random caches behind shuffled block tables; share = (src, dst, n): dst's first n blocks are src's."""
    needs = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(needs) + 2
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    poison_block = physical.pop()  # every padding entry of the table points here
    rows = []
    for need in needs:
        rows.append([physical.pop() for _ in range(need)])
    for src, dst, n in share:
        rows[dst][:n] = rows[src][:n]
    width = max(needs) + 1
    table = torch.full((len(rows), width), poison_block, dtype=torch.int32)
    for b, row in enumerate(rows):
        table[b, : len(row)] = torch.tensor(row, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    for cache in (k_cache, v_cache):
        cache[poison_block] = float("nan")
        for b, n in enumerate(seq_lens):
            if n % block_size and rows[b]:
                cache[rows[b][-1], n % block_size :] = float("nan")
    # a shared block must hold the same tokens for every owner: shares are of full prefix blocks
    for src, dst, n in share:
        assert n * block_size <= min(seq_lens[src], seq_lens[dst])
    return PagedBatch(k_cache, v_cache, table, torch.tensor(seq_lens, dtype=torch.int32))


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert not out.isnan().any(), "kernel left elements unwritten or read masked-off/poisoned K/V"
    tol = TOL[out.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


DECODE_CASES = [
    # dtype, Hq, Hkv, D, block_size, seq_lens, num_splits, share
    (F32, 4, 4, 64, 16, [1, 16, 33], None, ()),
    (F16, 8, 4, 64, 32, [32, 5, 64], 3, ((0, 2, 1),)),
    (BF16, 8, 2, 128, 16, [47, 1], 2, ()),
    (BF16, 8, 1, 64, 64, [64, 100, 3], 4, ((1, 0, 1),)),
    (F16, 16, 2, 64, 16, [1], None, ()),
    (F32, 6, 2, 96, 32, [40, 7], 2, ()),
    (F16, 6, 2, 64, 16, [300], None, ()),  # auto split count > 1 on a lone long sequence
]


@pytest.mark.parametrize("dtype,hq,hkv,d,bs,lens,splits,share", DECODE_CASES)
def test_decode_matches_reference(dtype, hq, hkv, d, bs, lens, splits, share):
    gen = torch.Generator().manual_seed(hash((hq, hkv, d, bs, tuple(lens))) % 2**31)
    batch = make_paged(gen, dtype, hkv, d, bs, lens, share)
    q = torch.randn(len(lens), hq, d, generator=gen).to(dtype)
    out = torch.full_like(q, float("nan"))
    scale = d**-0.5
    kernels.paged_decode_attention(
        q, batch.k_cache, batch.v_cache, batch.block_table, batch.seq_lens, scale, num_splits=splits, out=out
    )
    ref = paged_decode_attention_reference(q, batch.k_cache, batch.v_cache, batch.block_table, batch.seq_lens, scale)
    assert_matches(out, ref)


def test_auto_split_count_grows_when_few_sequences():
    cpu = torch.device("cpu")
    assert auto_num_splits(1, 1, 300, 32, cpu) > 1
    assert auto_num_splits(64, 8, 128, 32, cpu) == 1
    assert auto_num_splits(1, 1, 10**6, 32, cpu) <= 64


EXTEND_CASES = [
    # dtype, Hq, Hkv, D, block_size, query_lens, prefix_lens, share, config
    (F32, 4, 4, 64, 16, [5, 1, 20], [0, 29, 30], (), None),
    (F16, 8, 4, 64, 32, [16, 1, 1], [32, 63, 0], ((0, 1, 1),), None),
    (BF16, 8, 2, 128, 16, [7, 1], [16, 47], ((0, 1, 1),), None),
    (BF16, 8, 1, 64, 64, [1, 1], [63, 64], (), None),
    (F16, 4, 2, 96, 16, [33], [0], (), None),
    (F32, 6, 2, 64, 16, [9, 0, 4], [40, 3, 17], (), LaunchConfig(32, 16, 4, 1)),
    (F16, 8, 2, 64, 32, [24, 1], [35, 64], ((1, 0, 1),), LaunchConfig(16, 32, 4, 1)),
]


@pytest.mark.parametrize("dtype,hq,hkv,d,bs,qlens,prefixes,share,config", EXTEND_CASES)
def test_extend_matches_reference(dtype, hq, hkv, d, bs, qlens, prefixes, share, config):
    gen = torch.Generator().manual_seed(hash((hq, hkv, d, bs, tuple(qlens))) % 2**31)
    totals = [n + p for n, p in zip(qlens, prefixes)]
    batch = make_paged(gen, dtype, hkv, d, bs, totals, share)
    cu = torch.tensor([0, *itertools.accumulate(qlens)], dtype=torch.int32)
    q = torch.randn(sum(qlens), hq, d, generator=gen).to(dtype)
    out = torch.full_like(q, float("nan"))
    scale = d**-0.5
    args = (q, batch.k_cache, batch.v_cache, batch.block_table, cu, batch.seq_lens, scale)
    kernels.paged_extend_attention(*args, config=config, out=out)
    assert_matches(out, paged_extend_attention_reference(*args))


@pytest.mark.parametrize("src_dtype,cache_dtype", [(F32, F32), (F16, F16), (BF16, BF16), (F32, BF16), (F16, F32)])
def test_store_kv_matches_reference(src_dtype, cache_dtype):
    gen = torch.Generator().manual_seed(7)
    num_blocks, bs, hkv, d = 4, 16, 2, 64
    qkv = torch.randn(6, 3, hkv, d, generator=gen).to(src_dtype)
    k, v = qkv[:, 1], qkv[:, 2]  # strided views, as a fused qkv projection would give
    slots = torch.tensor([0, 15, 16, -1, 63, 37], dtype=torch.int64)  # -1: a padding token, skipped
    cache_k = torch.full((num_blocks, bs, hkv, d), float("nan"), dtype=cache_dtype)
    cache_v = torch.full_like(cache_k, float("nan"))
    ref_k, ref_v = cache_k.clone(), cache_v.clone()
    kernels.store_kv(k, v, cache_k, cache_v, slots)
    store_kv_reference(k, v, ref_k, ref_v, slots)
    # same dtype: a bit-exact copy; converting: within one rounding (the interpreter truncates to bf16)
    tol = 0.0 if src_dtype == cache_dtype else TOL[cache_dtype]
    torch.testing.assert_close(cache_k, ref_k, atol=tol, rtol=tol, equal_nan=True)
    torch.testing.assert_close(cache_v, ref_v, atol=tol, rtol=tol, equal_nan=True)


def as_fp8(batch: PagedBatch) -> PagedBatch:
    """The same caches quantized into FP8 rows (NaN poison stays NaN)."""
    return PagedBatch(fp8_format.quantize(batch.k_cache), fp8_format.quantize(batch.v_cache), batch.block_table,
                      batch.seq_lens)


def dequantized(batch: PagedBatch, dtype: torch.dtype) -> PagedBatch:
    return PagedBatch(fp8_format.dequantize(batch.k_cache, dtype), fp8_format.dequantize(batch.v_cache, dtype),
                      batch.block_table, batch.seq_lens)


@pytest.mark.parametrize("dtype,hq,hkv,d,bs,lens,splits,share", [DECODE_CASES[i] for i in (0, 1, 2)])
def test_decode_reads_fp8_rows(dtype, hq, hkv, d, bs, lens, splits, share):
    """An FP8 cache attends as its dequantized values do (the reference runs on those)."""
    gen = torch.Generator().manual_seed(11)
    batch = as_fp8(make_paged(gen, torch.float32, hkv, d, bs, lens, share))
    q = torch.randn(len(lens), hq, d, generator=gen).to(dtype)
    out = torch.full_like(q, float("nan"))
    args = (batch.block_table, batch.seq_lens, d**-0.5)
    kernels.paged_decode_attention(q, batch.k_cache, batch.v_cache, *args, num_splits=splits, out=out)
    plain = dequantized(batch, dtype)
    assert_matches(out, paged_decode_attention_reference(q, plain.k_cache, plain.v_cache, *args))


@pytest.mark.parametrize("dtype,hq,hkv,d,bs,qlens,prefixes,share,config", [EXTEND_CASES[i] for i in (0, 2, 5)])
def test_extend_reads_fp8_rows(dtype, hq, hkv, d, bs, qlens, prefixes, share, config):
    gen = torch.Generator().manual_seed(12)
    totals = [n + p for n, p in zip(qlens, prefixes)]
    batch = as_fp8(make_paged(gen, torch.float32, hkv, d, bs, totals, share))
    cu = torch.tensor([0, *itertools.accumulate(qlens)], dtype=torch.int32)
    q = torch.randn(sum(qlens), hq, d, generator=gen).to(dtype)
    out = torch.full_like(q, float("nan"))
    tail = (batch.block_table, cu, batch.seq_lens, d**-0.5)
    kernels.paged_extend_attention(q, batch.k_cache, batch.v_cache, *tail, config=config, out=out)
    plain = dequantized(batch, dtype)
    assert_matches(out, paged_extend_attention_reference(q, plain.k_cache, plain.v_cache, *tail))


@pytest.mark.parametrize("src_dtype", [F32, F16, BF16])
def test_store_kv_writes_the_fp8_format_bit_for_bit(src_dtype):
    """The kernel's bytes are kernels/fp8_format.quantize's, scales included, across magnitudes from
    e4m3's subnormals to its largest value, ties and all-zero rows; padding slots write nothing."""
    gen = torch.Generator().manual_seed(13)
    num_blocks, bs, hkv, d = 4, 16, 2, 64
    qkv = torch.randn(7, 3, hkv, d, generator=gen) * torch.logspace(-6, 4, 7)[:, None, None, None]
    qkv[0, 1, 0] = 0.0  # an all-zero row
    qkv[1, 1, 1, :8] = torch.tensor([448.0, 1.0625, 1.1875, -3.5, 2**-8, 3 * 2**-10, 2**-10, 0.0])  # ties
    qkv = qkv.to(src_dtype)
    k, v = qkv[:, 1], qkv[:, 2]  # strided views, as a fused qkv projection would give
    slots = torch.tensor([0, 15, 16, -1, 63, 37, 5], dtype=torch.int64)  # -1: a padding token, skipped
    width = fp8_format.row_width(d)
    cache_k = torch.full((num_blocks, bs, hkv, width), 0xAB, dtype=torch.uint8)
    cache_v = cache_k.clone()
    ref_k, ref_v = cache_k.clone(), cache_v.clone()
    kernels.store_kv(k, v, cache_k, cache_v, slots)
    keep = slots >= 0
    ref_k.view(-1, hkv, width)[slots[keep]] = fp8_format.quantize(k[keep])
    ref_v.view(-1, hkv, width)[slots[keep]] = fp8_format.quantize(v[keep])
    assert torch.equal(cache_k, ref_k) and torch.equal(cache_v, ref_v)


def _decode_inputs(block_size=16, dtype=F32, hq=4):
    k_cache = torch.zeros(4, block_size, 2, 64, dtype=dtype)
    q = torch.zeros(2, hq, 64, dtype=dtype)
    table = torch.zeros(2, 2, dtype=torch.int32)
    return q, k_cache, k_cache.clone(), table, torch.tensor([3, 5], dtype=torch.int32), 0.125


@pytest.mark.parametrize("change,message", [
    (lambda a: (a[0], torch.zeros(4, 8, 2, 64), torch.zeros(4, 8, 2, 64), *a[3:]), "block_size 8 is below 16"),
    (lambda a: (a[0].half(), *a[1:]), "must match the cache dtype"),
    (lambda a: (torch.zeros(2, 3, 64), *a[1:]), "multiple of Hkv"),
    (lambda a: (*a[:3], a[3].long(), *a[4:]), "block_table must be int32"),
    (lambda a: (*a[:4], torch.tensor([3, 40], dtype=torch.int32), a[5]), "a sequence needs 3"),
    (lambda a: (*a[:3], torch.full((2, 2), 9, dtype=torch.int32), *a[4:]), "outside [0, 4)"),
])
def test_decode_rejects_bad_input(change, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        kernels.paged_decode_attention(*change(_decode_inputs()))


def test_extend_and_store_reject_bad_input():
    q, k_cache, v_cache, table, seq_lens, scale = _decode_inputs()
    with pytest.raises(ValueError, match="must start at 0 and end at T=2"):
        kernels.paged_extend_attention(q, k_cache, v_cache, table, torch.tensor([0, 1, 3], dtype=torch.int32),
                                       seq_lens, scale)
    with pytest.raises(ValueError, match="must be >= the number of new tokens"):
        kernels.paged_extend_attention(q, k_cache, v_cache, table, torch.tensor([0, 0, 2], dtype=torch.int32),
                                       torch.tensor([3, 1], dtype=torch.int32), scale)
    kv = torch.zeros(2, 2, 64)
    with pytest.raises(ValueError, match="slot >= 64"):
        kernels.store_kv(kv, kv, k_cache, v_cache, torch.tensor([0, 64]))
    with pytest.raises(ValueError, match="1-D int64"):
        kernels.store_kv(kv, kv, k_cache, v_cache, torch.tensor([0, 1], dtype=torch.int32))


def _run_without_interpreter(code: str, timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=False,
                          timeout=timeout)


def test_cpu_tensors_without_interpreter_get_a_clear_error():
    code = (
        "import torch\nfrom radixserve import kernels\n"
        "q = torch.zeros(1, 2, 64); c = torch.zeros(2, 16, 2, 64)\n"
        "try:\n"
        "    kernels.paged_decode_attention(q, c, c, torch.zeros(1, 1, dtype=torch.int32),"
        " torch.ones(1, dtype=torch.int32), 1.0)\n"
        "except RuntimeError as e:\n"
        "    print('ERR', e)\n"
    )
    proc = _run_without_interpreter(code, timeout=120)
    assert "ERR Triton kernels need CUDA tensors" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_kernels_compile_for_hopper_and_fit_shared_memory(kv_cache_dtype):
    """Real sm_90 compile of the production shapes (bf16, D=128, GQA 4) through a stand-in driver, on a
    bf16 cache and on an FP8 one (whose e4m3 conversions are native from sm_89 on)."""
    code = (
        "import torch\n"
        "from radixserve.kernels.aot_check import check_arch\n"
        f"for v in check_arch(90, torch.bfloat16, 128, kv_cache_dtype={kv_cache_dtype!r}):\n"
        "    print(v.kernel, v.shared, v.fits, v.tensor_cores)\n"
    )
    proc = _run_without_interpreter(code, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines()]
    last = {name: (fits, mma) for name, _, fits, mma in rows}
    assert set(last) == {"_store_kv_kernel", "_decode_split_kernel", "_merge_kernel", "_extend_kernel"}
    assert all(fits == "True" for fits, _ in last.values())
    assert last["_decode_split_kernel"][1] == "True" and last["_extend_kernel"][1] == "True"


def test_kernel_bench_without_cuda_exits_with_a_message(capsys):
    import argparse

    from radixserve_bench import kernel_bench

    parser = argparse.ArgumentParser()
    kernel_bench.add_arguments(parser)
    assert kernel_bench.main(parser.parse_args([])) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_kernel_bench_pipeline_runs_on_cpu_under_the_interpreter():
    """The benchmark's own code (paging, correctness, SDPA baseline, report) on tiny CPU shapes."""
    import time

    from radixserve_bench import kernel_bench as kb

    def once(fn):
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    shapes = kb.Shapes(num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32)
    cpu = torch.device("cpu")
    errors = kb.check_correctness(cpu, shapes, decode_lens=(1, 16, 21), extend_qlens=(5, 1), extend_prefixes=(16, 3))
    assert len(errors) == 5 and all(err <= 1e-5 for err in errors.values()), errors
    rows = [kb.bench_decode(cpu, shapes, 2, 20, 1e9, once, True), kb.bench_extend(cpu, shapes, 9, 20, once, True)]
    assert all(r.ms and r.metric and r.sdpa_ms for r in rows)
    assert [ok for _, ok in kb.check_targets(rows)] == [None, None]  # those shapes are not the target rows
    table = kb.format_rows(rows, shapes)
    assert "decode" in table and "extend" in table and "vs sdpa" in table
