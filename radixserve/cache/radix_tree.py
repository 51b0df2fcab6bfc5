"""The radix prefix cache: a radix tree over token IDs whose nodes own refcounted KV blocks.

Each edge is a run of tokens; a node covers positions [start, end) of every sequence that passes
through it and lists the physical blocks holding those positions' K/V, one per logical block index
from start // block_size to (end - 1) // block_size. A block may straddle two nodes: a parent and
its child then both list it (and both hold a reference), or the child lists its own copy, which holds
the parent's positions too. For any matched prefix the deepest node covering a block index has valid
K/V for every matched position in that block, which is what makes token-granular hits (ending
mid-block) safe: the matcher shares the partial block and the scheduler copies it on first write.

Invariants (checked by `check_integrity`): children are keyed by their first token; a child starts
where its parent ends; len(blocks) matches the covered block range; a node's lock count is at least
the sum of its children's (locks are taken on a whole path); the LRU set holds exactly the unlocked
non-root leaves. Eviction removes unlocked leaves in least-recently-used order, only when the block
pool asks for blocks.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field

from sortedcontainers import SortedList

from radixserve.cache.block_pool import BlockPool

_ids = itertools.count()


@dataclass(eq=False)
class RadixNode:
    tokens: list[int]
    start: int
    blocks: list[int]
    parent: RadixNode | None = None
    children: dict[int, RadixNode] = field(default_factory=dict)
    lock_count: int = 0
    last_access: int = 0
    id: int = field(default_factory=lambda: next(_ids))

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass
class Match:
    length: int  # matched tokens
    blocks: list[int]  # ceil(length / block_size) blocks holding them (the last may be partial)
    node: RadixNode  # deepest node of the match; the match ends exactly at its end


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the common prefix, comparing slices (C speed) before single tokens."""
    n = min(len(a), len(b))
    i, step = 0, 64
    while i < n:
        j = min(i + step, n)
        if a[i:j] == b[i:j]:
            i = j
            continue
        while a[i] == b[i]:
            i += 1
        return i
    return n


class RadixTree:
    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.root = RadixNode(tokens=[], start=0, blocks=[])
        self.root.lock_count = 1  # the root is never evicted
        self._lru: SortedList = SortedList(key=lambda n: (n.last_access, n.id))
        self._clock = itertools.count(1)
        self.evictions = 0  # nodes evicted
        self.evicted_blocks = 0
        self.num_nodes = 0
        self.num_tokens = 0
        pool.evictor = self.evict

    # -- lookup --------------------------------------------------------------------------------
    def match(self, tokens: list[int], split: bool = True) -> Match:
        """Longest cached prefix of `tokens`. With split, a match ending inside an edge splits it so
        the match ends at a node (which the caller may lock); without, the tree is left untouched."""
        node, pos, path = self.root, 0, []
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            k = common_prefix_len(child.tokens, tokens[pos:pos + len(child.tokens)])
            if k < len(child.tokens):
                if split:
                    child = self._split(child, k)
                else:
                    path.append(child)
                    pos += k
                    break
            path.append(child)
            pos += k
            node = child
        self._touch(path if split else [])
        return Match(length=pos, blocks=self._blocks_of(path, pos), node=node)

    def exclusive_prefix_len(self, tokens: list[int]) -> int:
        """The longest block-aligned cached prefix of `tokens` whose path lists each block index once.

        Where a match passes a mid-block boundary at which the child keeps its own copy of the
        straddled block, a lock on the path pins the parent's copy too, which the sequence does not
        use; stopping before such a boundary (and on a block edge, so nothing is copied on write)
        means a locked match keeps alive only blocks of the sequence's own table."""
        bs = self.block_size
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            if node is not self.root and node.end % bs and child.blocks[0] != node.blocks[-1]:
                return node.end // bs * bs
            k = common_prefix_len(child.tokens, tokens[pos:pos + len(child.tokens)])
            pos += k
            if k < len(child.tokens):
                break
            node = child
        return pos // bs * bs

    def foreign_blocks(self, node: RadixNode, own: list[int], stop: RadixNode | None = None) -> int:
        """Blocks listed on the path from `node` up to `stop` (exclusive; the root by default) that
        are not in `own`: what a lock on `node` keeps alive besides a sequence's own blocks."""
        own_set, foreign = set(own), set[int]()
        n: RadixNode | None = node
        while n is not None and n is not stop and n is not self.root:
            foreign.update(b for b in n.blocks if b not in own_set)
            n = n.parent
        return len(foreign)

    def _blocks_of(self, path: list[RadixNode], length: int) -> list[int]:
        bs = self.block_size
        blocks: list[int] = [-1] * (-(-length // bs))
        for node in path:  # deeper nodes overwrite: their copy of a straddled block is valid longer
            first = node.start // bs
            for i, b in enumerate(node.blocks):
                if first + i < len(blocks):
                    blocks[first + i] = b
        return blocks

    # -- insertion -----------------------------------------------------------------------------
    def insert(self, tokens: list[int], blocks: list[int], known: RadixNode | None = None) -> RadixNode:
        """Cache `tokens` (whose K/V sit in `blocks`, a sequence's block table) and return the node
        ending at len(tokens). New nodes take a reference on the blocks they list. `known`, a node
        the caller holds locked on the path of `tokens`, lets the walk start there instead of at the
        root (a lock keeps it in the tree, and splits keep its end)."""
        bs = self.block_size
        if len(blocks) * bs < len(tokens):
            raise ValueError("insert: fewer blocks than the tokens need")
        node, pos, path = self.root, 0, []
        if known is not None and known.lock_count > 0 and known.end <= len(tokens):
            node, pos = known, known.end
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                leaf_blocks = blocks[pos // bs:(len(tokens) - 1) // bs + 1]
                for b in leaf_blocks:
                    self.pool.incref(b)
                child = RadixNode(tokens=tokens[pos:], start=pos, blocks=leaf_blocks, parent=node)
                self._attach(node, child)
                path.append(child)
                pos = len(tokens)
                break
            k = common_prefix_len(child.tokens, tokens[pos:pos + len(child.tokens)])
            if k < len(child.tokens):
                child = self._split(child, k)
            path.append(child)
            pos += k
            node = child
        self._touch(path)
        return path[-1] if path else self.root

    def _attach(self, parent: RadixNode, child: RadixNode) -> None:
        if not parent.children and parent.lock_count == 0:
            self._lru.discard(parent)
        parent.children[child.tokens[0]] = child
        self.num_nodes += 1
        self.num_tokens += len(child.tokens)
        if child.lock_count == 0:
            child.last_access = next(self._clock)
            self._lru.add(child)

    def _split(self, node: RadixNode, k: int) -> RadixNode:
        """Cut `node`'s edge after k tokens; return the new upper node (which ends at start + k)."""
        bs = self.block_size
        first = node.start // bs
        upper_last = (node.start + k - 1) // bs
        lower_first = (node.start + k) // bs
        upper = RadixNode(tokens=node.tokens[:k], start=node.start,
                          blocks=node.blocks[:upper_last - first + 1], parent=node.parent,
                          lock_count=node.lock_count, last_access=node.last_access)
        if upper_last == lower_first:  # the block at the cut is now listed by both nodes
            self.pool.incref(node.blocks[upper_last - first])
        assert node.parent is not None
        node.parent.children[upper.tokens[0]] = upper
        node.tokens = node.tokens[k:]
        node.start += k
        node.blocks = node.blocks[lower_first - first:]
        node.parent = upper
        upper.children[node.tokens[0]] = node
        self.num_nodes += 1
        return upper

    # -- locking and LRU -----------------------------------------------------------------------
    def lock(self, node: RadixNode) -> None:
        n: RadixNode | None = node
        while n is not None and n is not self.root:
            if n.lock_count == 0:
                self._lru.discard(n)
            n.lock_count += 1
            n = n.parent

    def unlock(self, node: RadixNode) -> None:
        n: RadixNode | None = node
        while n is not None and n is not self.root:
            assert n.lock_count > 0, "unlock of an unlocked node"
            n.lock_count -= 1
            if n.lock_count == 0 and not n.children:
                self._lru.add(n)
            n = n.parent

    def _touch(self, path: list[RadixNode]) -> None:
        now = next(self._clock)
        for n in path:
            in_lru = n.lock_count == 0 and not n.children
            if in_lru:
                self._lru.discard(n)
            n.last_access = now
            if in_lru:
                self._lru.add(n)

    def evict(self, num_blocks: int) -> int:
        """Evict least-recently-used unlocked leaves until num_blocks blocks are free (or none is
        left to evict); return the blocks freed."""
        freed = 0
        while freed < num_blocks and self._lru:
            leaf = self._lru.pop(0)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.tokens[0]]
            got = self.pool.release(leaf.blocks)
            freed += got
            self.evicted_blocks += got
            self.evictions += 1
            self.num_nodes -= 1
            self.num_tokens -= len(leaf.tokens)
            if parent is not self.root and not parent.children and parent.lock_count == 0:
                self._lru.add(parent)
        return freed

    def clear(self) -> int:
        """Evict everything unlocked (used by tests and at shutdown)."""
        return self.evict(self.pool.num_blocks + 1)

    # -- accounting ----------------------------------------------------------------------------
    def nodes(self) -> list[RadixNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def block_refs(self) -> Counter[int]:
        refs: Counter[int] = Counter()
        for n in self.nodes():
            refs.update(n.blocks)
        return refs

    def check_integrity(self) -> None:
        bs = self.block_size
        nodes = self.nodes()
        assert len(nodes) == self.num_nodes, f"node count {self.num_nodes} != {len(nodes)}"
        assert sum(len(n.tokens) for n in nodes) == self.num_tokens, "token count drifted"
        expected_lru = set()
        for n in [self.root, *nodes]:
            for first_token, c in n.children.items():
                assert c.parent is n, "child's parent link is wrong"
                assert c.tokens and c.tokens[0] == first_token, "child keyed by the wrong token"
                assert c.start == n.end, "child does not start where its parent ends"
            if n is self.root:
                continue
            span = (n.end - 1) // bs - n.start // bs + 1
            assert len(n.blocks) == span, f"node covers {span} blocks but lists {len(n.blocks)}"
            assert n.lock_count >= sum(c.lock_count for c in n.children.values()), "lock count below children's"
            if n.lock_count == 0 and not n.children:
                expected_lru.add(n.id)
        assert {n.id for n in self._lru} == expected_lru, "LRU set is not the unlocked leaves"
