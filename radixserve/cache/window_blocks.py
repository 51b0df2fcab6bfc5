"""Window blocks: the sliding-window layers' K/V of the paged KV blocks, in a pool of their own, so
that the prefix cache can drop it block by block while the full-attention layers' K/V stays.

With `--sliding-window-kv window-blocks` a sliding-window layer attends over its sequence's window
state, as with `window` (model/window_kv.py), and also writes every new token's K/V rows to the
window block of the KV block that holds the token, its **companion**. A cached path can then resume
at any position p whose last `window - 1` tokens all lie in blocks that still have companions:
their rows, copied into the sequence's window state (`CopyKind.WINDOW`), are exactly the state the
model left there. No state checkpoints are taken; a hit ends where the KV match ends, or earlier
where a companion in its window is gone (`restorable`).

Invariants (`check_integrity`):
- a KV block has at most one companion and a window block belongs to at most one KV block; the
  window pool's references are exactly the companions;
- only an allocated KV block has a companion: a KV block going free drops it (`BlockPool.on_free`);
- a companion holds the rows of every token written to its KV block: it is given only to a fresh
  KV block before any write (`attach`), to a copy-on-write copy as a copy of the source's (`copy`),
  or to a tree block whose every token a sequence computed again in a block of its own, taken
  from that one (`adopt`).

Eviction is explicit, as for KV blocks: before it attaches, the scheduler's cache layer calls
`make_room`, which drops companions of blocks the radix tree lists (never of a running sequence's
own blocks, which it is still writing). Tree blocks are never written again (copy-on-write), so
any of theirs may go. A hit is likeliest at a path's end (a leaf: a reply's end, where the next
turn resumes, often a little before it) or at a prefix paths share (a node with two children that
requests took). A companion within a window (and a margin) before such an end is live, as
recently as that end was used. A branch point one path left behind (where an agent's next turn left
the reply before it) is no such end, and the tail left there is a leaf no request used since. The
others go first, the least recently used node first; then the live ones, those of the least
recently used end first.
"""

from __future__ import annotations

from collections import Counter

from radixserve.cache.block_pool import BlockPool
from radixserve.cache.radix_tree import RadixTree
from radixserve.core import BlockCopy, CopyKind

# how far before a likely end a hit may land and still be worth its window (an agent's next turn
# leaves its path a little before the reply's end: a tool call's text tokenized otherwise)
_MARGIN_BLOCKS = 4


class WindowBlocks:
    def __init__(self, num_blocks: int, window: int, kv_pool: BlockPool) -> None:
        if window < 2:
            raise ValueError(f"window blocks need a window of at least 2 tokens, got {window}")
        self.pool = BlockPool(num_blocks, kv_pool.block_size)
        self.block_size = kv_pool.block_size
        self.keep = window - 1  # the rows before a position that resuming there needs
        self.kv_pool = kv_pool
        self.companion: dict[int, int] = {}  # KV block -> its window block
        self.evicted = 0  # companions dropped to make room
        self.adopted = 0  # companions the tree's blocks took from sequences that computed their tokens again
        kv_pool.on_free = self._kv_block_freed

    def _kv_block_freed(self, block: int) -> None:
        window_block = self.companion.pop(block, -1)
        if window_block >= 0:
            self.pool.decref(window_block)

    # -- queries --------------------------------------------------------------------------------
    def restorable(self, blocks: list[int], length: int) -> int:
        """The deepest position p <= `length` at which a sequence whose first blocks are `blocks`
        (a match's device blocks, covering at least `length` tokens) can resume: every position in
        [p - keep, p) lies in a block with a companion. 0 when none is. A query."""
        bs, p = self.block_size, length
        while p > 0:
            first, last = max(0, p - self.keep) // bs, (p - 1) // bs
            missing = next((i for i in range(last, first - 1, -1) if blocks[i] not in self.companion), None)
            if missing is None:
                return p
            p = missing * bs  # the window must end before that block
        return 0

    def rows(self, blocks: list[int], end: int) -> tuple[int, ...]:
        """The window-store rows (window block * block_size + offset) of positions [end - keep, end)
        (from 0 when that is negative), oldest first: what resuming at `end` copies. A query."""
        bs = self.block_size
        return tuple(self.companion[blocks[p // bs]] * bs + p % bs for p in range(max(0, end - self.keep), end))

    def of_blocks(self, blocks: list[int]) -> dict[int, int]:
        """The companions of those of `blocks` that have one (a step's map for its writes). A query."""
        companion = self.companion
        return {b: companion[b] for b in blocks if b in companion}

    # -- changes ----------------------------------------------------------------------------------
    def attach(self, kv_blocks: list[int]) -> None:
        """Give fresh KV blocks (nothing written yet) a companion each while free window blocks last;
        the rest stay without (their window K/V is not cached). Changes the cache."""
        for b in kv_blocks:
            assert b not in self.companion, f"KV block {b} already has a companion"
            got = self.pool.allocate(1)
            if got is None:
                return
            self.companion[b] = got[0]

    def copy(self, src: int, dst: int, copies: list[BlockCopy]) -> None:
        """`dst`, a fresh KV block, becomes a copy of `src` (copy-on-write): it gets a copy of `src`'s
        companion when `src` has one and a window block is free, else none. Changes the cache."""
        assert dst not in self.companion, f"KV block {dst} already has a companion"
        source = self.companion.get(src)
        if source is None:
            return
        got = self.pool.allocate(1)
        if got is not None:
            self.companion[dst] = got[0]
            copies.append(BlockCopy(CopyKind.WINDOW_BLOCK, source, got[0]))

    def adopt(self, cached: list[int], own: list[int]) -> int:
        """A sequence computed again tokens the tree holds in blocks without companions (a hit cut back
        before them): where `cached[i]`, the tree's block, has none and `own[i]`, the sequence's full block
        of the same tokens at the same positions, has one, the tree's block takes it. It holds the
        window rows of exactly those tokens, and the sequence never reads its own (it attends over its
        window state). Else a path that lost companions would lose its hits for good. Returns how many
        moved. Changes the cache."""
        moved = 0
        for tree_block, own_block in zip(cached, own):
            if tree_block != own_block and tree_block >= 0 and tree_block not in self.companion \
                    and own_block in self.companion:
                self.companion[tree_block] = self.companion.pop(own_block)
                moved += 1
        self.adopted += moved
        return moved

    def make_room(self, needed: int, tree: RadixTree) -> int:
        """Drop companions of tree blocks until `needed` window blocks are free (or none is left to
        drop), in the order of the module docstring; returns how many were dropped. Changes the cache."""
        short = needed - self.pool.num_free
        if short <= 0:
            return 0
        bs, reach = self.block_size, self.keep + self.block_size * _MARGIN_BLOCKS
        nodes = tree.nodes()
        live: dict[int, int] = {}  # KV block -> the latest use of a likely end whose window reaches it
        for end in nodes:
            if end.children and sum(1 for c in end.children.values() if c.hits) < 2:
                continue  # neither a path's end nor a prefix that paths share
            low, node = end.end - reach, end
            while node.parent is not None and node.end > low:
                first = node.start // bs
                for i, b in enumerate(node.blocks):
                    if (first + i + 1) * bs > low and b in self.companion and live.get(b, -1) < end.last_access:
                        live[b] = end.last_access
                node = node.parent
        order: dict[int, tuple[int, int]] = {}  # KV block -> its eviction key (lowest goes first)
        for node in nodes:
            for b in node.blocks:
                if b in self.companion:
                    key = (1, live[b]) if b in live else (0, node.last_access)
                    order[b] = max(order.get(b, key), key)
        dropped = 0
        for b in sorted(order, key=order.__getitem__)[:short]:
            self.pool.decref(self.companion.pop(b))
            dropped += 1
        self.evicted += dropped
        return dropped

    def check_integrity(self) -> None:
        """Assert the module docstring's invariants. A query."""
        owners = Counter(self.companion.values())
        assert all(n == 1 for n in owners.values()), "a window block is the companion of two KV blocks"
        self.pool.check_integrity(owners)
        freed = [b for b in self.companion if self.kv_pool.refcount[b] == 0]
        assert not freed, f"free KV blocks keep companions: {freed[:5]}"
