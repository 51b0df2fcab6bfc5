"""A bounded picture of the radix tree for people: the nodes that hold the most tokens, connected,
with what each one is (tier, pinned, locked) and how often it was hit. /v1/cache/tree and the
dashboard's tree view read it; it is taken on the thread that changes the tree, and changes nothing.

Invariants: a view holds at most `limit` nodes; every node's parent is in the view too, or the node
hangs from its namespace's root (`parent` None); a node's `hidden_tokens` counts the tokens of its
subtree that are not shown. Namespaces the caller may not see (`include` says no) are left out
entirely: they are not counted in any figure of the view.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

from radixserve.cache.radix_tree import RadixNode, RadixTree

HEAD_TOKENS = 12  # leading token ids of each node, for its label
T = TypeVar("T")


@dataclass(frozen=True)
class TreeNodeView:
    id: int
    parent: int | None  # None: a child of its namespace's root
    namespace: str
    start: int  # the position its tokens start at
    tokens: int  # the tokens on its edge
    subtree_tokens: int  # its tokens and all its descendants'
    hidden_tokens: int  # tokens of its descendants that the view leaves out
    head: tuple[int, ...]  # its first HEAD_TOKENS token ids
    tier: str  # device | host | both
    pinned: bool
    locked: bool  # held by a running sequence (besides any pin)
    hits: int  # matches that passed through it
    last_access: int  # the tree's clock at its last use (higher is more recent)


@dataclass(frozen=True)
class TreeView:
    nodes: list[TreeNodeView] = field(default_factory=list)
    total_nodes: int = 0  # nodes in the namespaces shown
    total_tokens: int = 0
    namespaces: dict[str, int] = field(default_factory=dict)  # namespace -> its tokens (those shown)


def tree_view(tree: RadixTree | None, limit: int, include: Callable[[str], bool] | None = None) -> TreeView:
    """The `limit` nodes to show: grown from the roots of the included namespaces, always taking the
    largest subtree (by tokens, the most recently used first on a tie) next. A query."""
    if tree is None or limit <= 0:
        return TreeView()
    roots = {ns: root for ns, root in tree.roots.items() if root.children and (include is None or include(ns))}
    subtree: dict[int, int] = {}
    total_nodes = 0
    for root in roots.values():
        total_nodes += _sum_subtrees(root, subtree)
    chosen = largest_first([(c, ns) for ns, root in roots.items() for c in root.children.values()],
                           lambda item: [(c, item[1]) for c in item[0].children.values()],
                           lambda item: (-subtree[item[0].id], -item[0].last_access, item[0].id), limit)
    shown_ids = {node.id for node, _ in chosen}
    nodes = []
    for node, ns in chosen:
        shown_below = sum(subtree[c.id] for c in node.children.values() if c.id in shown_ids)
        nodes.append(TreeNodeView(
            id=node.id, parent=node.parent.id if node.parent is not None and node.parent.parent is not None else None,
            namespace=ns, start=node.start, tokens=len(node.tokens), subtree_tokens=subtree[node.id],
            hidden_tokens=subtree[node.id] - len(node.tokens) - shown_below, head=tuple(node.tokens[:HEAD_TOKENS]),
            tier=node.tier, pinned=node.hold_count > 0, locked=node.lock_count > node.hold_count,
            hits=node.hits, last_access=node.last_access))
    namespaces = {ns: subtree[root.id] for ns, root in roots.items()}
    return TreeView(nodes, total_nodes, sum(namespaces.values()), namespaces)


def largest_first(first: Iterable[T], children: Callable[[T], Iterable[T]],
                  key: Callable[[T], tuple[int, ...]], limit: int) -> list[T]:
    """At most `limit` items grown from `first` by always taking the one with the smallest `key` next
    (the largest subtree, then the most recent) and offering its `children`: a connected selection,
    every item's parent taken before it. Also how replicas' views merge (scaleout/tree_merge.py)."""
    order = itertools.count()  # ties on the key never compare the items
    frontier = [(key(x), next(order), x) for x in first]
    heapq.heapify(frontier)
    chosen: list[T] = []
    while frontier and len(chosen) < limit:
        *_, item = heapq.heappop(frontier)
        chosen.append(item)
        for child in children(item):
            heapq.heappush(frontier, (key(child), next(order), child))
    return chosen


def _sum_subtrees(root: RadixNode, out: dict[int, int]) -> int:
    """Fill `out` with each node's subtree tokens below `root` (iteratively: trees can be deep); the
    number of nodes below `root`."""
    order: list[RadixNode] = []
    stack = [root]
    while stack:
        n = stack.pop()
        order.append(n)
        stack.extend(n.children.values())
    for n in reversed(order):  # children before parents
        out[n.id] = len(n.tokens) + sum(out[c.id] for c in n.children.values())
    return len(order) - 1
