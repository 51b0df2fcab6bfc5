"""A sequence's hold on the cache: its blocks, its lock on the tree and (when swapped out) its pin
in the host tier. Taking a cached prefix (with load-back), reserving blocks for a chunk (with
copy-on-write), caching completed blocks as they are computed, and releasing everything (by
recompute or swap). Only the scheduler calls these; it decides when, this module how. Each method
says whether it changes the cache; all but the queries do.

Every lookup and insert is in the sequence's cache namespace (`Sequence.namespace`, its request's
SamplingParams.cache_namespace): a sequence never takes, nor caches into, another namespace's tree.

Hybrid models (recurrent layers, `states` set): a sequence also holds a working state slot, its
recurrent state after its computed tokens. A hit resumes only where the tree checkpointed a state:
the match is cut back to the deepest checkpoint on it and that state is copied into the working slot
(the attention K/V past it is recomputed with the recurrent layers; `recomputed_state_tokens` counts
it). Where checkpoints are taken is `checkpoint_policy.py`'s choice; this module takes them. At the
end of every released sequence (a finished reply, a preemption) the working slot itself becomes the
checkpoint. Where the policy stops a prefill (`checkpoint_at`: the default policy's branch points,
where a new prompt leaves a cached path that has no checkpoint there or a prefill still running that
shares its prefix; every block boundary under `every-block`) a copy of its state is attached; under
the default policy a sequence sharing a running prefill's prefix waits for that checkpoint. When
slots run out the tree drops one (`RadixTree.evict_checkpoint`). A sequence verifying drafts
holds a copy of its state from before them (`back_up_state`): when the verification rejects any, the
state goes back to it and the kept tokens are computed again (`restore_state`).

Window blocks (`windows` set, `--sliding-window-kv window-blocks`, cache/window_blocks.py): the
sliding-window layers' K/V sit in window blocks, one beside each KV block whose tokens a window still
reads or the tree may resume from. Each fresh KV block a sequence will write gets one, which the model
fills with the sliding layers' rows of its tokens and reads in place (copy-on-write copies it too;
where the tree holds the same tokens in a block without one, that block takes it). Making room for
them drops those no live sequence's window spans (`readers`); a step they cannot be found for fails
like one short of KV blocks. A hit resumes where the match ends, or before the first position whose
window reaches a block without one (its K/V past there is recomputed and counted in
`recomputed_state_tokens`).

Eviction is explicit: before it allocates, this layer asks the tree to make room (`_allocate`); the
pool never calls up into the tree. Every eviction here (KV blocks, window blocks, checkpoints) keeps
for last what the waiting sequences will read (`next_reads`, cache/next_reads.py), which the
scheduler has rebuilt whenever its queue changes (`forget_reads`). Every block copy decided here
(copy-on-write, and the tree's write-backs and load-backs) is appended to the `copies` list the
caller passes in, which is the step the scheduler is building (`Batch.copies`), so all of a step's
copies keep the order they were decided in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from radixserve.cache.block_pool import BlockPool
from radixserve.cache.next_reads import NextReads
from radixserve.cache.radix_tree import Match, RadixNode, RadixTree, common_prefix_len
from radixserve.cache.window_blocks import WindowBlocks
from radixserve.core import Batch, BlockCopy, CopyKind, ScheduledSeq, Sequence
from radixserve.scheduler.checkpoint_policy import CheckpointPolicy


class SequenceCache:
    def __init__(self, pool: BlockPool, tree: RadixTree | None, states: BlockPool | None = None,
                 policy: CheckpointPolicy | None = None, windows: WindowBlocks | None = None,
                 readers: Callable[[], Iterable[Sequence]] = tuple,
                 upcoming: Callable[[], Iterable[Sequence]] = tuple, lookahead: int = 0) -> None:
        self.pool = pool
        self.tree = tree
        self.states = states  # a hybrid model's recurrent-state slots; None: attention layers only
        self.windows = windows  # the window group's pool (sliding-window layers' K/V); None: no such group
        self.readers = readers  # the live sequences (the scheduler's): whose windows' blocks must stay
        self.upcoming = upcoming  # the waiting sequences in admission order: what evictions keep for last
        self.lookahead = lookahead  # how many of them (0: evictions are least recently used first alone)
        self._reads: NextReads | None = None  # their matches, built when an eviction first needs them
        self.checkpoints = states is not None  # a hybrid resumes hits at state checkpoints
        self.policy = policy or CheckpointPolicy(interval=pool.block_size)
        self.block_size = pool.block_size
        self.recomputed_state_tokens = 0  # cached K/V recomputed because no checkpoint was at the match's end
        self.checkpoints_taken = 0

    def next_reads(self) -> NextReads:
        """What the waiting sequences will read, soonest first (cache/next_reads.py): built once until
        `forget_reads`. Reads the cache."""
        assert self.tree is not None
        if self._reads is None:
            upcoming = self.upcoming() if self.lookahead else ()
            self._reads = NextReads.of(self.tree, ((s.token_ids[:-1], s.namespace) for s in upcoming),
                                       self.pool.num_blocks * self.block_size, self.lookahead)
        return self._reads

    def forget_reads(self) -> None:
        """The waiting queue changed (a step begins, a sequence joined it): build `next_reads` again
        when an eviction next needs it."""
        self._reads = None

    def _allocate_state(self, keep: RadixNode | None = None) -> int:
        """A free state slot, evicting the policy's victim checkpoint (never `keep`'s) if none is; -1
        if none is left."""
        assert self.states is not None
        if self.states.num_free == 0 and self.tree is not None:
            victim = self.policy.victim(self.tree, keep, self.next_reads())
            if victim is not None:
                self.tree.evict_checkpoint(victim)
        got = self.states.allocate(1)
        return -1 if got is None else got[0]

    def _release_state(self, seq: Sequence) -> None:
        for slot in (seq.state_slot, seq.state_backup):
            if slot >= 0:
                assert self.states is not None
                self.states.decref(slot)
        seq.state_slot = seq.state_backup = -1

    def back_up_state(self, seq: Sequence, copies: list[BlockCopy]) -> bool:
        """Before `seq` verifies drafts: copy its working state aside, so that drafts the verification
        rejects can be undone (a recurrent state cannot be rolled back). False if no slot is free
        (then it does not draft). Changes the cache."""
        if self.states is None:
            return True
        got = self.states.allocate(1)  # drafts are never worth evicting a checkpoint, which a later hit resumes from
        if got is None:
            return False
        seq.state_backup = slot = got[0]
        copies.append(BlockCopy(CopyKind.STATE, seq.state_slot, slot))
        return True

    def restore_state(self, seq: Sequence, rejected: bool, copies: list[BlockCopy]) -> bool:
        """`seq`'s verification committed: with drafts `rejected`, its state goes back to the copy taken
        before them (the caller then recomputes from there); the copy's slot is freed either way. True
        if the state went back. Changes the cache."""
        slot, seq.state_backup = seq.state_backup, -1
        if slot < 0:
            return False
        assert self.states is not None
        if rejected:
            copies.append(BlockCopy(CopyKind.STATE, slot, seq.state_slot))
        self.states.decref(slot)  # (the restore above reads it first: freed slots are written only later)
        return rejected

    def _allocate(self, n: int, copies: list[BlockCopy]) -> list[int] | None:
        """n fresh blocks, evicting cached ones first if the free list lacks them."""
        if self.tree is not None and n > self.pool.num_free:
            copies.extend(self.tree.make_room(n, self.next_reads().first_read))
        return self.pool.allocate(n)

    def take_prefix(self, seq: Sequence, prefills: list[Sequence], copies: list[BlockCopy],
                    scheduled: dict[int, ScheduledSeq] | None = None) -> tuple[int, int, int, int] | None:
        """Share the longest cached prefix (never the last token: its logits are needed), loading
        back the part that lives only in the host tier, and lock it. Returns the matched length, how
        much of it came from the host tier, how much from pinned prefixes and how many cached tokens past
        it a hybrid or the window group could not resume (`count_recomputed` counts them once the
        sequence is admitted), or None when the sequence should wait for one of
        `prefills` (running prefills) to cache it. Changes the cache. The whole match is always
        taken: how long the sequence may grow later never decides how much of the cache it uses now
        (`loosen_lock` is what keeps it alive). A request's first sample that asks for prompt logprobs
        takes nothing: a cached prefix has no logits to give them (engine/prompt_logprobs.py)."""
        takes = self.tree is not None and not (seq.index == 0 and seq.request.params.prompt_logprobs is not None)
        wanted = seq.token_ids[:-1] if takes else []
        cached, resumes = 0, None  # hybrids: how much of the prompt the tree holds; the checkpoint to resume from
        if self.checkpoints and takes:
            wanted, cached, resumes = self._restorable(seq, wanted)
        if self.states is not None and seq.state_slot < 0:
            seq.state_slot = self._allocate_state(keep=resumes)
            if seq.state_slot < 0:
                return None  # every slot runs a sequence: it waits for one to end
        if self.tree is None or not takes:
            return 0, 0, 0, 0
        match = self.tree.match(wanted, namespace=seq.namespace)
        on_device = match.length - match.host_tokens
        match, loaded = self.tree.load_back(match, self.next_reads().first_read if match.host_tokens else None)
        copies.extend(loaded)
        if not self.checkpoints and _prefix_in_flight(seq, match.length, prefills, self.block_size):
            self._release_state(seq)
            return None
        if (self.checkpoints and self.policy.at_branches
                and self._branch_in_flight(seq, match.length, prefills, scheduled or {})):
            self._release_state(seq)
            return None
        if self.windows is not None:
            cached = match.length
            match = self._resume_windows(seq, wanted, match)
        elif self.states is not None and match.length:
            if match.node.state < 0:  # not all of it could stay on the device: resume from scratch
                match = self.tree.match([], namespace=seq.namespace)
            else:
                copies.append(BlockCopy(CopyKind.STATE, match.node.state, seq.state_slot))
                self.tree.resumed_from(match.node)
        self.tree.lock(match.node)
        self.tree.record_hit(match)
        for b in match.blocks:
            self.pool.incref(b)
        seq.locked_node, seq.block_table, seq.num_computed = match.node, match.blocks, match.length
        seq.num_cached = match.length // self.block_size * self.block_size
        pinned = sum(min(n.end, match.length) - n.start for n in match.path if n.hold_count)
        return match.length, max(0, match.length - on_device), pinned, max(0, cached - match.length)

    def count_recomputed(self, tokens: int) -> None:
        """An admitted sequence will compute again `tokens` cached tokens that its hit could not resume
        (counted here, not at each attempt to admit it). Changes the counters only."""
        self.recomputed_state_tokens += tokens

    def _resume_windows(self, seq: Sequence, wanted: list[int], match: Match) -> Match:
        """Window blocks: cut `match` back to where its window blocks hold the sliding layers' windows.
        Reads the cache."""
        assert self.tree is not None and self.windows is not None
        on_device = match.length - match.host_tokens
        resume = self.windows.restorable(match.blocks, on_device)
        if resume < match.length:
            match = self.tree.match(wanted[:resume], namespace=seq.namespace)
        return match

    def _restorable(self, seq: Sequence, tokens: list[int]) -> tuple[list[int], int, RadixNode | None]:
        """The part of `tokens` a hybrid model can resume: up to the deepest checkpoint on their
        cached path; how long that cached path is; the checkpoint's node. Where the path goes on past
        the checkpoint, the default policy has the sequence checkpoint its state where the path ends
        (`checkpoint_at`): a branch point, likely shared again. Reads the cache and writes only
        `seq.checkpoint_at`."""
        assert self.tree is not None
        cached = self.tree.match(tokens, split=False, namespace=seq.namespace)
        node = self.tree.checkpoint_on(cached.path, cached.length)
        end = 0 if node is None else node.end
        seq.checkpoint_at = cached.length if cached.length > end and self.policy.at_branches else -1
        return tokens[:end], cached.length, node

    def _branch_in_flight(self, seq: Sequence, restored: int, running: list[Sequence],
                          scheduled: dict[int, ScheduledSeq]) -> bool:
        """Hybrid models: does a running prefill of its namespace share at least a block more of
        `seq`'s prompt than the state `seq` can resume from, at a position it has not computed yet?
        Then that prefill is to stop and checkpoint there (its `checkpoint_at`, the earliest of its
        plans first; a chunk of it this step schedules past there, `scheduled`, is cut to end there)
        and `seq` waits for it, rather than both computing the shared part. Changes the other
        sequence's plan and its item in this step only."""
        tokens = seq.token_ids[:-1]
        for other in running:
            if not other.is_prefill or other.num_drafts or other.namespace != seq.namespace or other is seq:
                continue  # (a verification's tokens past its last are unverified drafts, and it is never cut)
            shared = common_prefix_len(tokens, other.token_ids[:-1])
            if shared - restored < self.block_size or other.num_computed >= shared:
                continue  # little to share, or it is past the branch (a checkpoint there is in the tree)
            item = scheduled.get(other.seq_id)
            if item is not None and item.start + item.num_tokens > shared:
                item.num_tokens = shared - item.start  # (the blocks reserved past it stay in its table)
            if other.checkpoint_at < 0 or other.checkpoint_at > shared:
                other.checkpoint_at = shared
            return True
        return False

    def cut_at_checkpoint(self, seq: Sequence, n: int) -> int:
        """How many of the next n tokens a prefill chunk of `seq` takes: it stops where the policy
        checkpoints next, which becomes its `checkpoint_at`; with window blocks, where the window pool
        could no longer hold its window and chunk together. Changes the sequence's plan only."""
        if self.windows is not None:
            n = min(n, self.windows.longest_chunk(seq.num_computed))
        if not self.checkpoints:
            return n
        seq.checkpoint_at = self.policy.next_stop(seq.num_computed, seq.checkpoint_at, len(seq.token_ids))
        stop = seq.checkpoint_at - seq.num_computed
        return min(n, stop) if stop > 0 else n

    def checkpoint(self, seq: Sequence, copies: list[BlockCopy]) -> bool:
        """`seq` computed up to its `checkpoint_at`: cache those tokens and attach a copy of its state
        to the node ending there (the copy runs before the next forward moves the state on). False
        when no slot is free or the node has a checkpoint already. Changes the cache."""
        seq.checkpoint_at = -1
        if self.tree is None or self.states is None:
            return False
        slot = self._allocate_state()
        if slot < 0:
            return False
        node = self.tree.insert(seq.token_ids[:seq.num_computed], seq.block_table, namespace=seq.namespace)
        if not self.tree.attach_state(node, slot):
            self.states.decref(slot)
            return False
        copies.append(BlockCopy(CopyKind.STATE, seq.state_slot, slot))
        self.checkpoints_taken += 1
        return True

    def fork_state(self, parent: Sequence, child: Sequence, copies: list[BlockCopy]) -> bool:
        """Give a fork its own copy of the parent's state; False if no slot is left. Changes the cache."""
        if self.states is None:
            return True
        child.state_slot = self._allocate_state()
        if child.state_slot < 0:
            return False
        copies.append(BlockCopy(CopyKind.STATE, parent.state_slot, child.state_slot))
        return True

    def needs_blocks(self, seq: Sequence, n: int) -> bool:
        """False for the common decode step, whose write lands in a private block it already has. A query."""
        if n > 1:
            return True
        index, table = seq.num_computed // self.block_size, seq.block_table
        return index >= len(table) or self.pool.refcount[table[index]] > 1

    def reserve(self, seq: Sequence, n: int, copies: list[BlockCopy]) -> bool:
        """Give `seq` blocks for positions [num_computed, num_computed + n), copying the first
        written block if it is shared. False if the pool cannot supply them (then only eviction
        changed the cache)."""
        bs, table, computed = self.block_size, seq.block_table, seq.num_computed
        first = computed // bs
        # (plain comparisons rather than max(): every decode at a block's start comes here)
        missing = -(-(computed + n) // bs) - len(table)
        if missing < 0:
            missing = 0
        shared = first < len(table) and self.pool.refcount[table[first]] > 1
        fresh = self._allocate(missing + shared, copies)
        if fresh is None and shared and self.pool.refcount[table[first]] == 1:
            # the failed allocation evicted the block's other owner: it is ours to write in place
            shared, fresh = False, self._allocate(missing, copies)
        if fresh is None:
            return False
        windows = self.windows
        if windows is not None:
            short = windows.pool.num_free < len(fresh) and self.tree is not None  # (then build the reads)
            if not windows.make_room(len(fresh), self.tree, self._readers(seq), self.next_reads() if short else None):
                self.pool.release(fresh)  # (fresh: nothing refers to them yet)
                return False
        if shared:
            dst = fresh.pop()
            src = table[first]
            if self.pool.refcount[src] > 1:  # allocating may have evicted the other owner
                copies.append(BlockCopy(CopyKind.DEVICE, src, dst))
                if windows is not None:
                    windows.copy(src, dst, copies)
                self.pool.decref(src)
                table[first] = dst
            else:
                self.pool.decref(dst)
        if windows is not None:
            windows.attach(fresh)
        table.extend(fresh)
        return True

    def _readers(self, seq: Sequence) -> list[Sequence]:
        """The live sequences, `seq` among them (one being admitted may not be listed yet). A query."""
        readers = list(self.readers())
        return readers if any(r is seq for r in readers) else readers + [seq]

    def _adopt_windows(self, seq: Sequence, length: int, leaving: bool = False) -> None:
        """Window blocks: the tree's blocks of `seq`'s first `length` tokens that have no companion take
        those of the sequence's own full blocks of the same tokens that no live window spans (`seq`'s
        too, unless it is `leaving`) (`WindowBlocks.adopt`). Changes the cache."""
        if self.windows is None or self.tree is None:
            return
        full = length // self.block_size
        cached = self.tree.match(seq.token_ids[:full * self.block_size], split=False, namespace=seq.namespace)
        readers = [r for r in self._readers(seq) if not (leaving and r is seq)]
        self.windows.adopt(cached.blocks[:full], seq.block_table[:full], self.windows.windows_in_use(readers)[0])

    def map_windows(self, batch: Batch) -> None:
        """Window blocks: tell the step which window block each KV block its items read or write in their
        windows has. Changes the step only."""
        if self.windows is None:
            return
        bs, keep, blocks = self.block_size, self.windows.keep, []
        for item in batch.items:
            table = item.seq.block_table
            blocks += table[max(0, item.start - keep) // bs:(item.start + item.num_tokens - 1) // bs + 1]
        batch.window_blocks = self.windows.of_blocks(blocks)

    def loosen_lock(self, seq: Sequence) -> bool:
        """Move the sequence's lock up to the longest block-aligned part of its locked path that
        lists only blocks of its own table, so the rest (the shared partial block of a mid-block hit
        once copied, superseded copies of straddled blocks) becomes evictable. The scheduler does
        this only for a sequence that would otherwise wait on itself (nothing else runs to free
        blocks): it keeps a sequence that needs the whole pool alive, while everywhere else the full
        lock keeps the entries it reads from being evicted for nothing. True if the lock moved
        (changes the cache: locks only)."""
        locked = seq.locked_node
        if self.tree is None or locked is None or locked.parent is None:
            return False
        path = seq.token_ids[:locked.end]
        exclusive = self.tree.exclusive_prefix_len(path, seq.namespace)
        if exclusive == locked.end:
            return False
        node = self.tree.match(path[:exclusive], namespace=seq.namespace).node
        self.tree.relock(locked, node)
        seq.locked_node = node
        return True

    def roll_back(self, seq: Sequence, keep: int) -> None:
        """`seq`'s tokens from position `keep` on were dropped (rejected drafts): forget their K/V.
        Blocks wholly past `keep` go back; the block holding `keep` stays (a later write copies it
        first if the tree shares it); a lock or cached count past `keep` moves back. Changes the cache."""
        bs, table = self.block_size, seq.block_table
        seq.num_computed = min(seq.num_computed, keep)
        held = -(-keep // bs)
        self.pool.release(table[held:])
        del table[held:]
        if seq.num_cached <= keep:
            return
        seq.num_cached = keep // bs * bs
        assert self.tree is not None and seq.locked_node is not None
        node = self.tree.match(seq.token_ids[:seq.num_cached], namespace=seq.namespace).node
        self.tree.relock(seq.locked_node, node)
        seq.locked_node = node

    def release(self, seq: Sequence, copies: list[BlockCopy] | None = None, keep_state: bool = True) -> bool:
        """Cache the computed tokens and give up the blocks and the lock. Given `copies` (a swap),
        the cached path is also copied to the host tier and pinned there (`seq.swapped_node`), the
        write-backs appended to `copies`; True if it was. A hybrid's working state becomes the
        checkpoint of its computed tokens, unless `keep_state` is False (a state not to trust).
        Changes the cache."""
        computed = min(seq.num_computed, seq.num_resolved)  # equal at every step boundary
        swapped = False
        if self.tree is not None and computed > 0:
            node = self.tree.insert(seq.token_ids[:computed], seq.block_table, namespace=seq.namespace)
            self._adopt_windows(seq, computed, leaving=True)
            moved = self.tree.swap_out(node) if copies is not None and seq.swapped_node is None else None
            if moved is not None and copies is not None:
                copies.extend(moved)
                seq.swapped_node, swapped = node, True
            # its working state is the state after exactly `computed` tokens: the node keeps it
            if (self.checkpoints and keep_state and seq.state_slot >= 0 and computed == seq.num_computed
                    and self.tree.attach_state(node, seq.state_slot)):
                self.checkpoints_taken += 1
                seq.state_slot = -1
        self._release_state(seq)
        seq.checkpoint_at = -1
        if seq.locked_node is not None:
            assert self.tree is not None
            self.tree.unlock(seq.locked_node)
            seq.locked_node = None
        self.pool.release(seq.block_table)
        seq.block_table = []
        seq.num_computed = seq.num_cached = 0
        return swapped

    def cache_computed(self, seq: Sequence) -> None:
        """Insert the sequence's newly completed, resolved full blocks into the tree and move its
        lock down onto them (unless another sequence's copy holds those tokens). Changes the cache."""
        bs = self.block_size
        if self.tree is None or seq.num_computed - seq.num_cached < bs:
            return  # the common decode step: no block completed (checked before the costlier count)
        full = min(seq.num_computed, seq.num_resolved) // bs * bs
        if full <= seq.num_cached:
            return
        seq.num_cached = full
        locked = seq.locked_node
        leaf = self.tree.extend_locked(locked, seq.token_ids, full, seq.block_table) if locked is not None else None
        if leaf is not None:  # the common case: nothing cached past the lock yet, and the lock moved down
            seq.locked_node = leaf
            return
        node = self.tree.insert(seq.token_ids[:full], seq.block_table, known=locked, namespace=seq.namespace)
        if self.tree.foreign_blocks(node, seq.block_table, stop=seq.locked_node):
            # another sequence cached these tokens first: locking its copy would pin blocks this
            # one does not use (it may need the whole pool), so the lock stays where it was
            self._adopt_windows(seq, full)
            return
        if seq.locked_node is None:
            self.tree.lock(node)
        else:
            self.tree.relock(seq.locked_node, node)
        seq.locked_node = node


def _prefix_in_flight(seq: Sequence, matched: int, prefills: list[Sequence], block_size: int) -> bool:
    """Does a running prefill of its namespace share at least a block more of `seq`'s prompt than the
    cache holds? (Another namespace's would never cache it a hit, and waiting for it would time it.)"""
    for other in prefills:
        if other.is_prefill and other.namespace == seq.namespace:
            shared = common_prefix_len(seq.token_ids[:-1], other.token_ids[:-1])
            if shared - matched >= block_size:
                return True
    return False
