"""The continuous batcher: which sequences run this step, with how many tokens, in which blocks.

Every step mixes decode tokens and prefill chunks under one token budget: running decodes first,
then running prefills, then waiting sequences admitted in policy order while the budget, the
sequence cap and free blocks allow. A waiting sequence first takes its longest cached prefix from
the radix tree (shared by refcount, the partial last block copied on first write; a part that lives
only in the host tier is loaded back first), so only uncached tokens are computed. A sequence whose
prompt shares a prefix with one still being prefilled waits for it instead of computing the same
tokens twice. When blocks run out, the lowest-priority running sequence is preempted: its computed
tokens go into the cache and its blocks are released. By recompute, that cached prefix is an
ordinary evictable one; by swap (`preemption.py` chooses), it is also copied to the host tier and
pinned there until the sequence resumes, so resuming loads it back and recomputes nothing.

Policies and aging are in `policy.py`. Under `priority` and `sjf`, a waiting sequence that outranks
running ones by `preempt_gap` levels and cannot be admitted preempts the worst-ranked of them (cause
"urgent"; never one that has run less than `preempt_min_run_s`) before anything else is scheduled.
Admission also keeps room for the running sequences' expected growth (`admission.py`). How a
sequence holds blocks, locks and pins is `seq_cache.py`; this module decides when.

Liveness: every sequence the engine accepted fits the pool on its own, locks included. A locked
match can pin blocks the sequence does not use (the shared partial block of a mid-block hit, which
it copies on first write, and superseded copies of straddled blocks on the path). A sequence always
takes its whole match, whatever it may generate later; when the pool cannot supply its next blocks
even after eviction and nothing else runs that could free them (it would preempt itself, or it is
the only one to admit), its lock moves up to the block-aligned part of the path that lists only its
own blocks (`SequenceCache.loosen_lock`, `RadixTree.exclusive_prefix_len`), so alone it can use the
whole pool. A lock never moves onto another sequence's copy of tokens.
Under `cache-aware`, a sequence waiting longer than `max_wait_steps` steps goes ahead of every cache
hit (oldest first), so hits cannot starve it.

A sequence moves between the queues: waiting → running (admission, forks) → waiting (preemption,
by recompute or swap) → finished.

The scheduler is the only writer of a sequence, of a request's scheduling fields (its sequences,
cached-token counts, queue time) and of cache state: refcounts, tree insertions, splits, locks, holds
and swap pins, a sequence's blocks, tokens, `num_computed` and status. `add` makes a new sequence
its request's and queues it. After `schedule`, a step comes back in two calls: `launched` (the
forward is queued: chunks count as computed, n > 1 requests fork, each draw gets a pending slot,
`pending.py`) and `commit` (the sampled tokens are known: slots are filled, several tokens per draw
and verified drafts included, `step_results.py`; stops and length limits finish sequences). Without
overlap the engine makes the two calls back to back. `finish` (one sequence) and `end` (a request:
an abort, an error) end them at any time. Pinned prefixes are commands too: `hold_prefix` keeps a
cached prefix on the device until `release_prefix` (engine/pins.py keeps the pins' names, labels and
budget), and `follow_cache_events` has the tree report what it drops. The engine asks; it never
writes a sequence, a request's fields or the tree (tests/test_layering.py enforces it). Every block
copy decided while scheduling (copy-on-write, write-back, load-back) is appended to the step's
`Batch.copies` as it is decided, in order (eviction is explicit: see seq_cache.py).

Invariants (checked by `check_integrity`, see integrity.py): a scheduled sequence owns a block for
every position it writes this step, and the block it writes first has exactly one owner
(copy-on-write is decided here and the copies are returned in the batch, to run before the
forward); running + waiting hold each live sequence exactly once; every block's refcount equals the
sequence tables and tree nodes listing it; every node's lock count equals the live sequences whose
locked path passes through it, plus the holds on paths through it (`held_prefixes`).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable

from radixserve.cache.block_pool import BlockPool
from radixserve.cache.events import CacheEventLog
from radixserve.cache.radix_tree import RadixNode, RadixTree
from radixserve.cache.window_blocks import WindowBlocks
from radixserve.config import EngineConfig
from radixserve.core import Batch, BlockCopy, Request, ScheduledSeq, Sequence, SequenceStatus
from radixserve.errors import TokenRefused
from radixserve.scheduler import pending
from radixserve.scheduler.admission import GrowthReserve
from radixserve.scheduler.checkpoint_policy import CheckpointPolicy
from radixserve.scheduler.drafts import DraftProposer
from radixserve.scheduler.integrity import check_integrity, leaked_blocks
from radixserve.scheduler.policy import Policy
from radixserve.scheduler.preemption import PreemptionCosts
from radixserve.scheduler.seq_cache import SequenceCache
from radixserve.scheduler.step_results import Committed, Launch, StopTest, TokenCommit, append_tokens

log = logging.getLogger(__name__)


class Scheduler:
    """The waiting and running queues and every move between them, each step's plan (`schedule`), the
    step's results (`launched`, `commit`), and the commands that change the cache outside a step
    (pinned prefixes, cache events)."""

    def __init__(self, config: EngineConfig, pool: BlockPool, tree: RadixTree | None,
                 clock: Callable[[], float] = time.monotonic, max_seq_len: int | None = None,
                 states: BlockPool | None = None, windows: WindowBlocks | None = None) -> None:
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
        self.cache = SequenceCache(pool, tree, states, CheckpointPolicy(config.state_checkpoints, pool.block_size,
                                                                          config.state_eviction), windows,
                                   readers=self.live_sequences, upcoming=self.waiting_in_order,
                                   lookahead=config.eviction_lookahead)
        self.states = states  # a hybrid model's recurrent-state slots (seq_cache.py); None: attention only
        # state copies decided after a step's forward was queued (checkpoints, forks): the next step runs them first
        self.pending_copies: list[BlockCopy] = []
        self.costs = PreemptionCosts()
        self.void_draws: set[tuple[int, int]] = set()  # (seq_id, position) of draws a commit replaced
        # the engine sets the caps from its device; without them (unit tests), none
        max_batch = config.speculative_max_batch if config.speculative_max_batch is not None else config.max_num_seqs
        self.drafts = DraftProposer(tree, config.num_speculative_tokens, max_batch, self.max_seq_len,
                                    config.speculative_max_rows)
        self.held_prefixes: list[RadixNode] = []  # one entry per hold (`hold_prefix`), repeats included

    # -- queue management ----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """A new request's first sequence (the engine made both) becomes its request's and waits."""
        seq.request.sequences.append(seq)
        self._queue(seq)

    def _queue(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.waiting_since = self.steps  # arrival, or preemption: the wait counts from entering the queue
        seq.running_since = None
        if seq.request.queued_at is None:
            seq.request.queued_at = self.clock()
        self.waiting.append(seq)
        self.cache.forget_reads()

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

    # -- the step plan -------------------------------------------------------------------------
    def schedule(self) -> Batch:
        self.steps += 1
        self.growth.step()
        self.cache.forget_reads()
        batch = Batch()
        if self.pending_copies:
            batch.copies.extend(self.pending_copies)
            self.pending_copies.clear()
        budget, running = self.config.max_num_batched_tokens, SequenceStatus.RUNNING
        # `running` is kept in policy order, so decodes-then-prefills needs no sort; an urgent arrival
        # admitted below is in neither list
        decodes, prefills = pending.split_running(self.running)
        if self.policy.ranks_by_merit and self.config.preempt_gap > 0 and self.waiting and self.running:
            budget -= self._admit_urgent(batch, budget - len(decodes))
        budget = self._schedule_decodes(decodes, batch, budget, prefills)
        for seq in prefills:
            if budget == 0:
                break
            if seq.status is not running:
                continue  # preempted earlier in this step
            n = self.cache.cut_at_checkpoint(seq, min(len(seq.token_ids) - seq.num_computed, budget))
            if self._reserve_or_preempt(seq, n, batch):
                batch.items.append(ScheduledSeq(seq, seq.num_computed, n))
                budget -= n
        if budget > 0:
            self._admit(batch, budget)
        self.cache.map_windows(batch)
        return batch

    def _schedule_decodes(self, decodes: list[Sequence], batch: Batch, budget: int, prefills: list[Sequence]) -> int:
        """One token each, or drafts to verify after it (each its share of the drafts' room:
        `DraftProposer.shares`), in running order while `budget` lasts; returns
        the budget left. The loop every running sequence passes through each step: kept to the checks
        a decode needs (its one token needs a block only at a block's start or a shared block); its
        item is the sequence's own `decode_item`, moved on to this step (core.py's Batch invariants)."""
        running, drafts = SequenceStatus.RUNNING, self.drafts
        room = drafts.room(len(decodes), lambda limit: self._prompt_rows(prefills, limit))
        shares = drafts.shares(decodes, room) if room else {}
        needs_blocks, items = self.cache.needs_blocks, batch.items  # (bound once: a call per sequence)
        for seq in decodes:
            if budget == 0:
                break
            if seq.status is not running:
                continue  # preempted earlier in this step
            # (not before its forks: they copy its tokens, which must not hold unverified drafts)
            if room and seq.has_pending_token and not seq.pending_forks and drafts.eligible(seq) \
                    and drafts.waits_for_token(seq):
                continue  # overlap: drafts are likely; wait a step for its token, then draft after it
            share = shares.get(seq, 0)
            if share and budget > 1 and self._draft(seq, min(budget - 1, share), batch):
                budget -= batch.items[-1].num_tokens
                continue
            if needs_blocks(seq, 1) and not self._reserve_or_preempt(seq, 1, batch):
                continue  # it was the one preempted
            item = seq.decode_item
            if item is None:
                item = seq.decode_item = ScheduledSeq(seq, seq.num_computed, 1)
            else:
                item.start = seq.num_computed
            items.append(item)
            budget -= 1
        return budget

    def _prompt_rows(self, prefills: list[Sequence], limit: int) -> int:
        """Prompt tokens the step will likely run beside its decodes (running prefills, then waiting
        sequences while the running set has room), counted up to `limit`: rows drafts must leave."""
        rows = 0
        more = self.waiting if len(self.running) < self.config.max_num_seqs else []
        for seq in itertools.chain(prefills, more):
            rows += seq.remaining
            if rows >= limit:
                return limit
        return rows

    def _reserve_or_preempt(self, seq: Sequence, n: int, batch: Batch) -> bool:
        """Blocks for a running sequence's next n tokens, preempting the lowest-priority running
        sequences not yet scheduled until the pool supplies them; False if `seq` itself had to go."""
        while self.cache.needs_blocks(seq, n) and not self.cache.reserve(seq, n, batch.copies):
            victim = self._victim(batch)  # `seq` itself is a candidate: never None
            assert victim is not None
            if victim is seq and self.cache.loosen_lock(seq):
                continue  # its own lock pinned what it lacks: try again before giving up its blocks
            self.preempt(victim, batch.copies)
            if victim is seq:
                return False
        return True

    def _draft(self, seq: Sequence, budget: int, batch: Batch) -> bool:
        """Schedule `seq` to verify drafts after its last token, if it proposes any and blocks for them
        are free without preempting anyone (drafts are never worth a preemption). True if it was."""
        draft = self.drafts.propose(seq, budget)
        if draft is None or not self.cache.back_up_state(seq, batch.copies):
            return False
        n = 1 + len(draft.tokens)
        if not self.cache.reserve(seq, n, batch.copies):
            self.cache.restore_state(seq, False, batch.copies)  # gives the copy's slot back
            return False
        seq.token_ids.extend(draft.tokens)
        seq.num_drafts, seq.draft_source = len(draft.tokens), draft.source
        batch.items.append(ScheduledSeq(seq, seq.num_computed, n, logit_rows=n))
        return True

    def _admit(self, batch: Batch, budget: int) -> None:
        if not self.waiting:
            return
        reserve = self.growth.total(self.running)
        for seq in self.waiting_in_order():
            if budget == 0:
                break
            if len(self.running) >= self.config.max_num_seqs:
                self.admission_blocked["max_num_seqs"] += 1
                break
            if not pending.may_admit(seq):
                continue
            taken = self._take(seq, batch)
            if taken is None:
                continue  # a running prefill will cache this sequence's prefix shortly (or no state slot is free)
            n = self.cache.cut_at_checkpoint(seq, min(seq.remaining, budget))
            own = self.growth.blocks(seq)
            room = self._room_after(seq, n)  # below 0: a shortage of blocks, which _reserve tells exactly
            if self.running and 0 <= room < reserve + own:
                self.cache.release(seq)
                self.admission_blocked["watermark"] += 1
                break  # the running sequences' expected growth needs the rest (no overtaking)
            if not self._reserve_to_admit(seq, n, batch.copies):
                self.cache.release(seq)
                self.admission_blocked["blocks"] += 1
                break  # no blocks even after eviction: admit nothing after it (no overtaking)
            self._admitted(seq, taken, n, batch)
            reserve += own
            budget -= n

    def _reserve_to_admit(self, seq: Sequence, n: int, copies: list[BlockCopy]) -> bool:
        """Blocks for a waiting sequence's first chunk. With nothing running, nothing will free any
        for it: its own lock must then stop pinning what it does not use."""
        if self.cache.reserve(seq, n, copies):
            return True
        return not self.running and self.cache.loosen_lock(seq) and self.cache.reserve(seq, n, copies)

    def _admit_urgent(self, batch: Batch, budget: int) -> int:
        """Under priority and sjf, before anything else is scheduled: if the best-ranked waiting
        sequence outranks running ones by at least `preempt_gap` and cannot be admitted as things
        stand, preempt the worst-ranked of those (each running for at least `preempt_min_run_s`)
        until it fits. Returns the budget it took."""
        now, config = self.clock(), self.config
        ready = [s for s in self.waiting if pending.may_admit(s)]
        if not ready or budget <= 0:
            return 0
        head = min(ready, key=lambda s: self.policy.rank(s, now))
        head_rank = self.policy.rank(head, now)[0]
        victims = sorted((s for s in self.running if self.policy.rank(s, now)[0] - head_rank >= config.preempt_gap
                          and s.running_since is not None and now - s.running_since >= config.preempt_min_run_s),
                         key=lambda s: self.policy.rank(s, now), reverse=True)
        if not victims:
            return 0
        taken = self._take(head, batch)
        if taken is None:
            return 0
        n = self.cache.cut_at_checkpoint(head, min(head.remaining, budget))
        # preempt only if the victims' blocks could make room at all (an estimate: shared blocks stay)
        if self._room_after(head, n) + sum(len(v.block_table) for v in victims) < 0:
            self.cache.release(head)
            return 0
        while len(self.running) >= config.max_num_seqs or not self.cache.reserve(head, n, batch.copies):
            if not victims:
                self.cache.release(head)
                return 0
            self.preempt(victims.pop(0), batch.copies, cause="urgent")
        self._admitted(head, taken, n, batch)
        return n

    def _take(self, seq: Sequence, batch: Batch) -> tuple[int, int, int, int] | None:
        # (hybrids: this step's chunks of the running sequences, which may be cut at a branch point)
        scheduled = {it.seq.seq_id: it for it in batch.items} if self.states is not None else {}
        taken = self.cache.take_prefix(seq, self.running, batch.copies, scheduled)
        if not seq.admitted_once and taken is not None:
            # a load-back done by an attempt that could not admit still served this request
            seq.request.host_cached_tokens = max(seq.request.host_cached_tokens, taken[1])
        return taken

    def _room_after(self, seq: Sequence, n: int) -> int:
        """Blocks free or evictable once `seq` has blocks for its next n tokens (an estimate: the
        tree counts blocks listed by unlocked nodes, straddled ones twice)."""
        evictable = self.tree.evictable_blocks if self.tree is not None else 0
        needed = max(0, -(-(seq.num_computed + n) // self.block_size) - len(seq.block_table))
        return self.pool.num_free + evictable - needed

    def _admitted(self, seq: Sequence, taken: tuple[int, int, int, int], n: int, batch: Batch) -> None:
        if seq.swapped_node is not None:  # resumed: its path may leave the host tier again
            assert self.tree is not None
            self.tree.unpin(seq.swapped_node)
            seq.swapped_node = None
            self.swaps_in += 1
        if not seq.admitted_once:
            seq.admitted_once = True
            seq.request.cached_tokens = taken[0]
            seq.request.host_cached_tokens = min(taken[0], seq.request.host_cached_tokens)
            seq.request.pinned_cached_tokens = taken[2]
        self.cache.count_recomputed(taken[3])
        seq.waiting_since = None
        seq.running_since = self.clock()
        self.waiting.remove(seq)
        self.add_running(seq)
        batch.items.append(ScheduledSeq(seq, seq.num_computed, n))

    def _victim(self, batch: Batch) -> Sequence | None:
        """The lowest-priority running sequence not yet given work this step."""
        scheduled = {it.seq.seq_id for it in batch.items}
        return next((s for s in reversed(self.running) if s.seq_id not in scheduled), None)

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
        self._queue(seq)

    def _should_swap(self, seq: Sequence) -> bool:
        if self.tree is None or self.tree.host_pool is None or self.config.preemption_mode == "recompute":
            return False
        if self.states is not None:  # its working state becomes a checkpoint
            return False
        if self.config.preemption_mode == "swap":
            return True
        computed = min(seq.num_computed, seq.num_resolved)
        return self.costs.swap_is_cheaper(computed, -(-computed // self.block_size))

    def finish(self, seq: Sequence, reason: str) -> None:
        """End `seq` now (a stop, an abort, an error): drop its pending slots, cache what it computed."""
        pending.drop_slots(seq)
        # (a request that failed may have failed in a forward that left its recurrent state half-moved)
        self.cache.release(seq, keep_state=reason != "error")
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
        the parent (copy-on-write) and its lock (a hybrid model's fork also gets a copy of its state,
        or, with no state slot left, waits to compute its prompt itself). Returns every new sample."""
        req = parent.request
        children = []
        for i in range(1, parent.pending_forks + 1):
            child = Sequence(req, i, list(parent.token_ids), parent.num_prompt_tokens, noise_key=noise_key(req, i),
                             num_computed=parent.num_computed, block_table=list(parent.block_table),
                             locked_node=parent.locked_node, num_cached=parent.num_cached, admitted_once=True)
            if not self.cache.fork_state(parent, child, self.pending_copies):
                # no state slot for it: it waits like a new sequence and computes its prompt again
                child.num_computed, child.block_table, child.locked_node, child.num_cached = 0, [], None, 0
                req.sequences.append(child)
                self._queue(child)
                children.append(child)
                continue
            for b in child.block_table:
                self.pool.incref(b)
            if child.locked_node is not None and self.tree is not None:
                self.tree.lock(child.locked_node)
            req.sequences.append(child)
            self.add_running(child)
            children.append(child)
        parent.pending_forks = 0
        return children

    # -- after a step ---------------------------------------------------------------------------
    def launched(self, batch: Batch, failed: Iterable[Request], noise_key: Callable[[Request, int], int]) -> Launch:
        """The step's forward is queued (`failed` requests' forwards failed: they end now). Its
        chunks' K/V count as computed, since any later reader is queued behind it, and newly full
        resolved blocks go into the tree at once, so concurrent requests with the same prefix hit
        them while this one still runs. A request with n > 1 whose prompt is done forks here: its
        other samples draw their first tokens from the same logits row, with keys from `noise_key`.
        Every draw gets a pending slot, filled by `commit`."""
        for req in failed:
            self.end(req, "error")
        launch = Launch()
        owners, rows, drafts = launch.owners, launch.rows, launch.drafts
        bs, running, cache_computed = self.block_size, SequenceStatus.RUNNING, self.cache.cache_computed
        next_row = 0  # the logits have `logit_rows` rows per item that samples, in batch order
        for item in batch.items:
            seq, computed = item.seq, item.start + item.num_tokens
            samples = computed == len(seq.token_ids)  # the chunk reaches the last token
            row = next_row
            if samples:
                next_row += item.logit_rows
            if seq.status is not running:
                continue
            seq.num_computed = computed
            if computed - seq.num_cached >= bs:  # a block may have completed
                cache_computed(seq)
            if seq.checkpoint_at == computed:  # a hybrid prefill reached the branch point it stopped at
                self.cache.checkpoint(seq, self.pending_copies)
            if not samples:
                continue
            if seq.pending_forks:
                forks = self._fork(seq, noise_key)
                launch.forks += forks
                forks = [f for f in forks if f.status is running]  # (a hybrid fork without a state slot waits)
                owners += forks
                rows += [row] * len(forks)
                drafts += [0] * len(forks)  # a fork verifies no drafts
            owners.append(seq)
            rows.append(row)
            drafts.append(seq.num_drafts)
        # the slots once every draw is known (a fork's tokens were copied before its parent's slot)
        launch.positions = pending.add_slots(owners, self.max_seq_len)
        return launch

    def commit(self, launch: Launch, commits: list[TokenCommit], failed: Iterable[Request], stop: StopTest) -> Committed:
        """A launched step's tokens are known: one commit per draw of `launch` (`failed` requests
        end first). Fills each draw's slot and appends the rest of its tokens (`step_results.py`),
        finishes what stopped or reached a length limit, and caches the blocks the commit completed."""
        for req in failed:
            self.end(req, "error")
        done = Committed()
        touched, tokens = done.touched, 0
        bs, max_seq_len, void = self.block_size, self.max_seq_len, self.void_draws
        finished, running = SequenceStatus.FINISHED, SequenceStatus.RUNNING
        for seq, position, commit in zip(launch.owners, launch.positions, commits):
            if void and (seq.seq_id, position) in void:  # (no tuple built while nothing is void)
                void.discard((seq.seq_id, position))
                continue  # an earlier commit's tokens took its place
            if seq.status is finished:
                continue  # ended while in flight: its slot was dropped
            if commit.replaces_in_flight and position < len(seq.token_ids) - 1:
                void.update((seq.seq_id, later) for later in pending.void_later(seq, position))
            assert commit.drafts == seq.num_drafts or position != len(seq.token_ids) - 1, \
                "a verifying draw's commit says how many drafts it verified"
            if commit.drafts:
                position = self._verified(seq, position, commit)
            try:
                taken, reason = append_tokens(seq, position, commit, stop, max_seq_len)
            except TokenRefused as refused:  # the request's own constraint: it alone ends, nothing is wrong
                log.info("request %s ended: %s", seq.request.request_id, refused)
                done.errors.append(seq.request)
                self.end(seq.request, "error")
                continue
            except Exception:  # e.g. a tokenizer that cannot decode this id: this request alone ends
                log.exception("committing a token of request %s failed", seq.request.request_id)
                done.errors.append(seq.request)
                self.end(seq.request, "error")
                continue
            tokens += taken
            touched.append(seq)
            if reason is not None:
                self.finish(seq, reason)
            elif seq.num_computed - seq.num_cached >= bs and seq.status is running:
                self.cache.cache_computed(seq)  # a block the slot completed can be cached now
        done.tokens = tokens
        return done

    def _verified(self, seq: Sequence, position: int, commit: TokenCommit) -> int:
        """A verifying draw commits: its drafts come out of `seq`'s tokens (the kept ones come back
        through the stop test with the commit's tokens), the K/V past the kept ones is forgotten, and
        its k adapts. Returns the position the commit's first token fills."""
        assert position == len(seq.token_ids) - 1 and commit.drafts == seq.num_drafts, \
            "drafts are verified only before a sequence's last slot, all of them at once"
        kept = len(commit.tokens) - 1
        assert 0 <= kept <= commit.drafts and seq.token_ids[position - commit.drafts:position - commit.drafts + kept] \
            == list(commit.tokens[:kept]), "a commit keeps a prefix of the drafts"
        first = position - commit.drafts
        del seq.token_ids[first:position]
        self.drafts.verified(seq, commit.drafts, kept)
        seq.num_drafts, seq.draft_source = 0, ""
        seq.final_token_pending = False  # a limit the slot reached is checked again as tokens commit
        # a hybrid's state went back to before the verification: it computes the kept tokens again
        restored = self.cache.restore_state(seq, kept < commit.drafts, self.pending_copies)
        self.cache.roll_back(seq, first - 1 if restored else first + kept)
        return first

    # -- pinned prefixes and cache events ------------------------------------------------------
    def hold_prefix(self, tokens: list[int], namespace: str) -> RadixNode | None:
        """Keep the cached prefix `tokens` of `namespace` on the device until `release_prefix` (a pinned
        prefix): the node ending at its last token, which the tree splits there if need be; None,
        changing nothing, when the prefix is not wholly cached on the device. Changes the cache."""
        if self.tree is None:
            return None
        cached = self.tree.match(tokens, split=False, namespace=namespace)
        if cached.length < len(tokens) or cached.host_tokens:
            return None
        node = self.tree.match(tokens, namespace=namespace).node
        self.tree.hold(node)
        self.held_prefixes.append(node)
        return node

    def release_prefix(self, node: RadixNode) -> None:
        """Give back a hold `hold_prefix` took: the prefix is an ordinary LRU entry again. Changes the cache."""
        assert self.tree is not None
        self.held_prefixes.remove(node)
        self.tree.release_hold(node)

    def follow_cache_events(self) -> CacheEventLog:
        """Have the tree report every subtree it drops (for a scale-out router); idempotent. ValueError
        when the prefix cache is off."""
        if self.tree is None:
            raise ValueError("the prefix cache is off: there are no cache events to follow")
        if self.tree.events is None:
            self.tree.events = CacheEventLog()
        return self.tree.events

    # -- introspection ---------------------------------------------------------------------------
    def live_sequences(self) -> list[Sequence]:
        return self.running + self.waiting

    def check_integrity(self) -> None:
        check_integrity(self.live_sequences(), self.pool, self.tree, self.held_prefixes, self.states)
        if self.cache.windows is not None:
            self.cache.windows.check_integrity(self.live_sequences())

    def leaked_blocks(self) -> int:
        return leaked_blocks(self.live_sequences(), self.pool, self.tree, self.states)
