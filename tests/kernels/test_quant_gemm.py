"""The quantized-weight GEMMs (`kernels.quant_gemm`) against their torch references
(`kernels.quant_formats`): dequantize the weight to fp32, then an fp32 matmul (+ bias), rounded once to
x's dtype.

Runs under TRITON_INTERPRET=1 on CPU tensors (set by conftest.py). Shapes are odd on purpose: M, N and
K that are no multiple of the tiles (the masks), several scale blocks and groups along K (a k tile
must never straddle two), split-K forced on and off, x a strided view. The kernel multiplies exact
e4m3 / integer-valued weights and applies the scales per k tile in fp32, so it agrees with the
reference to fp32 accumulation noise before the output rounding: within one ulp of the largest output
in fp16 / bf16.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from radixserve.kernels.quant_formats import (
    Fp8Weight,
    Int4Weight,
    concat_rows,
    dequantize,
    dequantize_fp8,
    dequantize_int4,
    pack_int4_along_k,
    unpack_int4_along_k,
)
from radixserve.kernels.quant_gemm import fp8_linear, int4_linear, plan

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
DTYPES = [F32, F16, BF16]
CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[2]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _fp8(n: int, k: int, block_k: int | None, g: torch.Generator) -> Fp8Weight:
    """Random e4m3 weights; block_k None: one scale per row, else per row per block of block_k columns."""
    bits = (torch.randn(n, k, generator=g) * 4).to(torch.float8_e4m3fn).view(torch.uint8)
    blocks = 1 if block_k is None else -(-k // block_k)
    return Fp8Weight(bits, torch.rand(n, blocks, generator=g) + 0.25, k if block_k is None else block_k)


def _int4(n: int, k: int, group: int, g: torch.Generator) -> Int4Weight:
    groups = -(-k // group)
    values = torch.randint(0, 16, (k, n), generator=g)
    zeros = torch.randint(0, 17, (groups, n), generator=g).to(torch.uint8)  # 16: GPTQ v1's zero 0 read back
    return Int4Weight(pack_int4_along_k(values), zeros, torch.rand(groups, n, generator=g) * 0.2, group, k)


def _x(m: int, k: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    wide = torch.randn(m, k + 5, generator=g).to(dtype)
    return wide[:, 2 : 2 + k]  # a strided view, as a split of a packed projection would be


def _check(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    ref = torch.nn.functional.linear(x.float(), weight, None if bias is None else bias.float())
    assert out.dtype == x.dtype and out.shape == ref.shape
    largest = float(ref.abs().max()) if ref.numel() else 0.0
    eps = torch.finfo(x.dtype).eps
    atol = (64 * eps if x.dtype == F32 else eps) * max(largest, 1.0)
    torch.testing.assert_close(out.float(), ref.to(x.dtype).float(), atol=atol, rtol=0)


FP8_CASES = [  # (m, n, k, scale block_k or None, forced split)
    (1, 40, 96, 32, None),  # decode, three scale blocks along K
    (3, 72, 80, None, None),  # per-channel / per-tensor scales, K no multiple of the tile
    (17, 33, 112, 16, 3),  # M over a tile, odd N, 16-column blocks (7 of them), split-K
    (5, 24, 48, 32, 1),  # a last scale block only half full
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m, n, k, block_k, split", FP8_CASES)
def test_fp8_gemm_matches_dequantize_then_matmul(dtype, m, n, k, block_k, split):
    g = _gen(m * 1000 + n)
    w = _fp8(n, k, block_k, g)
    x = _x(m, k, dtype, g)
    bias = (torch.randn(n, generator=g)).to(dtype) if m % 2 else None
    _check(fp8_linear(x, w, bias, split=split), x, dequantize_fp8(w), bias)


INT4_CASES = [  # (m, n, k, group, forced split)
    (1, 40, 96, 32, None),
    (3, 24, 80, 80, None),  # one group (per channel), K no multiple of 8
    (19, 33, 64, 16, 2),
    (4, 56, 128, 64, 4),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m, n, k, group, split", INT4_CASES)
def test_int4_gemm_matches_dequantize_then_matmul(dtype, m, n, k, group, split):
    g = _gen(m * 1000 + n + 7)
    w = _int4(n, k, group, g)
    x = _x(m, k, dtype, g)
    bias = (torch.randn(n, generator=g)).to(dtype) if m % 2 else None
    _check(int4_linear(x, w, bias, split=split), x, dequantize_int4(w), bias)


def test_split_k_sums_in_order_and_matches_one_split():
    g = _gen(3)
    w, x = _int4(24, 128, 16, g), _x(2, 128, F32, g)
    one, split = int4_linear(x, w, split=1), int4_linear(x, w, split=8)
    torch.testing.assert_close(split, one, atol=1e-5, rtol=0)
    assert plan(2, 24, 128, 16, CPU, split=100).split == 8  # never more splits than k tiles


def test_empty_batch():
    g = _gen(4)
    w = _fp8(16, 32, None, g)
    assert fp8_linear(torch.empty(0, 32), w).shape == (0, 16)


def test_int4_pack_round_trip_and_dequantize_formula():
    g = _gen(5)
    values = torch.randint(0, 16, (37, 5), generator=g)
    values[7, 1] = 8  # top nibble set: the packed int32 is negative
    packed = pack_int4_along_k(values)
    assert packed.shape == (5, 5) and packed.dtype == torch.int32 and int(packed[0, 1]) < 0
    assert torch.equal(unpack_int4_along_k(packed, 37), values)
    assert int(packed[1, 2]) == sum(int(values[8 + i, 2]) << (4 * i) for i in range(8)) - (
        2**32 if values[15, 2] >= 8 else 0)  # nibble i of row r is k = 8r + i
    zeros = torch.randint(0, 16, (3, 5), generator=g).to(torch.uint8)
    scales = torch.rand(3, 5, generator=g)
    w = Int4Weight(packed, zeros, scales, 16, 37)
    expected = torch.empty(5, 37)
    for k in range(37):
        for n in range(5):
            expected[n, k] = (values[k, n] - int(zeros[k // 16, n])) * scales[k // 16, n]
    assert torch.equal(dequantize(w), expected)


def test_fp8_dequantize_formula():
    bits = torch.zeros(2, 20, dtype=torch.uint8)
    bits[0, 0], bits[0, 17], bits[1, 1], bits[1, 16] = 0x38, 0xB8, 0x7E, 0x01  # 1, -1, 448, 2^-9
    w = Fp8Weight(bits, torch.tensor([[0.5, 2.0], [3.0, 1.0]]), 16)  # blocks of 16 columns
    expected = torch.zeros(2, 20)
    expected[0, 0], expected[0, 17], expected[1, 1], expected[1, 16] = 0.5, -2.0, 1344.0, 2.0**-9
    assert torch.equal(dequantize(w), expected)


def test_concat_rows_is_the_stacked_dequantized_weights():
    g = _gen(6)
    fp8 = [_fp8(8, 64, None, g), _fp8(5, 64, 32, g), _fp8(7, 64, None, g)]
    assert torch.equal(dequantize(concat_rows(fp8)), torch.cat([dequantize(p) for p in fp8]))
    int4 = [_int4(8, 64, 32, g), _int4(16, 64, 32, g)]
    assert torch.equal(dequantize(concat_rows(int4)), torch.cat([dequantize(p) for p in int4]))
    with pytest.raises(ValueError, match="differ"):
        concat_rows([int4[0], _int4(8, 64, 16, g)])
    with pytest.raises(ValueError, match="different scale blocks"):
        concat_rows([_fp8(8, 64, 32, g), _fp8(8, 64, 16, g)])


def test_bad_layouts_and_inputs_are_named():
    g = _gen(7)
    with pytest.raises(ValueError, match="FP8 scale must be"):
        Fp8Weight(torch.zeros(4, 8, dtype=torch.uint8), torch.ones(4, 2), 8)
    with pytest.raises(ValueError, match="int4 scales must be"):
        Int4Weight(torch.zeros(1, 4, dtype=torch.int32), torch.zeros(1, 4, dtype=torch.uint8), torch.ones(2, 4), 8, 8)
    with pytest.raises(ValueError, match="not a multiple of 16"):
        Int4Weight(torch.zeros(3, 4, dtype=torch.int32), torch.zeros(3, 4, dtype=torch.uint8), torch.ones(3, 4), 8, 24)
    w = _fp8(16, 32, None, g)
    with pytest.raises(ValueError, match=r"x must be \[M, 32\]"):
        fp8_linear(torch.ones(2, 31), w)
    with pytest.raises(ValueError, match="x dtype"):
        fp8_linear(torch.ones(2, 32, dtype=torch.float64), w)
    with pytest.raises(ValueError, match="bias"):
        fp8_linear(torch.ones(2, 32), w, torch.ones(15))


def test_kernels_compile_for_ampere_and_hopper_with_tensor_cores():
    """A real compile through aot_check's stand-in driver (launches do nothing): decode (split-K) and
    prefill tiles, bf16 on tensor cores, on sm_80 (no e4m3 conversions in hardware: the FP8 kernel
    decodes the bits itself) and sm_90. Every call finds tiles that fit (the wrappers fall back past
    those that do not, else raise); on Hopper the first choice fits."""
    code = (
        "import torch\n"
        "from radixserve.kernels.aot_check import _compiled, stand_in_gpu\n"
        "from radixserve.kernels import quant_formats as f, quant_gemm as q\n"
        "kernels = (q._fp8_gemm_kernel, q._int4_gemm_kernel, q._sum_splits_kernel)\n"
        "n, k = 1024, 2048\n"
        "fp8 = f.Fp8Weight(torch.zeros(n, k, dtype=torch.uint8), torch.ones(n, k // 128), 128)\n"
        "int4 = f.Int4Weight(torch.zeros(k // 8, n, dtype=torch.int32), torch.zeros(k // 128, n, dtype=torch.uint8),\n"
        "                    torch.ones(k // 128, n), 128, k)\n"
        "for arch in (80, 90):\n"
        "    with stand_in_gpu(arch):\n"
        "        for kernel in kernels:\n"
        "            kernel.device_caches.clear()\n"
        "        for m in (1, 100):\n"
        "            x = torch.zeros(m, k, dtype=torch.bfloat16)\n"
        "            q.fp8_linear(x, fp8, torch.zeros(n, dtype=torch.bfloat16), split=4 if m == 1 else None)\n"
        "            q.int4_linear(x, int4)\n"
        "        for kernel in kernels:\n"
        "            for v in _compiled(kernel):\n"
        "                print(arch, v.kernel, v.fits, v.tensor_cores)\n"
    )
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          check=False, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines()]
    for arch in ("80", "90"):
        names = [name for a, name, _, _ in rows if a == arch]
        assert {"_fp8_gemm_kernel", "_int4_gemm_kernel", "_sum_splits_kernel"} <= set(names), rows
        gemms = [mma for a, name, _, mma in rows if a == arch and name != "_sum_splits_kernel"]
        assert all(mma == "True" for mma in gemms), rows  # bf16 dots on tensor cores
    assert all(fits == "True" for arch, _, fits, _ in rows if arch == "90"), rows
