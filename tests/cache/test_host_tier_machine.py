"""The two-tier cache (device pool + host pool + radix tree) under random operation sequences
(hypothesis stateful testing).

Sequences are driven as the scheduler drives them: match a cached prefix and load back its host-only
part, write tokens (copy-on-write, fresh blocks past the table), insert, fork, free, evict from the
device (writing back), drop host copies, swap a sequence out (its path copied to the host tier and
pinned) and resume it. Two shadow KV stores, one per tier, record which (token, position) each slot
holds; the copies the tree decides are applied to them in order, exactly as the runner applies
them, so every match is checked token by token after any mix of write-backs and load-backs,
including matches ending mid-block. After every step the integrity checks of both pools and the
tree run, and lock and pin counts are recomputed from scratch.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule
from test_radix_tree import BLOCK, CacheMachine, SimSeq, path_counts, tokens_st

from radixserve.cache.block_pool import BlockPool
from radixserve.cache.next_reads import NextReads
from radixserve.cache.radix_tree import RadixNode, RadixTree
from radixserve.core import CopyKind

NUM_BLOCKS = 10  # a small device pool: evictions (write-backs) are frequent
HOST_BLOCKS = 20
Slots = dict[tuple[int, int], tuple[int, int, str]]  # (block, offset) -> (token, position, namespace)


@dataclass
class Swapped:
    tokens: list[int]
    computed: int
    node: RadixNode
    namespace: str


class TieredCacheMachine(CacheMachine):
    """CacheMachine's rules (start, write, insert, fork, free, evict) on a tree with a host tier,
    plus swapping out, resuming and dropping host copies."""

    def __init__(self) -> None:
        super().__init__()
        self.host = BlockPool(HOST_BLOCKS, BLOCK)
        self.pool = BlockPool(NUM_BLOCKS, BLOCK)
        self.tree = RadixTree(self.pool, self.host)
        self.host_kv: Slots = {}
        self.swapped: list[Swapped] = []
        self.seen: list[tuple[list[int], str]] = []  # tokens cached before: coming back to them hits the host tier

    def _moved(self) -> None:
        """What the runner does with a step's copies, in order, on the shadow stores."""
        for c in self.copies:
            src, dst = {CopyKind.TO_HOST: (self.kv, self.host_kv), CopyKind.TO_DEVICE: (self.host_kv, self.kv)}[c.kind]
            for off in range(BLOCK):
                if (c.src, off) in src:
                    dst[(c.dst, off)] = src[(c.src, off)]
                else:
                    dst.pop((c.dst, off), None)
        self.copies.clear()

    def _take(self, tokens: list[int], namespace: str) -> SimSeq:
        self.seen.append((tokens, namespace))
        m, loaded = self.tree.load_back(self.tree.match(tokens, namespace=namespace))
        self.copies += loaded
        self._moved()
        assert m.host_tokens == 0 and m.node.end == m.length
        self._check_blocks(tokens, m.blocks, m.length, namespace)
        self.tree.lock(m.node)
        for b in m.blocks:
            self.pool.incref(b)
        return SimSeq(tokens, list(m.blocks), m.length, m.node, namespace)

    @precondition(lambda self: self.seen)
    @rule(i=st.integers(0, 100), cut=st.integers(0, 18), extra=st.lists(st.integers(0, 3), max_size=3))
    def come_back(self, i: int, cut: int, extra: list[int]) -> None:
        """A conversation returns: an earlier prefix (often cut mid-block), maybe with new tokens."""
        old, namespace = self.seen[i % len(self.seen)]
        tokens = old[:max(1, min(cut, len(old)))] + extra
        self.seqs.append(self._take(tokens, namespace))

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100))
    def swap_out(self, i: int) -> None:
        s = self.seqs[i % len(self.seqs)]
        if not s.computed:
            return
        node = self.tree.insert(s.tokens[:s.computed], s.table, namespace=s.namespace)
        written = self.tree.swap_out(node)
        if written is None:
            return
        self.copies += written
        self._moved()
        self.seqs.remove(s)
        if s.node is not None:
            self.tree.unlock(s.node)
        self.pool.release(s.table)
        self.swapped.append(Swapped(s.tokens, s.computed, node, s.namespace))

    @precondition(lambda self: self.swapped)
    @rule(i=st.integers(0, 100))
    def swap_in(self, i: int) -> None:
        w = self.swapped.pop(i % len(self.swapped))
        assert self.tree.match(w.tokens[:w.computed], split=False, namespace=w.namespace).length == w.computed, \
            "a pinned path lost tokens"
        s = self._take(w.tokens[:w.computed], w.namespace)
        self.tree.unpin(w.node)
        s.tokens = w.tokens
        self.seqs.append(s)

    @rule(n=st.integers(1, HOST_BLOCKS), waiting=st.lists(tokens_st, max_size=3))
    def drop_host(self, n: int, waiting: list[list[int]]) -> None:
        """Least recently used first, or what sequences waiting with these prompts will read last."""
        free_before = self.host.num_free
        freed = self.tree.evict_host(n, NextReads.of(self.tree, [(t, "") for t in waiting], 10**6, 8).first_read)
        assert self.host.num_free == free_before + freed

    @invariant()
    def tiers(self) -> None:
        self.host.check_integrity(self.tree.host_block_refs())
        pins = path_counts(self.tree, [w.node for w in self.swapped])
        for node in self.tree.nodes():
            assert node.swap_pins == pins[node.id]

    def teardown(self) -> None:
        for w in self.swapped:
            self.tree.unpin(w.node)
        super().teardown()
        assert self.host.num_free == HOST_BLOCKS, "host blocks leaked after freeing everything"


TestTieredCacheMachine = TieredCacheMachine.TestCase
TestTieredCacheMachine.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)


def test_write_back_then_load_back_moves_the_bytes_in_order() -> None:
    pool, host = BlockPool(2, 4), BlockPool(4, 4)
    tree = RadixTree(pool, host)
    blocks = pool.allocate(2)
    assert blocks is not None
    tree.insert([1, 2, 3, 4, 5, 6], blocks)
    pool.release(blocks)
    freed, written = tree.evict(2)
    assert freed == 2 and [n.tier for n in tree.nodes()] == ["host"]
    assert [(c.kind, c.src) for c in written] == [(CopyKind.TO_HOST, blocks[0]), (CopyKind.TO_HOST, blocks[1])]
    m = tree.match([1, 2, 3, 4, 5, 9])  # ends mid-block, in the host tier: splits the host-only node
    assert (m.length, m.host_tokens) == (5, 5)
    m, loaded = tree.load_back(m)
    assert m.host_tokens == 0 and len(m.blocks) == 2 and all(c.kind is CopyKind.TO_DEVICE for c in loaded)
    assert {n.tier for n in tree.nodes()} == {"both", "host"}  # the loaded upper half keeps its host copy
    tree.check_integrity()


def test_host_copies_waiting_sequences_will_read_are_dropped_last() -> None:
    pool, host = BlockPool(3, 4), BlockPool(3, 4)
    tree = RadixTree(pool, host)
    for tokens in ([1] * 4, [2] * 4, [3] * 4):  # 1 the least recently used
        blocks = pool.allocate(1)
        assert blocks is not None
        tree.insert(tokens, blocks)
        pool.release(blocks)
    reads = NextReads.of(tree, [([1] * 4, ""), ([2] * 4, "")], 100, 8)
    assert tree.evict(3, reads.first_read)[0] == 3  # all three written back: host-only now
    assert tree.evict_host(1, reads.first_read) == 1  # 3: no one reads it
    assert tree.evict_host(1, reads.first_read) == 1  # 2: read after 1
    assert [tree.match([t] * 4, split=False).length for t in (1, 2, 3)] == [4, 0, 0]
    tree.check_integrity()
