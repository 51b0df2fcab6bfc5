"""Weight-only quantized linear layers on the GPU, in Triton: y = x @ W^T (+ bias) with W stored as FP8
e4m3 or as 4-bit integers and dequantized tile by tile inside the GEMM, never whole in memory.

The weights come in `kernels.quant_formats`' two layouts (`Fp8Weight`, `Int4Weight`), which every
supported checkpoint layout is repacked into at load (radixserve/model/quantized_checkpoint.py);
`quant_formats.dequantize` is the torch reference: the kernels must match dequantize-then-matmul.

Numerics: the dot of x with the integer-valued (q - zero) or the e4m3 values, both exact in fp16, bf16
and fp32, is accumulated in fp32 per k tile and multiplied by the tile's column scales (a k tile never
straddles two scale blocks, `_block_k`); the result rounds once to x's dtype. e4m3 bytes are decoded by
moving their bits into fp16's fields (`_e4m3_over_256`), so sm_80, which has no e4m3 conversion, runs
the same code. Under TRITON_INTERPRET=1 bf16 is raw bits: values are widened on load and the stores
round to nearest even (`fused._round`), as the other kernels do.

Decode (small M) is bound by the weight bytes, and an 8B layer's N tiles alone are fewer than twice
the SMs: K is then split over programs whose fp32 partial sums `_sum_splits_kernel` adds in split order.
Invariants: no host sync and no allocation but the output and that partial buffer, on the inputs'
device, so a step stays capturable in a CUDA graph; tile sizes and the split factor depend on M's
size class and N, K only (never on values).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radixserve.kernels.common import (
    SUPPORTED_DTYPES,
    LaunchConfig,
    check_device,
    dot_precision,
    launch_with_fallback,
    scheduling_kwargs,
    upcast_in_kernel,
)
from radixserve.kernels.fused import _round
from radixserve.kernels.quant_formats import MIN_BLOCK_K, Fp8Weight, Int4Weight, QuantWeight

MAX_BLOCK_K = 128
NUM_WARPS = 4
NUM_STAGES = 4  # the first try; fewer where the tiles do not fit (`_configs`)
SUM_BLOCK = 1024


# ---------------------------------------------------------------- kernels


@triton.jit
def _epilogue(acc, rows, cols, row_mask, col_mask, bias_ptr, out_ptr, part_ptr, split, M, N, stride_om,
              HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, EMULATE_BF16: tl.constexpr):
    mask = row_mask[:, None] & col_mask[None, :]
    if PARTIAL:  # fp32 partial sums, which _sum_splits_kernel adds in split order, then the bias
        tl.store(part_ptr + split.to(tl.int64) * M * N + rows[:, None] * N + cols[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        dtype = out_ptr.dtype.element_ty
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], _round(acc, dtype, EMULATE_BF16).to(dtype),
                 mask=mask)


@triton.jit
def _e4m3_over_256(raw):
    """e4m3 bytes -> their values / 256 as fp16, by moving the bits: e4m3's exponent bias is 8 below
    fp16's, so its exponent and mantissa fields placed in fp16's give value * 2^-8, subnormals too
    (e4m3's m * 2^-9 lands on fp16's m * 2^-17). Exact, and portable: sm_80 has no e4m3 conversion."""
    bits = raw.to(tl.uint16)
    return (((bits & 0x7F) << 7) | ((bits & 0x80) << 8)).to(tl.float16, bitcast=True)


@triton.jit
def _fp8_gemm_kernel(
    x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, part_ptr,
    M, N, K, tiles_per_split, scale_block_k,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sk, stride_om,
    HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    row_mask, col_mask = rows < M, cols < N
    rows64, cols64 = rows.to(tl.int64), cols.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(K, BLOCK_K))
    for tile in range(first, last):
        k0 = tile * BLOCK_K
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(x_ptr + rows64[:, None] * stride_xm + ks[None, :] * stride_xk,
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        raw = tl.load(w_ptr + cols64[None, :] * stride_wn + ks[:, None] * stride_wk,
                      mask=k_mask[:, None] & col_mask[None, :], other=0)
        w = _e4m3_over_256(raw)
        if UPCAST:
            a = a.to(tl.float32)
        w = w.to(a.dtype)  # exact: 3 significant bits, within range of fp16, bf16 and fp32
        scale = tl.load(s_ptr + cols64 * stride_sn + (k0 // scale_block_k) * stride_sk, mask=col_mask, other=0.0)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION) * (scale * 256.0)[None, :]
    _epilogue(acc, rows64, cols64, row_mask, col_mask, bias_ptr, out_ptr, part_ptr, split, M, N, stride_om,
              HAS_BIAS, PARTIAL, UPCAST)


@triton.jit
def _int4_gemm_kernel(
    x_ptr, q_ptr, z_ptr, s_ptr, bias_ptr, out_ptr, part_ptr,
    M, N, K, packed_rows, tiles_per_split, group_size,
    stride_xm, stride_xk, stride_qk, stride_qn, stride_zg, stride_zn, stride_sg, stride_sn, stride_om,
    HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    row_mask, col_mask = rows < M, cols < N
    rows64, cols64 = rows.to(tl.int64), cols.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(K, BLOCK_K))
    for tile in range(first, last):
        k0 = tile * BLOCK_K
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(x_ptr + rows64[:, None] * stride_xm + ks[None, :] * stride_xk,
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        # BLOCK_K / 8 rows of int32, each spread over its 8 k in registers (row r, nibble i: k = k0 + 8r + i)
        words = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        packed = tl.load(q_ptr + words[:, None] * stride_qk + cols64[None, :] * stride_qn,
                         mask=(words < packed_rows)[:, None] & col_mask[None, :], other=0)
        nibbles = tl.reshape((packed[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
        group = k0 // group_size
        zero = tl.load(z_ptr + group * stride_zg + cols64 * stride_zn, mask=col_mask, other=0).to(tl.int32)
        scale = tl.load(s_ptr + group * stride_sg + cols64 * stride_sn, mask=col_mask, other=0.0)
        w = (nibbles - zero[None, :]).to(tl.float32)  # integers in [-15, 15]: exact in every dtype
        if UPCAST:
            a = a.to(tl.float32)
        else:
            w = w.to(a.dtype)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION) * scale[None, :]
    _epilogue(acc, rows64, cols64, row_mask, col_mask, bias_ptr, out_ptr, part_ptr, split, M, N, stride_om,
              HAS_BIAS, PARTIAL, UPCAST)


@triton.jit
def _sum_splits_kernel(part_ptr, bias_ptr, out_ptr, M, N, stride_om, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """out[m] = round(sum over splits in split order of the fp32 partials + bias): one launch after split-K."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    total = tl.load(part_ptr + row * N + cols, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        total += tl.load(part_ptr + s * M * N + row * N + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        total += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * stride_om + cols, _round(total, dtype, EMULATE_BF16).to(dtype), mask=mask)


# ---------------------------------------------------------------- launch


@dataclass(frozen=True)
class GemmPlan:
    """Tile sizes and the split-K factor of one launch."""

    block_m: int
    block_n: int
    block_k: int
    split: int
    tiles_per_split: int


def _block_k(k: int, scale_block: int) -> int:
    """The largest power-of-two k tile (16..128) that never straddles two scale blocks."""
    if scale_block >= k:  # one block: any tile
        return max(MIN_BLOCK_K, min(MAX_BLOCK_K, triton.next_power_of_2(k)))
    block = MAX_BLOCK_K
    while scale_block % block:
        block //= 2
    if block < MIN_BLOCK_K:
        raise ValueError(f"scale blocks of {scale_block} columns are not a multiple of {MIN_BLOCK_K}")
    return block


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: small, so the tests exercise split-K on tiny shapes
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def plan(m: int, n: int, k: int, scale_block: int, device: torch.device, split: int | None = None) -> GemmPlan:
    """Decode (small M) is bound by the weight bytes: enough programs to keep every SM streaming weights,
    splitting K when the N tiles alone are too few. `split` forces a split-K factor (tests)."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64 if m <= 64 else 128
    block_k = _block_k(k, scale_block)
    k_tiles = triton.cdiv(k, block_k)
    if split is None:
        programs = max(1, triton.cdiv(m, block_m) * triton.cdiv(n, block_n))
        split = max(1, min(k_tiles // 2, triton.cdiv(2 * _sm_count(device), programs))) if m <= 64 else 1
    split = max(1, min(split, k_tiles))
    tiles_per_split = triton.cdiv(k_tiles, split)
    split = triton.cdiv(k_tiles, tiles_per_split)  # no empty split
    return GemmPlan(block_m, block_n, block_k, split, tiles_per_split)


def _check_x(kernel: object, x: torch.Tensor, k: int, bias: torch.Tensor | None, n: int,
             *weights: torch.Tensor) -> None:
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}], got {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"x dtype {x.dtype} unsupported; use float16, bfloat16 or float32")
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous [{n}] vector, got {tuple(bias.shape)}")
    check_device(kernel, x, *weights, *(() if bias is None else (bias,)))


def _finish(out: torch.Tensor, part: torch.Tensor, bias: torch.Tensor | None, p: GemmPlan) -> torch.Tensor:
    if p.split == 1:
        return out
    m, n = out.shape
    _sum_splits_kernel[(m, triton.cdiv(n, SUM_BLOCK))](
        part, bias if bias is not None else part, out, m, n, out.stride(0),
        SPLIT=p.split, HAS_BIAS=bias is not None, BLOCK=SUM_BLOCK, EMULATE_BF16=upcast_in_kernel(_sum_splits_kernel,
                                                                                                 out.dtype),
    )
    return out


def _configs(p: GemmPlan, m: int) -> list[LaunchConfig]:
    """The plan's tiles with fewer pipeline stages, then narrower N tiles, for GPUs with less shared memory
    (fp32 x on an A100): the first that fits is kept (common.launch_with_fallback)."""
    warps = NUM_WARPS if m <= 64 else 8
    return ([LaunchConfig(p.block_m, p.block_n, warps, stages) for stages in (NUM_STAGES, 3, 2)]
            + [LaunchConfig(p.block_m, p.block_n // 2, NUM_WARPS, 2), LaunchConfig(16, 32, NUM_WARPS, 2)])


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None, *,
               split: int | None = None) -> torch.Tensor:
    """x [M, K] (fp16/bf16/fp32) @ dequantize(w)^T + bias -> [M, N] in x's dtype."""
    n, k = w.shape
    _check_x(_fp8_gemm_kernel, x, k, bias, n, w.weight, w.scale)
    m = x.shape[0]
    scale_block = w.block_k if w.scale.shape[1] > 1 else k
    p = plan(m, n, k, scale_block, x.device, split)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    part = torch.empty((p.split, m, n) if p.split > 1 else (1,), dtype=torch.float32, device=x.device)
    if m == 0:
        return out

    def launch(cfg: LaunchConfig) -> None:
        _fp8_gemm_kernel[(triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), p.split)](
            x, w.weight, w.scale, bias if bias is not None else w.scale, out, part,
            m, n, k, p.tiles_per_split, scale_block,
            x.stride(0), x.stride(1), w.weight.stride(0), w.weight.stride(1), w.scale.stride(0), w.scale.stride(1),
            out.stride(0),
            HAS_BIAS=bias is not None, PARTIAL=p.split > 1, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=p.block_k,
            UPCAST=upcast_in_kernel(_fp8_gemm_kernel, x.dtype), DOT_PRECISION=dot_precision(x.dtype),
            **scheduling_kwargs(_fp8_gemm_kernel, cfg),
        )

    launch_with_fallback(launch, _configs(p, m), ("quant_fp8", x.dtype, p.block_m, p.block_n, p.block_k, x.device))
    return _finish(out, part, bias, p)


def int4_linear(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None = None, *,
                split: int | None = None) -> torch.Tensor:
    """x [M, K] (fp16/bf16/fp32) @ dequantize(w)^T + bias -> [M, N] in x's dtype."""
    n, k = w.shape
    _check_x(_int4_gemm_kernel, x, k, bias, n, w.qweight, w.zeros, w.scales)
    m = x.shape[0]
    p = plan(m, n, k, w.group_size, x.device, split)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    part = torch.empty((p.split, m, n) if p.split > 1 else (1,), dtype=torch.float32, device=x.device)
    if m == 0:
        return out

    def launch(cfg: LaunchConfig) -> None:
        _int4_gemm_kernel[(triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), p.split)](
            x, w.qweight, w.zeros, w.scales, bias if bias is not None else w.scales, out, part,
            m, n, k, w.qweight.shape[0], p.tiles_per_split, w.group_size,
            x.stride(0), x.stride(1), w.qweight.stride(0), w.qweight.stride(1), w.zeros.stride(0),
            w.zeros.stride(1), w.scales.stride(0), w.scales.stride(1), out.stride(0),
            HAS_BIAS=bias is not None, PARTIAL=p.split > 1, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=p.block_k,
            UPCAST=upcast_in_kernel(_int4_gemm_kernel, x.dtype), DOT_PRECISION=dot_precision(x.dtype),
            **scheduling_kwargs(_int4_gemm_kernel, cfg),
        )

    launch_with_fallback(launch, _configs(p, m), ("quant_int4", x.dtype, p.block_m, p.block_n, p.block_k, x.device))
    return _finish(out, part, bias, p)


def quant_linear(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    return fp8_linear(x, w, bias) if isinstance(w, Fp8Weight) else int4_linear(x, w, bias)
