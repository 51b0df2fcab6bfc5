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


def _cached(pool: BlockPool, windows: WindowBlocks, tree: RadixTree, tokens: list[int], shared: list[int]) -> list[int]:
    """Cache `tokens` as a sequence would: `shared` blocks taken from the tree, fresh ones with companions."""
    fresh = pool.allocate(-(-len(tokens) // BS) - len(shared))
    assert fresh is not None
    windows.attach(fresh)
    for b in shared:
        pool.incref(b)
    blocks = shared + fresh
    tree.insert(tokens, blocks)
    pool.release(blocks)  # the tree's references only
    return blocks


def test_room_is_made_first_from_blocks_no_likely_hit_reads() -> None:
    pool, windows = pools(kv=40, window_blocks=40, window=9)  # keep 8; a window and 4 blocks: 24 tokens
    tree = RadixTree(pool)
    a = _cached(pool, windows, tree, [1] + [0] * 39, [])  # two paths, b the more recently used
    b = _cached(pool, windows, tree, [2] + [0] * 39, [])

    def kept(blocks: list[int]) -> list[bool]:
        return [x in windows.companion for x in blocks]

    windows.make_room(windows.pool.num_free + 4, tree)  # no end's window reaches them: a's, older
    assert kept(a) == [False] * 4 + [True] * 6 and kept(b) == [True] * 10
    windows.make_room(windows.pool.num_free + 4, tree)
    assert kept(b) == [False] * 4 + [True] * 6
    windows.make_room(windows.pool.num_free + 6, tree)  # then the windows of the least recently used end
    assert kept(a) == [False] * 10 and kept(b) == [False] * 4 + [True] * 6
    windows.check_integrity()


def test_a_branch_point_one_path_left_is_not_a_likely_end() -> None:
    pool, windows = pools(kv=40, window_blocks=40, window=9)
    tree = RadixTree(pool)
    turn = [5] * 28  # a reply's end at 28; the next turn leaves it at 20 and goes on to 60
    first = _cached(pool, windows, tree, turn, [])
    tree.record_hit(tree.match(turn[:20]))
    second = _cached(pool, windows, tree, turn[:20] + [6] * 40, first[:5])
    tree.record_hit(tree.match(turn[:20] + [6] * 40))
    short = windows.pool.num_free + len(windows.companion)
    windows.make_room(short - 6, tree)  # six kept: the newest end's (60) window and margin, and nothing else
    assert [b in windows.companion for b in second] == [False] * 9 + [True] * 6
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
