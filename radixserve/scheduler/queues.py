"""The scheduler's state and every move of a sequence between its queues: waiting → running
(admission, forks) → waiting (preemption, by recompute or swap) → finished.

The scheduler is the only writer of a sequence and of cache state: refcounts, tree locks and
insertions, a sequence's blocks, tokens, `num_computed` and status. After `schedule`, a step comes
back in two calls: `launched` (the forward is queued: chunks count as computed, n > 1 requests fork,
each draw gets a pending slot, `pending.py`) and `commit` (the sampled tokens are known: slots are
filled, several tokens per draw and verified drafts included, `step_results.py`; stops and length
limits finish sequences). Without overlap the engine makes the two calls back to back. `finish` (one
sequence) and `end` (a request: an abort, an error) end them at any time. The engine asks; it never
writes a sequence (tests/test_layering.py enforces it). Every block copy decided while scheduling
(copy-on-write, write-back, load-back) is appended to the step's `Batch.copies` as it is decided, in
order (eviction is explicit: see seq_cache.py).

Invariants (checked by `check_integrity`, see integrity.py): a scheduled sequence owns a block for
every position it writes this step, and the block it writes first has exactly one owner
(copy-on-write is decided here and the copies are returned in the batch, to run before the
forward); running + waiting hold each live sequence exactly once; every block's refcount equals the
sequence tables and tree nodes listing it; every node's lock count equals the live sequences whose
locked path passes through it.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import Counter
from collections.abc import Callable

from radixserve.cache.block_pool import BlockPool
from radixserve.cache.radix_tree import RadixNode, RadixTree
from radixserve.config import EngineConfig
from radixserve.core import BlockCopy, Request, Sequence, SequenceStatus
from radixserve.scheduler import pending
from radixserve.scheduler.admission import GrowthReserve
from radixserve.scheduler.drafts import DraftProposer
from radixserve.scheduler.integrity import check_integrity, leaked_blocks
from radixserve.scheduler.policy import Policy
from radixserve.scheduler.preemption import PreemptionCosts
from radixserve.scheduler.seq_cache import SequenceCache

log = logging.getLogger(__name__)


class SequenceQueues:
    """The waiting and running queues, the cache hold of each sequence in them, the counters of their
    moves, and the moves themselves. `Scheduler` (scheduler.py) decides when each happens."""

    def __init__(self, config: EngineConfig, pool: BlockPool, tree: RadixTree | None,
                 clock: Callable[[], float] = time.monotonic, max_seq_len: int | None = None) -> None:
        self.config = config
        # the longest a sequence may grow (tokens): the engine's limit, by default the pool's size
        self.max_seq_len = max_seq_len or pool.num_blocks * pool.block_size
        self.clock = clock  # seconds: what aging and minimum run times are measured with
        self.policy = Policy(config, tree, clock)
        self.growth = GrowthReserve(config.new_token_ratio, config.new_token_ratio_min, config.new_token_ratio_decay,
                                    pool.block_size)
        self.pool = pool
        self.tree = tree
        self.block_size = pool.block_size
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.preemptions = 0
        # why admission stopped ("blocks", "max_num_seqs", ...) and why sequences were preempted
        # ("blocks", ...): per-cause counters for metrics
        self.admission_blocked: Counter[str] = Counter()
        self.preemptions_by_cause: Counter[str] = Counter()
        self.swaps_out = 0
        self.swaps_in = 0
        self.steps = 0  # schedule() calls: the clock that waiting times are measured in
        self.cache = SequenceCache(pool, tree)
        self.costs = PreemptionCosts()
        self.void_draws: set[tuple[int, int]] = set()  # (seq_id, position) of draws a commit replaced
        # the engine sets the caps from its device; without them (unit tests), none
        max_batch = config.speculative_max_batch if config.speculative_max_batch is not None else config.max_num_seqs
        self.drafts = DraftProposer(tree, config.num_speculative_tokens, max_batch, self.max_seq_len,
                                    config.speculative_max_rows)

    # -- queue management ----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.waiting_since = self.steps  # arrival, or preemption: the wait counts from entering the queue
        seq.running_since = None
        if seq.request.queued_at is None:
            seq.request.queued_at = self.clock()
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Join the running set, which is kept sorted in policy order (forks join directly: their
        blocks are shared with the parent's)."""
        seq.status = SequenceStatus.RUNNING
        now = self.clock()
        if seq.running_since is None:  # forks: they run from now on, like their parent
            seq.running_since = now
        bisect.insort(self.running, seq, key=lambda s: self.policy.rank(s, now))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def waiting_in_order(self) -> list[Sequence]:
        return self.policy.waiting_order(self.waiting, self.steps)


    # -- leaving the running set ---------------------------------------------------------------
    def preempt(self, seq: Sequence, copies: list[BlockCopy], cause: str = "blocks") -> None:
        """Cache what was computed, release the blocks, wait again; by swap when `preemption_mode`
        (or, under auto, the estimated cost) says so and the host tier can hold the sequence (its
        write-backs go to `copies`, the step's)."""
        self.preemptions += 1
        self.preemptions_by_cause[cause] += 1
        if cause == "blocks":
            self.growth.preempted()
        self.swaps_out += self.cache.release(seq, copies if self._should_swap(seq) else None)
        self.running.remove(seq)
        self.add(seq)

    def _should_swap(self, seq: Sequence) -> bool:
        if self.tree is None or self.tree.host_pool is None or self.config.preemption_mode == "recompute":
            return False
        if self.config.preemption_mode == "swap":
            return True
        computed = min(seq.num_computed, seq.num_resolved)
        return self.costs.swap_is_cheaper(computed, -(-computed // self.block_size))

    def finish(self, seq: Sequence, reason: str) -> None:
        """End `seq` now (a stop, an abort, an error): drop its pending slots, cache what it computed."""
        pending.drop_slots(seq)
        self.cache.release(seq)
        if seq.swapped_node is not None:  # ended while swapped out (an abort): unpin its path
            assert self.tree is not None
            self.tree.unpin(seq.swapped_node)
            seq.swapped_node = None
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def unschedulable_head(self) -> Request | None:
        """A step scheduled nothing though work remains, which the liveness rules make unreachable:
        logged; with nothing running, the head of the queue can never fit, so it is returned (to fail)."""
        if self.running:
            log.error("a step scheduled none of %d running sequences", len(self.running))
            return None
        head = self.waiting_in_order()[0].request
        log.error("request %s cannot be scheduled in a pool of %d blocks", head.request_id, self.pool.num_blocks)
        return head

    def end(self, req: Request, reason: str) -> None:
        """End every unfinished sequence of `req` (an abort, an error)."""
        for seq in req.sequences:
            if seq.status is not SequenceStatus.FINISHED:
                self.finish(seq, reason)

    def _fork(self, parent: Sequence, noise_key: Callable[[Request, int], int]) -> list[Sequence]:
        """n > 1: the prompt is done; the other samples join the running set sharing every block of
        the parent (copy-on-write) and its lock."""
        req = parent.request
        children = []
        for i in range(1, parent.pending_forks + 1):
            child = Sequence(req, i, list(parent.token_ids), parent.num_prompt_tokens, noise_key=noise_key(req, i),
                             num_computed=parent.num_computed, block_table=list(parent.block_table),
                             locked_node=parent.locked_node, num_cached=parent.num_cached, admitted_once=True)
            for b in child.block_table:
                self.pool.incref(b)
            if child.locked_node is not None and self.tree is not None:
                self.tree.lock(child.locked_node)
            req.sequences.append(child)
            self.add_running(child)
            children.append(child)
        parent.pending_forks = 0
        return children

    # -- introspection ---------------------------------------------------------------------------
    def live_sequences(self) -> list[Sequence]:
        return self.running + self.waiting

    def check_integrity(self, held: list[RadixNode] | None = None) -> None:
        """`held`: the nodes pinned prefixes hold (engine/pins.py)."""
        check_integrity(self.live_sequences(), self.pool, self.tree, held or [])

    def leaked_blocks(self) -> int:
        return leaked_blocks(self.live_sequences(), self.pool, self.tree)
