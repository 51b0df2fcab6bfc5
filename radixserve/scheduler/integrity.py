"""Cross-structure invariants of the cache state the scheduler owns, recomputed from scratch.

`check_integrity` proves: every live sequence is queued once; each sequence's table covers what it
has computed; a pending token (sampled, still on the device) is only ever a sequence's last token
and never counts as computed, and none is in the tree; unverified drafts sit only before a pending
slot, and neither a sequence's cached tokens nor its lock reach past its verified ones; each block's refcount equals the sequence
tables and tree nodes listing it (so free, owned and cached blocks partition the pool); each tree
node's lock count equals the live sequences whose locked path passes through it plus the pinned
prefixes whose held path does (and its hold count the latter); the host tier's
block refcounts equal the tree nodes listing them (a swapped-out sequence holds its host blocks
through the tree path it pins, never a table of its own), and each node's pin count equals the
waiting swapped-out sequences whose path passes through it; a hybrid model's state slots are each
held once, by a running sequence (every one has its working slot, and one verifying drafts its copy
from before them) or a tree checkpoint; and the
tree's own invariants hold.
Tests run it after every step, and so does any engine with RADIXSERVE_CHECK_INTEGRITY=1.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence as Sequence_

from radixserve.cache.block_pool import BlockPool
from radixserve.cache.radix_tree import RadixNode, RadixTree
from radixserve.core import PENDING_TOKEN, Sequence


def leaked_blocks(live: list[Sequence], pool: BlockPool, tree: RadixTree | None,
                  states: BlockPool | None = None) -> int:
    """Blocks of either tier (and a hybrid model's state slots) with references but no sequence or
    tree node holding them."""
    owners = Counter(b for s in live for b in s.block_table)
    if tree is not None:
        owners.update(tree.block_refs())
    leaked = sum(1 for b, rc in enumerate(pool.refcount) if rc > 0 and owners[b] == 0)
    if tree is not None and tree.host_pool is not None:
        host_owners = tree.host_block_refs()
        leaked += sum(1 for b, rc in enumerate(tree.host_pool.refcount) if rc > 0 and host_owners[b] == 0)
    if states is not None:
        slot_owners = Counter(slot for s in live for slot in (s.state_slot, s.state_backup) if slot >= 0)
        if tree is not None:
            slot_owners.update(tree.state_refs())
        leaked += sum(1 for slot, rc in enumerate(states.refcount) if rc > 0 and slot_owners[slot] == 0)
    return leaked


def check_integrity(live: list[Sequence], pool: BlockPool, tree: RadixTree | None,
                    held: Sequence_[RadixNode] = (), states: BlockPool | None = None) -> None:
    """`held`: the nodes pinned prefixes hold (`Scheduler.hold_prefix`), each a lock and a hold on its path;
    `states`: a hybrid model's state slots, each held by one running sequence or one tree checkpoint."""
    assert len({s.seq_id for s in live}) == len(live), "a sequence is queued twice"
    owners: Counter[int] = Counter()
    locks: Counter[int] = Counter()
    pins: Counter[int] = Counter()
    holds: Counter[int] = Counter()
    for node in held:
        _count_path(node, tree, locks)
        _count_path(node, tree, holds)
    for s in live:
        owners.update(s.block_table)
        assert len(s.block_table) * pool.block_size >= s.num_computed, "table shorter than computed"
        assert PENDING_TOKEN not in s.token_ids[:-1], f"sequence {s.seq_id}: a pending token before its last"
        assert s.num_computed <= s.num_resolved + s.num_drafts, f"sequence {s.seq_id}: a pending token counts as computed"
        # drafts sit only before a pending slot, and nothing past the resolved tokens is in the tree
        assert not s.num_drafts or s.has_pending_token, f"sequence {s.seq_id}: drafts without a slot"
        assert s.num_cached <= s.num_resolved, f"sequence {s.seq_id}: an unverified token is cached"
        assert s.locked_node is None or s.locked_node.end <= s.num_resolved, \
            f"sequence {s.seq_id}: its lock reaches past its verified tokens"
        _count_path(s.locked_node, tree, locks)
        if s.swapped_node is not None:
            assert not s.block_table and s.locked_node is None, f"sequence {s.seq_id} is swapped out but holds blocks"
            _count_path(s.swapped_node, tree, pins)
    if tree is not None:
        owners.update(tree.block_refs())
        tree.check_integrity()
        for n in tree.nodes():
            assert n.lock_count == locks[n.id], f"node {n.id}: lock count {n.lock_count} != {locks[n.id]}"
            assert n.swap_pins == pins[n.id], f"node {n.id}: pin count {n.swap_pins} != {pins[n.id]}"
            assert n.hold_count == holds[n.id], f"node {n.id}: hold count {n.hold_count} != {holds[n.id]}"
            assert PENDING_TOKEN not in n.tokens, f"node {n.id} caches a pending token"
        if tree.host_pool is not None:
            tree.host_pool.check_integrity(tree.host_block_refs())
    pool.check_integrity(owners)
    if states is not None:
        state_owners: Counter[int] = Counter(slot for s in live for slot in (s.state_slot, s.state_backup)
                                             if slot >= 0)
        for s in live:
            assert s.status.name != "RUNNING" or s.state_slot >= 0, f"sequence {s.seq_id} runs without a state slot"
        if tree is not None:
            state_owners.update(tree.state_refs())
        states.check_integrity(state_owners)


def _count_path(node: RadixNode | None, tree: RadixTree | None, counts: Counter[int]) -> None:
    while node is not None and tree is not None and node.parent is not None:
        counts[node.id] += 1
        node = node.parent
