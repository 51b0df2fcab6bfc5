"""The continuous batcher: which sequences run this step, with how many tokens, in which blocks.

Every step mixes decode tokens and prefill chunks under one token budget: running decodes first,
then running prefills, then waiting sequences admitted in policy order while the budget, the
sequence cap and free blocks allow. A waiting sequence first takes its longest cached prefix from
the radix tree (shared by refcount, the partial last block copied on first write), so only uncached
tokens are computed. A sequence whose prompt shares a prefix with one still being prefilled waits
for it instead of computing the same tokens twice. When blocks run out, the lowest-priority running
sequence is preempted by recompute: its computed tokens go into the cache, its blocks are released.

Invariants: a scheduled sequence owns a block for every position it writes this step, and the block
it writes first has exactly one owner (copy-on-write is decided here and the copies are returned in
the batch, to run before the forward); running + waiting hold each live sequence exactly once.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from radixserve.block_pool import BlockPool
from radixserve.config import EngineConfig
from radixserve.radix_tree import RadixTree, common_prefix_len
from radixserve.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # first position computed this step
    num_tokens: int

    @property
    def samples(self) -> bool:
        """Does this chunk reach the sequence's last token, so its logits give the next token?"""
        return self.start + self.num_tokens == len(self.seq.token_ids)


@dataclass
class Batch:
    items: list[ScheduledSeq] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) blocks

    @property
    def num_tokens(self) -> int:
        return sum(i.num_tokens for i in self.items)


class Scheduler:
    def __init__(self, config: EngineConfig, pool: BlockPool, tree: RadixTree | None) -> None:
        self.config = config
        self.pool = pool
        self.tree = tree
        self.block_size = pool.block_size
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.preemptions = 0

    # -- queue management ----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Join the running set, which is kept sorted in policy order (forks join directly: their
        blocks are shared with the parent's)."""
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=self._order_key)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _order_key(self, seq: Sequence) -> tuple[int, ...]:
        if self.config.policy == "priority":
            return (seq.request.priority, *seq.sort_key)
        return seq.sort_key

    # -- the step plan -------------------------------------------------------------------------
    def schedule(self) -> Batch:
        batch = Batch()
        budget = self.config.max_num_batched_tokens
        scheduled: set[int] = set()
        # `running` is kept in policy order, so decodes-then-prefills needs no sort
        decodes = [s for s in self.running if len(s.token_ids) - s.num_computed == 1]
        prefills = [s for s in self.running if len(s.token_ids) - s.num_computed > 1]
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(len(seq.token_ids) - seq.num_computed, budget)
            while self._needs_blocks(seq, n) and not self._reserve(seq, n, batch):
                victim = self._victim(scheduled)  # `seq` itself is a candidate: never None
                assert victim is not None
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                batch.items.append(ScheduledSeq(seq, seq.num_computed, n))
                scheduled.add(seq.seq_id)
                budget -= n
        if budget > 0:
            self._admit(batch, budget)
        return batch

    def _admit(self, batch: Batch, budget: int) -> None:
        for seq in self._waiting_in_order():
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            matched = self._take_cached_prefix(seq)
            if matched is None:
                continue  # a running prefill will cache this sequence's prefix shortly
            n = min(seq.remaining, budget)
            if not self._reserve(seq, n, batch):
                self._release(seq)
                break  # no blocks even after eviction: admit nothing after it (no overtaking)
            if not seq.admitted_once:
                seq.admitted_once = True
                seq.request.cached_tokens = matched
            self.waiting.remove(seq)
            self.add_running(seq)
            batch.items.append(ScheduledSeq(seq, seq.num_computed, n))
            budget -= n

    def _waiting_in_order(self) -> list[Sequence]:
        if self.config.policy == "cache-aware" and self.tree is not None:
            # longest cached prefix first (ties by arrival), so hot prefixes are reused before eviction
            def key(s: Sequence) -> tuple[int, ...]:
                return (-self.tree.match(s.token_ids[:-1], split=False).length, *s.sort_key)

            return sorted(self.waiting, key=key)
        return sorted(self.waiting, key=self._order_key)

    def _take_cached_prefix(self, seq: Sequence) -> int | None:
        """Share the longest cached prefix (never the last token: its logits are needed). Returns
        the matched length, or None when the sequence should wait for an in-flight prefill."""
        if self.tree is None:
            return 0
        match = self.tree.match(seq.token_ids[:-1])
        if self._prefix_in_flight(seq, match.length):
            return None
        self.tree.lock(match.node)
        for b in match.blocks:
            self.pool.incref(b)
        seq.locked_node, seq.block_table, seq.num_computed = match.node, match.blocks, match.length
        return match.length

    def _prefix_in_flight(self, seq: Sequence, matched: int) -> bool:
        for other in self.running:
            if other.is_prefill:
                shared = common_prefix_len(seq.token_ids[:-1], other.token_ids[:-1])
                if shared - matched >= self.block_size:
                    return True
        return False

    def _needs_blocks(self, seq: Sequence, n: int) -> bool:
        """False for the common decode step, whose write lands in a private block it already has."""
        if n > 1:
            return True
        pos, table = seq.num_computed, seq.block_table
        return pos >= len(table) * self.block_size or self.pool.refcount[table[pos // self.block_size]] > 1

    def _reserve(self, seq: Sequence, n: int, batch: Batch) -> bool:
        """Give `seq` blocks for positions [num_computed, num_computed + n), copying the first
        written block if it is shared. False (nothing changed) if the pool cannot supply them."""
        bs, table = self.block_size, seq.block_table
        first = seq.num_computed // bs
        missing = max(0, -(-(seq.num_computed + n) // bs) - len(table))
        shared = first < len(table) and self.pool.refcount[table[first]] > 1
        fresh = self.pool.allocate(missing + int(shared))
        if fresh is None:
            return False
        if shared:
            dst = fresh.pop()
            src = table[first]
            if self.pool.refcount[src] > 1:  # allocating may have evicted the other owner
                batch.copies.append((src, dst))
                self.pool.decref(src)
                table[first] = dst
            else:
                self.pool.decref(dst)
        table.extend(fresh)
        return True

    def _victim(self, scheduled: set[int]) -> Sequence | None:
        """The lowest-priority running sequence not yet given work this step."""
        return next((s for s in reversed(self.running) if s.seq_id not in scheduled), None)

    # -- leaving the running set ---------------------------------------------------------------
    def preempt(self, seq: Sequence) -> None:
        """Preempt by recompute: cache what was computed, release the blocks, wait again."""
        self.preemptions += 1
        self._release(seq)
        self.running.remove(seq)
        self.add(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        self._release(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _release(self, seq: Sequence) -> None:
        if self.tree is not None and seq.num_computed > 0:
            self.tree.insert(seq.token_ids[:seq.num_computed], seq.block_table)
        if seq.locked_node is not None:
            assert self.tree is not None
            self.tree.unlock(seq.locked_node)
            seq.locked_node = None
        self.pool.release(seq.block_table)
        seq.block_table = []
        seq.num_computed = 0

    def cache_computed(self, seq: Sequence, before: int) -> None:
        """After a step: cache the sequence's newly completed full blocks, so concurrent requests
        with the same prefix hit them while this one still runs. Partial blocks wait for release."""
        bs = self.block_size
        if self.tree is None or seq.num_computed // bs == before // bs:
            return
        full = seq.num_computed // bs * bs
        node = self.tree.insert(seq.token_ids[:full], seq.block_table, known=seq.locked_node)
        self.tree.lock(node)
        if seq.locked_node is not None:
            self.tree.unlock(seq.locked_node)
        seq.locked_node = node
