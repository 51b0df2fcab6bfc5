"""The block pool: which physical KV blocks are free, and how many owners each one has.

Invariants (checked by `check_integrity`):
- every block is exactly one of: free (refcount 0, on the free list once), owned by live sequences
  (and maybe the cache), or cached-unowned (held only by radix-tree nodes);
- a block's refcount equals its number of owners: each sequence block-table entry and each radix
  node that lists the block holds one reference;
- copy-on-write: a block with more than one owner is never written (the scheduler copies it first).

The pool knows nothing of the cache above it: `allocate` only hands out free blocks. One hook,
`on_free`, tells the owner of what is attached to a block (the window blocks, cache/window_blocks.py)
that the block went free, so that nothing stays attached to a block someone else may be handed next. Whoever needs
blocks the free list lacks evicts first, explicitly (the scheduler's `SequenceCache` and the radix
tree's own tier moves call `RadixTree.evict`), so cached prefixes are evicted only under memory
pressure and every eviction is visible at its call site.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable


class OutOfBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError("the block pool needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.refcount = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self.on_free: Callable[[int], None] | None = None  # called with each block whose refcount drops to 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """n free blocks, now with refcount 1; None (and no change) if fewer than n are free."""
        if n > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.refcount[b] = 1
        return blocks

    def incref(self, block: int) -> None:
        if self.refcount[block] <= 0:
            raise AssertionError(f"incref of free block {block}")
        self.refcount[block] += 1

    def decref(self, block: int) -> bool:
        """Drop one reference; True when the block became free."""
        if self.refcount[block] <= 0:
            raise AssertionError(f"decref of free block {block}")
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            self._free.append(block)
            if self.on_free is not None:
                self.on_free(block)
            return True
        return False

    def release(self, blocks: list[int]) -> int:
        return sum(self.decref(b) for b in blocks)

    def check_integrity(self, owners: Counter[int]) -> None:
        """`owners` counts, per block, every sequence and tree node that lists it."""
        free = list(self._free)
        assert len(free) == len(set(free)), "a block is on the free list twice"
        free_set = set(free)
        for b in range(self.num_blocks):
            rc = self.refcount[b]
            assert rc == owners.get(b, 0), f"block {b}: refcount {rc} != {owners.get(b, 0)} owners"
            assert (rc == 0) == (b in free_set), f"block {b}: refcount {rc} but free={b in free_set}"
        stray = set(owners) - set(range(self.num_blocks))
        assert not stray, f"owners name blocks outside the pool: {sorted(stray)[:5]}"
