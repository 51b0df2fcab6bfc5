"""The Triton attention backend: paged kernels from the top-level `kernels` package.

Per layer and step: store the step's K/V into the cache (`store_kv`), then run the split-K decode
kernel when every sequence has exactly one new token, otherwise the extend kernel, which handles
prefill chunks over a cached prefix and decodes in one launch. Host-side lengths from the metadata
size the launches, so no device sync happens here. Runs on CUDA, or on CPU under the Triton
interpreter (tests); anything else gets a clear error from the kernels.
"""

from __future__ import annotations

import torch

from radixserve.model.attention import AttentionMetadata


class TritonAttentionBackend:
    name = "triton"

    def __init__(self) -> None:
        # resolved now, not at the first forward: a missing or broken triton fails at engine start
        from kernels import paged_decode_attention, paged_extend_attention, store_kv

        self._decode = paged_decode_attention
        self._extend = paged_extend_attention
        self._store_kv = store_kv

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        self._store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        query = q if q.dtype == k_cache.dtype else q.to(k_cache.dtype)
        if meta.num_seqs == 0:
            return torch.empty_like(q)
        if meta.all_decode:
            out = self._decode(
                query, k_cache, v_cache, meta.block_table, meta.seq_lens, scale,
                max_seq_len=max(meta.seq_lens_host),
            )
        else:
            out = self._extend(
                query, k_cache, v_cache, meta.block_table, meta.cu_seqlens_q, meta.seq_lens, scale,
                max_query_len=max(meta.query_lens),
            )
        return out if out.dtype == q.dtype else out.to(q.dtype)
