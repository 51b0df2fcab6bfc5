"""Fused elementwise kernels of the decode hot path: `add_rms_norm`, `rotary_qk_`, `silu_and_mul`.

Each one reproduces its plain-torch reference in `kernels.reference` rounding step by rounding step:
values are widened to fp32 on load, and wherever the torch code produces a tensor in the model dtype
the kernel rounds to that dtype too (`_round`, nearest even), then goes on in fp32. Products and sums
of two fp16/bf16 values are formed in fp32 and rounded once, as torch does; divisions and the square
root are the IEEE-rounded forms (`div_rn`, `sqrt_rn`), exp is libdevice's expf (torch's), and fp
contraction into FMAs is off. Rotary is therefore bit-exact, and so is SiLU against torch on CUDA. The
RMS reduction sums in another order than torch, so the normalised value may rarely round one ulp the
other way, which the weight multiply can make two ulps of the result (H100: 4e-6 of bf16 elements).

Invariants, for CUDA-graph capture: the wrappers check shapes and dtypes only (cheap Python), check
values only on CPU (the interpreter), allocate nothing but their outputs on the inputs' device, never
sync, and branch only on shapes. Offsets are int64. Under TRITON_INTERPRET=1 bf16 is raw bits and
the interpreter's fp32 -> bf16 cast truncates, so there `_round` rounds to nearest even on the bits
(EMULATE_BF16) and stores only values that bf16 holds exactly; fp16 and fp32 run the GPU code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from radixserve.kernels.common import SUPPORTED_DTYPES, check_device, is_interpreted, next_pow2, upcast_in_kernel

MAX_NORM_BLOCK = 8192  # longer rows are normalised in a loop over blocks of this many columns
SILU_BLOCK = 1024


@triton.jit
def _round(x, DTYPE: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """fp32 `x` rounded to DTYPE (to nearest, ties to even), returned as fp32."""
    if EMULATE_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(DTYPE).to(tl.float32)


@triton.jit
def _residual_sum(x_row, res_row, new_res_row, stride_xc, stride_rc, stride_nc, cols, mask,
                  HAS_RESIDUAL: tl.constexpr, STORE: tl.constexpr, EMULATE_BF16: tl.constexpr):
    h = tl.load(x_row + cols * stride_xc, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_row + cols * stride_rc, mask=mask, other=0.0).to(tl.float32)
        h = _round(h + r, new_res_row.dtype.element_ty, EMULATE_BF16)
        if STORE:
            tl.store(new_res_row + cols * stride_nc, h.to(new_res_row.dtype.element_ty), mask=mask)
    return h


@triton.jit
def _scale_store(h, rstd, w_ptr, stride_w, out_row, cols, mask, EMULATE_BF16: tl.constexpr):
    dtype = out_row.dtype.element_ty
    w = tl.load(w_ptr + cols * stride_w, mask=mask, other=0.0).to(tl.float32)
    normed = _round(h * rstd, dtype, EMULATE_BF16)
    tl.store(out_row + cols, _round(w * normed, dtype, EMULATE_BF16).to(dtype), mask=mask)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr,
    eps,
    stride_xt, stride_xc, stride_rt, stride_rc, stride_w, stride_ot, stride_nt, stride_nc,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, EMULATE_BF16: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row, res_row = x_ptr + row * stride_xt, res_ptr + row * stride_rt
    out_row, new_res_row = out_ptr + row * stride_ot, new_res_ptr + row * stride_nt
    cols = tl.arange(0, BLOCK)
    if HIDDEN <= BLOCK:  # the whole row stays in registers
        mask = cols < HIDDEN
        h = _residual_sum(x_row, res_row, new_res_row, stride_xc, stride_rc, stride_nc, cols, mask,
                          HAS_RESIDUAL, True, EMULATE_BF16)
        mean_sq = tl.math.div_rn(tl.sum(h * h, 0), tl.full([], HIDDEN, tl.float32))
        rstd = tl.math.div_rn(tl.full([], 1.0, tl.float32), tl.sqrt_rn(mean_sq + eps))
        _scale_store(h, rstd, w_ptr, stride_w, out_row, cols, mask, EMULATE_BF16)
    else:  # pass 1 sums the squares (and writes the residual), pass 2 recomputes the sum and scales
        acc = tl.zeros([BLOCK], tl.float32)
        for start in range(0, HIDDEN, BLOCK):
            mask = start + cols < HIDDEN
            h = _residual_sum(x_row, res_row, new_res_row, stride_xc, stride_rc, stride_nc, start + cols, mask,
                              HAS_RESIDUAL, True, EMULATE_BF16)
            acc += h * h
        mean_sq = tl.math.div_rn(tl.sum(acc, 0), tl.full([], HIDDEN, tl.float32))
        rstd = tl.math.div_rn(tl.full([], 1.0, tl.float32), tl.sqrt_rn(mean_sq + eps))
        for start in range(0, HIDDEN, BLOCK):
            mask = start + cols < HIDDEN
            h = _residual_sum(x_row, res_row, new_res_row, stride_xc, stride_rc, stride_nc, start + cols, mask,
                              HAS_RESIDUAL, False, EMULATE_BF16)
            _scale_store(h, rstd, w_ptr, stride_w, out_row, start + cols, mask, EMULATE_BF16)


@triton.jit
def _rotate_heads(row, stride_h, stride_d, cos, sin, dims, dim_mask,
                  NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr, EMULATE_BF16: tl.constexpr):
    dtype = row.dtype.element_ty
    heads = tl.arange(0, HEADS_PAD)
    mask = (heads < NUM_HEADS)[:, None] & dim_mask[None, :]
    first = row + heads[:, None] * stride_h + dims[None, :] * stride_d
    second = first + HALF * stride_d
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(second, mask=mask, other=0.0).to(tl.float32)
    c, s = cos[None, :], sin[None, :]
    # x * cos + rotate_half(x) * sin, each product and the sum rounded to the dtype as torch does
    out1 = _round(_round(x1 * c, dtype, EMULATE_BF16) + _round(-x2 * s, dtype, EMULATE_BF16), dtype, EMULATE_BF16)
    out2 = _round(_round(x2 * c, dtype, EMULATE_BF16) + _round(x1 * s, dtype, EMULATE_BF16), dtype, EMULATE_BF16)
    tl.store(first, out1.to(dtype), mask=mask)
    tl.store(second, out2.to(dtype), mask=mask)


@triton.jit
def _rotary_qk_kernel(
    q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr,
    max_pos,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd, stride_ct, stride_cd, stride_st, stride_sd,
    NUM_Q_HEADS: tl.constexpr, Q_HEADS_PAD: tl.constexpr, NUM_KV_HEADS: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, EMULATE_BF16: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    if (pos < 0) | (pos >= max_pos):  # never read outside the tables (CPU callers get an error first)
        return
    dtype = q_ptr.dtype.element_ty
    dims = tl.arange(0, HALF_PAD)
    dim_mask = dims < HALF
    cos = tl.load(cos_ptr + pos * stride_ct + dims * stride_cd, mask=dim_mask, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_st + dims * stride_sd, mask=dim_mask, other=0.0)
    cos, sin = _round(cos, dtype, EMULATE_BF16), _round(sin, dtype, EMULATE_BF16)
    _rotate_heads(q_ptr + token * stride_qt, stride_qh, stride_qd, cos, sin, dims, dim_mask,
                  NUM_Q_HEADS, Q_HEADS_PAD, HALF, EMULATE_BF16)
    _rotate_heads(k_ptr + token * stride_kt, stride_kh, stride_kd, cos, sin, dims, dim_mask,
                  NUM_KV_HEADS, KV_HEADS_PAD, HALF, EMULATE_BF16)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr,
    stride_xt, stride_xc, stride_ot,
    INTER: tl.constexpr, BLOCK: tl.constexpr, EMULATE_BF16: tl.constexpr, LIBDEVICE_EXP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_xt + cols * stride_xc, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_xt + (cols + INTER) * stride_xc, mask=mask, other=0.0).to(tl.float32)
    if LIBDEVICE_EXP:  # expf, as torch's CUDA kernel calls it; tl.exp would be the approximate ex2 path
        e = libdevice.exp(-gate)
    else:  # the interpreter: numpy's float32 exp is off by up to 2 ulp, its float64 exp rounds correctly
        e = tl.exp(-gate.to(tl.float64)).to(tl.float32)
    silu = _round(tl.math.div_rn(gate, 1.0 + e), dtype, EMULATE_BF16)
    tl.store(out_ptr + row * stride_ot + cols, _round(silu * up, dtype, EMULATE_BF16).to(dtype), mask=mask)


def _check_dtype(name: str, t: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    if dtype is None and t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} dtype {t.dtype} unsupported; use float16, bfloat16 or float32")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")


def _check_block(block: int | None, default: int) -> int:
    if block is None:
        return default
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    return block


def _output(name: str, given: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """The caller's contiguous buffer (checked) or a fresh one, on `like`'s device in its dtype."""
    if given is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if tuple(given.shape) != shape or given.dtype != like.dtype or given.device != like.device or not given.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {shape} {like.dtype} tensor on {like.device}, "
                         f"got {tuple(given.shape)} {given.dtype} on {given.device}")
    return given


def _launch_opts(kernel: object, elems: int) -> dict[str, object]:
    """Warps by tile size; fp fusion off so no product is contracted into an FMA the reference lacks."""
    if is_interpreted(kernel):
        return {}
    return {"num_warps": min(16, max(1, elems // 256)), "enable_fp_fusion": False}


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    block: int | None = None,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, H] (residual may be None), weight [H] -> (RMSNorm(x + residual) * weight, x + residual).

    With residual None this is plain RMSNorm and the second result is `x` itself (`residual_out` is
    then unused). Keyword-only: `block` (a power of two) overrides the column tile, and rows longer
    than the tile are walked in a loop; `out` / `residual_out` are buffers to write the results into
    instead of fresh tensors.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, hidden], got shape {tuple(x.shape)}")
    _check_dtype("x", x)
    tokens, hidden = x.shape
    if weight.shape != (hidden,):
        raise ValueError(f"weight must have shape ({hidden},), got {tuple(weight.shape)}")
    _check_dtype("weight", weight, x.dtype)
    tensors = [x, weight]
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} differs from x {tuple(x.shape)}")
        _check_dtype("residual", residual, x.dtype)
        tensors.append(residual)
    check_device(_add_rms_norm_kernel, *tensors)
    out = _output("out", out, (tokens, hidden), x)
    new_residual = x if residual is None else _output("residual_out", residual_out, (tokens, hidden), x)
    if tokens == 0 or hidden == 0:
        return out, new_residual
    res = x if residual is None else residual  # unread when HAS_RESIDUAL is off
    blk = _check_block(block, min(next_pow2(hidden), MAX_NORM_BLOCK))
    _add_rms_norm_kernel[(tokens,)](
        x, res, weight, out, new_residual,
        float(eps),
        *x.stride(), *res.stride(), weight.stride(0), out.stride(0), *new_residual.stride(),
        HIDDEN=hidden, BLOCK=blk, HAS_RESIDUAL=residual is not None,
        EMULATE_BF16=upcast_in_kernel(_add_rms_norm_kernel, x.dtype), **_launch_opts(_add_rms_norm_kernel, blk),
    )
    return out, new_residual


def rotary_qk_(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor
) -> None:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place (rotate-half) by the angles at `positions` [T] int64.

    cos_table/sin_table are float32 [max_positions, D / 2]; q and k may be any strided views (e.g.
    of a packed qkv projection). Token t is left untouched if its position is outside the table
    (on CPU that raises instead).
    """
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"q and k must be [tokens, heads, head_dim], got {tuple(q.shape)} and {tuple(k.shape)}")
    tokens, num_q_heads, head_dim = q.shape
    if k.shape[0] != tokens or k.shape[2] != head_dim:
        raise ValueError(f"k shape {tuple(k.shape)} does not match q {tuple(q.shape)} in tokens and head_dim")
    if head_dim % 2:
        raise ValueError(f"rotary head_dim must be even, got {head_dim}")
    _check_dtype("q", q)
    _check_dtype("k", k, q.dtype)
    if positions.dim() != 1 or positions.shape[0] != tokens or positions.dtype != torch.int64:
        raise ValueError(f"positions must be int64 [{tokens}], got {positions.dtype} {tuple(positions.shape)}")
    for name, table in (("cos_table", cos_table), ("sin_table", sin_table)):
        if table.dim() != 2 or table.shape[1] != head_dim // 2 or table.shape != cos_table.shape:
            raise ValueError(f"{name} must be [max_positions, {head_dim // 2}] like cos_table, got {tuple(table.shape)}")
        _check_dtype(name, table, torch.float32)
    check_device(_rotary_qk_kernel, q, k, positions, cos_table, sin_table)
    max_pos = cos_table.shape[0]
    if tokens == 0 or head_dim == 0:
        return
    if positions.device.type != "cuda" and (int(positions.min()) < 0 or int(positions.max()) >= max_pos):
        raise ValueError(f"positions must be in [0, {max_pos}) (the cos/sin table's length)")
    half = head_dim // 2
    q_pad, kv_pad, half_pad = next_pow2(num_q_heads), next_pow2(k.shape[1]), next_pow2(half)
    _rotary_qk_kernel[(tokens,)](
        q, k, positions, cos_table, sin_table,
        max_pos,
        *q.stride(), *k.stride(), *cos_table.stride(), *sin_table.stride(),
        NUM_Q_HEADS=num_q_heads, Q_HEADS_PAD=q_pad, NUM_KV_HEADS=k.shape[1], KV_HEADS_PAD=kv_pad,
        HALF=half, HALF_PAD=half_pad, EMULATE_BF16=upcast_in_kernel(_rotary_qk_kernel, q.dtype),
        **_launch_opts(_rotary_qk_kernel, 2 * q_pad * half_pad),
    )


def silu_and_mul(x: torch.Tensor, *, block: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, 2I] (gate = first I columns, up = last I) -> silu(gate) * up, [T, I] in x's dtype.

    Keyword-only: `block` (a power of two) overrides the column tile; `out` is a buffer to write into.
    """
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be [tokens, 2 * intermediate], got shape {tuple(x.shape)}")
    _check_dtype("x", x)
    check_device(_silu_and_mul_kernel, x)
    tokens, inter = x.shape[0], x.shape[1] // 2
    out = _output("out", out, (tokens, inter), x)
    if tokens == 0 or inter == 0:
        return out
    blk = _check_block(block, min(next_pow2(inter), SILU_BLOCK))
    _silu_and_mul_kernel[(tokens, triton.cdiv(inter, blk))](
        x, out, *x.stride(), out.stride(0),
        INTER=inter, BLOCK=blk, EMULATE_BF16=upcast_in_kernel(_silu_and_mul_kernel, x.dtype),
        LIBDEVICE_EXP=not is_interpreted(_silu_and_mul_kernel), **_launch_opts(_silu_and_mul_kernel, blk),
    )
    return out
