"""engine/sizing.py on CUDA without a budget: a hybrid's state slots, or a window group's blocks, come
out of the profiled memory's K/V blocks (half of it by default, or what --state-slots or
--window-blocks asks), never on top of it; too many is a clear error. (A fake runner stands in for
the profiled device.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from radixserve.config import EngineConfig
from radixserve.engine.sizing import engine_sizes

BLOCK_BYTES, SLOT_BYTES, WINDOW_BLOCK_BYTES, PROFILED_BLOCKS = 1000, 10_000, 5000, 1000


class FakeRunner:
    def __init__(self, hybrid: bool, windows: bool = False) -> None:
        self.spec = SimpleNamespace(max_position_embeddings=1 << 20)
        self.device = torch.device("cuda")  # only its type is read: nothing is allocated
        self.hybrid, self.windows = hybrid, windows

    def window_layout(self) -> SimpleNamespace | None:
        return SimpleNamespace(bytes_per_block=WINDOW_BLOCK_BYTES) if self.windows else None

    def kv_layout(self) -> SimpleNamespace:
        return SimpleNamespace(bytes_per_block=BLOCK_BYTES)

    def state_layout(self) -> SimpleNamespace | None:
        return SimpleNamespace(bytes_per_slot=SLOT_BYTES, slots_for_budget=lambda mb: 3) if self.hybrid else None

    def kv_blocks_for_device(self, utilization: float, max_step_tokens: int, max_batch: int) -> int:
        return PROFILED_BLOCKS


def _sizes(hybrid: bool, **config: object) -> tuple[int, int]:
    sizes = engine_sizes(EngineConfig(**config), FakeRunner(hybrid))  # type: ignore[arg-type]
    return sizes.num_blocks, sizes.state_slots


def test_state_slots_share_the_profiled_memory_with_the_kv_blocks() -> None:
    assert _sizes(False) == (PROFILED_BLOCKS, 0)
    # by default half the bytes: 500 blocks' worth holds 50 slots
    assert _sizes(True) == (PROFILED_BLOCKS // 2, PROFILED_BLOCKS * BLOCK_BYTES // 2 // SLOT_BYTES)
    assert _sizes(True, max_num_seqs=8) == (PROFILED_BLOCKS - 16 * SLOT_BYTES // BLOCK_BYTES, 16)  # 2 x max_num_seqs
    assert _sizes(True, state_slots=10) == (PROFILED_BLOCKS - 10 * SLOT_BYTES // BLOCK_BYTES, 10)
    with pytest.raises(ValueError, match="lower --state-slots"):
        _sizes(True, state_slots=100)


def test_an_explicit_pool_or_budget_leaves_the_slots_apart() -> None:
    assert _sizes(True, num_blocks=64, state_slots=10) == (64, 10)
    assert _sizes(True, num_blocks=64) == (64, 4)  # the CPU default: what the budget holds, at least 4


def test_window_blocks_share_the_profiled_memory_with_the_kv_blocks() -> None:
    def sizes(**config: object) -> tuple[int, int]:
        got = engine_sizes(EngineConfig(**config), FakeRunner(False, windows=True))  # type: ignore[arg-type]
        return got.num_blocks, got.window_blocks

    # by default half the bytes: 500 KV blocks' worth holds 100 window blocks
    assert sizes() == (PROFILED_BLOCKS // 2, PROFILED_BLOCKS * BLOCK_BYTES // 2 // WINDOW_BLOCK_BYTES)
    assert sizes(window_blocks=10) == (PROFILED_BLOCKS - 10 * WINDOW_BLOCK_BYTES // BLOCK_BYTES, 10)
    assert sizes(num_blocks=64, window_blocks=10) == (64, 10)  # an explicit pool: apart
    with pytest.raises(ValueError, match="lower --window-blocks"):
        sizes(window_blocks=200)
