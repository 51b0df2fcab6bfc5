"""The FP8 KV cache (`--kv-cache-dtype fp8`) in the torch attention backend: K/V rows quantized as they
are written and dequantized after each gather. The row format (e4m3 values and a bfloat16 scale per
token and kv head, in one uint8 row) is owned by radixserve/kernels/fp8_format.py, which the Triton kernels
follow bit for bit.
"""

from __future__ import annotations

import torch

from radixserve.kernels.fp8_format import (
    DEQUANTIZE_INTO,
    SCALE_BYTES,
    STORAGE,
    dequantize,
    dequantize_into,
    quantize,
    row_width,
)

__all__ = ["DEQUANTIZE_INTO", "SCALE_BYTES", "STORAGE", "dequantize_into", "is_packed", "readable",
           "row_width", "storable"]


def is_packed(cache: torch.Tensor) -> bool:
    """Is this an FP8 cache (or rows gathered from one)?"""
    return cache.dtype == STORAGE


def readable(cache_rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gathered cache rows as values in `dtype`: dequantized when packed, else converted."""
    return dequantize(cache_rows, dtype) if is_packed(cache_rows) else cache_rows.to(dtype)


def storable(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """New K or V rows [T, H, D] in the form `cache` stores them."""
    return quantize(x) if is_packed(cache) else x.to(cache.dtype)
