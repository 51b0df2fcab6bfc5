"""The radix prefix cache: a radix tree over token IDs whose nodes own refcounted KV blocks in two
tiers, device memory and (optionally) a host-memory pool.

Each edge is a run of tokens; a node covers positions [start, end) of every sequence that passes
through it and lists the physical blocks holding those positions' K/V, one per logical block index
from start // block_size to (end - 1) // block_size: `blocks` on the device, `host_blocks` in the
host tier, either list empty when the node has no copy there. A block may straddle two nodes: a
parent and its child then both list it (and both hold a reference), or the child lists its own copy,
which holds the parent's positions too. For any matched prefix the deepest node covering a block
index has valid K/V for every matched position in that block, which is what makes token-granular
hits (ending mid-block) safe in both tiers: the matcher shares the partial block and the scheduler
copies it on first write.

Tiers: a node lives on the device, in host memory, or both. Device-resident nodes form a subtree
hanging from the root (a node on the device has its parent on the device), so a match is a device
part followed by a host-only part, which `load_back` copies into fresh device blocks. When the pool
needs blocks, eviction takes the least recently used unlocked node with no child on the device
(nodes that waiting sequences will read last, the one read furthest ahead first:
cache/next_reads.py): a node with a host copy just frees its device blocks; otherwise it is written
back (its blocks copied to the host pool) first, and only when the host pool cannot take it is it
dropped, with its host-only subtree. The host pool makes room by dropping least recently used host
copies (what waiting sequences will read last, as on the device): of nodes also on the device, or
host-only leaves. A swapped-out sequence pins its cached path (`swap_out`), which keeps every node
on it in the host tier until the sequence resumes. Eviction is explicit: the pools never call back
into the tree; `make_room` (the scheduler's cache layer, before it allocates) and the tree's own
tier moves evict before they allocate. Every copy decided here is returned to the caller, in order,
which passes it on to the step that must run it (the tree keeps no list of them). With `events` set
(`Scheduler.follow_cache_events`), every subtree dropped from both tiers is also reported there, for
a scale-out router (cache/events.py).

Namespaces: each cache namespace (SamplingParams.cache_namespace) has its own root, so a lookup in
one namespace can only ever reach what was inserted in it; eviction and the host tier see all of
them as one LRU cache. The shared namespace "" keeps `root` forever; another namespace's root is
made by its first insert and forgotten when its last child goes (a namespace per cache_salt must not
grow the tree without bound). A root has no parent: walks up a path stop at the first node without
one. A held path (`hold`, a pinned prefix) is a lock no sequence owns: it stays on the device until
released.

Checkpoints (hybrid models, `states` set): a node on the device may hold one state slot, the
recurrent layers' state after exactly the tokens up to its end (`state`); a split keeps it on the
lower node, which keeps that end. A node leaving the device drops its checkpoint, and
`evict_checkpoint` drops the one the scheduler's checkpoint policy picks when the state pool needs a slot. Which
positions get checkpoints is the scheduler's cache layer's choice (scheduler/seq_cache.py).

Who may change it: only the scheduler (scheduler/), through the methods below; each says whether it
changes the cache or is a query (`match` is a query only with split=False). Nodes are written here
alone (tests/test_layering.py enforces both).

Invariants (checked by `check_integrity`): each namespace's root is kept only while it has
children (the shared one always); children are keyed by their first token; a child starts where
its parent ends; each non-empty block list matches the covered block range and every non-root node
has at least one; a node on the device has its parent on the device; a locked node is on the
device; a pinned node is in the host tier; lock, pin and hold counts are at least the sum of the
children's (all are taken on a whole path), and a node's lock count is at least its hold count;
the two LRU sets hold exactly the nodes their predicates name, and the checkpoint set exactly the
nodes holding a state, each on the device. Nothing is evicted or dropped except
when a pool asks for blocks.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from sortedcontainers import SortedList

from radixserve.cache.block_pool import BlockPool
from radixserve.cache.events import CacheEventLog
from radixserve.cache.tree_integrity import check_tree
from radixserve.core import BlockCopy, CopyKind

__all__ = ["Match", "RadixNode", "RadixTree", "common_prefix_len"]

_ids = itertools.count()


@dataclass(eq=False)
class RadixNode:
    tokens: list[int]
    start: int
    blocks: list[int]  # device blocks, [] while the K/V lives only in the host tier
    parent: RadixNode | None = None
    children: dict[int, RadixNode] = field(default_factory=dict)
    lock_count: int = 0  # running sequences whose locked path passes here: must stay on the device
    last_access: int = 0
    host_blocks: list[int] = field(default_factory=list)  # the host tier's copy, [] if none
    swap_pins: int = 0  # swapped-out sequences whose cached path passes here: must stay in the host tier
    device_children: int = 0  # children on the device
    in_lru: bool = False
    in_host_lru: bool = False
    hold_count: int = 0  # pinned prefixes (Scheduler.hold_prefix) whose held path passes here: each also holds a lock
    hits: int = 0  # matches that took this node's tokens (radix_tree.record_hit)
    hits_ended: int = 0  # of those, the ones that ended at this node's end: where requests resumed
    namespace: str = ""  # on a namespace's root only: the namespace it is the root of
    state: int = -1  # hybrid models: a checkpoint, the state slot holding the recurrent state after tokens[:end]
    state_used: int = 0  # when its checkpoint was last taken or resumed from (traffic through the node does not count)
    in_checkpoints: bool = False
    id: int = field(default_factory=_ids.__next__)

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def on_device(self) -> bool:
        return bool(self.blocks) or self.parent is None  # the root holds nothing and counts as resident

    @property
    def tier(self) -> str:
        return "both" if self.blocks and self.host_blocks else "device" if self.on_device else "host"


@dataclass
class Match:
    length: int  # matched tokens
    blocks: list[int]  # device blocks of the first `length - host_tokens` tokens (the last may be partial)
    node: RadixNode  # deepest node of the match; the match ends exactly at its end when split
    host_tokens: int = 0  # trailing matched tokens whose K/V is only in the host tier
    path: list[RadixNode] = field(default_factory=list)


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
    """The prefix cache over token IDs: nodes, matching, insertion, splits, locks, swap pins, holds, the
    two LRU sets, eviction and the moves between tiers (the module docstring tells what it all means)."""

    def __init__(self, pool: BlockPool, host_pool: BlockPool | None = None, states: BlockPool | None = None) -> None:
        self.pool = pool
        self.host_pool = host_pool
        self.states = states  # a hybrid model's recurrent-state slots (one-slot "blocks"): checkpoints hold them
        self.block_size = pool.block_size
        if host_pool is not None and host_pool.block_size != pool.block_size:
            raise ValueError("the host pool's block size must equal the device pool's")
        self.root = RadixNode(tokens=[], start=0, blocks=[])
        self.root.lock_count = 1  # the root is never evicted
        self.roots: dict[str, RadixNode] = {"": self.root}  # namespace -> its root
        self._lru: SortedList = SortedList(key=lambda n: (n.last_access, n.id))  # evictable from the device
        self._host_lru: SortedList = SortedList(key=lambda n: (n.last_access, n.id))  # droppable host copies
        self._checkpoints: SortedList = SortedList(key=lambda n: (n.state_used, n.id))  # nodes holding a state
        self.checkpoints_evicted = 0  # checkpoints dropped to free a state slot
        self._protected: set[int] = set()  # nodes in the middle of a move: neither tier may give them up
        self._clock = itertools.count(1)
        self.num_nodes = 0
        self.num_tokens = 0
        # device blocks listed by unlocked nodes (straddled ones twice): what eviction could free at
        # most, for the scheduler's admission estimate
        self.evictable_blocks = 0
        self.write_back_enabled = host_pool is not None
        self.evictions = 0  # nodes evicted from the device
        self.evicted_blocks = 0  # device blocks freed by eviction
        self.written_back_blocks = 0
        self.loaded_blocks = 0
        self.host_dropped_blocks = 0
        self.events: CacheEventLog | None = None  # set when a router follows what this tree drops

    # -- namespaces ----------------------------------------------------------------------------
    def root_of(self, namespace: str) -> RadixNode:
        """The namespace's root; an empty stand-in (not kept) when nothing is cached under it. A query."""
        root = self.roots.get(namespace)
        if root is None:
            root = RadixNode(tokens=[], start=0, blocks=[], lock_count=1, namespace=namespace)
        return root

    def _kept_root(self, namespace: str) -> RadixNode:
        root = self.roots.get(namespace)
        if root is None:
            root = self.roots[namespace] = RadixNode(tokens=[], start=0, blocks=[], lock_count=1, namespace=namespace)
        return root

    def namespace_of(self, node: RadixNode) -> str:
        """The namespace whose tree `node` is in. A query."""
        while node.parent is not None:
            node = node.parent
        return node.namespace

    # -- lookup --------------------------------------------------------------------------------
    def match(self, tokens: list[int], split: bool = True, namespace: str = "") -> Match:
        """Longest cached prefix of `tokens` in `namespace`, in either tier. With split, a match
        ending inside an edge splits it so the match ends at a node (which the caller may lock once
        it is on the device, see `load_back`), and the path's recency is renewed: changes the cache.
        Without split, a query: the tree is left untouched."""
        path, pos, node = self._walk(tokens, namespace, split)
        if split:
            self._touch(path)
        return self._match_of(path, pos, node)

    def cached_path(self, tokens: list[int], namespace: str = "") -> tuple[list[RadixNode], int]:
        """The nodes, in either tier, that the longest cached prefix of `tokens` in `namespace` passes
        through (the last one maybe in part), and its length: a match without its blocks. A query."""
        path, pos, _ = self._walk(tokens, namespace, split=False)
        return path, pos

    def _walk(self, tokens: list[int], namespace: str, split: bool) -> tuple[list[RadixNode], int, RadixNode]:
        """The path of the longest cached prefix of `tokens`, its length, and the deepest node it
        passes wholly; with split, an edge it ends inside is split there first."""
        node, pos, path = self.root_of(namespace), 0, []
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            k = common_prefix_len(child.tokens, tokens[pos:pos + len(child.tokens)])
            if k < len(child.tokens):
                if not split:
                    path.append(child)
                    pos += k
                    break
                child = self._split(child, k)
            path.append(child)
            pos += k
            node = child
        return path, pos, node

    def continuation(self, tokens: list[int], limit: int, namespace: str = "") -> list[int]:
        """Up to `limit` cached tokens that follow all of `tokens` on a path of `namespace`'s tree
        (in either tier), following the most recently used child at each fork; [] if `tokens` is not
        wholly a cached path or nothing follows it. A query: changes nothing (not even recency)."""
        node, pos, offset = self.root_of(namespace), 0, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                return []
            offset = common_prefix_len(child.tokens, tokens[pos:pos + len(child.tokens)])
            pos += offset
            node = child
            if offset < len(child.tokens) and pos < len(tokens):
                return []  # the path diverges inside this edge
        out = node.tokens[offset:offset + limit]
        while len(out) < limit and node.children:
            node = max(node.children.values(), key=lambda n: (n.last_access, n.id))
            out += node.tokens[:limit - len(out)]
        return out

    def _match_of(self, path: list[RadixNode], length: int, node: RadixNode) -> Match:
        device = [n for n in path if n.blocks]  # a prefix of the path
        on_device = min(length, device[-1].end) if device else 0
        return Match(length, self._blocks_of(device, on_device), node, length - on_device, path)

    def exclusive_prefix_len(self, tokens: list[int], namespace: str = "") -> int:
        """The longest block-aligned device-resident prefix of `tokens` whose path lists each block
        index once.

        Where a match passes a mid-block boundary at which the child keeps its own copy of the
        straddled block, a lock on the path pins the parent's copy too, which the sequence does not
        use; stopping before such a boundary (and on a block edge, so nothing is copied on write)
        means a locked match keeps alive only blocks of the sequence's own table. A query."""
        bs = self.block_size
        node, pos = self.root_of(namespace), 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None or not child.blocks:
                break
            if node.parent is not None and node.end % bs and child.blocks[0] != node.blocks[-1]:
                return node.end // bs * bs
            k = common_prefix_len(child.tokens, tokens[pos:pos + len(child.tokens)])
            pos += k
            if k < len(child.tokens):
                break
            node = child
        return pos // bs * bs

    def foreign_blocks(self, node: RadixNode, own: list[int], stop: RadixNode | None = None) -> int:
        """Device blocks listed on the path from `node` up to `stop` (exclusive; the root by default)
        that are not in `own`: what a lock on `node` keeps alive besides a sequence's own blocks. A query."""
        bs = self.block_size
        own_set: set[int] | None = None
        foreign: set[int] = set()
        n: RadixNode | None = node
        while n is not None and n is not stop and n.parent is not None:
            first = n.start // bs
            # the common case, a node cached from `own` itself, lists its blocks where the table does:
            # none foreign, told without building a set of the table
            if n.blocks != own[first:first + len(n.blocks)]:
                if own_set is None:
                    own_set = set(own)
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
    def insert(self, tokens: list[int], blocks: list[int], known: RadixNode | None = None,
               namespace: str = "") -> RadixNode:
        """Cache `tokens` (whose K/V sit in `blocks`, a sequence's block table) in `namespace` and
        return the node ending at len(tokens). New nodes, and host-only nodes on the way (the
        sequence computed the same K/V, so its blocks become their device copy), take a reference on
        the blocks they list. `known`, a node of that namespace the caller holds locked on the path
        of `tokens`, lets the walk start there instead of at the root (a lock keeps it in the tree,
        and splits keep its end; a root is never taken as known, since an emptied one is forgotten).
        Changes the cache."""
        bs = self.block_size
        if len(blocks) * bs < len(tokens):
            raise ValueError("insert: fewer blocks than the tokens need")
        node, pos, path = self._kept_root(namespace), 0, []
        if not tokens:
            self._forget_if_empty(node)
            return node
        now = next(self._clock)  # this access's time: a new node enters the LRU sets with it, once
        if known is not None and known.parent is not None and known.lock_count > 0 and known.end <= len(tokens):
            node, pos = known, known.end
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                path.append(self._new_leaf(node, tokens, pos, len(tokens), blocks, now))
                pos = len(tokens)
                break
            k = common_prefix_len(child.tokens, tokens[pos:pos + len(child.tokens)])
            if k < len(child.tokens):
                child = self._split(child, k)
            if not child.blocks:
                own = blocks[child.start // bs:(child.end - 1) // bs + 1]
                for b in own:
                    self.pool.incref(b)
                self._set_blocks(child, own)
            path.append(child)
            pos += k
            node = child
        self._touch(path, now)
        return path[-1]

    def extend_locked(self, known: RadixNode, tokens: list[int], end: int, blocks: list[int]) -> RadixNode | None:
        """Cache tokens[:end] (a running sequence's, whose K/V sit in `blocks`, its block table) in the
        common case, in one step: they go on past the end of `known` (a node the caller holds locked
        on their path) where nothing is cached yet. A new leaf under `known` lists the blocks of
        tokens[known.end:end] and takes the caller's lock from `known`: the tree ends as
        `insert(tokens[:end], blocks, known=known)` then `relock(known, leaf)` would leave it, but
        the leaf, born locked, never passes through the LRU sets, and only its own tokens are copied.
        Returns the leaf (changes the cache); None, changing nothing, when the path is not that simple
        (then the caller inserts and relocks)."""
        start = known.end
        if known.parent is None or known.lock_count == 0 or start >= end or tokens[start] in known.children:
            return None
        if len(blocks) * self.block_size < end:
            raise ValueError("extend_locked: fewer blocks than the tokens need")
        return self._new_leaf(known, tokens, start, end, blocks, next(self._clock), lock_count=1)

    def _new_leaf(self, parent: RadixNode, tokens: list[int], pos: int, end: int, blocks: list[int], now: int,
                  lock_count: int = 0) -> RadixNode:
        """A leaf under `parent` for tokens[pos:end], listing (and taking a reference on) the blocks of
        `blocks` that hold them, with `lock_count` locks."""
        bs = self.block_size
        leaf_blocks = blocks[pos // bs:(end - 1) // bs + 1]
        for b in leaf_blocks:
            self.pool.incref(b)
        # (positional: matching keywords against the node's 16 fields costs more, once per new node)
        child = RadixNode(tokens[pos:end], pos, leaf_blocks, parent)
        child.lock_count = lock_count
        self._attach(parent, child, now)
        return child

    def _attach(self, parent: RadixNode, child: RadixNode, now: int) -> None:
        parent.children[child.tokens[0]] = child
        parent.device_children += 1
        self.evictable_blocks += len(child.blocks) if child.lock_count == 0 else 0
        self.num_nodes += 1
        self.num_tokens += len(child.tokens)
        child.last_access = now
        self._refresh(child)
        self._refresh(parent)

    def _split(self, node: RadixNode, k: int) -> RadixNode:
        """Cut `node`'s edge after k tokens; return the new upper node (which ends at start + k)."""
        bs = self.block_size
        first = node.start // bs
        upper_last = (node.start + k - 1) // bs
        lower_first = (node.start + k) // bs
        upper = RadixNode(tokens=node.tokens[:k], start=node.start, blocks=node.blocks[:upper_last - first + 1],
                          parent=node.parent, lock_count=node.lock_count, last_access=node.last_access,
                          host_blocks=node.host_blocks[:upper_last - first + 1], swap_pins=node.swap_pins,
                          device_children=int(bool(node.blocks)), hold_count=node.hold_count, hits=node.hits)
        if upper_last == lower_first:  # the block at the cut is now listed by both nodes
            if node.blocks:
                self.pool.incref(node.blocks[upper_last - first])
                self.evictable_blocks += int(node.lock_count == 0)
            if node.host_blocks:
                assert self.host_pool is not None
                self.host_pool.incref(node.host_blocks[upper_last - first])
        assert node.parent is not None
        node.parent.children[upper.tokens[0]] = upper
        node.tokens = node.tokens[k:]
        node.start += k
        node.blocks = node.blocks[lower_first - first:]
        node.host_blocks = node.host_blocks[lower_first - first:]
        node.parent = upper
        upper.children[node.tokens[0]] = node
        self.num_nodes += 1
        self._refresh(upper)
        self._refresh(node)
        return upper

    # -- locks, pins and the LRU sets ------------------------------------------------------------
    def lock(self, node: RadixNode) -> None:
        """Lock the path from the root to `node` (it stays on the device and is never evicted). Changes
        the cache: locks only."""
        self._add_locks(node, None, +1)

    def unlock(self, node: RadixNode) -> None:
        """Give back a lock `lock` took on `node`'s path. Changes the cache: locks only."""
        self._add_locks(node, None, -1)

    def relock(self, old: RadixNode, new: RadixNode) -> None:
        """Move one lock from `old`'s path to `new`'s. When one of them lies on the other's path
        (a sequence's lock moving down onto the blocks it just cached, or up), only the nodes between
        them change, not the whole path to the root. Changes the cache: locks only."""
        if old is new:
            return
        if self._is_above(old, new):
            self._add_locks(new, old, +1)
        elif self._is_above(new, old):
            self._add_locks(old, new, -1)
        else:
            self.lock(new)
            self.unlock(old)

    def _is_above(self, upper: RadixNode, node: RadixNode) -> bool:
        """Is `upper` on the path from the root to `node` (the root always is)?"""
        n: RadixNode | None = node
        while n is not None and n is not upper:
            n = n.parent
        return n is upper

    def _add_locks(self, node: RadixNode, stop: RadixNode | None, delta: int) -> None:
        """Add `delta` (+1, -1) to the lock count of each node from `node` up to `stop` (exclusive; the
        root by default, whose own lock never changes)."""
        n: RadixNode | None = node
        while n is not None and n is not stop and n.parent is not None:
            assert n.blocks or delta < 0, "lock of a node that is not on the device"
            assert n.lock_count + delta >= 0, "unlock of an unlocked node"
            n.lock_count += delta
            if n.lock_count == (delta > 0):  # 0 <-> 1: what eviction may take changed
                self.evictable_blocks -= delta * len(n.blocks)
                self._refresh(n)
            n = n.parent

    def _pin(self, node: RadixNode, delta: int) -> None:
        n: RadixNode | None = node
        while n is not None and n.parent is not None:
            n.swap_pins += delta
            assert n.swap_pins >= 0, "unpin of an unpinned node"
            if n.swap_pins == int(delta > 0):  # 0 <-> 1: what the host tier may drop changed
                self._refresh(n)
            n = n.parent

    def unpin(self, node: RadixNode) -> None:
        """A swapped-out sequence resumed or ended: its path may leave the host tier again. Changes the
        cache: pins only."""
        self._pin(node, -1)

    def hold(self, node: RadixNode) -> None:
        """Keep the path from the root to `node` on the device until `release_hold`: a lock that no
        sequence owns, drawn as pinned (a pinned prefix, Scheduler.hold_prefix). Changes the cache: locks only."""
        self.lock(node)
        self._add_holds(node, +1)

    def release_hold(self, node: RadixNode) -> None:
        """Give back a hold `hold` took on `node`'s path. Changes the cache: locks only."""
        self._add_holds(node, -1)
        self.unlock(node)

    def _add_holds(self, node: RadixNode, delta: int) -> None:
        n: RadixNode | None = node
        while n is not None and n.parent is not None:
            n.hold_count += delta
            assert n.hold_count >= 0, "release of a node that is not held"
            n = n.parent

    def record_hit(self, match: Match) -> None:
        """Count a match taken by a request on each node whose tokens it took (for the tree's picture
        and the pins' hit counts), and where it ended (window_blocks.make_room: a likely hit end). Changes
        counters only."""
        for n in match.path:
            if n.start < match.length:
                n.hits += 1
        if match.length and match.length == match.node.end:
            match.node.hits_ended += 1

    def _touch(self, path: list[RadixNode], now: int | None = None) -> None:
        now = next(self._clock) if now is None else now
        for n in path:
            if n.last_access == now:
                continue  # attached by this access: listed with this time already
            if n.in_lru or n.in_host_lru or n.in_checkpoints:  # its key changes: out of the sorted sets and back in
                self._unlist(n)
                n.last_access = now
                self._refresh(n)
            else:
                n.last_access = now

    def _unlist(self, n: RadixNode) -> None:
        if n.in_checkpoints:
            self._checkpoints.remove(n)
            n.in_checkpoints = False
        if n.in_lru:
            self._lru.remove(n)
            n.in_lru = False
        if n.in_host_lru:
            self._host_lru.remove(n)
            n.in_host_lru = False

    def _evictable(self, n: RadixNode) -> bool:
        return bool(n.blocks) and n.lock_count == 0 and n.device_children == 0 and n.id not in self._protected

    def _droppable(self, n: RadixNode) -> bool:
        return (bool(n.host_blocks) and n.swap_pins == 0 and (bool(n.blocks) or not n.children)
                and n.id not in self._protected)

    def _refresh(self, n: RadixNode) -> None:
        """Put `n` in exactly the LRU sets its state names (its key, last_access, is unchanged)."""
        if n.parent is None:
            return
        want, want_host = self._evictable(n), self._droppable(n)
        if want != n.in_lru:
            (self._lru.add if want else self._lru.remove)(n)
            n.in_lru = want
        if want_host != n.in_host_lru:
            (self._host_lru.add if want_host else self._host_lru.remove)(n)
            n.in_host_lru = want_host
        if (n.state >= 0) != n.in_checkpoints:
            (self._checkpoints.add if n.state >= 0 else self._checkpoints.remove)(n)
            n.in_checkpoints = n.state >= 0

    def _set_blocks(self, n: RadixNode, blocks: list[int]) -> None:
        """Give `n` a device copy, or take it away ([]); the caller moves the references. A node
        leaving the device drops its checkpoint (states live on the device only)."""
        if not blocks:
            self._drop_state(n)
        was = bool(n.blocks)
        if n.lock_count == 0:
            self.evictable_blocks += len(blocks) - len(n.blocks)
        n.blocks = blocks
        assert n.parent is not None
        n.parent.device_children += int(bool(blocks)) - int(was)
        self._refresh(n)
        self._refresh(n.parent)

    def _protect(self, nodes: list[RadixNode], on: bool) -> None:
        for n in nodes:
            (self._protected.add if on else self._protected.discard)(n.id)
            self._refresh(n)

    # -- recurrent-state checkpoints (hybrid models) -------------------------------------------------
    @staticmethod
    def checkpoint_on(path: list[RadixNode], length: int) -> RadixNode | None:
        """The deepest node of a matched `path` whose checkpoint a match of `length` tokens can
        resume from (it ends within the match); None if there is none. A query."""
        return next((n for n in reversed(path) if n.state >= 0 and n.end <= length), None)

    def attach_state(self, node: RadixNode, slot: int) -> bool:
        """Make `slot` (whose reference the caller hands over) `node`'s checkpoint: the state after the
        tokens up to its end. False, changing nothing, when the node has one already or is not on the
        device (the caller keeps the slot). Changes the cache."""
        if node.parent is None or node.state >= 0 or not node.blocks:
            return False
        node.state, node.state_used = slot, next(self._clock)
        self._refresh(node)
        return True

    def resumed_from(self, node: RadixNode) -> None:
        """A sequence copied `node`'s checkpoint: it counts as used now. Changes the cache (its order)."""
        assert node.state >= 0, "the node holds no checkpoint"
        self._unlist(node)
        node.state_used = next(self._clock)
        self._refresh(node)

    def checkpoints_by_age(self) -> list[RadixNode]:
        """The nodes holding a checkpoint, least recently used first: by when each was taken or last
        resumed from. A sequence running on through a checkpoint's node does not use it: the
        checkpoint of an earlier turn on a conversation still going is older than the newest one of a
        conversation waiting for its next turn, which that turn resumes from. A query."""
        return list(self._checkpoints)

    def evict_checkpoint(self, node: RadixNode) -> None:
        """Drop `node`'s checkpoint, freeing its slot. A checkpoint is never needed by a running
        sequence (a hit copies it), so any may go; which one is the scheduler's checkpoint policy's
        choice. Changes the cache."""
        assert node.state >= 0, "the node holds no checkpoint"
        self._drop_state(node)
        self.checkpoints_evicted += 1

    def _drop_state(self, n: RadixNode) -> None:
        if n.state < 0:
            return
        assert self.states is not None
        self.states.decref(n.state)
        n.state = -1
        self._refresh(n)

    def state_refs(self) -> Counter[int]:
        """How many nodes hold each state slot. A query."""
        return Counter(n.state for n in self.nodes() if n.state >= 0)

    @property
    def num_checkpoints(self) -> int:
        return len(self._checkpoints)

    # -- moving between tiers ---------------------------------------------------------------------
    def make_room(self, num_blocks: int, read_next: Mapping[int, int] | None = None) -> list[BlockCopy]:
        """Evict until `num_blocks` device blocks are free (or nothing is evictable); the write-backs
        that eviction decided, to run before anything reuses the freed blocks. `read_next`: see
        `evict`. Changes the cache."""
        short = num_blocks - self.pool.num_free
        return self.evict(short, read_next)[1] if short > 0 else []

    def _host_room(self, num_blocks: int, read_next: Mapping[int, int] | None = None) -> None:
        short = num_blocks - self.host_pool.num_free if self.host_pool is not None else 0
        if short > 0:
            self.evict_host(short, read_next)

    def load_back(self, match: Match, read_next: Mapping[int, int] | None = None) -> tuple[Match, list[BlockCopy]]:
        """Copy the host-only tail of `match` into fresh device blocks (evicting others for them, as
        `evict` orders them). If the pool cannot supply them, the match is cut back to its device part.
        Returns the match and the copies to run (write-backs of what was evicted, then the load-backs).
        Changes the cache."""
        if not match.host_tokens:
            return match, []
        hosted = [n for n in match.path if not n.blocks]  # a suffix of the path
        anchor = hosted[0].parent
        assert anchor is not None
        self.lock(anchor)  # its path must stay on the device while eviction runs
        self._protect(hosted, True)
        needed = sum(len(n.host_blocks) for n in hosted)
        copies = self.make_room(needed, read_next)
        fresh = self.pool.allocate(needed)
        self._protect(hosted, False)
        self.unlock(anchor)
        if fresh is None:
            device = match.path[:len(match.path) - len(hosted)]
            return self._match_of(device, anchor.end, anchor), copies
        for n in hosted:
            own, fresh = fresh[:len(n.host_blocks)], fresh[len(n.host_blocks):]
            copies.extend(BlockCopy(CopyKind.TO_DEVICE, h, d) for h, d in zip(n.host_blocks, own))
            self.loaded_blocks += len(own)
            self._set_blocks(n, own)
        return self._match_of(match.path, match.length, match.node), copies

    def swap_out(self, node: RadixNode) -> list[BlockCopy] | None:
        """Give every node on `node`'s path a host copy and pin the path there, for a preempted
        sequence whose computed tokens end at `node`; the write-backs to run. None (nothing changed
        but host copies dropped to make room) if the host pool cannot hold them. Changes the cache."""
        if self.host_pool is None:
            return None
        path: list[RadixNode] = []
        n: RadixNode | None = node
        while n is not None and n.parent is not None:
            path.append(n)
            n = n.parent
        missing = [n for n in reversed(path) if not n.host_blocks]
        self._protect(path, True)  # making room must not drop this path's own host copies
        needed = sum(len(n.blocks) for n in missing)
        self._host_room(needed)
        host = self.host_pool.allocate(needed)
        self._protect(path, False)
        if host is None:
            return None
        copies: list[BlockCopy] = []
        for n in missing:
            own, host = host[:len(n.blocks)], host[len(n.blocks):]
            copies.extend(self._write_to(n, own))
        self._pin(node, +1)
        return copies

    def _write_to(self, n: RadixNode, host: list[int]) -> list[BlockCopy]:
        copies = [BlockCopy(CopyKind.TO_HOST, d, h) for d, h in zip(n.blocks, host)]
        self.written_back_blocks += len(host)
        n.host_blocks = host
        self._refresh(n)
        return copies

    def evict(self, num_blocks: int, read_next: Mapping[int, int] | None = None) -> tuple[int, list[BlockCopy]]:
        """Free device blocks until num_blocks are free or nothing is left to evict, writing back what
        the host tier can take; the blocks freed and the write-backs to run before the freed blocks are
        reused. Least recently used first, except that nodes listed in `read_next` (node id -> when a
        waiting sequence will read it, cache/next_reads.py) go after all others, the one read last
        first. Changes the cache."""
        freed = 0
        copies: list[BlockCopy] = []
        while freed < num_blocks and self._lru:
            node = self._victim(self._lru, read_next) if read_next else self._lru[0]
            if not node.host_blocks and self.write_back_enabled:
                assert self.host_pool is not None
                self._host_room(len(node.blocks), read_next)
                host = self.host_pool.allocate(len(node.blocks))
                if host is not None:
                    copies.extend(self._write_to(node, host))
            if node.host_blocks:
                blocks = node.blocks
                self._set_blocks(node, [])
                got = self.pool.release(blocks)
            else:
                got = self._remove(node)
            freed += got
            self.evicted_blocks += got
            self.evictions += 1
        return freed, copies

    @staticmethod
    def _victim(lru: SortedList, read_next: Mapping[int, int]) -> RadixNode:
        """The least recently used node of `lru` (an LRU set) that no waiting sequence reads, else the
        one read last. Scans past at most the nodes `read_next` lists."""
        last: RadixNode = lru[0]
        last_read = -1
        node: RadixNode
        for node in lru:
            when = read_next.get(node.id)
            if when is None:
                return node
            if when > last_read:
                last, last_read = node, when
        return last

    def evict_host(self, num_blocks: int, read_next: Mapping[int, int] | None = None) -> int:
        """Drop least recently used host copies until num_blocks host blocks are free (or none is
        droppable), those `read_next` lists last (see `evict`); return the host blocks freed. Changes
        the cache."""
        assert self.host_pool is not None
        freed = 0
        while freed < num_blocks and self._host_lru:
            node = self._victim(self._host_lru, read_next) if read_next else self._host_lru[0]
            if node.blocks:  # still on the device: only the host copy goes
                host, node.host_blocks = node.host_blocks, []
                self._refresh(node)
                got = self.host_pool.release(host)
                self.host_dropped_blocks += got
            else:
                got = self._remove(node)
            freed += got
        return freed

    def _remove(self, node: RadixNode) -> int:
        """Drop `node` and its subtree (host-only: nothing below an evictable node is on the device)
        from both tiers; return the blocks freed in the pool `node` was evicted from."""
        parent = node.parent
        assert parent is not None
        if self.events is not None:
            self.events.dropped(self.path_tokens(parent) + (node.tokens[0],), self.namespace_of(parent))
        del parent.children[node.tokens[0]]
        parent.device_children -= int(bool(node.blocks))
        freed_device = freed_host = 0
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            self._drop_state(n)
            self._unlist(n)
            self.evictable_blocks -= len(n.blocks)  # an evicted node is never locked
            freed_device += self.pool.release(n.blocks)
            if n.host_blocks:
                assert self.host_pool is not None
                freed_host += self.host_pool.release(n.host_blocks)
            self.num_nodes -= 1
            self.num_tokens -= len(n.tokens)
        self.host_dropped_blocks += freed_host
        self._refresh(parent)
        if parent.parent is None:
            self._forget_if_empty(parent)
        return freed_device if node.blocks else freed_host

    @staticmethod
    def path_tokens(node: RadixNode) -> tuple[int, ...]:
        """The tokens from the root to the end of `node`. A query."""
        runs: list[list[int]] = []
        walk: RadixNode | None = node
        while walk is not None and walk.parent is not None:
            runs.append(walk.tokens)
            walk = walk.parent
        return tuple(t for run in reversed(runs) for t in run)

    def clear(self) -> int:
        """Drop everything not locked or pinned from both tiers, writing nothing back (tests, shutdown).
        Changes the cache."""
        self.write_back_enabled = False
        try:
            freed = self.evict(self.pool.num_blocks + 1)[0]
            if self.host_pool is not None:
                self.evict_host(self.host_pool.num_blocks + 1)
        finally:
            self.write_back_enabled = self.host_pool is not None
        return freed

    # -- accounting ----------------------------------------------------------------------------
    def _forget_if_empty(self, root: RadixNode) -> None:
        """Forget an emptied namespace's root (never the shared one's)."""
        if root is not self.root and not root.children and self.roots.get(root.namespace) is root:
            del self.roots[root.namespace]

    def nodes(self) -> list[RadixNode]:
        """Every node of every namespace, roots excluded. A query."""
        out, stack = [], [c for root in self.roots.values() for c in root.children.values()]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def block_refs(self) -> Counter[int]:
        """How many nodes list each device block. A query."""
        refs: Counter[int] = Counter()
        for n in self.nodes():
            refs.update(n.blocks)
        return refs

    def host_block_refs(self) -> Counter[int]:
        """How many nodes list each host block. A query."""
        refs: Counter[int] = Counter()
        for n in self.nodes():
            refs.update(n.host_blocks)
        return refs

    def check_integrity(self) -> None:
        """Assert the invariants of the module docstring, recomputed from scratch. A query."""
        check_tree(self)
