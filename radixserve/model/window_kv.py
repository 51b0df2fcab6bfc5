"""Sliding-window attention over keys and values kept as a per-sequence state, not in paged blocks.

A window-state layer (`spec.WindowKVSpec`, `--sliding-window-kv window`) keeps, in each sequence's
state slot, the K and V rows of the last `window - 1` tokens before the sequence's next position:
`windows` [slots + 1, window - 1, 2 * kv_size] (the state cache's `conv` tensor of the layer), each
row a token's kv heads flattened, K then V, oldest first. That is everything a later query reads
besides the step's own new tokens: the query at p sees the keys p - window < j <= p. So the layer's
memory per sequence is fixed whatever its length, and the radix tree resumes such a model like any
hybrid: at a checkpoint, a copy of a slot (docs/hybrid_cache.md, "Sliding-window layers").

Invariant: after a step each item's slot holds its last `window - 1` tokens' rows, right-aligned:
row r is position next - window + 1 + r, where `next` is the item's first position not yet computed.
Rows at negative positions (a sequence shorter than the window) hold anything and are masked out,
so a fresh slot needs no zeroing. One-token items run as one batched attention over their slots;
longer items (prefill chunks, verifications of drafts) one by one, in pieces of queries.
"""

from __future__ import annotations

import torch

from radixserve.model.attention import EXPLICIT_SCORES, SHORT_QUERY, WINDOW_PIECE, AttentionMetadata, attend, visible


def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, windows: torch.Tensor | None,
                     meta: AttentionMetadata, scale: float, window: int, sinks: torch.Tensor | None,
                     softcap: float | None, slots: list[int] | None = None, update: bool = True) -> torch.Tensor:
    """q [T, Hq, D], the step's new k and v [T, Hkv, D] -> out [T, Hq, D]; `windows` is read at
    `slots` (default `meta.state_slots`) and, with `update`, moved on past the step's rows there
    (a layer reading another's K/V reads the other's windows as they were before the step, and leaves
    them). `windows` None: a probe forward (no state cache), each item from an empty window."""
    tokens, kv_heads, head_dim = k.shape
    rows = torch.cat([k.reshape(tokens, -1), v.reshape(tokens, -1)], dim=1)  # [T, 2 * Hkv * D]
    keep = window - 1
    if windows is None:
        windows = rows.new_zeros(meta.num_seqs, keep, rows.shape[1])
        slots = list(range(meta.num_seqs))
    elif slots is None:
        slots = meta.state_slots
    out = torch.empty_like(q)
    starts = meta.cu_seqlens_q.tolist()
    single = [b for b, n in enumerate(meta.query_lens) if n == 1]
    if single:
        _one_token_items(q, rows, windows, meta, single, [starts[b] for b in single], [slots[b] for b in single],
                         kv_heads, scale, window, sinks, softcap, out, update)
    for b, n in enumerate(meta.query_lens):
        if n > 1:
            first = starts[b]
            _item(q[first:first + n], rows[first:first + n], windows, slots[b], meta.seq_lens_host[b] - n,
                  kv_heads, scale, window, sinks, softcap, out[first:first + n], update)
    return out


def _one_token_items(q, rows, windows, meta, items, tokens, slots, kv_heads, scale, window, sinks, softcap, out,
                     update):
    device = q.device
    token_index = torch.tensor(tokens, dtype=torch.long).to(device, non_blocking=True)
    slot_index = torch.tensor(slots, dtype=torch.long).to(device, non_blocking=True)
    seen = torch.cat([windows[slot_index], rows.index_select(0, token_index)[:, None]], dim=1)  # [B, window, C]
    if window > 1 and update:
        windows[slot_index] = seen[:, 1:]
    keys, vals = _heads(seen, kv_heads)  # [B, Hkv, window, D]
    positions = torch.tensor([meta.seq_lens_host[b] - 1 for b in items], device=device)
    key_pos = positions[:, None] - window + 1 + torch.arange(window, device=device)[None, :]
    mask = (key_pos >= 0)[:, None, None, :]  # [B, 1, 1, window]: the window's keys are all causal
    o = attend(q.index_select(0, token_index)[:, :, None], keys, vals, mask, scale, sinks, softcap)
    out.index_copy_(0, token_index, o[:, :, 0])


def _item(q, rows, windows, slot, start, kv_heads, scale, window, sinks, softcap, out, update):
    """One item's n new tokens at positions start.. after its slot's rows, in pieces of queries: a
    piece's keys start at the first its first query sees."""
    keep, n = window - 1, q.shape[0]
    seen = torch.cat([windows[slot], rows])  # [keep + n, C]: row i is position start - keep + i
    if keep and update:
        windows[slot] = seen[-keep:]
    keys, vals = _heads(seen[None], kv_heads)
    piece = WINDOW_PIECE
    if sinks is not None or softcap is not None:  # explicit attention holds its fp32 scores: bound them
        piece = max(SHORT_QUERY, min(piece, EXPLICIT_SCORES // (q.shape[1] * (keep + piece))))
    for first in range(0, n, piece):
        count = min(piece, n - first)
        q_pos = torch.arange(start + first, start + first + count, device=q.device)
        key_pos = torch.arange(start + first - keep, start + first + count, device=q.device)
        mask = visible(q_pos, key_pos, window) & (key_pos >= 0)[None, :]
        span = slice(first, first + keep + count)
        o = attend(q[first:first + count].transpose(0, 1)[None], keys[:, :, span], vals[:, :, span], mask[None, None],
                   scale, sinks, softcap)
        out[first:first + count] = o[0].transpose(0, 1)


def _heads(seen: torch.Tensor, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, L, 2 * Hkv * D] rows -> keys and values [B, Hkv, L, D]."""
    batch, length, width = seen.shape
    keys, vals = seen.view(batch, length, 2, kv_heads, width // (2 * kv_heads)).unbind(2)
    return keys.transpose(1, 2), vals.transpose(1, 2)
