"""Step observers: callables that see a `StepInfo` after every step that ran, on the stepping thread.

Counting the blocks live sequences hold costs a pass over every block table, so a step pays for it
only when some observer asked (`pool=True`); the pool figures are taken at the step's peak, after
scheduling allocated and before anything was released. A StepInfo also carries the batch's limits
(max_num_seqs, max_num_batched_tokens), so observers read slot and token-budget utilization from it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from radixserve.cache.block_pool import BlockPool
from radixserve.core import Batch, StepInfo
from radixserve.scheduler import Scheduler

StepObserver = Callable[[StepInfo], None]
PoolCounts = tuple[int, int | None, int | None]  # free, held by live sequences, held only by the tree


class StepObservers:
    def __init__(self) -> None:
        self._observers: list[StepObserver] = []
        self._want_pool = False

    def add(self, observer: StepObserver, pool: bool = False) -> None:
        self._observers.append(observer)
        self._want_pool |= pool

    def __bool__(self) -> bool:
        return bool(self._observers)

    def pool_counts(self, pool: BlockPool, scheduler: Scheduler) -> PoolCounts:
        """(free, held by live sequences, held only by the tree) blocks; the last two only when an
        observer asked for them."""
        free = pool.num_free
        if not self._want_pool:
            return free, None, None
        used = len({b for s in scheduler.live_sequences() for b in s.block_table})
        return free, used, pool.num_blocks - free - used

    def notify(self, step: int, batch: Batch, started: float, peak: PoolCounts, pool: BlockPool,
               scheduler: Scheduler) -> None:
        decode = sum(1 for it in batch.items if it.num_tokens == 1 and it.samples)
        config = scheduler.config
        info = StepInfo(step, started, time.monotonic() - started, len(batch.items), batch.num_tokens - decode,
                        decode, len(scheduler.running), len(scheduler.waiting), pool.num_blocks, *peak,
                        config.max_num_seqs, config.max_num_batched_tokens)
        for observer in self._observers:
            observer(info)
