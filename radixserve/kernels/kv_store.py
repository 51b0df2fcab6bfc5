"""`store_kv`: scatter one step's new K/V rows into the paged cache (module not named store_kv so the
submodule can never shadow the `kernels.store_kv` function on the package).

One program per new token copies its [Hkv, D] K and V tiles to slot = block * block_size + offset,
converting to the cache dtype, or quantizing each head's row into an FP8 cache (radixserve/kernels/fp8.py).
Slots < 0 are skipped (padding tokens); slots past the cache end are skipped too, so a bad slot can
never write outside the cache (on CPU the wrapper rejects them with an error first). Offsets are
int64: a cache can hold more than 2^31 elements.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radixserve.kernels.common import (
    check_cache_pair,
    check_device,
    is_fp8_cache,
    next_pow2,
    should_check_values,
)
from radixserve.kernels.fp8 import quantize_rows


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    num_slots,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr, KV_FP8: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if (slot < 0) | (slot >= num_slots):
        return
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, DIM_PAD)
    mask = (heads[:, None] < NUM_HEADS) & (dims[None, :] < HEAD_DIM)

    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :] * stride_kd, mask=mask,
                other=0.0)
    rows_k = k_cache_ptr + page * stride_kcb + offset * stride_kcs + heads[:, None] * stride_kch
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :] * stride_vd, mask=mask,
                other=0.0)
    rows_v = v_cache_ptr + page * stride_vcb + offset * stride_vcs + heads[:, None] * stride_vch
    if KV_FP8:
        head_mask = heads[:, None] < NUM_HEADS
        k_values, k_scale = quantize_rows(k.to(tl.float32))
        tl.store(rows_k + dims[None, :] * stride_kcd, k_values, mask=mask)
        tl.store((rows_k + HEAD_DIM).to(tl.pointer_type(tl.bfloat16)), k_scale[:, None], mask=head_mask)
        v_values, v_scale = quantize_rows(v.to(tl.float32))
        tl.store(rows_v + dims[None, :] * stride_vcd, v_values, mask=mask)
        tl.store((rows_v + HEAD_DIM).to(tl.pointer_type(tl.bfloat16)), v_scale[:, None], mask=head_mask)
    else:
        tl.store(rows_k + dims[None, :] * stride_kcd, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(rows_v + dims[None, :] * stride_vcd, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class StoreLaunch:
    """A checked `store_kv` launch for one step's shapes; calling it copies with no validation."""

    num_tokens: int
    num_slots: int
    constants: dict

    def __call__(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        if self.num_tokens == 0:
            return
        _store_kv_kernel[(self.num_tokens,)](
            k, v, k_cache, v_cache, slot_mapping,
            self.num_slots,
            *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
            **self.constants,
        )


def plan_store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> StoreLaunch:
    """Validate a `store_kv` call (see there) and fix its launch parameters."""
    num_blocks, block_size, num_kv_heads, head_dim = check_cache_pair(k_cache, v_cache)
    expected = (slot_mapping.shape[0], num_kv_heads, head_dim) if slot_mapping.dim() == 1 else None
    if slot_mapping.dim() != 1 or slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be a 1-D int64 tensor, got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != expected:
            raise ValueError(f"{name} must have shape {expected} to match slot_mapping and the cache, got {tuple(t.shape)}")
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"{name} dtype {t.dtype} unsupported")
    check_device(_store_kv_kernel, k, v, k_cache, v_cache, slot_mapping)
    num_slots = num_blocks * block_size
    if should_check_values(slot_mapping) and slot_mapping.numel() and int(slot_mapping.max()) >= num_slots:
        raise ValueError(f"slot_mapping holds a slot >= {num_slots} (num_blocks * block_size)")
    constants = {
        "NUM_HEADS": num_kv_heads, "HEAD_DIM": head_dim, "HEADS_PAD": next_pow2(num_kv_heads),
        "DIM_PAD": next_pow2(head_dim), "PAGE_SIZE": block_size, "KV_FP8": is_fp8_cache(k_cache),
    }
    return StoreLaunch(slot_mapping.shape[0], num_slots, constants)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k, v [T, Hkv, D] into k_cache/v_cache [num_blocks, block_size, Hkv, D] at slot_mapping [T] int64
    (or quantized into FP8 caches [num_blocks, block_size, Hkv, D + 2] uint8)."""
    plan_store_kv(k, v, k_cache, v_cache, slot_mapping)(k, v, k_cache, v_cache, slot_mapping)
