"""The router's picture of what one replica has cached: a radix trie over token ids per cache
namespace (SamplingParams.cache_namespace), no KV behind it.

The router adds every prompt it sends to a replica and, when the request finishes, the tokens the
replica cached for it (prompt and reply); it cuts the subtrees the replica reports it dropped
(cache/events.py). So the picture is approximate in one direction only between reports: it may
still hold a prefix the replica has just dropped, never miss one the router sent there.

A replica never reports dropping what it never cached (a prompt aborted before its prefill), so the
picture also forgets on its own: `prune` removes the part of a prompt that only that request put
there, and `evict` removes the least recently inserted leaves beyond a size (routing.py bounds each
picture by a multiple of its replica's pool). Per edge it keeps `refs` (requests in flight whose
prompt covers it: never pruned or evicted), `held` (the replica is believed to have cached it: a
finished request's tokens, or a prompt that was prefilled; never pruned), `tick` (the last insert
through it: the eviction order) and `born` (the insert that made its tokens an edge). An insert with
a ref returns its clock, and `unref` takes that back only from edges born no later: a prompt's path
may have been cut since and built again by other requests, whose refs are not its to release.

Namespaces mirror the replica's tree (cache/radix_tree.py): each one is its own trie under its own
root, so a lookup in one namespace never sees what another cached (the router must never send a
tenant's request somewhere because of another tenant's prefix), while `evict` and the bound see
every namespace as one LRU picture, as the replica's pool does.

Invariants: a namespace's root is kept only while it has children; children are keyed by their
first token and every edge is non-empty; `tokens` is the sum of the edge lengths and `prefixes` the
number of leaves, over all namespaces; a parent's tick is >= its children's, its refs >= each
child's, and it is held when a child is (an insert marks its whole path).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from radixserve.cache.radix_tree import common_prefix_len


@dataclass(eq=False, slots=True)
class _Edge:
    tokens: list[int]
    parent: _Edge | None = None
    children: dict[int, _Edge] = field(default_factory=dict)
    refs: int = 0
    held: bool = False
    tick: int = 0
    born: int = 0  # the clock of the insert that made these tokens an edge (a split keeps it)


class PrefixIndex:
    def __init__(self) -> None:
        self._roots: dict[str, _Edge] = {}  # namespace -> its root (parent None, no tokens)
        self._clock = 0
        self.tokens = 0
        self.prefixes = 0

    @property
    def namespaces(self) -> list[str]:
        return sorted(self._roots)

    def match(self, tokens: Sequence[int], namespace: str = "") -> int:
        """How many leading tokens of `tokens` the replica is believed to hold in `namespace`."""
        key = list(tokens)
        edge, pos = self._roots.get(namespace), 0
        if edge is None:
            return 0
        while pos < len(key):
            child = edge.children.get(key[pos])
            if child is None:
                return pos
            k = common_prefix_len(child.tokens, key[pos:pos + len(child.tokens)])
            pos += k
            if k < len(child.tokens):
                return pos
            edge = child
        return pos

    def insert(self, tokens: Sequence[int], namespace: str = "", held: bool = False, ref: bool = False) -> int:
        """Add `tokens` to `namespace` as the most recent entry; `held`: the replica cached them;
        `ref`: a request in flight holds them until `unref`, which takes the clock returned here."""
        key = list(tokens)
        self._clock += 1
        if not key:
            return self._clock
        edge, pos = self._roots.get(namespace) or self._roots.setdefault(namespace, _Edge([])), 0
        while pos < len(key):
            child = edge.children.get(key[pos])
            if child is None:
                self.prefixes += int(bool(edge.children) or edge.parent is None)
                child = edge.children[key[pos]] = _Edge(key[pos:], edge, born=self._clock)
                self.tokens += len(key) - pos
            else:
                k = common_prefix_len(child.tokens, key[pos:pos + len(child.tokens)])
                if k < len(child.tokens):
                    child = self._split(edge, child, k)
            child.tick = self._clock
            child.held |= held
            child.refs += int(ref)
            pos += len(child.tokens)
            edge = child
        return self._clock

    @staticmethod
    def _split(parent: _Edge, child: _Edge, k: int) -> _Edge:
        """Cut `child` after k tokens; returns the new upper part (which keeps the child's marks)."""
        head = _Edge(child.tokens[:k], parent, {child.tokens[k]: child}, child.refs, child.held, child.tick, child.born)
        child.tokens, child.parent = child.tokens[k:], head
        parent.children[head.tokens[0]] = head
        return head

    def _path(self, tokens: Sequence[int], namespace: str) -> list[_Edge]:
        """The edges `tokens` covers whole in `namespace`, from its root down."""
        key, path = list(tokens), []
        edge, pos = self._roots.get(namespace), 0
        while edge is not None and pos < len(key):
            child = edge.children.get(key[pos])
            if child is None or child.tokens != key[pos:pos + len(child.tokens)]:
                break
            path.append(child)
            pos += len(child.tokens)
            edge = child
        return path

    def unref(self, tokens: Sequence[int], ticket: int, namespace: str = "") -> None:
        """A request in flight with this prompt ended; `ticket`: what its `insert` returned. Edges born
        after it never held its ref (its path was cut and built again since)."""
        for edge in self._path(tokens, namespace):
            if edge.born <= ticket:
                edge.refs -= 1

    def prune(self, tokens: Sequence[int], namespace: str = "") -> int:
        """Forget the tail of `tokens` that nothing else holds (no request in flight, not cached, no
        longer entry through it); return the tokens forgotten."""
        removed = 0
        for edge in reversed(self._path(tokens, namespace)):
            if edge.children or edge.refs or edge.held:
                break
            removed += self._remove_leaf(edge, namespace)
        return removed

    def _remove_leaf(self, edge: _Edge, namespace: str) -> int:
        parent = edge.parent
        assert parent is not None and not edge.children
        del parent.children[edge.tokens[0]]
        self.tokens -= len(edge.tokens)
        self.prefixes -= 1 - int(not parent.children and parent.parent is not None)
        self._forget_if_empty(namespace)
        return len(edge.tokens)

    def _forget_if_empty(self, namespace: str) -> None:
        root = self._roots.get(namespace)
        if root is not None and not root.children:
            del self._roots[namespace]

    def evict(self, target: int) -> int:
        """Forget least recently inserted leaves of any namespace not held by a request in flight
        until at most `target` tokens remain (or nothing more may go); return the tokens forgotten."""
        if self.tokens <= target:
            return 0
        heap: list[tuple[int, int, _Edge, str]] = []
        stack = [(e, ns) for ns, root in self._roots.items() for e in root.children.values()]
        while stack:
            e, ns = stack.pop()
            if e.children:
                stack.extend((c, ns) for c in e.children.values())
            elif not e.refs:
                heap.append((e.tick, id(e), e, ns))
        heapq.heapify(heap)
        removed = 0
        while heap and self.tokens > target:
            _, _, edge, ns = heapq.heappop(heap)
            parent = edge.parent
            removed += self._remove_leaf(edge, ns)
            if parent is not None and parent.parent is not None and not parent.children and not parent.refs:
                heapq.heappush(heap, (parent.tick, id(parent), parent, ns))
        return removed

    def cut(self, path: Sequence[int], namespace: str = "") -> int:
        """Forget everything that continues path[:-1] with path[-1] in `namespace` (a dropped
        subtree); return the tokens forgotten (0 when the index never held it)."""
        root = self._roots.get(namespace)
        if not path or root is None:
            return 0
        depth, first = len(path) - 1, path[-1]
        edge, pos = root, 0
        while pos < depth:
            child = edge.children.get(path[pos])
            if child is None:
                return 0
            need = depth - pos  # tokens above the cut still to walk
            if len(child.tokens) > need:  # the cut falls inside this edge
                if child.tokens[:need] != list(path[pos:depth]) or child.tokens[need] != first:
                    return 0
                edge, pos = self._split(edge, child, need), depth
                break
            if child.tokens != list(path[pos:pos + len(child.tokens)]):
                return 0
            edge, pos = child, pos + len(child.tokens)
        gone = edge.children.pop(first, None)
        if gone is None:
            return 0
        removed, leaves = self._size(gone)
        self.tokens -= removed
        self.prefixes -= leaves - int(not edge.children and edge.parent is not None)
        self._forget_if_empty(namespace)
        return removed

    @staticmethod
    def _size(edge: _Edge) -> tuple[int, int]:
        tokens, leaves, stack = 0, 0, [edge]
        while stack:
            e = stack.pop()
            tokens += len(e.tokens)
            leaves += int(not e.children)
            stack.extend(e.children.values())
        return tokens, leaves

    def check_integrity(self) -> None:
        for root in self._roots.values():
            assert root.children and root.parent is None and not root.tokens, "an empty root kept"
            assert all(c.parent is root for c in root.children.values()), "child with a wrong parent"
        tokens, leaves, stack = 0, 0, [e for root in self._roots.values() for e in root.children.values()]
        while stack:
            e = stack.pop()
            assert e.tokens, "empty edge"
            for first, c in e.children.items():
                assert c.tokens[0] == first, "child keyed by a token it does not start with"
                assert c.parent is e, "child with a wrong parent"
                assert c.tick <= e.tick and c.refs <= e.refs and (e.held or not c.held), "marks not monotone"
            assert e.refs >= 0, "a ref released twice"
            tokens += len(e.tokens)
            leaves += int(not e.children)
            stack.extend(e.children.values())
        assert (tokens, leaves) == (self.tokens, self.prefixes), ((tokens, leaves), (self.tokens, self.prefixes))
