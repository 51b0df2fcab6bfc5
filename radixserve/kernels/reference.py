"""Plain-torch references for the paged kernels: slow, obvious, and the ground truth in tests.

Same signatures and semantics as the Triton entry points. Attention math runs in fp32 with an
explicit softmax, one sequence at a time, reading K/V through the block table exactly as the kernels
must; results are cast back to q's dtype. The attention variants (sliding `window`, gpt-oss `sinks`,
Gemma 2 `softcap`) are written out as formulas in `_attend`. Slots < 0 in `store_kv_reference` are skipped (padding).

The fused-kernel references (`add_rms_norm_reference`, `rotary_qk_reference_`, `silu_and_mul_reference`)
are the model's own torch code for those steps, written out here because kernels never import radixserve:
every rounding to the model dtype they perform is one `kernels.fused` must reproduce.
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


def _attend(
    q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, q_pos: torch.Tensor, scale: float,
    window: int | None = None, sinks: torch.Tensor | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """q [n, Hq, D] at absolute positions q_pos attends causally to keys/vals [S, Hkv, D]; fp32 result.

    For query i of head h and key j: s = scale * q.k, then s <- softcap * tanh(s / softcap) with a softcap;
    key j is visible when j <= q_pos[i], and also q_pos[i] - window < j with a window; then
    out = sum_j e^(s_j - m) v_j / (sum_j e^(s_j - m) + e^(sinks[h] - m)) over visible j, m the largest
    of the visible s_j and sinks[h] (the sink term is absent without sinks: a plain softmax).
    """
    group = q.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1)  # [S, Hq, D]
    v = vals.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,shd->hns", q.float(), k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    key_pos = torch.arange(keys.shape[0], device=q.device)[None, :]
    visible = key_pos <= q_pos[:, None]  # [n, S]
    if window is not None:
        visible &= key_pos > q_pos[:, None] - window
    scores = scores.masked_fill(~visible[None], float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        # the sink is one more logit with no value: it joins the softmax and is dropped after
        sink = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    return torch.einsum("hns,shd->nhd", probs, v)


def paged_extend_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
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
        out[lo:hi] = _attend(q[lo:hi], keys, vals, q_pos, scale, window, sinks, softcap).to(q.dtype)
    return out


def paged_decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return paged_extend_attention_reference(q, k_cache, v_cache, block_table, cu, seq_lens, scale, window=window,
                                            sinks=sinks, softcap=softcap)


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = x if residual is None else x + residual  # rounded to x's dtype
    x32 = new_residual.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * normed, new_residual


def rotary_qk_reference_(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor
) -> None:
    """Rotate-half RoPE in place, as radixserve/model/rope.py: cos/sin cast to x's dtype, then x*cos + rot*sin."""
    for x in (q, k):
        half = x.shape[-1] // 2
        cos = cos_table[positions]
        sin = sin_table[positions]
        cos = torch.cat((cos, cos), dim=-1).to(x.dtype).unsqueeze(1)
        sin = torch.cat((sin, sin), dim=-1).to(x.dtype).unsqueeze(1)
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        x.copy_(x * cos + rotated * sin)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
