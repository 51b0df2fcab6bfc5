"""The attention-backend seam between the model and the paged KV cache.

A step is one flattened batch of T new tokens from B sequences (prefill chunks and decode tokens
mixed, in sequence order). Each backend first writes the step's new K/V into the cache at
`slot_mapping` (slot = block * block_size + offset), then lets every new token attend to its own
sequence's whole prefix through the block table, causally. Backends never allocate or free blocks:
the engine guarantees that every slot written belongs to a block owned by exactly one sequence
(copy-on-write happens before the forward).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from radixserve.model.kv_fp8 import DEQUANTIZE_INTO, SCALE_BYTES, dequantize_into, is_packed, readable, storable


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
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, row]: D values, or an FP8 row (kv_fp8.py)
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        ...


# rows with at most this many new tokens (decodes, verifications of drafts, the tail of a prompt)
# share one padded SDPA call per layer; longer prefill chunks run one call each
SHORT_QUERY = 16


class TorchAttentionBackend:
    """Reference-quality backend in plain torch: correct for any dtype on CPU and GPU.

    Short rows (decodes and verifications: at most SHORT_QUERY new tokens) are batched into one
    padded SDPA call per layer, with a causal mask offset by each row's cached prefix; each longer
    prefill chunk runs its own call. Keys and values are gathered a block at a time (`index_select`
    of whole blocks through the block table), block_size times fewer indices than one per token,
    into buffers the backend keeps (`_GatherBuffers`). An FP8 cache (model/kv_fp8.py) is quantized as
    it is written and dequantized after each gather.

    With `cpu_kernel` (the runner sets it where the C++ extension is loaded, `cpu_extension`), short
    rows over a cache the kernel reads (`reads_in_place`) run `radixserve::paged_attention` instead,
    which reads the keys and values where they lie, without a gathered copy or SDPA's setup; the
    compiled step calls the same kernel, so both paths agree bit for bit.
    """

    name = "torch"

    def __init__(self, cpu_kernel: bool = False) -> None:
        self._buffers = _GatherBuffers()
        self.cpu_kernel = cpu_kernel

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):
        flat_k = k_cache.view(-1, *k_cache.shape[2:])
        flat_v = v_cache.view(-1, *v_cache.shape[2:])
        # index_copy_/index_select are several times faster than advanced indexing on CPU
        flat_k.index_copy_(0, meta.slot_mapping, storable(k, k_cache))
        flat_v.index_copy_(0, meta.slot_mapping, storable(v, v_cache))
        out = torch.empty_like(q)
        if self.cpu_kernel and reads_in_place(k_cache):
            torch.ops.radixserve.paged_attention(q, k_cache, v_cache, meta.block_table, meta.seq_lens_host,
                                                 meta.query_lens, scale, SHORT_QUERY, out)
            if all(n <= SHORT_QUERY for n in meta.query_lens):
                return out
        elif (plan := self.short_plan(meta, k_cache.shape[1], q.device)) is not None:
            self._short(q, k_cache, v_cache, plan, scale, out)
            if plan.num_rows == meta.num_seqs:
                return out
        starts = meta.cu_seqlens_q.tolist()
        for b, n in enumerate(meta.query_lens):
            if n <= SHORT_QUERY:
                continue
            total = meta.seq_lens_host[b]
            # [S, Hkv, D]; SDPA shares each kv head across its q heads
            blocks = block_indices(meta.block_table[b:b + 1], total, k_cache.shape[1])
            keys, vals = (self._buffers.read(i, cache, blocks, 1, total, q.dtype)[0]
                          for i, cache in enumerate((k_cache, v_cache)))
            qs = q[starts[b] : starts[b] + n].transpose(0, 1)
            if total == n:  # no cached prefix: plain causal, which SDPA runs without a mask tensor
                mask, causal = None, True
            else:  # query i sits at position total - n + i and sees keys 0..that position
                q_pos = torch.arange(total - n, total, device=q.device)
                mask, causal = torch.arange(total, device=q.device)[None, :] <= q_pos[:, None], False
            # with a batch dimension SDPA takes its flash kernel on CPU; without one, the math path (2x slower)
            o = torch.nn.functional.scaled_dot_product_attention(
                qs[None], keys.transpose(0, 1)[None], vals.transpose(0, 1)[None], attn_mask=mask, is_causal=causal,
                scale=scale, enable_gqa=True,
            )
            out[starts[b] : starts[b] + n] = o[0].transpose(0, 1)
        return out

    @staticmethod
    def short_plan(meta: AttentionMetadata, block_size: int, device: torch.device) -> _ShortPlan | None:
        """The step's short rows' plan (None without any), the same for every layer: made by the first."""
        if "torch_short" not in meta.plans:
            short = [b for b, n in enumerate(meta.query_lens) if n <= SHORT_QUERY]
            meta.plans["torch_short"] = _ShortPlan.of(meta, short, block_size, device) if short else None
        return meta.plans["torch_short"]

    def _short(self, q, k_cache, v_cache, plan, scale, out):
        keys, vals = (self._buffers.read(i, cache, plan.blocks, plan.num_rows, plan.max_len, q.dtype)
                      for i, cache in enumerate((k_cache, v_cache)))
        rows, width = plan.num_rows, plan.max_query
        qs = q if plan.tokens is None else q.index_select(0, plan.tokens)
        qs = qs.view(rows, width, *q.shape[1:]).transpose(1, 2)  # [R, Hq, width, D]
        o = torch.nn.functional.scaled_dot_product_attention(
            qs, keys.transpose(1, 2), vals.transpose(1, 2), attn_mask=plan.mask, scale=scale, enable_gqa=True,
        ).transpose(1, 2).reshape(rows * width, *q.shape[1:])
        if plan.tokens is None:
            out.copy_(o)
        else:
            out.index_copy_(0, plan.targets, o.index_select(0, plan.real))


# what `radixserve::paged_attention` reads: a cache of plain fp32 or bf16 values on CPU, head_dim a
# multiple of 16 (its lanes) up to 128, or 256
IN_PLACE_DTYPES = (torch.float32, torch.bfloat16)
IN_PLACE_HEAD_DIMS = (*range(16, 129, 16), 256)


def reads_in_place(cache: torch.Tensor) -> bool:
    """Whether the C++ kernel reads this cache [blocks, block_size, kv_heads, head_dim] in place."""
    return cache.device.type == "cpu" and cache.dtype in IN_PLACE_DTYPES and cache.shape[-1] in IN_PLACE_HEAD_DIMS


@dataclass
class _ShortPlan:
    """What every layer's attention over the step's short rows reads, made once per step.

    Row b of R has n_b new tokens (at most `max_query`) ending its L_b tokens; its queries sit in
    slots b * max_query + i. `blocks`: the blocks to gather, row by row (`block_indices` of the
    block-table rows, a row's entries past its own blocks replaced by its first block, so masked
    keys are its own and never another sequence's or the scratch block's). `mask` [R, 1, max_query,
    max_len]: query i of row b sees keys 0..L_b - n_b + i; a padding slot (i >= n_b) sees its row's
    keys and its output is dropped. `tokens`: the q row each slot reads (a padding slot its row's
    last token), None when the slots are exactly q's rows in order; `real`: the slots that are not
    padding, and `targets` the q rows they answer. The mask is there even when every row has one
    length: SDPA rounds differently without one, and a row's result should not depend on its
    neighbours'."""

    blocks: torch.Tensor
    num_rows: int
    max_len: int
    max_query: int
    mask: torch.Tensor
    tokens: torch.Tensor | None
    real: torch.Tensor
    targets: torch.Tensor

    @classmethod
    def of(cls, meta: AttentionMetadata, rows: list[int], block_size: int, device: torch.device) -> _ShortPlan:
        lens = [meta.seq_lens_host[b] for b in rows]
        news = [meta.query_lens[b] for b in rows]
        max_len, width = max(lens), max(news)
        every = len(rows) == meta.num_seqs
        table = (meta.block_table if every else meta.block_table[rows])[:, : -(-max_len // block_size)]
        lens_t = torch.tensor(lens, device=device)
        own = torch.arange(table.shape[1], device=device)[None, :] < (lens_t[:, None] + block_size - 1) // block_size
        table = torch.where(own, table, table[:, :1])
        slot = torch.arange(width, device=device)
        news_t = torch.tensor(news, device=device)
        last_seen = (lens_t - news_t)[:, None] + slot[None, :]  # [R, width]: the last key each query sees
        last_seen = torch.minimum(last_seen, lens_t[:, None] - 1)
        mask = (torch.arange(max_len, device=device)[None, None, :] <= last_seen[:, :, None])[:, None]
        real = (slot[None, :] < news_t[:, None]).reshape(-1).nonzero().squeeze(1)
        if every and all(n == width for n in news):
            tokens = None
        else:
            starts = meta.cu_seqlens_q.tolist()
            first = torch.tensor([starts[b] for b in rows], device=device)
            tokens = (first[:, None] + torch.minimum(slot[None, :], news_t[:, None] - 1)).reshape(-1)
        targets = real if tokens is None else tokens[real]
        return cls(block_indices(table, max_len, block_size), len(rows), max_len, width, mask, tokens, real, targets)


def block_indices(table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """The blocks holding each table row's first `length` tokens, flattened row by row (int64, what
    `index_select` takes)."""
    return table[:, : -(-length // block_size)].reshape(-1).long()


class _GatherBuffers:
    """Where the gathered keys (slot 0) and values (slot 1) land, kept between layers and steps (and,
    from an FP8 cache, their dequantized values: slots 2 and 3).

    On CPU a fresh tensor of several megabytes per layer costs more than the gather itself: the
    allocator maps and zeroes new pages each time (batch 16 x 512 tokens: 30 layers' attention took
    55-195 ms with fresh tensors, 40-50 ms with these). A slot grows to the largest gather seen and
    is only ever read before the same slot's next gather, which is the next layer's. CUDA's caching
    allocator already reuses memory, so there (and under CUDA graph capture) the gather allocates."""

    def __init__(self) -> None:
        self._flat: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def read(self, slot: int, cache: torch.Tensor, blocks: torch.Tensor, rows: int, length: int,
             dtype: torch.dtype) -> torch.Tensor:
        """`gather`'s rows as values in `dtype` [rows, length, Hkv, D]: on CPU an FP8 cache's are
        dequantized into kept buffers of their own (slot + 2, and an int16 scratch), any other's converted."""
        gathered = self.gather(slot, cache, blocks, rows, length)
        if not is_packed(gathered) or cache.device.type != "cpu" or dtype not in DEQUANTIZE_INTO:
            return readable(gathered, dtype)
        shape = (*gathered.shape[:-1], gathered.shape[-1] - SCALE_BYTES)
        return dequantize_into(gathered, self._buffer(slot + 2, shape, dtype), self._buffer(slot, shape, torch.int16))

    def gather(self, slot: int, cache: torch.Tensor, blocks: torch.Tensor, rows: int, length: int) -> torch.Tensor:
        """[rows, length, Hkv, D]: the first `length` cached tokens of each row of `blocks`
        (`block_indices`), whole blocks copied at once; a view of the slot's buffer on CPU, valid
        until its next gather."""
        if cache.device.type == "cpu":
            gathered = torch.index_select(cache, 0, blocks, out=self.for_gather(slot, cache, blocks))
        else:
            gathered = cache.index_select(0, blocks)
        return gathered.view(rows, -1, *cache.shape[2:])[:, :length]

    def for_gather(self, slot: int, cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """The slot's buffer shaped for `cache`'s `blocks` (CPU only)."""
        return self._buffer(slot, (blocks.numel(), *cache.shape[1:]), cache.dtype)

    def _buffer(self, slot: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = math.prod(shape)
        flat = self._flat.get((slot, dtype))
        if flat is None or flat.numel() < numel:
            flat = self._flat[(slot, dtype)] = torch.empty(numel, dtype=dtype)
        return flat[:numel].view(shape)


def make_backend(name: str, device: torch.device, cpu_kernel: bool = False) -> AttentionBackend:
    """Resolve --attention-backend: auto picks Triton on CUDA and torch elsewhere. `cpu_kernel`: the
    C++ extension is loaded (`TorchAttentionBackend`)."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return TorchAttentionBackend(cpu_kernel)
    if name == "triton":
        from radixserve.model.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose auto, triton or torch")
