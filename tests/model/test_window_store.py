"""The window blocks' storage (model/window_store.py): rows written through per token come back, in
order and right-aligned, as a state slot's windows, also for a layer whose window is shorter than the
longest; copies of whole blocks."""

from __future__ import annotations

import torch

from radixserve.model.spec import WindowKVSpec
from radixserve.model.state_cache import StateCache, StateLayout
from radixserve.model.window_store import WindowStore

BS, HEADS, DIM = 4, 2, 3


def test_written_rows_restore_a_slots_windows_of_every_length() -> None:
    layout = StateLayout((WindowKVSpec(9, HEADS * DIM), WindowKVSpec(5, HEADS * DIM)), torch.float32)
    states = StateCache(layout, 2, torch.device("cpu"))
    store = WindowStore(states, 3, BS, torch.device("cpu"))
    k, v = torch.randn(12, HEADS, DIM), torch.randn(12, HEADS, DIM)  # 12 tokens in window blocks 2, 0, 1
    at = torch.tensor([b * BS + o for b in (2, 0, 1) for o in range(BS)])
    for layer in (0, 1):
        store.write(layer, k * (layer + 1), v * (layer + 1), at)
    rows = tuple(int(r) for r in at[12 - 8:])  # resuming at 12 with the longest window: its last 8 tokens
    store.restore(states, 1, rows)
    expected = torch.cat([k.reshape(12, -1), v.reshape(12, -1)], dim=1)
    assert torch.equal(states.conv[0][1], expected[4:])
    assert torch.equal(states.conv[1][1], 2 * expected[8:])  # window 5 keeps the last 4
    assert not states.conv[0][0].any()  # other slots untouched
    store.copy_block(2, 1)
    assert torch.equal(store.rows[0][1], store.rows[0][2])


def test_a_short_prefix_fills_only_the_rows_it_has() -> None:
    layout = StateLayout((WindowKVSpec(9, HEADS * DIM),), torch.float32)
    states = StateCache(layout, 1, torch.device("cpu"))
    store = WindowStore(states, 2, BS, torch.device("cpu"))
    k, v = torch.randn(3, HEADS, DIM), torch.randn(3, HEADS, DIM)
    store.write(0, k, v, torch.tensor([0, 1, 2]))
    store.restore(states, 0, (0, 1, 2))
    assert torch.equal(states.conv[0][0, 5:], torch.cat([k.reshape(3, -1), v.reshape(3, -1)], dim=1))
    assert not states.conv[0][0, :5].any()
