"""Physical KV storage: one tensor holding K and V of every layer for every block.

Layout [num_layers, 2, num_blocks + 1, block_size, num_kv_heads, head_dim]; `k(layer)` / `v(layer)`
are views of shape [num_blocks + 1, block_size, num_kv_heads, head_dim], the layout the attention
backends and kernels take. Blocks 0..num_blocks-1 are the pool's; the extra last one is the scratch
block that padding rows of a padded decode step write and read, so padding never touches a block
the pool can hand out. Which block belongs to whom is the block pool's business, not this module's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.model.device import to_device


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

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
        self.data = torch.zeros(
            layout.num_layers, 2, num_blocks + 1, layout.block_size, layout.num_kv_heads, layout.head_dim,
            dtype=layout.dtype, device=device,
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
