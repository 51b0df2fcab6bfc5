"""Physical KV storage: one tensor holding K and V of every attention layer for every block, and for
a hybrid model the recurrent layers' states by slot beside it (`states`, model/state_cache.py), and
with window blocks on, the window group's (`windows`): a KVCache of its own holding the sliding-window
layers' K/V by window block (cache/window_blocks.py says which KV block each belongs to).

Layout [num_layers, 2, num_blocks + 1, block_size, num_kv_heads, row]; `k(layer)` / `v(layer)`
are views of shape [num_blocks + 1, block_size, num_kv_heads, row], the layout the attention
backends and kernels take. `row` is head_dim values in the model's dtype (with `kv_dtype` "fp16", in
fp16 whatever the model's: half an fp32 model's bytes, as llama.cpp keeps K/V), or with "fp8"
head_dim e4m3 bytes and their scale in one uint8 row (model/kv_fp8.py), so a block's bytes are
all there is to copy. Blocks 0..num_blocks-1 are the pool's; the extra last one is the scratch
block that padding rows of a padded decode step write and read, so padding never touches a block
the pool can hand out. Which block belongs to whom is the block pool's business, not this module's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.config import KV_CACHE_DTYPES
from radixserve.model import kv_fp8
from radixserve.model.device import to_device
from radixserve.model.state_cache import StateCache


def resolve_kv_dtype(kv_cache_dtype: str, gguf_quantized: bool) -> str:
    """What `--kv-cache-dtype` stores: "auto" is fp16 where a GGUF file's weights run quantized (on
    CPU), as llama.cpp keeps K/V by default: half an fp32 model's bytes per token, so twice the cached
    tokens in the same memory, and a long decode reads half the bytes (docs/quantized.md). Otherwise,
    and for "model", the model's dtype."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    if kv_cache_dtype == "auto":
        return "fp16" if gguf_quantized else "model"
    return kv_cache_dtype


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # the model's: what attention computes in
    kv_dtype: str = "model"  # "model" (or "auto", resolved by the runner): the cache stores `dtype`; "fp16": fp16
    # values; "fp8": packed e4m3 rows (model/kv_fp8.py)

    def __post_init__(self) -> None:
        if self.kv_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_dtype!r}")

    @property
    def storage_dtype(self) -> torch.dtype:
        return {"fp8": kv_fp8.STORAGE, "fp16": torch.float16}.get(self.kv_dtype, self.dtype)

    @property
    def row(self) -> int:
        """Elements of one token's row of one kv head in the cache tensor."""
        return kv_fp8.row_width(self.head_dim) if self.kv_dtype == "fp8" else self.head_dim

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.storage_dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.row * elem

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_block // self.block_size

    def blocks_for_budget(self, memory_mb: float) -> int:
        n = int(memory_mb * 1024 * 1024) // self.bytes_per_block
        if n < 1:
            raise ValueError(f"KV memory budget {memory_mb} MB holds no block of {self.bytes_per_block} bytes")
        return n


class KVCache:
    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.scratch_block = num_blocks
        self.states: StateCache | None = None  # a hybrid model's recurrent states (the runner sets them)
        self.windows: KVCache | None = None  # --sliding-window-kv window-blocks: the window group (the runner sets it)
        self.data = torch.zeros(
            layout.num_layers, 2, num_blocks + 1, layout.block_size, layout.num_kv_heads, layout.row,
            dtype=layout.storage_dtype, device=device,
        )

    def k(self, layer: int) -> torch.Tensor:
        return self.data[layer, 0]

    def v(self, layer: int) -> torch.Tensor:
        return self.data[layer, 1]

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks src[i] -> dst[i] in every layer (the copy in copy-on-write)."""
        if not src:
            return
        device = self.data.device
        s, d = to_device(src, torch.long, device), to_device(dst, torch.long, device)
        self.data[:, :, d] = self.data[:, :, s]
