"""Runs one scheduled batch through the model: flattens it into tensors, applies the batch's
copy-on-write block copies, calls the forward pass and returns logits for the sampling rows.

Owns the model, the KV cache tensors and the attention backend; knows nothing of scheduling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.core import Batch
from radixserve.model.attention import AttentionMetadata, make_backend
from radixserve.model.device import resolve_device, resolve_dtype
from radixserve.model.kv_cache import KVCache, KVLayout
from radixserve.model.loader import load_model


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # index into the T tokens of each row whose logits are sampled


class ModelRunner:
    def __init__(self, model_dir: str, dtype: str, device: str, backend: str, block_size: int,
                 load_format: str = "auto") -> None:
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.model, self.spec = load_model(model_dir, self.dtype, self.device, load_format)
        self.backend = make_backend(backend, self.device)
        if self.backend.name == "triton" and block_size < 16:  # tl.dot needs K >= 16 on NVIDIA GPUs
            raise ValueError(f"the triton attention backend needs block_size >= 16, got {block_size}")
        self.block_size = block_size
        self.kv_cache: KVCache | None = None

    def kv_layout(self) -> KVLayout:
        s = self.spec
        return KVLayout(s.num_layers, s.num_kv_heads, s.head_dim, self.block_size, self.dtype)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_cache = KVCache(self.kv_layout(), num_blocks, self.device)

    def prepare(self, batch: Batch) -> StepInputs:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu = [0]
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        bs = self.block_size
        max_blocks = 1
        for item in batch.items:
            seq, start, n = item.seq, item.start, item.num_tokens
            ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            cu.append(cu[-1] + n)
            seq_lens.append(start + n)
            max_blocks = max(max_blocks, len(table))
            if item.samples:
                sample_rows.append(cu[-1] - 1)
        tables = [it.seq.block_table + [0] * (max_blocks - len(it.seq.block_table)) for it in batch.items]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_table=torch.tensor(tables, dtype=torch.int32, device=dev),
            query_lens=[it.num_tokens for it in batch.items],
            seq_lens_host=seq_lens,
        )
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            meta=meta,
            sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=dev),
        )

    @torch.inference_mode()
    def run(self, batch: Batch) -> torch.Tensor:
        """Logits [rows, vocab] (fp32) for the batch items whose chunk reaches their last token."""
        assert self.kv_cache is not None, "allocate_kv_cache first"
        if batch.copies:
            src, dst = zip(*batch.copies)
            self.kv_cache.copy_blocks(list(src), list(dst))
        inputs = self.prepare(batch)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta, self.backend)
        if inputs.sample_rows.numel() == 0:
            return hidden.new_empty((0, self.spec.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden[inputs.sample_rows])

    def run_each(self, batch: Batch) -> list[torch.Tensor | None]:
        """Run each item of a batch on its own (after a batched forward failed): per item, its logits
        rows (0 or 1) or None where its own forward fails. Copy-on-write copies are idempotent, so
        each item takes the ones that fill its own blocks."""
        out: list[torch.Tensor | None] = []
        for item in batch.items:
            own = set(item.seq.block_table)
            try:
                out.append(self.run(Batch([item], [c for c in batch.copies if c[1] in own])))
            except Exception:
                out.append(None)
        return out
