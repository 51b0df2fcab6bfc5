"""A step as the window group's layers see it (`--sliding-window-kv window-blocks`): its slots and
block table in window blocks.

The scheduler gives each step a map of KV block -> window block (`Batch.window_blocks`): every block
its items read or write inside their windows. `WindowView` turns the step's KV slots and block table
into the window group's through a lookup over every KV block, on the device: the lookup is reset to
the group's scratch block and takes the map, so a block outside every window (and the KV cache's own
scratch block, which padding rows use) reads the group's scratch block, where no key a query sees lies.
The eager path makes a view per step; the padded decode path keeps one whose tensors are the static
inputs its CUDA graphs replay over (model/decode_graphs.py).

Invariant: every slot a step writes lies in a mapped block (`check_written_blocks_mapped`), so a window
row is never written to the scratch block in place of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def check_written_blocks_mapped(slots: list[int], companions: dict[int, int], block_size: int) -> None:
    """Refuse a step that would write a window row whose KV block has no window block (a scheduler bug)."""
    missing = sorted({s // block_size for s in slots} - companions.keys())
    if missing:
        raise RuntimeError(f"window blocks: the step writes KV blocks {missing[:8]} that have no window block")


@dataclass
class WindowView:
    """The window group's slots and block table, and the device lookup that makes them."""

    lookup: torch.Tensor  # [KV blocks + 1] int32: this step's window block of each KV block, else scratch
    slot_mapping: torch.Tensor  # [max tokens] int64
    block_table: torch.Tensor  # [max rows, max blocks] int32
    scratch_block: int  # the window group's

    @classmethod
    def allocate(cls, kv_blocks: int, scratch_block: int, max_tokens: int, max_rows: int, max_blocks: int,
                 device: torch.device) -> WindowView:
        """`kv_blocks`: the KV cache's blocks, its scratch block being the last (index `kv_blocks`)."""
        return cls(lookup=torch.full((kv_blocks + 1,), scratch_block, dtype=torch.int32, device=device),
                   slot_mapping=torch.zeros(max_tokens, dtype=torch.long, device=device),
                   block_table=torch.full((max_rows, max_blocks), scratch_block, dtype=torch.int32, device=device),
                   scratch_block=scratch_block)

    def fill(self, companions: torch.Tensor, slots: torch.Tensor, table: torch.Tensor, block_size: int) -> None:
        """This step's view into the first rows and tokens of the buffers, from its map (`companions`:
        n KV blocks, then their n window blocks, int64 on the device), its KV slots [tokens] and block
        table [rows, max blocks]."""
        n = companions.numel() // 2
        self.lookup.fill_(self.scratch_block)
        self.lookup.index_put_((companions[:n],), companions[n:].to(torch.int32))
        rows, tokens = table.shape[0], slots.numel()
        assert table.shape[1] == self.block_table.shape[1], "a table as wide as the view's"
        torch.index_select(self.lookup, 0, table.reshape(-1), out=self.block_table[:rows].view(-1))
        blocks = torch.div(slots, block_size, rounding_mode="floor")
        self.slot_mapping[:tokens] = self.lookup[blocks].long() * block_size + slots % block_size
