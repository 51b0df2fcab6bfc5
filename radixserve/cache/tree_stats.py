"""What the radix tree publishes about itself: a `TreeStats` of its size, its eviction and tier-move
counters and the host pool, taken by `tree_stats(tree)` on the thread that changes the tree.

Readers (engine/stats.py, and through it /v1/cache/stats and /metrics) build on these and never on
the tree's attributes. No tree (the prefix cache off) reads as all zeros, as does the host tier
while it is off.

Invariants: a TreeStats is immutable. Counting the nodes whose K/V lives only in the host tier takes
a pass over every node, so it is done only when asked (`count_host`); `host_only` is None otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.cache.radix_tree import RadixTree


@dataclass(frozen=True)
class HostOnly:
    nodes: int  # nodes whose K/V lives only in host memory
    tokens: int  # the tokens those nodes cover


@dataclass(frozen=True)
class TreeStats:
    nodes: int = 0
    tokens: int = 0
    evictions: int = 0  # nodes evicted from the device
    evicted_blocks: int = 0  # device blocks freed by eviction
    written_back_blocks: int = 0  # device blocks copied to the host tier
    loaded_blocks: int = 0  # host blocks copied back to the device
    host_dropped_blocks: int = 0  # host blocks dropped (least recently used) to make room
    host_blocks_total: int = 0  # 0: the host tier is off
    host_blocks_free: int = 0
    host_only: HostOnly | None = None  # None unless counted


def tree_stats(tree: RadixTree | None, count_host: bool = False) -> TreeStats:
    """The tree's figures now; `count_host` adds the host-only nodes (a pass over every node)."""
    if tree is None:
        return TreeStats()
    host = tree.host_pool
    host_only = None
    if count_host and host is not None:
        resident = [n for n in tree.nodes() if not n.blocks]
        host_only = HostOnly(len(resident), sum(len(n.tokens) for n in resident))
    return TreeStats(
        nodes=tree.num_nodes, tokens=tree.num_tokens, evictions=tree.evictions, evicted_blocks=tree.evicted_blocks,
        written_back_blocks=tree.written_back_blocks, loaded_blocks=tree.loaded_blocks,
        host_dropped_blocks=tree.host_dropped_blocks, host_blocks_total=host.num_blocks if host is not None else 0,
        host_blocks_free=host.num_free if host is not None else 0, host_only=host_only,
    )
