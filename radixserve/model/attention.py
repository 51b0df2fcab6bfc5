"""The attention-backend seam between the model and the paged KV cache.

A step is one flattened batch of T new tokens from B sequences (prefill chunks and decode tokens
mixed, in sequence order). Each backend first writes the step's new K/V into the cache at
`slot_mapping` (slot = block * block_size + offset), then lets every new token attend to its own
sequence's whole prefix through the block table, causally. Backends never allocate or free blocks:
the engine guarantees that every slot written belongs to a block owned by exactly one sequence
(copy-on-write happens before the forward).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    cu_seqlens_q: torch.Tensor  # [B+1] int32: new tokens of sequence b are q[cu[b]:cu[b+1]]
    seq_lens: torch.Tensor  # [B] int32: total tokens of each sequence incl. the new ones
    block_table: torch.Tensor  # [B, max_blocks] int32: physical block of each logical block
    query_lens: list[int]  # host copies of the above, so backends need no device sync
    seq_lens_host: list[int]
    # host upper bound on seq_lens that sizes launches: max(seq_lens_host) on eager steps, the longest
    # possible sequence in a CUDA graph (whose launches must suit any lengths it is replayed with)
    max_seq_len: int = 0
    plans: dict[str, Any] = field(default_factory=dict)  # a backend's launch plans for this step, made once

    def __post_init__(self) -> None:
        if not self.max_seq_len and self.seq_lens_host:
            self.max_seq_len = max(self.seq_lens_host)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def all_decode(self) -> bool:
        return all(n == 1 for n in self.query_lens)


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        ...


class TorchAttentionBackend:
    """Reference-quality backend in plain torch: correct for any dtype on CPU and GPU.

    Decodes are batched into one padded SDPA call; each prefill chunk runs its own call with a
    causal mask offset by its cached prefix length.
    """

    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):
        block_size = k_cache.shape[1]
        flat_k = k_cache.view(-1, *k_cache.shape[2:])
        flat_v = v_cache.view(-1, *v_cache.shape[2:])
        # index_copy_/index_select are several times faster than advanced indexing on CPU
        flat_k.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        flat_v.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        out = torch.empty_like(q)
        decode_rows = [b for b, n in enumerate(meta.query_lens) if n == 1]
        if decode_rows:
            self._decode(q, flat_k, flat_v, meta, decode_rows, block_size, scale, out)
        starts = meta.cu_seqlens_q.tolist()
        for b, n in enumerate(meta.query_lens):
            if n == 1:
                continue
            total = meta.seq_lens_host[b]
            slots = _slots(meta.block_table[b], total, block_size)
            # [S, Hkv, D]; SDPA shares each kv head across its q heads
            keys = flat_k.index_select(0, slots).to(q.dtype)
            vals = flat_v.index_select(0, slots).to(q.dtype)
            qs = q[starts[b] : starts[b] + n].transpose(0, 1)
            if total == n:  # no cached prefix: plain causal, which SDPA runs without a mask tensor
                mask, causal = None, True
            else:  # query i sits at position total - n + i and sees keys 0..that position
                q_pos = torch.arange(total - n, total, device=q.device)
                mask, causal = torch.arange(total, device=q.device)[None, :] <= q_pos[:, None], False
            o = torch.nn.functional.scaled_dot_product_attention(
                qs, keys.transpose(0, 1), vals.transpose(0, 1), attn_mask=mask, is_causal=causal, scale=scale,
                enable_gqa=True,
            )
            out[starts[b] : starts[b] + n] = o.transpose(0, 1)
        return out

    @staticmethod
    def _decode(q, flat_k, flat_v, meta, rows, block_size, scale, out):
        starts = meta.cu_seqlens_q.tolist()
        lens = [meta.seq_lens_host[b] for b in rows]
        max_len = max(lens)
        device = q.device
        offsets = torch.arange(max_len, device=device)
        table = meta.block_table[rows].long()  # [R, max_blocks]
        blocks = table.gather(1, (offsets // block_size).clamp(max=table.shape[1] - 1).expand(len(rows), -1))
        slots = blocks * block_size + offsets % block_size  # [R, L]
        lens_t = torch.tensor(lens, device=device)
        valid = offsets[None, :] < lens_t[:, None]  # [R, L]
        slots = torch.where(valid, slots, torch.zeros_like(slots))
        shape = (*slots.shape, *flat_k.shape[1:])  # [R, L, Hkv, D]
        keys = flat_k.index_select(0, slots.view(-1)).view(shape).to(q.dtype)
        vals = flat_v.index_select(0, slots.view(-1)).view(shape).to(q.dtype)
        idx = torch.tensor([starts[b] for b in rows], device=device)
        qs = q[idx].unsqueeze(2)  # [R, Hq, 1, D]
        o = torch.nn.functional.scaled_dot_product_attention(
            qs, keys.transpose(1, 2), vals.transpose(1, 2), attn_mask=valid[:, None, None, :], scale=scale,
            enable_gqa=True,
        )
        out[idx] = o.squeeze(2)


def _slots(block_row: torch.Tensor, total: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(total, device=block_row.device)
    return block_row.long()[pos // block_size] * block_size + pos % block_size


def make_backend(name: str, device: torch.device) -> AttentionBackend:
    """Resolve --attention-backend: auto picks Triton on CUDA and torch elsewhere."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        from radixserve.model.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose auto, triton or torch")
