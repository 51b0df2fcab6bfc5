"""Window blocks (cache/window_blocks.py): which positions a path can resume at, companions following
their KV blocks (freed, copied on write, adopted), eviction order and the windows it never touches, the
longest chunk a pool holds, and a hypothesis state machine over sequences' windows, the tree and the
window pool with `check_integrity` after every step."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixserve.cache.block_pool import BlockPool
from radixserve.cache.next_reads import NextReads
from radixserve.cache.radix_tree import RadixTree
from radixserve.cache.window_blocks import WindowBlocks, least_window_blocks
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
    windows.pool.decref(windows.companion.pop(blocks[1]))  # block 1 (positions 4-7) loses its window K/V
    assert windows.restorable(blocks, 15) == 15  # the window [10, 15) lies in blocks 2 and 3
    assert windows.restorable(blocks, 12) == 4  # [7, 12) reaches block 1: resume before it
    assert windows.restorable(blocks, 13) == 13  # [8, 13) does not
    windows.pool.decref(windows.companion.pop(blocks[0]))
    assert windows.restorable(blocks, 12) == 0
    windows.check_integrity()


def reader(blocks: list[int], computed: int, seq_id: int = 0, drafts: int = 0) -> Any:
    """A live sequence as the window pool sees it: its table, how far it computed, the drafts among those."""
    return SimpleNamespace(block_table=blocks, num_computed=computed, seq_id=seq_id, num_drafts=drafts)


def test_companions_go_with_their_kv_blocks_and_copies_copy_them() -> None:
    pool, windows = pools(kv=8, window_blocks=4)
    blocks = pool.allocate(3)
    assert blocks is not None
    windows.attach(blocks)
    with pytest.raises(AssertionError, match="make room first"):
        windows.attach(pool.allocate(2) or [])
    copies: list[BlockCopy] = []
    pool.decref(blocks[0])  # freed: its companion with it
    assert blocks[0] not in windows.companion and windows.pool.num_free == 2
    dst = pool.allocate(2)
    assert dst is not None
    windows.copy(blocks[1], dst[0], copies)
    assert copies == [BlockCopy(CopyKind.WINDOW_BLOCK, windows.companion[blocks[1]], windows.companion[dst[0]])]
    windows.pool.decref(windows.companion.pop(blocks[2]))  # blocks[2] lost its window K/V
    # it holds tokens a sequence computed again in dst[0]: it takes dst[0]'s, unless a window spans dst[0]
    assert windows.adopt([blocks[2]], [dst[0]], in_use={dst[0]}) == 0
    assert windows.adopt([blocks[1], blocks[2]], [blocks[1], dst[0]], in_use=set()) == 1
    assert blocks[2] in windows.companion and dst[0] not in windows.companion
    windows.check_integrity()


def test_the_longest_chunk_is_what_the_pool_holds_beside_the_window() -> None:
    pool, windows = pools(kv=8, window_blocks=least_window_blocks(6, BS), window=6)  # keep 5: 2 + 2 blocks
    assert windows.pool.num_blocks == 4
    assert windows.longest_chunk(0) == 16  # no window yet: four blocks of chunk
    assert windows.longest_chunk(5) == 11  # the window [0, 5) is block 0: [5, 16)
    assert windows.longest_chunk(7) == 9  # [2, 7) spans blocks 0 and 1: [7, 16)
    assert windows.longest_chunk(10) == 10  # [5, 10) starts in block 1: [10, 20)
    with pytest.raises(ValueError, match="at least 4 are needed"):
        pools(window_blocks=3, window=6)


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

    assert windows.make_room(windows.pool.num_free + 4, tree, ())  # no end's window reaches them: a's, older
    assert kept(a) == [False] * 4 + [True] * 6 and kept(b) == [True] * 10
    windows.make_room(windows.pool.num_free + 4, tree, ())
    assert kept(b) == [False] * 4 + [True] * 6
    windows.make_room(windows.pool.num_free + 6, tree, ())  # then the windows of the least recently used end
    assert kept(a) == [False] * 10 and kept(b) == [False] * 4 + [True] * 6
    windows.check_integrity()


def test_room_is_never_made_from_a_live_window() -> None:
    pool, windows = pools(kv=40, window_blocks=40, window=9)  # keep 8
    tree = RadixTree(pool)
    a = _cached(pool, windows, tree, [1] + [0] * 39, [])
    for b in a:
        pool.incref(b)
    live = reader(a, 30)  # a sequence that took a's path and computed 30 of it: its window is [22, 30)
    assert not windows.make_room(40, tree, [live])  # its window's blocks 5 to 9 stay (the table's end too)
    assert [b in windows.companion for b in a] == [False] * 5 + [True] * 5
    windows.check_integrity([live])
    # verifying 4 drafts up to 40, it may go back to 36: its window then reaches back to 28, in block 7
    assert windows.window_start(reader(a, 40)) == 8 and windows.window_start(reader(a, 40, drafts=4)) == 7
    live.num_computed = 40  # moved on: block 5 is behind its window now
    assert windows.make_room(36, tree, [live]) and a[5] not in windows.companion
    pool.release(a)


def test_a_shared_prefix_where_hits_end_stays_a_likely_end_after_its_paths_are_lost() -> None:
    """Requests found only the shared prefix (its paths were evicted) and computed the rest anew: no
    request took the new paths, yet hits keep ending at the prefix, so its window stays."""
    pool, windows = pools(kv=40, window_blocks=40, window=9)  # keep 8: a window and margin of 6 blocks
    tree = RadixTree(pool)
    shared = [7] * 24
    prefix = _cached(pool, windows, tree, shared, [])
    paths = []
    for task in (1, 2):
        tree.record_hit(tree.match(shared + [task]))  # the hit ends at the prefix's end
        paths.append(_cached(pool, windows, tree, shared + [task] * 40, prefix))  # 64 tokens, 16 blocks
    node = tree.match(shared).node
    assert node.hits_ended == 2 and all(c.hits == 0 for c in node.children.values())
    # 14 to drop: the 8 no end's window reaches, then the 6 live ones of the older path's end; the
    # prefix's six stay (without its hits it would have gone with the first eight: no hit there)
    windows.make_room(windows.pool.num_free + 14, tree, ())
    assert all(b in windows.companion for b in prefix) and windows.restorable(prefix, 24) == 24
    assert not any(b in windows.companion for b in paths[0][6:])
    assert [b in windows.companion for b in paths[1][6:]] == [False] * 4 + [True] * 6
    windows.check_integrity()


def test_where_waiting_sequences_resume_goes_last_the_one_admitted_last_first() -> None:
    """Paths a and b, a the older; a waits first, b second, and c no one waits for: c's windows go
    first though it is the most recent, then b's (admitted after a), and a's last."""
    pool, windows = pools(kv=40, window_blocks=40, window=9)  # keep 8; a window and 4 blocks: 24 tokens
    tree = RadixTree(pool)
    a, b, c = (_cached(pool, windows, tree, [t] + [0] * 35, []) for t in (1, 2, 3))  # 9 blocks each
    reads = NextReads.of(tree, [([1] + [0] * 35 + [5], ""), ([2] + [0] * 35 + [6], "")], 1000, 8)

    def kept(blocks: list[int]) -> list[bool]:
        return [x in windows.companion for x in blocks]

    assert windows.make_room(windows.pool.num_free + 9, tree, (), reads)  # those no end reaches: a's, b's, c's
    assert kept(a) == kept(b) == kept(c) == [False] * 3 + [True] * 6
    windows.make_room(windows.pool.num_free + 6, tree, (), reads)  # c's end: no one waits to resume there
    assert kept(c) == [False] * 9 and kept(a) == [False] * 3 + [True] * 6
    windows.make_room(windows.pool.num_free + 1, tree, (), reads)  # b waits to resume, after a
    assert kept(b).count(True) == 5 and kept(a) == [False] * 3 + [True] * 6
    windows.make_room(windows.pool.num_free + 5, tree, (), reads)
    assert kept(b) == [False] * 9 and kept(a) == [False] * 3 + [True] * 6
    windows.check_integrity()


def test_a_shared_prefix_on_a_waiting_path_stays_with_it() -> None:
    """Where a waiting sequence resumes if the end of its path is lost: the prefix its path shares."""
    pool, windows = pools(kv=40, window_blocks=40, window=9)
    tree = RadixTree(pool)
    shared = [7] * 24
    prefix = _cached(pool, windows, tree, shared, [])
    for task in (1, 2):
        tree.record_hit(tree.match(shared + [task]))
        _cached(pool, windows, tree, shared + [task] * 12, prefix)
    late = _cached(pool, windows, tree, [3] * 40, [])  # the most recent path: no one waits for it
    reads = NextReads.of(tree, [(shared + [1] * 12 + [0], "")], 1000, 8)
    # 13 go (late's 10, task 2's 3); the prefix (an older likely end than late's) stays with task 1's 3
    windows.make_room(windows.pool.num_free + 13, tree, (), reads)
    assert all(b in windows.companion for b in prefix) and not any(b in windows.companion for b in late)
    assert len(windows.companion) == 6 + 3
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
    windows.make_room(short - 6, tree, ())  # six kept: the newest end's (60) window and margin, and nothing else
    assert [b in windows.companion for b in second] == [False] * 9 + [True] * 6
    windows.check_integrity()


class WindowBlocksMachine(RuleBasedStateMachine):
    """Sequences computing into blocks with companions (taking cached paths, copying a shared block on
    write, moving on, finishing into the tree), and evictions, in any order: every live window keeps
    its companions."""

    def __init__(self) -> None:
        super().__init__()
        self.pool, self.windows = pools(kv=24, window_blocks=10, window=7)  # keep 6
        self.tree = RadixTree(self.pool)
        self.live: list[Any] = []
        self.finished = 0

    def _fresh(self, n: int, seq: Any) -> list[int] | None:
        if self.pool.num_free < n:
            self.tree.evict(n - self.pool.num_free)
        fresh = self.pool.allocate(n)
        if fresh is not None and not self.windows.make_room(n, self.tree, self.live + [seq]):
            self.pool.release(fresh)
            return None
        return fresh

    @rule(n=st.integers(1, 3), resume=st.booleans())
    def start(self, n: int, resume: bool) -> None:
        seq = reader([], 0, seq_id=len(self.live) + 100 * self.finished)
        if resume and self.finished:  # take a cached path where its window can resume
            match = self.tree.match([1] + [0] * (2 * BS - 2))
            at = self.windows.restorable(match.blocks, match.length)
            seq.block_table, seq.num_computed = list(match.blocks[:-(-at // BS)]), at
            for b in seq.block_table:
                self.pool.incref(b)
        fresh = self._fresh(n, seq)
        if fresh is None:
            self.pool.release(seq.block_table)
            return
        self.windows.attach(fresh)
        seq.block_table += fresh
        self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def advance(self, data: st.DataObject) -> None:
        seq = self.live[data.draw(st.integers(0, len(self.live) - 1))]
        seq.num_computed = min(seq.num_computed + data.draw(st.integers(1, BS)), len(seq.block_table) * BS)
        last = (seq.num_computed - 1) // BS if seq.num_computed else 0
        if seq.block_table and self.pool.refcount[seq.block_table[last]] > 1:  # written: copied first
            dst = self._fresh(1, seq)
            if dst is not None:
                copies: list[BlockCopy] = []
                self.windows.copy(seq.block_table[last], dst[0], copies)
                self.pool.decref(seq.block_table[last])
                seq.block_table[last] = dst[0]
        if len(seq.block_table) * BS == seq.num_computed:
            grown = self._fresh(1, seq)
            if grown is not None:
                self.windows.attach(grown)
                seq.block_table += grown

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        seq = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
        full = seq.num_computed // BS
        if full:
            self.finished += 1
            self.tree.insert([1] + [0] * (full * BS - 1), seq.block_table[:full])
        self.pool.release(seq.block_table)

    @rule(n=st.integers(1, 10), waiting=st.lists(st.integers(1, 60), max_size=3))
    def make_room(self, n: int, waiting: list[int]) -> None:
        """Least recently used ends first, or what sequences waiting with prompts of these lengths read last."""
        reads = NextReads.of(self.tree, [([1] + [0] * (k - 1), "") for k in waiting], 10**6, 8)
        if not self.windows.make_room(n, self.tree, self.live, reads):
            in_use, behind = self.windows.windows_in_use(self.live)
            tree_blocks = set(self.tree.block_refs())
            assert all(b in in_use or b not in tree_blocks and b not in behind for b in self.windows.companion)

    @invariant()
    def consistent(self) -> None:
        self.windows.check_integrity(self.live)
        self.tree.check_integrity()


TestWindowBlocksMachine = WindowBlocksMachine.TestCase
TestWindowBlocksMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
