"""Physical storage of the window blocks (`--sliding-window-kv window-blocks`): per window-state layer,
the K/V rows of every token written to a KV block that has a companion (cache/window_blocks.py).

Layout: per window-state layer (the state cache's index), `rows` [num_blocks + 1, block_size,
2 * kv_size] in the model's dtype, a token's row as the layer's window state holds it (its kv heads
flattened, K then V: model/window_kv.py). Blocks 0..num_blocks-1 are the window pool's; the last is
scratch, where the rows of tokens whose KV block has no companion go. Which block belongs to which KV
block is the cache layer's business, not this module's. Nothing reads a window block but a hit's
restore (`restore`), which copies rows into a state slot's windows.
"""

from __future__ import annotations

import torch

from radixserve.model.device import to_device
from radixserve.model.state_cache import StateCache


class WindowStore:
    def __init__(self, states: StateCache, num_blocks: int, block_size: int, device: torch.device) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.scratch_row = num_blocks * block_size
        self.rows = [torch.zeros(num_blocks + 1, block_size, windows.shape[-1], dtype=windows.dtype, device=device)
                     for windows in states.conv]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, at: torch.Tensor) -> None:
        """Store the step's new rows of window-state layer `layer` (k and v [T, Hkv, D]) at rows `at` [T]."""
        tokens = k.shape[0]
        flat = self.rows[layer].view(-1, self.rows[layer].shape[-1])
        flat.index_copy_(0, at, torch.cat([k.reshape(tokens, -1), v.reshape(tokens, -1)], dim=1))

    def restore(self, states: StateCache, slot: int, rows: tuple[int, ...]) -> None:
        """Make `rows` (oldest first, the longest window's) the last rows of `slot`'s windows in every
        layer: the window state right-aligned as model/window_kv.py keeps it (earlier rows are masked,
        left as they are)."""
        if not rows:
            return
        for store, windows in zip(self.rows, states.conv):
            kept = min(len(rows), windows.shape[1])  # a layer with a shorter window than the longest keeps fewer
            index = to_device(list(rows[len(rows) - kept:]), torch.long, store.device)
            windows[slot, windows.shape[1] - kept:] = store.view(-1, store.shape[-1])[index]

    def copy_block(self, src: int, dst: int) -> None:
        for store in self.rows:
            store[dst].copy_(store[src])
