"""Plain-torch references for the paged kernels: slow, obvious, and the ground truth in tests.

Same signatures and semantics as the Triton entry points. Attention math runs in fp32 with an
explicit softmax, one sequence at a time, reading K/V through the block table exactly as the kernels
must; results are cast back to q's dtype. Slots < 0 in `store_kv_reference` are skipped (padding).
"""

from __future__ import annotations

import torch


def store_kv_reference(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    flat_k[slots] = k[keep].to(k_cache.dtype)
    flat_v[slots] = v[keep].to(v_cache.dtype)


def gather_sequence(cache: torch.Tensor, block_row: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence as a contiguous [length, Hkv, D] tensor."""
    block_size = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    blocks = block_row.long()[pos // block_size]
    return cache[blocks, pos % block_size]


def _attend(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, q_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, Hq, D] at absolute positions q_pos attends causally to keys/vals [S, Hkv, D]; fp32 result."""
    group = q.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1)  # [S, Hq, D]
    v = vals.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,shd->hns", q.float(), k) * scale
    visible = torch.arange(keys.shape[0], device=q.device)[None, :] <= q_pos[:, None]  # [n, S]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hns,shd->nhd", probs, v)


def paged_extend_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    for b, total in enumerate(seq_lens.tolist()):
        lo, hi = starts[b], starts[b + 1]
        n = hi - lo
        if n == 0:
            continue
        keys = gather_sequence(k_cache, block_table[b], total)
        vals = gather_sequence(v_cache, block_table[b], total)
        q_pos = torch.arange(total - n, total, device=q.device)
        out[lo:hi] = _attend(q[lo:hi], keys, vals, q_pos, scale).to(q.dtype)
    return out


def paged_decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return paged_extend_attention_reference(q, k_cache, v_cache, block_table, cu, seq_lens, scale)
