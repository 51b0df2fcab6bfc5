"""What the scheduler publishes about itself: a `SchedulerSnapshot` of its queues, preemptions, swaps,
admission and the pool's blocks, taken by `snapshot(scheduler)` on the thread that steps it.

Readers (engine/stats.py, and through it /v1/cache/stats and /metrics) build on snapshots and never
on the scheduler's attributes, so what the scheduler keeps and how is its own affair.

Invariants: a snapshot is immutable and shares nothing mutable with the scheduler (the by-cause
counts are read-only copies), so it may be handed to any thread. The block split (free / used: held
by a live sequence or on a pinned path, which nothing can evict either / cached: held only by the
radix tree, evictable) takes a pass over every block table and tree node, so it is counted only when
asked (`count_blocks`), and then free + used + cached == blocks_total.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixserve.scheduler.scheduler import Scheduler


@dataclass(frozen=True)
class BlockCounts:
    free: int
    used: int  # held by at least one live sequence or a pin (engine/pins.py: a hold on its path)
    cached: int  # held only by the radix tree: evictable


@dataclass(frozen=True)
class SchedulerSnapshot:
    num_running: int
    num_waiting: int
    preemptions: int
    preemptions_by_cause: Mapping[str, int]
    swaps_out: int  # preemptions by swap (the rest recompute)
    swaps_in: int  # swapped sequences resumed
    admission_blocked: Mapping[str, int]  # steps whose admission stopped, by cause
    new_token_ratio: float  # output-aware admission's ratio now (scheduler/admission.py)
    growth_reserve_blocks: int  # the blocks the last admission pass kept for running sequences' growth
    blocks_total: int
    blocks: BlockCounts | None  # None unless counted


def snapshot(scheduler: Scheduler, count_blocks: bool = False) -> SchedulerSnapshot:
    """The scheduler's state now; `count_blocks` adds the block split (a pass over all blocks)."""
    pool = scheduler.pool
    return SchedulerSnapshot(
        num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
        preemptions=scheduler.preemptions, preemptions_by_cause=MappingProxyType(dict(scheduler.preemptions_by_cause)),
        swaps_out=scheduler.swaps_out, swaps_in=scheduler.swaps_in,
        admission_blocked=MappingProxyType(dict(scheduler.admission_blocked)),
        new_token_ratio=scheduler.growth.ratio, growth_reserve_blocks=scheduler.growth.reserved_blocks,
        blocks_total=pool.num_blocks, blocks=_count_blocks(scheduler) if count_blocks else None,
    )


def held_blocks(scheduler: Scheduler) -> set[int]:
    """The blocks live sequences hold (a pass over every block table)."""
    return {b for seq in scheduler.live_sequences() for b in seq.block_table}


def _count_blocks(scheduler: Scheduler) -> BlockCounts:
    nodes = scheduler.tree.nodes() if scheduler.tree is not None else []
    tree_owned = {b for n in nodes for b in n.blocks}
    used = held_blocks(scheduler) | {b for n in nodes if n.hold_count for b in n.blocks}
    return BlockCounts(scheduler.pool.num_free, len(used), len(tree_owned - used))
