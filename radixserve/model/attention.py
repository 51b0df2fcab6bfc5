"""The attention-backend seam between the model and the paged KV cache.

A step is one flattened batch of T new tokens from B sequences (prefill chunks and decode tokens
mixed, in sequence order). Each backend first writes the step's new K/V into the cache at
`slot_mapping` (slot = block * block_size + offset), then lets every new token attend to its own
sequence's whole prefix through the block table, causally. Backends never allocate or free blocks:
the engine guarantees that every slot written belongs to a block owned by exactly one sequence
(copy-on-write happens before the forward).

A layer's attention may differ from plain causal softmax attention in three ways, passed per call
(transformers' semantics): `window` (sliding-window attention: the query at position p sees the
keys j with p - window < j <= p), `sinks` (gpt-oss: one logit per q head that joins each softmax's
denominator with no value attached) and `softcap` (Gemma 2: each score s = scale * q.k becomes
softcap * tanh(s / softcap) before masking and softmax). They combine with each other and with GQA,
chunked prefill, mixed batches and every cache dtype.
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
    state_slots: list[int] = field(default_factory=list)  # [B] hybrid models: each item's recurrent-state slot
    # window blocks on: the step as the window group's layers see it, its slots and block table in window
    # blocks (a block outside every item's window may map to the group's scratch block)
    window: AttentionMetadata | None = None

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
        *,
        window: int | None = None,  # keys a query sees, itself included; None: every earlier key
        sinks: torch.Tensor | None = None,  # [Hq]: a sink logit per q head
        softcap: float | None = None,  # scores capped to (-softcap, softcap) by tanh
    ) -> torch.Tensor:  # [T, Hq, D]
        ...


# rows with at most this many new tokens (decodes, verifications of drafts, the tail of a prompt)
# share one padded SDPA call per layer; longer prefill chunks run one call each
SHORT_QUERY = 16
# a long row under a window runs in pieces of this many queries (or the window, if larger), each
# over the keys its own queries see: a long prompt's cost grows with the window, not the prompt
WINDOW_PIECE = 256
# explicit attention (sinks or a softcap, which SDPA has not) holds at most about this many fp32
# scores at once: a long row runs in pieces of queries that fit
EXPLICIT_SCORES = 1 << 24


class TorchAttentionBackend:
    """Reference-quality backend in plain torch: correct for any dtype on CPU and GPU.

    Short rows (decodes and verifications: at most SHORT_QUERY new tokens) are batched into one
    padded SDPA call per layer, with a causal mask offset by each row's cached prefix; each longer
    prefill chunk runs its own call. Keys and values are gathered a block at a time (`index_select`
    of whole blocks through the block table), block_size times fewer indices than one per token,
    into buffers the backend keeps (`_GatherBuffers`). An FP8 cache (model/kv_fp8.py) is quantized as
    it is written and dequantized after each gather.

    With `cpu_kernel` (the runner sets it where the C++ extension is loaded, `cpu_extension`), every
    row over a cache the kernel reads (`reads_in_place`) runs `radixserve::paged_attention` instead,
    which reads the keys and values where they lie, without a gathered copy or SDPA's setup; the
    compiled step calls the same kernel, so both paths agree bit for bit. Prefill chunks run it too:
    its keys fall into partitions fixed by their positions, so a query's result does not depend on
    how its prompt was chunked or which prefix came from the cache, where SDPA's tiling does (8-bit
    activations turned SDPA's last-bit differences into different greedy replies; docs/quantized.md).
    A cold 1,024-token prefill takes 1.15x SDPA's time.

    Variants (`window`, `sinks`, `softcap`): a window is a tighter mask for SDPA, and the gathers
    skip the blocks wholly before the first key a row (or a piece of a long row) sees; the short
    rows' plan is made once per step and window. SDPA has no sinks or softcap: where either is set,
    the attention is computed explicitly in fp32 (`attend`).
    """

    name = "torch"

    def __init__(self, cpu_kernel: bool = False) -> None:
        self._buffers = _GatherBuffers()
        self.cpu_kernel = cpu_kernel

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, *, window=None, sinks=None, softcap=None):
        if window is not None and window < 1 or softcap is not None and softcap <= 0:
            raise ValueError(f"window {window} and softcap {softcap}: positive, or None for none")
        flat_k = k_cache.view(-1, *k_cache.shape[2:])
        flat_v = v_cache.view(-1, *v_cache.shape[2:])
        # index_copy_/index_select are several times faster than advanced indexing on CPU
        flat_k.index_copy_(0, meta.slot_mapping, storable(k, k_cache))
        flat_v.index_copy_(0, meta.slot_mapping, storable(v, v_cache))
        out = torch.empty_like(q)
        if self.cpu_kernel and reads_in_place(k_cache):
            torch.ops.radixserve.paged_attention(q, k_cache, v_cache, meta.block_table, meta.seq_lens_host,
                                                 meta.query_lens, scale, max(meta.query_lens), out, window or 0, sinks,
                                                 softcap or 0.0)
            return out
        else:
            if window is not None and window >= meta.max_seq_len:  # it hides no key: share the full plan
                window = None
            if (plan := self.short_plan(meta, k_cache.shape[1], q.device, window)) is not None:
                self._short(q, k_cache, v_cache, plan, scale, out, sinks, softcap)
                if plan.num_rows == meta.num_seqs:
                    return out
        starts = meta.cu_seqlens_q.tolist()
        for b, n in enumerate(meta.query_lens):
            if n > SHORT_QUERY:
                self._long(q[starts[b] : starts[b] + n], k_cache, v_cache, meta, b, scale, window, sinks, softcap,
                           out[starts[b] : starts[b] + n])
        return out

    @staticmethod
    def short_plan(meta: AttentionMetadata, block_size: int, device: torch.device,
                   window: int | None = None) -> _ShortPlan | None:
        """The step's short rows' plan under `window` (None without any short row), the same for every
        layer with that window: made by the first."""
        key = "torch_short" if window is None else f"torch_short/{window}"
        if key not in meta.plans:
            short = [b for b, n in enumerate(meta.query_lens) if n <= SHORT_QUERY]
            meta.plans[key] = _ShortPlan.of(meta, short, block_size, device, window) if short else None
        return meta.plans[key]

    def _short(self, q, k_cache, v_cache, plan, scale, out, sinks=None, softcap=None):
        keys, vals = (self._buffers.read(i, cache, plan.blocks, plan.num_rows, plan.max_len, q.dtype)
                      for i, cache in enumerate((k_cache, v_cache)))
        rows, width = plan.num_rows, plan.max_query
        qs = q if plan.tokens is None else q.index_select(0, plan.tokens)
        qs = qs.view(rows, width, *q.shape[1:]).transpose(1, 2)  # [R, Hq, width, D]
        o = attend(qs, keys.transpose(1, 2), vals.transpose(1, 2), plan.mask, scale, sinks, softcap)
        o = o.transpose(1, 2).reshape(rows * width, *q.shape[1:])
        if plan.tokens is None:
            out.copy_(o)
        else:
            out.index_copy_(0, plan.targets, o.index_select(0, plan.real))

    def _long(self, q, k_cache, v_cache, meta, b, scale, window, sinks, softcap, out):
        """Row b's n new tokens q [n, Hq, D] into out: in one SDPA call, or under a window or in
        explicit attention in pieces of queries, each over the keys from the first its first query sees."""
        n, total, block_size = q.shape[0], meta.seq_lens_host[b], k_cache.shape[1]
        if window is not None and window >= total:
            window = None
        explicit = sinks is not None or softcap is not None
        piece = n if window is None else min(n, max(window, WINDOW_PIECE))
        if explicit:
            keys_bound = total if window is None else min(total, window + piece)
            piece = min(piece, max(SHORT_QUERY, EXPLICIT_SCORES // (q.shape[1] * keys_bound)))
        for first in range(0, n, piece):
            count = min(piece, n - first)
            start = total - n + first  # the position of the piece's first query
            end = start + count  # its keys are those below end ...
            skip = 0 if window is None else max(0, start + 1 - window) // block_size  # ... in blocks from skip on
            blocks = meta.block_table[b, skip : -(-end // block_size)].long()
            # [S, Hkv, D]; SDPA shares each kv head across its q heads
            keys, vals = (self._buffers.read(i, cache, blocks, 1, end - skip * block_size, q.dtype)[0]
                          for i, cache in enumerate((k_cache, v_cache)))
            mask = None
            if start > 0 or window is not None or explicit:  # else plain causal, which SDPA runs without a mask tensor
                q_pos = torch.arange(start, end, device=q.device)
                mask = visible(q_pos, torch.arange(skip * block_size, end, device=q.device), window)
            qs = q[first : first + count].transpose(0, 1)
            # with a batch dimension SDPA takes its flash kernel on CPU; without one, the math path (2x slower)
            o = attend(qs[None], keys.transpose(0, 1)[None], vals.transpose(0, 1)[None], mask, scale, sinks, softcap)
            out[first : first + count] = o[0].transpose(0, 1)


def visible(q_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[..., Q, K]: whether the query at q_pos [..., Q] sees the key at key_pos [..., K] (causal, and
    inside the window)."""
    keys, queries = key_pos[..., None, :], q_pos[..., :, None]
    seen = keys <= queries
    return seen if window is None else seen & (keys > queries - window)


def attend(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor | None, scale: float,
            sinks: torch.Tensor | None, softcap: float | None) -> torch.Tensor:
    """Attention of q [B, Hq, Q, D] over keys and vals [B, Hkv, K, D] (q head h reads kv head
    h // (Hq / Hkv)) where mask [B or 1, 1, Q, K] is true (None: causal, Q == K), in q's dtype:
    SDPA, or without it where there are sinks or a softcap: fp32 scores (capped), masked, a softmax
    whose denominator has each head's e^sink too, fp32 products. Every query sees some key."""
    if sinks is None and softcap is None:
        return torch.nn.functional.scaled_dot_product_attention(
            q, keys, vals, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True)
    assert mask is not None, "explicit attention takes a mask"
    batch, heads, queries, dim = q.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    grouped = q.float().reshape(batch, kv_heads, heads // kv_heads * queries, dim)  # a kv head's q heads together
    scores = torch.matmul(grouped, keys.float().transpose(-1, -2)).view(batch, heads, queries, length) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, -math.inf)
    top = scores.amax(-1, keepdim=True)
    if sinks is not None:
        sink = sinks.float().view(1, heads, 1, 1)
        top = torch.maximum(top, sink)
    weights = torch.exp(scores - top)
    total = weights.sum(-1, keepdim=True)
    if sinks is not None:
        total = total + torch.exp(sink - top)
    weights = (weights / total).view(batch, kv_heads, -1, length)
    return torch.matmul(weights, vals.float()).view(batch, heads, queries, dim).to(q.dtype)


# what `radixserve::paged_attention` reads: a cache of plain fp32, bf16 or fp16 values on CPU, head_dim a
# multiple of 16 (its lanes) up to 128, or 256, or 512 (Gemma 4's global layers)
IN_PLACE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
IN_PLACE_HEAD_DIMS = (*range(16, 129, 16), 256, 512)


def reads_in_place(cache: torch.Tensor) -> bool:
    """Whether the C++ kernel reads this cache [blocks, block_size, kv_heads, head_dim] in place."""
    return cache.device.type == "cpu" and cache.dtype in IN_PLACE_DTYPES and cache.shape[-1] in IN_PLACE_HEAD_DIMS


@dataclass
class _ShortPlan:
    """What every layer's attention over the step's short rows reads, made once per step and window.

    Row b of R has n_b new tokens (at most `max_query`) ending its L_b tokens; its queries sit in
    slots b * max_query + i. Under a window W a row skips its first s_b blocks, those wholly before
    the first key its first query sees (position L_b - n_b + 1 - W); without one s_b = 0. `blocks`:
    the blocks to gather, row by row (the block-table row's blocks from s_b on, the entries past its
    own blocks replaced by its first gathered block, so masked keys are its own and never another
    sequence's or the scratch block's); gathered key k of row b is its token s_b * block_size + k.
    `mask` [R, 1, max_query, max_len]: query i of row b, at position p = L_b - n_b + i, sees the keys
    at positions up to p (and above p - W); a padding slot (i >= n_b) sees what the row's last query
    sees and its output is dropped. `tokens`: the q row each slot reads (a padding slot its row's
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
    def of(cls, meta: AttentionMetadata, rows: list[int], block_size: int, device: torch.device,
           window: int | None = None) -> _ShortPlan:
        lens = [meta.seq_lens_host[b] for b in rows]
        news = [meta.query_lens[b] for b in rows]
        skips = [0 if window is None else max(0, n - new + 1 - window) // block_size for n, new in zip(lens, news)]
        max_len, width = max(n - s * block_size for n, s in zip(lens, skips)), max(news)
        every = len(rows) == meta.num_seqs
        table = meta.block_table if every else meta.block_table[rows]
        skips_t, lens_t = torch.tensor(skips, device=device), torch.tensor(lens, device=device)
        count = (lens_t + block_size - 1) // block_size - skips_t  # the blocks each row gathers
        entry = torch.arange(-(-max_len // block_size), device=device)[None, :]
        table = table.gather(1, skips_t[:, None] + torch.where(entry < count[:, None], entry, 0))
        slot = torch.arange(width, device=device)
        news_t = torch.tensor(news, device=device)
        last_seen = (lens_t - news_t)[:, None] + slot[None, :]  # [R, width]: the last key each query sees
        last_seen = torch.minimum(last_seen, lens_t[:, None] - 1)
        key_pos = skips_t[:, None] * block_size + torch.arange(max_len, device=device)[None, :]  # [R, max_len]
        mask = visible(last_seen, key_pos, window)[:, None]
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
