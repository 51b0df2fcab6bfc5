"""The radix tree's own invariants, recomputed from scratch (see radix_tree.py's docstring for what
they mean). Cross-structure checks (refcounts against sequence tables, lock and pin counts against
live sequences) are the scheduler's, in scheduler/integrity.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixserve.cache.radix_tree import RadixTree


def check_tree(tree: RadixTree) -> None:
    bs = tree.block_size
    nodes = tree.nodes()
    assert len(nodes) == tree.num_nodes, f"node count {tree.num_nodes} != {len(nodes)}"
    assert sum(len(n.tokens) for n in nodes) == tree.num_tokens, "token count drifted"
    evictable, droppable = set(), set()
    assert tree.roots.get("") is tree.root, "the shared namespace lost its root"
    for ns, root in tree.roots.items():
        assert root.parent is None and root.namespace == ns and root.lock_count == 1, f"namespace {ns!r}: bad root"
        assert root is tree.root or root.children, f"namespace {ns!r}: an empty root is kept"
    for n in [*tree.roots.values(), *nodes]:
        for first_token, c in n.children.items():
            assert c.parent is n, "child's parent link is wrong"
            assert c.tokens and c.tokens[0] == first_token, "child keyed by the wrong token"
            assert c.start == n.end, "child does not start where its parent ends"
        on_device_children = sum(1 for c in n.children.values() if c.blocks)
        assert n.device_children == on_device_children, f"node {n.id}: {n.device_children} != {on_device_children} on device"
        if n.parent is None:
            continue
        assert n.parent is not None
        span = (n.end - 1) // bs - n.start // bs + 1
        assert n.blocks or n.host_blocks, f"node {n.id} has its K/V in neither tier"
        for tier, blocks in (("device", n.blocks), ("host", n.host_blocks)):
            assert not blocks or len(blocks) == span, f"node {n.id} covers {span} blocks but lists {len(blocks)} {tier}"
        assert not n.host_blocks or tree.host_pool is not None, f"node {n.id}: host blocks without a host tier"
        assert not n.blocks or n.parent.on_device, f"node {n.id} is on the device but its parent is not"
        assert n.lock_count == 0 or n.blocks, f"node {n.id} is locked but not on the device"
        assert n.swap_pins == 0 or n.host_blocks, f"node {n.id} is pinned but not in the host tier"
        assert n.lock_count >= sum(c.lock_count for c in n.children.values()), "lock count below children's"
        assert n.swap_pins >= sum(c.swap_pins for c in n.children.values()), "pin count below children's"
        assert n.hold_count >= sum(c.hold_count for c in n.children.values()), "hold count below children's"
        assert n.lock_count >= n.hold_count, f"node {n.id}: held but not locked"
        assert n.state < 0 or (n.blocks and tree.states is not None), f"node {n.id}: a checkpoint off the device"
        assert n.in_checkpoints == (n.state >= 0), f"node {n.id}: stale checkpoint flag"
        if tree._evictable(n):
            evictable.add(n.id)
        if tree._droppable(n):
            droppable.add(n.id)
        assert n.in_lru == (n.id in evictable) and n.in_host_lru == (n.id in droppable), f"node {n.id}: stale LRU flags"
    listed = sum(len(n.blocks) for n in nodes if n.lock_count == 0)
    assert tree.evictable_blocks == listed, f"evictable_blocks {tree.evictable_blocks} != {listed} listed by unlocked nodes"
    assert {n.id for n in tree._lru} == evictable, "device LRU set is not the evictable nodes"
    assert {n.id for n in tree._host_lru} == droppable, "host LRU set is not the droppable host copies"
    assert {n.id for n in tree._checkpoints} == {n.id for n in nodes if n.state >= 0}, "checkpoint set drifted"
