"""FP8 KV rows in the Triton kernels: quantize a tile of K or V rows as `store_kv` writes them, and
dequantize the rows `paged_decode_attention` and `paged_extend_attention` read.

The format is radixserve/kernels/fp8_format.py's, which owns it and is the torch reference: a row of one
token and one kv head is HEAD_DIM e4m3 bytes, then its scale as a bfloat16; scale = the row's largest
magnitude / E4M3_MAX rounded to bfloat16 (at least TINY), values = row / scale clamped to +-E4M3_MAX,
rounded to nearest even. The rounding is done here in integer and power-of-two arithmetic, so that
the casts that follow are exact: the kernels write the torch reference's bytes bit for bit on a GPU
and under the interpreter alike (whose own float casts round half up, and truncate to bfloat16).
Rows are contiguous (`stride_d` 1), as the engine's cache is.
"""

from __future__ import annotations

import triton
import triton.language as tl

from radixserve.kernels import fp8_format

E4M3_MAX: tl.constexpr = tl.constexpr(fp8_format.E4M3_MAX)
TINY: tl.constexpr = tl.constexpr(fp8_format.TINY)  # the scale of an all-zero row
E4M3_MIN_NORMAL: tl.constexpr = tl.constexpr(0.015625)  # 2^-6
SUBNORMAL_STEP: tl.constexpr = tl.constexpr(0.001953125)  # 2^-9: e4m3's subnormals are its multiples
SUBNORMAL_STEP_INV: tl.constexpr = tl.constexpr(512.0)
ROUND_TO_INT: tl.constexpr = tl.constexpr(12582912.0)  # 1.5 * 2^23: x + this - this rounds x to an integer (RNE)


@triton.jit
def _round_mantissa(x, DROP: tl.constexpr):
    """fp32 x with its lowest DROP mantissa bits rounded off, to nearest even (a carry moves into the
    exponent, as it should)."""
    bits = x.to(tl.uint32, bitcast=True)
    lsb = (bits >> DROP) & 1
    rounded = ((bits + ((1 << (DROP - 1)) - 1) + lsb) >> DROP) << DROP
    return rounded.to(tl.float32, bitcast=True)


@triton.jit
def quantize_rows(x):
    """x [R, D] fp32 -> (e4m3 values [R, D] as uint8, scales [R] as bfloat16)."""
    amax = tl.max(tl.abs(x), 1)
    scale = _round_mantissa(tl.maximum(tl.math.div_rn(amax, E4M3_MAX), TINY), 16)  # exactly a bfloat16
    y = tl.math.div_rn(x, scale[:, None])
    y = tl.minimum(tl.maximum(y, -E4M3_MAX), E4M3_MAX)
    normal = _round_mantissa(y, 20)  # 3 mantissa bits
    magnitude = tl.abs(y)
    # powers of two only (a GPU's default division is approximate): exact but for the one rounding wanted
    tiny = ((magnitude * SUBNORMAL_STEP_INV + ROUND_TO_INT) - ROUND_TO_INT) * SUBNORMAL_STEP
    negative = (y.to(tl.uint32, bitcast=True) >> 31) == 1  # the sign bit: -0.0 too
    tiny = tl.where(negative, tiny * -1.0, tiny)  # keeps the sign when it rounds to 0, as torch does (0 - x would not)
    y = tl.where(magnitude >= E4M3_MIN_NORMAL, normal, tiny)  # every value now exact in e4m3
    return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True), scale.to(tl.bfloat16)


@triton.jit
def dequantize_rows(raw, row_ptrs, row_mask, HEAD_DIM: tl.constexpr):
    """raw [R, DIM_PAD] uint8 loaded from the rows at `row_ptrs` [R, 1] -> fp32 values."""
    scale = tl.load((row_ptrs + HEAD_DIM).to(tl.pointer_type(tl.bfloat16)), mask=row_mask, other=0.0)
    return raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale.to(tl.float32)
