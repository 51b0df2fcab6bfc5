"""How big the engine's KV pools and sequences may be, decided once at start from the config and the
model: the device pool's blocks (a memory budget, or what the GPU has left after a profiled step),
the host tier's blocks, a hybrid model's recurrent-state slots, the context length, and the longest
sequence the engine accepts.

On CUDA without a budget, the profiled memory holds the state slots or the window blocks too: they
take their bytes out of the KV blocks (by default half of it, as the CPU default gives them as much
as the KV budget).

Invariant: `max_seq_len` <= the device pool's capacity in tokens (less the pin budget when the
operator set neither the context nor the pool), so every accepted sequence fits the
pool on its own (the scheduler's liveness rests on it), and <= `max_model_len`.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.config import DEFAULT_CPU_KV_MB, EngineConfig
from radixserve.engine.host_tier import host_tier_blocks
from radixserve.model.runner import ModelRunner


@dataclass(frozen=True)
class Sizes:
    num_blocks: int  # the device pool
    host_blocks: int  # the host tier (0: off)
    max_model_len: int  # the context length the engine advertises
    max_seq_len: int  # the longest sequence (prompt + generated) it runs
    state_slots: int = 0  # a hybrid model's recurrent-state slots (0: no recurrent layers)
    window_blocks: int = 0  # --sliding-window-kv window-blocks: the window pool (0: off)


def engine_sizes(config: EngineConfig, runner: ModelRunner) -> Sizes:
    limit = runner.spec.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > limit:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's {limit} positions")
    layout = runner.kv_layout()
    state_slots, window_blocks = _state_slots(config, runner), _window_blocks(config, runner)
    if config.num_blocks:
        num_blocks = config.num_blocks
    elif config.kv_cache_memory_mb is None and runner.device.type == "cuda":
        num_blocks = runner.kv_blocks_for_device(config.gpu_memory_utilization, config.max_num_batched_tokens,
                                                 config.max_num_seqs)
        num_blocks, state_slots = _share_with_states(config, runner, num_blocks, state_slots)
        num_blocks, window_blocks = _share_with_windows(config, runner, num_blocks, window_blocks)
    else:
        num_blocks = layout.blocks_for_budget(config.kv_cache_memory_mb or DEFAULT_CPU_KV_MB)
    max_model_len = config.max_model_len or limit
    usable = num_blocks
    if config.max_model_len is None and not config.num_blocks and config.pin_budget > 0:
        # neither the context nor the pool was asked for: a context the pool bounds leaves the pin budget
        # (and a block to copy on write) free, or no prefix could ever be pinned (engine/pins.py)
        usable = max(1, num_blocks - int(config.pin_budget * num_blocks) - 1)
    return Sizes(num_blocks, host_tier_blocks(config.host_cache_mb, layout.bytes_per_block), max_model_len,
                 min(max_model_len, usable * config.block_size), state_slots, window_blocks)


def _window_blocks(config: EngineConfig, runner: ModelRunner) -> int:
    """The window group's pool (`--sliding-window-kv window-blocks`, or what auto chose): what
    `--window-blocks` asks, or as much memory as the KV budget holds. It holds the sliding-window
    layers' K/V, the cache on or off."""
    layout = runner.window_layout()
    if layout is None:
        return 0
    if config.window_blocks is not None:
        return config.window_blocks
    return max(1, int((config.kv_cache_memory_mb or DEFAULT_CPU_KV_MB) * 2**20) // layout.bytes_per_block)


def _state_slots(config: EngineConfig, runner: ModelRunner) -> int:
    layout = runner.state_layout()
    if layout is None:
        return 0
    if config.state_slots is not None:
        return config.state_slots
    # as much memory as the KV pool's budget: a hybrid's few attention layers need little K/V, and its
    # states serve both the running sequences and the checkpoints every hit resumes from
    fits = layout.slots_for_budget(config.kv_cache_memory_mb or DEFAULT_CPU_KV_MB)
    return max(4, min(2 * config.max_num_seqs, fits))


def _share_with_states(config: EngineConfig, runner: ModelRunner, num_blocks: int, slots: int) -> tuple[int, int]:
    """The profiled device memory's `num_blocks` of K/V, less what the state slots take (their
    default: half of it, within the CPU default's bounds)."""
    states = runner.state_layout()
    if states is None:
        return num_blocks, 0
    per_block, per_slot = runner.kv_layout().bytes_per_block, states.bytes_per_slot
    if config.state_slots is None:
        slots = max(4, min(2 * config.max_num_seqs, num_blocks * per_block // 2 // per_slot))
    return _blocks_beside(num_blocks, per_block, slots, per_slot, "state slots", "--state-slots"), slots


def _share_with_windows(config: EngineConfig, runner: ModelRunner, num_blocks: int,
                        window_blocks: int) -> tuple[int, int]:
    """The profiled device memory's `num_blocks` of K/V, less what the window blocks take (their
    default: half of it)."""
    windows = runner.window_layout()
    if windows is None:
        return num_blocks, 0
    per_block, per_window = runner.kv_layout().bytes_per_block, windows.bytes_per_block
    if config.window_blocks is None:
        window_blocks = num_blocks * per_block // 2 // per_window
    return (_blocks_beside(num_blocks, per_block, window_blocks, per_window, "window blocks", "--window-blocks"),
            window_blocks)


def _blocks_beside(num_blocks: int, per_block: int, units: int, per_unit: int, what: str, option: str) -> int:
    """The KV blocks (of `per_block` bytes) left of `num_blocks` once `units` of `per_unit` bytes each
    take their memory out (whole blocks); at least one of each, or a clear error naming the option to
    lower."""
    left = num_blocks - -(-units * per_unit // per_block)
    if left < 1 or units < 1:
        raise ValueError(f"{num_blocks} blocks of device memory for K/V cannot hold {units} {what} of "
                         f"{per_unit / 2**20:.1f} MiB beside any KV block; lower {option} or raise "
                         "--gpu-memory-utilization")
    return left
