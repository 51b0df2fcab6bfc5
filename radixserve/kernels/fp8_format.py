"""The FP8 KV cache's row format, in plain torch: the owner of the format, the CPU engine's own code
(radixserve/model/kv_fp8.py uses it) and the reference of the Triton kernels (radixserve/kernels/fp8.py).

A cached K or V row of one token and one kv head is `head_dim` e4m3 bytes followed by its scale as a
bfloat16 (2 bytes), in one uint8 row of `row_width(head_dim)` bytes. So a block of the cache holds
its values and their scales together, and everything that moves whole blocks (the copy of
copy-on-write, the host tier's write-back and load-back, swap) moves both as they are.

Scale: the row's largest magnitude over E4M3_MAX, at least TINY, rounded to bfloat16 (the range of
float32, so no row's scale underflows or overflows), set when the row is written and never changed:
a token's K/V are written once. Values: x / scale with that rounded scale, clamped to +-E4M3_MAX (a
value past it would become NaN in e4m3), rounded to nearest even; dequantizing is value * scale. An
all-zero row gets the scale TINY and zeros. Per token and head rather than per tensor: no
calibration pass, and one outlier token costs only its own row's precision. Imports only torch.
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
TINY = 1e-30
SCALE_DTYPE = torch.bfloat16
SCALE_BYTES = 2
STORAGE = torch.uint8  # what an FP8 cache tensor holds; no other cache is ever uint8
DEQUANTIZE_INTO = (torch.float32, torch.bfloat16)  # the dtypes `dequantize_into` writes


def row_width(head_dim: int) -> int:
    """Bytes of one token's row of one kv head."""
    return head_dim + SCALE_BYTES


def quantize(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (any float dtype) -> rows [..., D + 2] uint8."""
    x32 = x.float()
    scale = (x32.abs().amax(-1, keepdim=True) / E4M3_MAX).clamp_min(TINY).to(SCALE_DTYPE)
    values = (x32 / scale.float()).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return torch.cat((values.view(STORAGE), scale.view(STORAGE)), dim=-1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows [..., D + 2] uint8 (any strides but a contiguous last dim) -> [..., D] in `dtype`: each the
    float32 product value * scale (exact: 4 and 8 significant bits) rounded once to `dtype`."""
    head_dim = rows.shape[-1] - SCALE_BYTES
    values = rows[..., :head_dim].view(E4M3)
    scale = rows[..., head_dim:].view(SCALE_DTYPE)  # [..., 1]: head_dim and every row stride are even
    return (values.float() * scale.float()).to(dtype)


def dequantize_into(rows: torch.Tensor, out: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """`dequantize(rows, out.dtype)` into `out` (float32 or bfloat16, whose exponent range holds every
    scale), bit for bit, allocating only the scales (`bits`: an int16 scratch tensor of out's shape).
    Integer ops turn each e4m3 byte into a float16 worth exactly its
    value / 256, subnormals included: the byte read as int8 and widened (sign-extended) to int16, then
    shifted left by 7, puts its sign in bit 15, its exponent and mantissa in bits 13..7 and a copy of
    its sign in bit 14, which is cleared. torch runs these vectorized on CPU, where its own float8
    conversion goes one element at a time (7x slower on the reference machine)."""
    head_dim = rows.shape[-1] - SCALE_BYTES
    bits.copy_(rows[..., :head_dim].view(torch.int8)).bitwise_left_shift_(7).bitwise_and_(~0x4000)
    if out.dtype not in DEQUANTIZE_INTO:
        raise ValueError(f"dequantize_into writes float32 or bfloat16, not {out.dtype}")
    scale = rows[..., head_dim:].view(SCALE_DTYPE) * 256  # exact: a power of two
    return out.copy_(bits.view(torch.float16)).mul_(scale.to(out.dtype))  # the value / 256: exact in either
