"""The fused decode-path kernels (add_rms_norm, rotary_qk_, silu_and_mul) against their torch references.

Runs under TRITON_INTERPRET=1 on CPU tensors (set by conftest.py), like tests/kernels/test_kernels.py. The
kernels promise the references' rounding step by step, so the comparisons are in ulps, not
tolerances. Rotary and the residual sum are bit-exact in every dtype. SiLU is bit-exact but for rare
one-ulp differences (exp's last bit). RMSNorm's mean square is an fp32 sum in another order than
torch's, so the normalised value may rarely round one ulp the other way, which the weight multiply can
turn into two ulps of the result: fp16/bf16 within 2 ulps on at most RARE of the elements (on an H100,
vs torch on CUDA and on CPU: 4e-6 of bf16 and 5e-5 of fp16 elements differ, all within 2 ulps), fp32
within 1e-6 relative. Outputs start as NaN, so an element the kernel never writes shows up; inputs
are strided views where the model passes views; shapes are odd on purpose.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from radixserve import kernels
from radixserve.kernels.reference import add_rms_norm_reference, rotary_qk_reference_, silu_and_mul_reference

ROOT = Path(__file__).resolve().parents[2]
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
RARE = 1e-3  # fp16/bf16: most elements that may differ from the reference at all (RMSNorm, SiLU)


def ulps(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in units in the last place of the shared dtype (int64)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    ints = {F32: torch.int32, F16: torch.int16, BF16: torch.int16}[out.dtype]
    sign = 1 << (8 * out.element_size() - 1)
    a, b = (t.contiguous().view(ints).long() for t in (out, ref))
    a, b = (torch.where(t < 0, -(t + sign), t) for t in (a, b))  # sign-magnitude -> ordered integers
    return (a - b).abs()


def assert_close_in_ulps(out: torch.Tensor, ref: torch.Tensor, max_ulp: int) -> None:
    assert not out.isnan().any(), "kernel left elements unwritten"
    if out.dtype == F32:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=0)
        return
    dist = ulps(out, ref)
    assert int(dist.max()) <= max_ulp, f"{int(dist.max())} ulps off"
    assert float((dist > 0).float().mean()) <= RARE, f"{int((dist > 0).sum())} of {dist.numel()} elements differ"


def nan_like(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype)


NORM_CASES = [
    # dtype, tokens, hidden, with residual, block override, x a strided view
    (F32, 7, 200, True, None, False),
    (F32, 1, 72, False, 32, True),  # looped over 3 blocks, the last one partial
    (F16, 1, 72, False, None, False),
    (F16, 7, 200, True, 64, True),
    (F16, 16, 2048, True, None, False),
    (BF16, 7, 4096, True, None, True),
    (BF16, 1, 8192, True, None, False),
    (BF16, 3, 1000, False, 128, False),
]


@pytest.mark.parametrize("dtype,tokens,hidden,with_residual,block,strided", NORM_CASES)
def test_add_rms_norm_matches_reference(dtype, tokens, hidden, with_residual, block, strided):
    gen = torch.Generator().manual_seed(hidden * 31 + tokens)
    x = torch.randn(tokens, hidden + 8 if strided else hidden, generator=gen).to(dtype)[:, :hidden]
    residual = torch.randn(tokens, hidden, generator=gen).to(dtype) if with_residual else None
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    out, residual_out = nan_like((tokens, hidden), dtype), nan_like((tokens, hidden), dtype)
    normed, new_residual = kernels.add_rms_norm(x, residual, weight, 1e-5, block=block, out=out,
                                                residual_out=residual_out)
    ref_normed, ref_residual = add_rms_norm_reference(x, residual, weight, 1e-5)
    assert normed is out
    assert_close_in_ulps(normed, ref_normed, max_ulp=2)
    if residual is None:
        assert new_residual is x
    else:
        assert new_residual is residual_out and torch.equal(new_residual, ref_residual)


def rope_tables(max_pos: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.arange(max_pos).float()[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


ROPE_CASES = [
    # dtype, tokens, Hq, Hkv, head_dim, layout
    (F32, 7, 8, 2, 128, "packed"),
    (F16, 1, 4, 4, 64, "packed"),
    (F16, 7, 6, 2, 80, "head-major"),
    (BF16, 7, 6, 2, 80, "packed"),
    (BF16, 5, 14, 2, 64, "packed"),
    (BF16, 7, 8, 1, 128, "head-major"),
    (F32, 1, 3, 1, 64, "head-major"),
]


@pytest.mark.parametrize("dtype,tokens,hq,hkv,head_dim,layout", ROPE_CASES)
def test_rotary_qk_matches_reference(dtype, tokens, hq, hkv, head_dim, layout):
    gen = torch.Generator().manual_seed(tokens * 131 + hq * 7 + head_dim)
    width = (hq + 2 * hkv) * head_dim

    def views(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layout == "packed":  # qkv_proj output split as the model does: rows strided by the qkv width
            q, k, _ = qkv.split([hq * head_dim, hkv * head_dim, hkv * head_dim], dim=-1)
            return q.reshape(tokens, hq, head_dim), k.reshape(tokens, hkv, head_dim)
        heads = qkv.view(hq + 2 * hkv, tokens, head_dim)  # [heads, T, D] storage, [T, heads, D] views
        return heads[:hq].transpose(0, 1), heads[hq : hq + hkv].transpose(0, 1)

    qkv = torch.randn(tokens, width, generator=gen).to(dtype)
    expected = qkv.clone()
    cos, sin = rope_tables(4096, head_dim)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    positions[0] = 4095  # the table's last row; the rest are out of order
    kernels.rotary_qk_(*views(qkv), positions, cos, sin)
    rotary_qk_reference_(*views(expected), positions, cos, sin)
    assert torch.equal(qkv, expected)  # bit-exact, and v (the tail of each row) untouched


SILU_CASES = [
    # dtype, tokens, intermediate, block override, x a strided view
    (F32, 7, 200, None, False),
    (F16, 1, 1000, None, True),
    (F16, 3, 300, 64, False),
    (BF16, 7, 3000, None, False),
    (BF16, 2, 14336, None, True),
]


@pytest.mark.parametrize("dtype,tokens,inter,block,strided", SILU_CASES)
def test_silu_and_mul_matches_reference(dtype, tokens, inter, block, strided):
    gen = torch.Generator().manual_seed(inter + tokens)
    cols = 2 * inter + (16 if strided else 0)
    x = (3 * torch.randn(tokens, cols, generator=gen)).to(dtype)[:, : 2 * inter]
    out = nan_like((tokens, inter), dtype)
    assert kernels.silu_and_mul(x, block=block, out=out) is out
    assert_close_in_ulps(out, silu_and_mul_reference(x), max_ulp=1)


def test_no_tokens_and_fresh_outputs():
    x = torch.randn(0, 64)
    normed, new_residual = kernels.add_rms_norm(x, x, torch.ones(64), 1e-6)
    assert normed.shape == new_residual.shape == (0, 64)
    assert kernels.silu_and_mul(torch.randn(0, 64)).shape == (0, 32)
    cos, sin = rope_tables(8, 64)
    kernels.rotary_qk_(torch.randn(0, 2, 64), torch.randn(0, 1, 64), torch.zeros(0, dtype=torch.int64), cos, sin)
    x = torch.randn(3, 64, dtype=BF16)
    normed, new_residual = kernels.add_rms_norm(x, x, torch.ones(64, dtype=BF16), 1e-6)
    assert normed.is_contiguous() and new_residual is not x


def _rope_args(tokens=2, dtype=F32):
    cos, sin = rope_tables(16, 64)
    return (torch.zeros(tokens, 4, 64, dtype=dtype), torch.zeros(tokens, 2, 64, dtype=dtype),
            torch.tensor([3, 1]), cos, sin)


@pytest.mark.parametrize("call,message", [
    (lambda: kernels.add_rms_norm(torch.zeros(4), None, torch.ones(4), 1e-6), "x must be [tokens, hidden]"),
    (lambda: kernels.add_rms_norm(torch.zeros(2, 4), None, torch.ones(5), 1e-6), "weight must have shape (4,)"),
    (lambda: kernels.add_rms_norm(torch.zeros(2, 4), torch.zeros(3, 4), torch.ones(4), 1e-6), "residual shape"),
    (lambda: kernels.add_rms_norm(torch.zeros(2, 4), torch.zeros(2, 4, dtype=F16), torch.ones(4), 1e-6),
     "residual must be torch.float32"),
    (lambda: kernels.add_rms_norm(torch.zeros(2, 4), None, torch.ones(4, dtype=BF16), 1e-6), "weight must be"),
    (lambda: kernels.add_rms_norm(torch.zeros(2, 4, dtype=torch.float64), None, torch.ones(4), 1e-6),
     "unsupported"),
    (lambda: kernels.add_rms_norm(torch.zeros(2, 4), None, torch.ones(4), 1e-6, block=24), "power of two"),
    (lambda: kernels.add_rms_norm(torch.zeros(2, 4), None, torch.ones(4), 1e-6, out=torch.zeros(4, 2)),
     "out must be a contiguous (2, 4)"),
    (lambda: kernels.silu_and_mul(torch.zeros(2, 5)), "x must be [tokens, 2 * intermediate]"),
    (lambda: kernels.silu_and_mul(torch.zeros(2, 4), out=torch.zeros(2, 2, dtype=F16)), "out must be"),
    (lambda: kernels.rotary_qk_(torch.zeros(2, 4, 63), torch.zeros(2, 2, 63), *_rope_args()[2:]), "must be even"),
    (lambda: kernels.rotary_qk_(torch.zeros(2, 4, 64), torch.zeros(3, 2, 64), *_rope_args()[2:]),
     "does not match q"),
    (lambda: kernels.rotary_qk_(torch.zeros(2, 4, 64), torch.zeros(2, 2, 64, dtype=F16), *_rope_args()[2:]),
     "k must be torch.float32"),
    (lambda: kernels.rotary_qk_(*_rope_args()[:2], torch.tensor([3, 1], dtype=torch.int32), *_rope_args()[3:]),
     "positions must be int64 [2]"),
    (lambda: kernels.rotary_qk_(*_rope_args()[:3], *rope_tables(16, 32)), "cos_table must be [max_positions, 32]"),
    (lambda: kernels.rotary_qk_(*_rope_args()[:4], _rope_args()[4].double()), "sin_table must be torch.float32"),
    (lambda: kernels.rotary_qk_(*_rope_args()[:2], torch.tensor([3, 16]), *_rope_args()[3:]), "positions must be in [0, 16)"),
])
def test_fused_kernels_reject_bad_input(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


def test_fused_kernels_compile_for_hopper():
    """Real sm_90 compiles (no interpreter) of every dtype and code path, with IEEE division and sqrt."""
    code = (
        "import torch\n"
        "from radixserve.kernels.aot_check import check_fused\n"
        "for v in check_fused(90):\n"
        "    print(v.kernel, v.fits)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          check=False, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines()]
    assert {name for name, _ in rows} == {"_add_rms_norm_kernel", "_rotary_qk_kernel", "_silu_and_mul_kernel"}
    assert len(rows) == 3 * 3 * 2 and all(fits == "True" for _, fits in rows)  # kernels x dtypes x paths


def test_fused_bench_rows_run_on_cpu_under_the_interpreter():
    from radixserve_bench import kernel_bench as kb

    def once(fn):
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    shapes = kb.Shapes(num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=16, dtype=BF16)
    rows = kb.bench_fused(torch.device("cpu"), shapes, 3, 72, 40, once)
    assert [r.kernel for r in rows] == ["add_rms_norm", "rotary_qk_", "silu_and_mul"]
    assert all(r.ms and r.torch_ms and r.max_ulp is not None and r.max_ulp <= kb.FUSED_MAX_ULP[r.kernel] for r in rows)
    assert rows[1].differ == 0.0  # rotary is bit-exact
    table = kb.format_fused(rows, shapes)
    assert "add_rms_norm" in table and "silu_and_mul" in table and "torch ms" in table
