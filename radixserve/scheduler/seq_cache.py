"""A sequence's hold on the cache: its blocks, its lock on the tree and (when swapped out) its pin
in the host tier. Taking a cached prefix (with load-back), reserving blocks for a chunk (with
copy-on-write), caching completed blocks as they are computed, and releasing everything (by
recompute or swap). Only the scheduler calls these; it decides when, this module how.

Every block copy decided here is appended to `copies`, which is the tree's list (the scheduler
hands it to the step), so copy-on-write copies and tier moves keep one order.
"""

from __future__ import annotations

from radixserve.cache.block_pool import BlockPool
from radixserve.cache.radix_tree import RadixTree, common_prefix_len
from radixserve.core import BlockCopy, CopyKind, Sequence


class SequenceCache:
    def __init__(self, pool: BlockPool, tree: RadixTree | None, running: list[Sequence]) -> None:
        self.pool = pool
        self.tree = tree
        self.block_size = pool.block_size
        self.running = running  # the scheduler's running list (read: prefills in flight)
        self.copies: list[BlockCopy] = tree.copies if tree is not None else []

    def take_prefix(self, seq: Sequence) -> tuple[int, int] | None:
        """Share the longest cached prefix (never the last token: its logits are needed), loading
        back the part that lives only in the host tier, and lock it. Returns the matched length and
        how much of it came from the host tier, or None when the sequence should wait for an
        in-flight prefill. The whole match is always taken: how long the sequence may grow later
        never decides how much of the cache it uses now (`loosen_lock` is what keeps it alive)."""
        if self.tree is None:
            return 0, 0
        match = self.tree.match(seq.token_ids[:-1])
        on_device = match.length - match.host_tokens
        match = self.tree.load_back(match)
        if self._prefix_in_flight(seq, match.length):
            return None
        self.tree.lock(match.node)
        for b in match.blocks:
            self.pool.incref(b)
        seq.locked_node, seq.block_table, seq.num_computed = match.node, match.blocks, match.length
        seq.num_cached = match.length // self.block_size * self.block_size
        return match.length, max(0, match.length - on_device)

    def _prefix_in_flight(self, seq: Sequence, matched: int) -> bool:
        for other in self.running:
            if other.is_prefill:
                shared = common_prefix_len(seq.token_ids[:-1], other.token_ids[:-1])
                if shared - matched >= self.block_size:
                    return True
        return False

    def needs_blocks(self, seq: Sequence, n: int) -> bool:
        """False for the common decode step, whose write lands in a private block it already has."""
        if n > 1:
            return True
        pos, table = seq.num_computed, seq.block_table
        return pos >= len(table) * self.block_size or self.pool.refcount[table[pos // self.block_size]] > 1

    def reserve(self, seq: Sequence, n: int) -> bool:
        """Give `seq` blocks for positions [num_computed, num_computed + n), copying the first
        written block if it is shared. False (nothing changed) if the pool cannot supply them."""
        bs, table = self.block_size, seq.block_table
        first = seq.num_computed // bs
        missing = max(0, -(-(seq.num_computed + n) // bs) - len(table))
        shared = first < len(table) and self.pool.refcount[table[first]] > 1
        fresh = self.pool.allocate(missing + int(shared))
        if fresh is None and shared and self.pool.refcount[table[first]] == 1:
            # the failed allocation evicted the block's other owner: it is ours to write in place
            shared, fresh = False, self.pool.allocate(missing)
        if fresh is None:
            return False
        if shared:
            dst = fresh.pop()
            src = table[first]
            if self.pool.refcount[src] > 1:  # allocating may have evicted the other owner
                self.copies.append(BlockCopy(CopyKind.DEVICE, src, dst))
                self.pool.decref(src)
                table[first] = dst
            else:
                self.pool.decref(dst)
        table.extend(fresh)
        return True

    def loosen_lock(self, seq: Sequence) -> bool:
        """Move the sequence's lock up to the longest block-aligned part of its locked path that
        lists only blocks of its own table, so the rest (the shared partial block of a mid-block hit
        once copied, superseded copies of straddled blocks) becomes evictable. The scheduler does
        this only for a sequence that would otherwise wait on itself (nothing else runs to free
        blocks): it keeps a sequence that needs the whole pool alive, while everywhere else the full
        lock keeps the entries it reads from being evicted for nothing. True if the lock moved."""
        locked = seq.locked_node
        if self.tree is None or locked is None or locked is self.tree.root:
            return False
        path = seq.token_ids[:locked.end]
        exclusive = self.tree.exclusive_prefix_len(path)
        if exclusive == locked.end:
            return False
        node = self.tree.match(path[:exclusive]).node
        self.tree.lock(node)
        self.tree.unlock(locked)
        seq.locked_node = node
        return True

    def release(self, seq: Sequence, swap: bool = False) -> bool:
        """Cache the computed tokens and give up the blocks and the lock. With `swap`, the cached
        path is also copied to the host tier and pinned there (`seq.swapped_node`); True if it was."""
        computed = min(seq.num_computed, seq.num_resolved)  # equal at every step boundary
        swapped = False
        if self.tree is not None and computed > 0:
            node = self.tree.insert(seq.token_ids[:computed], seq.block_table)
            if swap and seq.swapped_node is None and self.tree.swap_out(node):
                seq.swapped_node, swapped = node, True
        if seq.locked_node is not None:
            assert self.tree is not None
            self.tree.unlock(seq.locked_node)
            seq.locked_node = None
        self.pool.release(seq.block_table)
        seq.block_table = []
        seq.num_computed = seq.num_cached = 0
        return swapped

    def cache_computed(self, seq: Sequence) -> None:
        bs = self.block_size
        full = min(seq.num_computed, seq.num_resolved) // bs * bs
        if self.tree is None or full <= seq.num_cached:
            return
        seq.num_cached = full
        node = self.tree.insert(seq.token_ids[:full], seq.block_table, known=seq.locked_node)
        if self.tree.foreign_blocks(node, seq.block_table, stop=seq.locked_node):
            # another sequence cached these tokens first: locking its copy would pin blocks this
            # one does not use (it may need the whole pool), so the lock stays where it was
            return
        self.tree.lock(node)
        if seq.locked_node is not None:
            self.tree.unlock(seq.locked_node)
        seq.locked_node = node
