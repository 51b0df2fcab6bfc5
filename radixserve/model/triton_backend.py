"""The Triton attention backend: paged kernels from the top-level `kernels` package.

Per layer and step: store the step's K/V into the cache (`store_kv`), then run the split-K decode
kernel when every sequence has exactly one new token, otherwise the extend kernel, which handles
prefill chunks over a cached prefix and decodes in one launch. Arguments are validated and launch
parameters fixed once per step (the first layer makes the plans, kept on the step's metadata); every
layer then only launches. Host-side lengths from the metadata size the launches, so no device sync
happens here, and a decode plan sized by `meta.max_seq_len` replays inside a CUDA graph. Runs on
CUDA, or on CPU under the Triton interpreter (tests); anything else gets a clear error from the kernels.

Layers may differ in sliding window, softcap and whether they have attention sinks, so attention plans
are keyed by those: each kind of layer plans once per step. The sinks tensor is a layer's own and
goes to the launch, never into a plan.
"""

from __future__ import annotations

import torch

from radixserve.model.attention import AttentionMetadata
from radixserve.model.kv_fp8 import is_packed


class TritonAttentionBackend:
    name = "triton"

    def __init__(self) -> None:
        # resolved now, not at the first forward: a missing or broken triton fails at engine start
        from radixserve.kernels.decode import plan_decode
        from radixserve.kernels.extend import plan_extend
        from radixserve.kernels.kv_store import plan_store_kv

        self._plan_decode = plan_decode
        self._plan_extend = plan_extend
        self._plan_store = plan_store_kv

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        plans = meta.plans
        if "store" not in plans:
            plans["store"] = self._plan_store(k, v, k_cache, v_cache, meta.slot_mapping)
        plans["store"](k, v, k_cache, v_cache, meta.slot_mapping)
        # an FP8 cache is read in the model's dtype; any other cache in its own
        query = q if q.dtype == k_cache.dtype or is_packed(k_cache) else q.to(k_cache.dtype)
        if meta.num_seqs == 0:
            return torch.empty_like(q)
        # scale too: it is baked into the plan, and nothing says every layer's is the same
        variant = f"scale={scale},window={window},softcap={softcap},sinks={sinks is not None}"
        if meta.all_decode:
            key = f"decode:{variant}"
            if key not in plans:
                plans[key] = self._plan_decode(query, k_cache, v_cache, meta.block_table, meta.seq_lens, scale,
                                               max_seq_len=meta.max_seq_len, window=window, sinks=sinks,
                                               softcap=softcap)
            out = plans[key](query, k_cache, v_cache, meta.block_table, meta.seq_lens, sinks=sinks)
        else:
            key = f"extend:{variant}"
            if key not in plans:
                plans[key] = self._plan_extend(query, k_cache, v_cache, meta.block_table, meta.cu_seqlens_q,
                                               meta.seq_lens, scale, max_query_len=max(meta.query_lens),
                                               window=window, sinks=sinks, softcap=softcap)
            out = plans[key](query, k_cache, v_cache, meta.block_table, meta.cu_seqlens_q, meta.seq_lens,
                             sinks=sinks)
        return out if out.dtype == q.dtype else out.to(q.dtype)
