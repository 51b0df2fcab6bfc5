"""The tree view of several replicas as one (ClusterEngine.cache_tree): each replica's bounded view
(cache/tree_view.py) merged into one of at most `limit` nodes.

Every replica has its own tree, so a prefix cached on two replicas is two nodes: the merged view
keeps them apart, each replica's nodes hanging from the same namespace roots. Namespaces keep their
names (the server reads tenants from them), and node ids are renumbered `id * R + i` (the replica's
position `i` among the R sorted replica names), unique and stable while the replicas stay the same.
The nodes kept are chosen as one view chooses its own: grown from the roots, the largest subtree
(by tokens, then the most recently used) first, so every node's parent is in the view too.

Invariants: as a single view's (tree_view.py); totals and per-namespace tokens are the replicas'
sums; `hidden_tokens` counts what the merged view leaves out below a node, including what the
replica's own view had left out.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import replace

from radixserve.cache.tree_view import TreeNodeView, TreeView, largest_first


def merge_views(views: Mapping[str, TreeView], limit: int) -> TreeView:
    names = sorted(views)
    width = max(len(names), 1)
    children: defaultdict[int | None, list[TreeNodeView]] = defaultdict(list)
    for i, name in enumerate(names):
        for node in views[name].nodes:
            renamed = replace(node, id=node.id * width + i,
                              parent=None if node.parent is None else node.parent * width + i)
            children[renamed.parent].append(renamed)
    chosen = largest_first(children[None], lambda n: children[n.id],
                           lambda n: (-n.subtree_tokens, -n.last_access, n.id), limit)
    shown = {n.id for n in chosen}
    nodes = [replace(n, hidden_tokens=n.subtree_tokens - n.tokens
                     - sum(c.subtree_tokens for c in children[n.id] if c.id in shown)) for n in chosen]
    namespaces: Counter[str] = Counter()
    for view in views.values():
        namespaces.update(view.namespaces)
    return TreeView(nodes, sum(v.total_nodes for v in views.values()), sum(v.total_tokens for v in views.values()),
                    dict(namespaces))
