"""A sequence's hold on the cache: its blocks, its lock on the tree and (when swapped out) its pin
in the host tier. Taking a cached prefix (with load-back), reserving blocks for a chunk (with
copy-on-write), caching completed blocks as they are computed, and releasing everything (by
recompute or swap). Only the scheduler calls these; it decides when, this module how.

Every block copy decided here is appended to `copies`, which is the tree's list (the scheduler
hands it to the step), so copy-on-write copies and tier moves keep one order.
"""

from __future__ import annotations

from radixserve.cache.block_pool import BlockPool
from radixserve.cache.radix_tree import Match, RadixTree, common_prefix_len
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
        back the part that lives only in the host tier. Returns the matched length and how much of
        it came from the host tier, or None when the sequence should wait for an in-flight prefill."""
        if self.tree is None:
            return 0, 0
        prefix = seq.token_ids[:-1]
        match = self.tree.match(prefix)
        on_device = match.length - match.host_tokens
        match = self.tree.load_back(match)
        if self._footprint(seq, match) > self.pool.num_blocks:
            match = self.tree.match(prefix[:self.tree.exclusive_prefix_len(prefix)])
        if self._prefix_in_flight(seq, match.length):
            return None
        self.tree.lock(match.node)
        for b in match.blocks:
            self.pool.incref(b)
        seq.locked_node, seq.block_table, seq.num_computed = match.node, match.blocks, match.length
        seq.num_cached = match.length // self.block_size * self.block_size
        return match.length, max(0, match.length - on_device)

    def _footprint(self, seq: Sequence, match: Match) -> int:
        """Blocks this sequence could hold at its longest if it locks `match`: its own table plus
        the blocks the locked path pins besides (superseded copies of straddled blocks, and the
        shared partial block that a mid-block hit copies on first write)."""
        assert self.tree is not None
        longest = min(seq.num_prompt_tokens + seq.request.params.max_tokens, self.pool.num_blocks * self.block_size)
        pinned = self.tree.foreign_blocks(match.node, match.blocks) + int(match.length % self.block_size != 0)
        return -(-longest // self.block_size) + pinned

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
