"""Window blocks: the window group's pool. The sliding-window layers' K/V of a KV block's tokens sit
in a window block of their own, its **companion**, so that the prefix cache can drop it block by
block while the full-attention layers' K/V stays.

With `--sliding-window-kv window-blocks` a sliding-window layer writes every new token's K/V rows to
the companion of the KV block holding the token, and attends over its sequence's window by reading
the companions of the blocks it spans, in place (model/runner.py maps a step's block tables through
`of_blocks`). A cached path can then resume at any position p whose last `window - 1` tokens all lie
in blocks that still have companions (`restorable`): they are exactly the K/V the model left there.
A hit ends where the KV match ends, or earlier where a companion in its window is gone.

Invariants (`check_integrity`):
- a KV block has at most one companion and a window block belongs to at most one KV block; the
  window pool's references are exactly the companions;
- only an allocated KV block has a companion: a KV block going free drops it (`BlockPool.on_free`);
- a companion holds the rows of every token written to its KV block: it is given only to a fresh
  KV block before any write (`attach`), to a copy-on-write copy as a copy of the source's (`copy`),
  or to a tree block whose every token a sequence computed again in a block of its own, taken
  from that one (`adopt`);
- every block a live sequence's window spans (from `keep` tokens before its next position to the
  end of its table) has a companion: what its next step reads and writes.

Eviction is explicit, as for KV blocks: before it attaches, the scheduler's cache layer calls
`make_room`, which drops companions of blocks no live sequence's window spans (`windows_in_use`):
those of the tree's blocks, and those of the sequences' own blocks behind their windows, which
nothing reads again unless the tree holds them. Those the tree does not list go first. Of the
tree's, a hit is likeliest at a path's end (a leaf: a reply's end, where the next turn resumes,
often a little before it) or at a prefix that paths share: a node with two children that requests
took, or where two hits ended. The second counts a shared prefix whose own paths the tree lost:
requests that found only the prefix computed the rest anew, so no request took its children, and
without it the prefix's window went first and no hit could end there again (docs/bench/hybrid.md,
"A working set larger than the pool"). A companion within a window (and a margin) before such an end
is live, as recently as that end was used. A branch point one path left behind (where an agent's
next turn left the reply before it, one hit ending there) is no such end, and the tail left there is
a leaf no request used since. The others go first, the least recently used node first; then the
live ones, those of the least recently used end first; last those within a window (and the margin)
before where a waiting sequence's match ends or a shared prefix on its path does (where it resumes if
the end is lost), the one admitted last first (cache/next_reads.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator

from radixserve.cache.block_pool import BlockPool
from radixserve.cache.next_reads import NextReads
from radixserve.cache.radix_tree import RadixNode, RadixTree
from radixserve.core import BlockCopy, CopyKind, Sequence

# how far before a likely end a hit may land and still be worth its window (an agent's next turn
# leaves its path a little before the reply's end: a tool call's text tokenized otherwise)
_MARGIN_BLOCKS = 4


def least_window_blocks(window: int, block_size: int) -> int:
    """The fewest window blocks that hold one sequence's window and a new token wherever it lies."""
    return -(-(window - 1) // block_size) + 2


class WindowBlocks:
    def __init__(self, num_blocks: int, window: int, kv_pool: BlockPool) -> None:
        if window < 2:
            raise ValueError(f"window blocks need a window of at least 2 tokens, got {window}")
        if num_blocks < least_window_blocks(window, kv_pool.block_size):
            raise ValueError(f"{num_blocks} window blocks cannot hold a window of {window} tokens and a step's "
                             f"block: at least {least_window_blocks(window, kv_pool.block_size)} are needed")
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

    def of_blocks(self, blocks: list[int]) -> dict[int, int]:
        """The companions of those of `blocks` that have one (a step's map for its windows). A query."""
        companion = self.companion
        return {b: companion[b] for b in blocks if b in companion}

    def longest_chunk(self, start: int) -> int:
        """The most tokens a step may compute from position `start` on for one sequence whose window
        and chunk the whole pool holds (at least 1: the pool holds a window and two blocks). A query."""
        bs = self.block_size
        first = max(0, start - self.keep) // bs
        return max(1, (first + self.pool.num_blocks) * bs - start)

    def window_start(self, seq: Sequence) -> int:
        """The index in `seq`'s table of the first block its window spans: its next step reads from
        `keep` tokens before its next position on, which drafts being verified may yet move back to
        just past their first token. A query."""
        return max(0, seq.num_computed - seq.num_drafts - self.keep) // self.block_size

    def windows_in_use(self, readers: Iterable[Sequence]) -> tuple[set[int], list[int]]:
        """The KV blocks the windows of `readers` (the live sequences) span, whose companions must stay,
        and their other blocks that have a companion, behind every window. A query."""
        in_use: set[int] = set()
        behind: list[int] = []
        for seq in readers:
            first = self.window_start(seq)
            in_use.update(seq.block_table[first:])
            behind += [b for b in seq.block_table[:first] if b in self.companion]
        return in_use, [b for b in behind if b not in in_use]

    # -- changes ----------------------------------------------------------------------------------
    def attach(self, kv_blocks: list[int]) -> None:
        """Give fresh KV blocks (nothing written yet) a companion each; the caller made room for them.
        Changes the cache."""
        got = self.pool.allocate(len(kv_blocks))
        assert got is not None, f"{len(kv_blocks)} window blocks wanted, {self.pool.num_free} free: make room first"
        for b, window_block in zip(kv_blocks, got):
            assert b not in self.companion, f"KV block {b} already has a companion"
            self.companion[b] = window_block

    def copy(self, src: int, dst: int, copies: list[BlockCopy]) -> None:
        """`dst`, a fresh KV block, becomes a copy of `src` (copy-on-write), whose companion it gets a
        copy of; the caller made room for it. Changes the cache."""
        assert dst not in self.companion, f"KV block {dst} already has a companion"
        source = self.companion[src]  # (a block being written lies in its writer's window: it has one)
        got = self.pool.allocate(1)
        assert got is not None, "no window block free: make room first"
        self.companion[dst] = got[0]
        copies.append(BlockCopy(CopyKind.WINDOW_BLOCK, source, got[0]))

    def adopt(self, cached: list[int], own: list[int], in_use: set[int]) -> int:
        """A sequence computed again tokens the tree holds in blocks without companions (a hit cut back
        before them): where `cached[i]`, the tree's block, has none and `own[i]`, the sequence's full block
        of the same tokens at the same positions, has one that no live window spans (`in_use`), the
        tree's block takes it. It holds the window rows of exactly those tokens. Else a path that lost
        companions would lose its hits for good. Returns how many moved. Changes the cache."""
        moved = 0
        for tree_block, own_block in zip(cached, own):
            if tree_block != own_block and tree_block >= 0 and tree_block not in self.companion \
                    and own_block in self.companion and own_block not in in_use:
                self.companion[tree_block] = self.companion.pop(own_block)
                moved += 1
        self.adopted += moved
        return moved

    def make_room(self, needed: int, tree: RadixTree | None, readers: Iterable[Sequence],
                  reads: NextReads | None = None) -> bool:
        """Drop companions no window of `readers` (the live sequences) spans until `needed` window
        blocks are free, in the order of the module docstring (those before where `reads`, the waiting
        sequences' matches, end go last); False if they cannot be. Changes the cache."""
        short = needed - self.pool.num_free
        if short <= 0:
            return True
        in_use, behind = self.windows_in_use(readers)
        nodes = tree.nodes() if tree is not None else []
        ends = [end for end in nodes if not end.children or end.hits_ended >= 2
                or sum(1 for c in end.children.values() if c.hits) >= 2]  # a path's end, or a prefix paths share
        live: dict[int, int] = {}  # KV block -> the latest use of a likely end whose window reaches it
        for end in ends:
            for b in self._reaching(end, end.end):
                live[b] = max(live.get(b, -1), end.last_access)
        waited: dict[int, int] = {}  # KV block -> the soonest waiting sequence that may resume where it serves
        shared = {end.id for end in ends if end.children}
        for index, match in enumerate(reads.matches if reads is not None else []):
            # where its match ends, and the shared prefixes on its way there: where it resumes if that end is lost
            for node in match.path[:-1]:
                if node.id in shared:
                    for b in self._reaching(node, node.end):
                        waited.setdefault(b, index)
            for b in self._reaching(match.path[-1], match.length):  # (the path's last node may be matched in part)
                waited.setdefault(b, index)
        order: dict[int, tuple[int, int]] = {}  # KV block -> its eviction key (lowest goes first)
        for node in nodes:
            for b in node.blocks:
                if b in self.companion and b not in in_use:
                    key = (2, -waited[b]) if b in waited else (1, live[b]) if b in live else (0, node.last_access)
                    order[b] = max(order.get(b, key), key)
        for b in behind:
            order.setdefault(b, (-1, 0))  # behind its sequence's window and not the tree's: nothing reads it again
        victims = sorted(order, key=order.__getitem__)[:short]
        for b in victims:
            self.pool.decref(self.companion.pop(b))
        self.evicted += len(victims)
        return self.pool.num_free >= needed

    def _reaching(self, node: RadixNode, end: int) -> Iterator[int]:
        """The KV blocks with a companion that a hit ending at position `end` (on `node`, or the path
        above it) would read its window from, within a margin. A query."""
        bs, low = self.block_size, end - self.keep - self.block_size * _MARGIN_BLOCKS
        at: RadixNode | None = node
        while at is not None and at.parent is not None and at.end > low:
            first = at.start // bs
            for i, b in enumerate(at.blocks):
                if low < (first + i + 1) * bs and (first + i) * bs < end and b in self.companion:
                    yield b
            at = at.parent

    def check_integrity(self, live: Iterable[Sequence] = ()) -> None:
        """Assert the module docstring's invariants, the last over `live` (the live sequences). A query."""
        for seq in live:
            missing = [b for b in seq.block_table[self.window_start(seq):] if b not in self.companion]
            assert not missing, f"sequence {seq.seq_id}: blocks {missing[:5]} in its window have no window block"
        owners = Counter(self.companion.values())
        assert all(n == 1 for n in owners.values()), "a window block is the companion of two KV blocks"
        self.pool.check_integrity(owners)
        freed = [b for b in self.companion if self.kv_pool.refcount[b] == 0]
        assert not freed, f"free KV blocks keep companions: {freed[:5]}"
