"""Block pool + radix tree under random operation sequences (hypothesis stateful testing).

The machine simulates sequences the way the scheduler drives them: match a cached prefix (sharing
its blocks, locking its path), write tokens (copy-on-write of a shared block, fresh blocks past the
table), insert into the cache, fork, free, evict, in three cache namespaces, and pin prefixes
(holds). A shadow KV store records which (token, position, namespace) each slot holds, so every match
is checked token by token — including matches that end mid-block — and a match that reached another
namespace's blocks would fail. After every step the pool and tree integrity checks run, lock and hold
counts are recomputed from scratch, and every held prefix is still whole on the device.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixserve.cache.block_pool import BlockPool
from radixserve.cache.next_reads import NextReads
from radixserve.cache.radix_tree import RadixNode, RadixTree, common_prefix_len
from radixserve.core import BlockCopy

BLOCK = 4
NUM_BLOCKS = 24
tokens_st = st.lists(st.integers(0, 3), min_size=1, max_size=18)
NAMESPACES = ("", "a", "b\x1fsalt")
namespace_st = st.sampled_from(NAMESPACES)


@dataclass
class SimSeq:
    tokens: list[int]
    table: list[int] = field(default_factory=list)
    computed: int = 0
    node: RadixNode | None = None
    namespace: str = ""


@dataclass
class Held:
    node: RadixNode
    tokens: list[int]
    namespace: str


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS, BLOCK)
        self.tree = RadixTree(self.pool)
        self.kv: dict[tuple[int, int], tuple[int, int, str]] = {}  # (block, offset) -> (token, position, namespace)
        self.seqs: list[SimSeq] = []
        self.held: list[Held] = []
        self.copies: list[BlockCopy] = []  # decided and not yet applied (the two-tier machine applies them)

    def _check_blocks(self, tokens: list[int], blocks: list[int], length: int, namespace: str) -> None:
        for p in range(length):
            assert self.kv.get((blocks[p // BLOCK], p % BLOCK)) == (tokens[p], p, namespace), f"stale KV at position {p}"

    def _moved(self) -> None:
        """Blocks were allocated or evicted (the two-tier machine applies the copies decided)."""

    def _take(self, tokens: list[int], namespace: str) -> SimSeq:
        m = self.tree.match(tokens, namespace=namespace)
        self._check_blocks(tokens, m.blocks, m.length, namespace)
        assert m.node.end == m.length
        self.tree.lock(m.node)
        for b in m.blocks:
            self.pool.incref(b)
        return SimSeq(tokens, list(m.blocks), m.length, m.node, namespace)

    @rule(tokens=tokens_st, namespace=namespace_st)
    def start(self, tokens: list[int], namespace: str) -> None:
        self.seqs.append(self._take(tokens, namespace))

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100), n=st.integers(1, 9), extra=st.lists(st.integers(0, 3), max_size=6))
    def write(self, i: int, n: int, extra: list[int]) -> None:
        s = self.seqs[i % len(self.seqs)]
        s.tokens = s.tokens + extra
        n = min(n, len(s.tokens) - s.computed)
        if n <= 0:
            return
        first = s.computed // BLOCK
        missing = max(0, -(-(s.computed + n) // BLOCK) - len(s.table))
        shared = first < len(s.table) and self.pool.refcount[s.table[first]] > 1
        self.copies += self.tree.make_room(missing + int(shared))  # eviction is explicit: the pool never evicts
        fresh = self.pool.allocate(missing + int(shared))
        self._moved()  # write-backs read blocks that `fresh` may reuse
        if fresh is None:
            return
        if shared:
            dst, src = fresh.pop(), s.table[first]
            if self.pool.refcount[src] > 1:
                for off in range(BLOCK):  # copy-on-write
                    if (src, off) in self.kv:
                        self.kv[(dst, off)] = self.kv[(src, off)]
                self.pool.decref(src)
                s.table[first] = dst
            else:
                self.pool.decref(dst)
        s.table.extend(fresh)
        for p in range(s.computed, s.computed + n):
            b = s.table[p // BLOCK]
            assert self.pool.refcount[b] == 1, "writing a shared block"
            self.kv[(b, p % BLOCK)] = (s.tokens[p], p, s.namespace)
        s.computed += n

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100))
    def insert(self, i: int) -> None:
        s = self.seqs[i % len(self.seqs)]
        node = self.tree.insert(s.tokens[:s.computed], s.table, namespace=s.namespace)
        assert node.end == s.computed
        self.tree.lock(node)
        if s.node is not None:
            self.tree.unlock(s.node)
        s.node = node
        m = self.tree.match(s.tokens[:s.computed], split=False, namespace=s.namespace)
        assert m.length == s.computed
        self._check_blocks(s.tokens, m.blocks, m.length, s.namespace)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100))
    def fork(self, i: int) -> None:
        s = self.seqs[i % len(self.seqs)]
        for b in s.table:
            self.pool.incref(b)
        if s.node is not None:
            self.tree.lock(s.node)
        self.seqs.append(SimSeq(list(s.tokens), list(s.table), s.computed, s.node, s.namespace))

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100), cache=st.booleans())
    def free(self, i: int, cache: bool) -> None:
        s = self.seqs.pop(i % len(self.seqs))
        if cache and s.computed:
            self.tree.insert(s.tokens[:s.computed], s.table, namespace=s.namespace)
        if s.node is not None:
            self.tree.unlock(s.node)
        self.pool.release(s.table)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100))
    def hold(self, i: int) -> None:
        """Pin what a sequence has locked (a pinned prefix is a held path)."""
        s = self.seqs[i % len(self.seqs)]
        if s.node is not None and s.node.parent is not None:
            self.tree.hold(s.node)
            self.held.append(Held(s.node, s.tokens[:s.node.end], s.namespace))

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def release_hold(self, i: int) -> None:
        self.tree.release_hold(self.held.pop(i % len(self.held)).node)

    @rule(n=st.integers(1, NUM_BLOCKS), waiting=st.lists(tokens_st, max_size=3))
    def evict(self, n: int, waiting: list[list[int]]) -> None:
        """Least recently used first, or what sequences waiting with these prompts will read last."""
        free_before = self.pool.num_free
        reads = NextReads.of(self.tree, [(t, "") for t in waiting], NUM_BLOCKS * BLOCK, 8)
        freed, copies = self.tree.evict(n, reads.first_read)
        self.copies += copies
        self._moved()
        assert self.pool.num_free == free_before + freed

    @invariant()
    def integrity(self) -> None:
        owners = Counter(b for s in self.seqs for b in s.table)
        owners.update(self.tree.block_refs())
        self.pool.check_integrity(owners)
        self.tree.check_integrity()
        locks = path_counts(self.tree, [s.node for s in self.seqs] + [h.node for h in self.held])
        holds = path_counts(self.tree, [h.node for h in self.held])
        for node in self.tree.nodes():
            assert node.lock_count == locks[node.id] and node.hold_count == holds[node.id]
        for h in self.held:  # whole, on the device, in its own namespace only
            m = self.tree.match(h.tokens, split=False, namespace=h.namespace)
            assert m.length == len(h.tokens) and m.host_tokens == 0, "a held prefix lost tokens"
            self._check_blocks(h.tokens, m.blocks, m.length, h.namespace)

    def teardown(self) -> None:
        while self.held:
            self.release_hold(0)
        while self.seqs:
            self.free(0, False)
        self.tree.clear()
        assert self.pool.num_free == self.pool.num_blocks, "blocks leaked after freeing everything"


def path_counts(tree: RadixTree, nodes: list[RadixNode | None]) -> Counter[int]:
    """Per node id, how many of `nodes` have it on their path (what lock and pin counts must be)."""
    counts: Counter[int] = Counter()
    for n in nodes:
        while n is not None and n.parent is not None:
            counts[n.id] += 1
            n = n.parent
    return counts


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_common_prefix_len() -> None:
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len(list(range(200)), list(range(150)) + [-1]) == 150
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len([5] * 70, [5] * 70) == 70


def test_match_ending_mid_block_shares_the_partial_block() -> None:
    pool = BlockPool(8, 4)
    tree = RadixTree(pool)
    blocks = pool.allocate(2)
    tree.insert([1, 2, 3, 4, 5, 6], blocks)
    pool.release(blocks)
    m = tree.match([1, 2, 3, 4, 5, 9])
    assert m.length == 5 and m.blocks == blocks  # position 4 lies in the second, partial block
    assert pool.refcount[blocks[1]] == 2  # the split left both halves listing it


def test_eviction_is_lru_and_leaf_first() -> None:
    pool = BlockPool(4, 4)
    tree = RadixTree(pool)
    for toks in ([1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]):
        b = pool.allocate(1)
        tree.insert(toks, b)
        pool.release(b)
    tree.match([1, 1, 1, 1])  # 1 is now the most recent; 2 is the oldest
    assert tree.evict(1) == (1, [])
    assert tree.match([2, 2, 2, 2], split=False).length == 0
    assert tree.match([1, 1, 1, 1], split=False).length == 4
    assert tree.match([3, 3, 3, 3], split=False).length == 4
    tree.check_integrity()


def cached_leaves(pool: BlockPool, tree: RadixTree, paths: list[list[int]]) -> None:
    for tokens in paths:
        blocks = pool.allocate(-(-len(tokens) // pool.block_size))
        assert blocks is not None
        tree.insert(tokens, blocks)
        pool.release(blocks)


def test_eviction_keeps_what_waiting_sequences_read_for_last_the_one_read_last_first() -> None:
    """Tasks taking turns: the least recently used path is the one whose turn is next. What no waiting
    sequence reads goes first however recent, then the path read last."""
    pool = BlockPool(4, 4)
    tree = RadixTree(pool)
    cached_leaves(pool, tree, [[1] * 4, [2] * 4, [3] * 4, [4] * 4])  # 1 is the least recently used
    reads = NextReads.of(tree, [([1] * 4 + [9], ""), ([2] * 3, ""), ([7, 7], "")], 100, 8)
    assert [m.length for m in reads.matches] == [4, 3]  # a prompt the tree does not hold is no read
    assert tree.evict(1, reads.first_read)[0] == 1
    assert [tree.match([t] * 4, split=False).length for t in (1, 2, 3, 4)] == [4, 4, 0, 4]  # not read: first
    tree.evict(1, reads.first_read)
    assert [tree.match([t] * 4, split=False).length for t in (1, 2, 4)] == [4, 4, 0]
    tree.evict(1, reads.first_read)  # only read paths left: the one read last goes, though more recent
    assert [tree.match([t] * 4, split=False).length for t in (1, 2)] == [4, 0]
    tree.check_integrity()


def test_a_shared_prefix_is_read_as_soon_as_its_first_reader() -> None:
    pool = BlockPool(8, 4)
    tree = RadixTree(pool)
    cached_leaves(pool, tree, [[5] * 4 + [1] * 4, [5] * 4 + [2] * 4, [6] * 4])
    prefix = tree.match([5] * 4, split=False).path[0]
    reads = NextReads.of(tree, [([6] * 4, ""), ([5] * 4 + [2] * 4, ""), ([5] * 4 + [1] * 2, "")], 100, 8)
    assert reads.first_read[prefix.id] == 1 and tree.root.id not in reads.first_read
    assert [reads.first_read[m.path[-1].id] for m in reads.matches] == [0, 1, 2]


def test_looking_ahead_stops_after_a_pool_of_prompt_tokens_or_the_lookahead() -> None:
    pool = BlockPool(8, 4)
    tree = RadixTree(pool)
    cached_leaves(pool, tree, [[t] * 4 for t in range(1, 5)])
    prompts = [([t] * 4, "") for t in range(1, 5)]
    assert len(NextReads.of(tree, prompts, 8, 8).matches) == 2  # the prompts after 8 tokens are not looked at
    assert len(NextReads.of(tree, prompts * 4, 10**9, 6).matches) == 6
    # a prompt the tree does not hold counts as looked at: the lookahead bounds the matches tried
    assert len(NextReads.of(tree, [([9], "")] * 5 + prompts, 10**9, 6).matches) == 1
    assert NextReads.of(tree, prompts, 10**9, 0).matches == []  # --eviction-lookahead 0: LRU alone


def test_allocation_evicts_only_under_pressure() -> None:
    pool = BlockPool(3, 4)
    tree = RadixTree(pool)
    b = pool.allocate(2)
    tree.insert([1] * 8, b)
    pool.release(b)
    assert tree.make_room(1) == [] and tree.evictions == 0  # a free block was there
    assert pool.allocate(1) is not None
    assert pool.allocate(2) is None and tree.evictions == 0  # the pool alone never evicts
    assert tree.make_room(2) == [] and tree.evictions == 1 and pool.allocate(2) is not None
    assert tree.make_room(1) == [] and pool.allocate(1) is None  # nothing left to evict


def test_a_checkpoint_is_used_when_taken_or_resumed_from_not_when_traffic_passes() -> None:
    """Checkpoint recency (what LRU eviction of checkpoints reads) is when each was taken or last
    resumed from: matches running on through a checkpoint's node leave its age alone."""
    pool, states = BlockPool(8, 4), BlockPool(4, 1)
    tree = RadixTree(pool, states=states)
    nodes = []
    for toks in ([1, 1, 1, 1], [2, 2, 2, 2]):
        b = pool.allocate(1)
        node = tree.insert(toks, b)
        pool.release(b)
        slot = states.allocate(1)
        assert slot is not None and tree.attach_state(node, slot[0])
        nodes.append(node)
    first, second = nodes
    assert tree.checkpoints_by_age() == [first, second]
    for _ in range(3):  # traffic through the first checkpoint's node, as a longer conversation's turns
        tree.match([1, 1, 1, 1, 5, 6])
    assert tree.checkpoints_by_age() == [first, second]
    tree.resumed_from(first)
    assert tree.checkpoints_by_age() == [second, first]
    tree.check_integrity()
