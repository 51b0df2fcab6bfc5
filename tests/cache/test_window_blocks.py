"""Window blocks (cache/window_blocks.py): which positions a path can resume at, the rows a resume
copies, companions following their KV blocks (freed, copied on write), eviction order, and a
hypothesis state machine over KV blocks, the tree and the window pool with `check_integrity` after
every step."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixserve.cache.block_pool import BlockPool
from radixserve.cache.radix_tree import RadixTree
from radixserve.cache.window_blocks import WindowBlocks
from radixserve.core import BlockCopy, CopyKind

BS = 4


def pools(kv: int = 16, window_blocks: int = 16, window: int = 6) -> tuple[BlockPool, WindowBlocks]:
    pool = BlockPool(kv, BS)
    return pool, WindowBlocks(window_blocks, window, pool)


def test_a_path_resumes_where_every_block_of_its_window_has_a_companion() -> None:
    pool, windows = pools()  # keep = 5 rows before a position
    blocks = pool.allocate(4)
    assert blocks is not None
    windows.attach(blocks)
    assert windows.restorable(blocks, 15) == 15
    assert windows.rows(blocks, 7) == tuple(windows.companion[blocks[p // BS]] * BS + p % BS for p in range(2, 7))
    assert windows.rows(blocks, 3) == tuple(windows.companion[blocks[0]] * BS + p for p in range(3))
    windows.pool.decref(windows.companion.pop(blocks[1]))  # block 1 (positions 4-7) loses its window K/V
    assert windows.restorable(blocks, 15) == 15  # the window [10, 15) lies in blocks 2 and 3
    assert windows.restorable(blocks, 12) == 4  # [7, 12) reaches block 1: resume before it
    assert windows.restorable(blocks, 13) == 13  # [8, 13) does not
    windows.pool.decref(windows.companion.pop(blocks[0]))
    assert windows.restorable(blocks, 12) == 0
    windows.check_integrity()


def test_companions_go_with_their_kv_blocks_and_copies_copy_them() -> None:
    pool, windows = pools(kv=8, window_blocks=2)
    blocks = pool.allocate(3)
    assert blocks is not None
    windows.attach(blocks)
    assert sorted(windows.companion) == blocks[:2]  # the pool ran out: the third has none
    copies: list[BlockCopy] = []
    pool.decref(blocks[0])  # freed: its companion with it
    assert blocks[0] not in windows.companion and windows.pool.num_free == 1
    dst = pool.allocate(2)
    assert dst is not None
    windows.copy(blocks[1], dst[0], copies)
    assert copies == [BlockCopy(CopyKind.WINDOW_BLOCK, windows.companion[blocks[1]], windows.companion[dst[0]])]
    windows.copy(blocks[2], dst[1], copies)  # a source without one: the copy has none either
    assert dst[1] not in windows.companion and len(copies) == 1
    # blocks[2] (no companion) holds tokens a sequence computed again in dst[0]: it takes dst[0]'s
    assert windows.adopt([blocks[1], blocks[2]], [blocks[1], dst[0]]) == 1
    assert blocks[2] in windows.companion and dst[0] not in windows.companion
    assert windows.adopt([blocks[2]], [dst[1]]) == 0  # it has one now; dst[1] has none
    windows.check_integrity()


def test_room_is_made_from_tree_blocks_far_from_node_ends_first() -> None:
    pool, windows = pools(kv=16, window_blocks=13, window=9)  # keep = 8
    tree = RadixTree(pool)
    paths = []
    for first_token in (1, 2):  # two paths of 24 tokens: d = 20, 16 | 12, 8 | 4, 0 per block
        blocks = pool.allocate(6)
        assert blocks is not None
        windows.attach(blocks)
        tree.insert([first_token] + [0] * 23, blocks)  # the second is the more recently used
        for b in blocks:
            pool.decref(b)  # the tree's references only
        paths.append(blocks)
    private = pool.allocate(1)  # a running sequence's block, still being written
    assert private is not None
    windows.attach(private)

    def kept() -> list[list[bool]]:
        return [[b in windows.companion for b in blocks] for blocks in paths]

    assert windows.make_room(4, tree) == 4  # d >= 2 x keep: the older path's first
    assert kept() == [[False, False, True, True, True, True]] * 2
    windows.make_room(6, tree)  # keep <= d < 2 x keep: the largest d first, on every path
    assert kept() == [[False, False, False, True, True, True]] * 2
    windows.make_room(8, tree)
    windows.make_room(10, tree)  # then what a hit at the node's end reads, the older path first
    assert kept() == [[False] * 6, [False, False, False, False, True, True]]
    assert windows.make_room(13, tree) == 2 and private[0] in windows.companion  # never a private block's
    windows.check_integrity()


class WindowBlocksMachine(RuleBasedStateMachine):
    """Sequences' private blocks, blocks cached in the tree, copies on write and evictions, in any order."""

    def __init__(self) -> None:
        super().__init__()
        self.pool, self.windows = pools(kv=24, window_blocks=10, window=7)
        self.tree = RadixTree(self.pool)
        self.private: list[int] = []
        self.cached = 0

    @rule(n=st.integers(1, 4))
    def allocate(self, n: int) -> None:
        if self.pool.num_free < n:
            self.tree.evict(n - self.pool.num_free)
        fresh = self.pool.allocate(n)
        if fresh is not None:
            self.windows.make_room(n, self.tree)
            self.windows.attach(fresh)
            self.private += fresh

    @precondition(lambda self: self.private)
    @rule(data=st.data())
    def free_one(self, data: st.DataObject) -> None:
        self.pool.decref(self.private.pop(data.draw(st.integers(0, len(self.private) - 1))))

    @precondition(lambda self: self.private)
    @rule(data=st.data())
    def copy_on_write(self, data: st.DataObject) -> None:
        src = self.private[data.draw(st.integers(0, len(self.private) - 1))]
        dst = self.pool.allocate(1)
        if dst is not None:
            copies: list[BlockCopy] = []
            self.windows.copy(src, dst[0], copies)
            assert len(copies) == int(dst[0] in self.windows.companion)
            self.private.append(dst[0])

    @precondition(lambda self: len(self.private) >= 2)
    @rule()
    def cache_two(self) -> None:
        blocks = self.private[:2]
        self.cached += 1
        self.tree.insert([self.cached] + [0] * (2 * BS - 1), blocks)
        for b in blocks:
            self.pool.decref(b)
        del self.private[:2]

    @rule(n=st.integers(1, 10))
    def make_room(self, n: int) -> None:
        self.windows.make_room(n, self.tree)
        tree_blocks = set(self.tree.block_refs())
        assert self.windows.pool.num_free >= n or all(b not in tree_blocks for b in self.windows.companion)

    @invariant()
    def consistent(self) -> None:
        self.windows.check_integrity()
        self.tree.check_integrity()


TestWindowBlocksMachine = WindowBlocksMachine.TestCase
TestWindowBlocksMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
