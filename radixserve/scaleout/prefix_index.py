"""The router's picture of what one replica has cached: a radix trie over token ids, no KV behind it.

The router adds every prompt it sends to a replica and, when the request finishes, the tokens the
replica cached for it (prompt and reply); it cuts the subtrees the replica reports it dropped
(cache/events.py). So the picture is approximate in one direction only between reports: it may
still hold a prefix the replica has just dropped, never miss one the router sent there.

Invariants: children are keyed by their first token and every edge is non-empty; `tokens` is the
sum of the edge lengths and `prefixes` the number of leaves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from radixserve.cache.radix_nodes import common_prefix_len


@dataclass
class _Edge:
    tokens: list[int]
    children: dict[int, _Edge] = field(default_factory=dict)


class PrefixIndex:
    def __init__(self) -> None:
        self._root = _Edge([])
        self.tokens = 0
        self.prefixes = 0

    def match(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` the replica is believed to hold."""
        key = list(tokens)
        edge, pos = self._root, 0
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

    def insert(self, tokens: Sequence[int]) -> None:
        key = list(tokens)
        edge, pos = self._root, 0
        while pos < len(key):
            child = edge.children.get(key[pos])
            if child is None:
                self.prefixes += int(bool(edge.children) or edge is self._root)
                edge.children[key[pos]] = _Edge(key[pos:])
                self.tokens += len(key) - pos
                return
            k = common_prefix_len(child.tokens, key[pos:pos + len(child.tokens)])
            if k < len(child.tokens):
                self._split(edge, child, k)
                child = edge.children[key[pos]]
            pos += k
            edge = child

    @staticmethod
    def _split(parent: _Edge, child: _Edge, k: int) -> None:
        head = _Edge(child.tokens[:k], {child.tokens[k]: child})
        child.tokens = child.tokens[k:]
        parent.children[head.tokens[0]] = head

    def cut(self, path: Sequence[int]) -> int:
        """Forget everything that continues path[:-1] with path[-1] (a dropped subtree); return the
        tokens forgotten (0 when the index never held it)."""
        if not path:
            return 0
        depth, first = len(path) - 1, path[-1]
        edge, pos = self._root, 0
        while pos < depth:
            child = edge.children.get(path[pos])
            if child is None:
                return 0
            need = depth - pos  # tokens above the cut still to walk
            if len(child.tokens) > need:  # the cut falls inside this edge
                if child.tokens[:need] != list(path[pos:depth]) or child.tokens[need] != first:
                    return 0
                self._split(edge, child, need)
                edge, pos = edge.children[path[pos]], depth
                break
            if child.tokens != list(path[pos:pos + len(child.tokens)]):
                return 0
            edge, pos = child, pos + len(child.tokens)
        gone = edge.children.pop(first, None)
        if gone is None:
            return 0
        removed, leaves = self._size(gone)
        self.tokens -= removed
        self.prefixes -= leaves - int(not edge.children and edge is not self._root)
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
        tokens, leaves, stack = 0, 0, list(self._root.children.values())
        while stack:
            e = stack.pop()
            assert e.tokens, "empty edge"
            for first, c in e.children.items():
                assert c.tokens[0] == first, "child keyed by a token it does not start with"
            tokens += len(e.tokens)
            leaves += int(not e.children)
            stack.extend(e.children.values())
        assert (tokens, leaves) == (self.tokens, self.prefixes), ((tokens, leaves), (self.tokens, self.prefixes))
