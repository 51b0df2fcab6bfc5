"""Step observers: callables that see a `StepInfo` after every step that ran, on the stepping thread;
and `StepFeed`, the observer that hands them to another thread.

Counting the blocks live sequences hold costs a pass over every block table, so a step pays for it
only when some observer asked (`pool=True`); the pool figures are taken at the step's peak, after
scheduling allocated and before anything was released. A StepInfo also carries the batch's limits
(max_num_seqs, max_num_batched_tokens), so observers read slot and token-budget utilization from it.

A StepFeed runs nothing of its reader's on the stepping thread: it only appends the StepInfo, and
the reader (the server, on its event loop) drains them when it likes. It holds at most `maxlen`
steps; beyond that the oldest go (counted in `dropped`), so a reader that never comes costs nothing
but that bound.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from radixserve.cache.block_pool import BlockPool
from radixserve.core import Batch, StepInfo
from radixserve.scheduler import Scheduler
from radixserve.scheduler.snapshot import held_blocks

StepObserver = Callable[[StepInfo], None]
PoolCounts = tuple[int, int | None, int | None]  # free, held by live sequences, held only by the tree


def decode_tokens(batch: Batch) -> tuple[int, int]:
    """Tokens of the batch's decodes (a decode is one token, or one plus the drafts it verifies), and
    the draft tokens among them. Read before `Scheduler.launched`: once it appends each draw's
    pending slot, no chunk reaches its sequence's last token, so `samples` is False for all of them."""
    decodes = [it for it in batch.items if it.samples and it.num_tokens == it.logit_rows]
    return sum(it.num_tokens for it in decodes), sum(it.logit_rows - 1 for it in decodes)


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
        used = len(held_blocks(scheduler))
        return free, used, pool.num_blocks - free - used

    def notify(self, step: int, batch: Batch, decodes: tuple[int, int], started: float, peak: PoolCounts,
               pool: BlockPool, scheduler: Scheduler, forced_tokens: int = 0,
               committed: tuple[int, int] = (0, 0)) -> None:
        """`decodes`: the batch's `decode_tokens`, counted before the launch; `committed`: (tokens,
        draws) the step's commit took."""
        decode, drafted = decodes
        config = scheduler.config
        info = StepInfo(step, started, time.monotonic() - started, len(batch.items), batch.num_tokens - decode,
                        decode, len(scheduler.running), len(scheduler.waiting), pool.num_blocks, *peak,
                        config.max_num_seqs, config.max_num_batched_tokens, forced_tokens,
                        drafted, *committed)
        for observer in self._observers:
            observer(info)


class StepFeed:
    def __init__(self, maxlen: int = 8192) -> None:
        self._steps: deque[StepInfo] = deque(maxlen=maxlen)
        self._lock = threading.Lock()  # never held across anything but a deque operation
        self.dropped = 0

    def publish(self, info: StepInfo) -> None:
        """The step observer (stepping thread)."""
        with self._lock:
            self.dropped += len(self._steps) == self._steps.maxlen
            self._steps.append(info)

    def drain(self) -> list[StepInfo]:
        """Every step published since the last drain, oldest first (any thread)."""
        with self._lock:
            steps = list(self._steps)
            self._steps.clear()
        return steps
