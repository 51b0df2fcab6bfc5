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
needs blocks, eviction takes the least recently used unlocked node with no child on the device: a
node with a host copy just frees its device blocks; otherwise it is written back (its blocks copied
to the host pool) first, and only when the host pool cannot take it is it dropped, with its host-only
subtree. The host pool makes room by dropping least recently used host copies: of nodes also on the
device, or host-only leaves. A swapped-out sequence pins its cached path (`swap_out`), which keeps
every node on it in the host tier until the sequence resumes. Eviction is explicit: the pools never
call back into the tree; `make_room` (the scheduler's cache layer, before it allocates) and the
tree's own tier moves evict before they allocate. Every copy decided here is returned to the caller,
in order, which passes it on to the step that must run it (the tree keeps no list of them). With `events` set, every subtree
dropped from both tiers is also reported there, for a scale-out router (cache/events.py).

Namespaces (radix_nodes.py): each cache namespace is its own tree under its own root; eviction
and the host tier see all of them as one LRU cache, while a lookup only ever walks one. A held path
(`hold`, a pinned prefix) is a lock no sequence owns: it stays on the device until released.

Invariants (checked by `check_integrity`): each namespace's root is kept only while it has
children (the shared one always); children are keyed by their first token; a child starts where
its parent ends; each non-empty block list matches the covered block range and every non-root node
has at least one; a node on the device has its parent on the device; a locked node is on the
device; a pinned node is in the host tier; lock, pin and hold counts are at least the sum of the
children's (all are taken on a whole path), and a node's lock count is at least its hold count;
the two LRU sets hold exactly the nodes their predicates name. Nothing is evicted or dropped except when a pool asks for blocks.
"""

from __future__ import annotations

from radixserve.cache.block_pool import BlockPool
from radixserve.cache.events import CacheEventLog
from radixserve.cache.radix_nodes import Match, RadixNode, RadixStructure, common_prefix_len
from radixserve.core import BlockCopy, CopyKind

__all__ = ["Match", "RadixNode", "RadixTree", "common_prefix_len"]


class RadixTree(RadixStructure):
    def __init__(self, pool: BlockPool, host_pool: BlockPool | None = None) -> None:
        super().__init__(pool, host_pool)
        self.write_back_enabled = host_pool is not None
        self.evictions = 0  # nodes evicted from the device
        self.evicted_blocks = 0  # device blocks freed by eviction
        self.written_back_blocks = 0
        self.loaded_blocks = 0
        self.host_dropped_blocks = 0
        self.events: CacheEventLog | None = None  # set when a router follows what this tree drops

    # -- moving between tiers ---------------------------------------------------------------------
    def make_room(self, num_blocks: int) -> list[BlockCopy]:
        """Evict until `num_blocks` device blocks are free (or nothing is evictable); the write-backs
        that eviction decided, to run before anything reuses the freed blocks. Changes the cache."""
        short = num_blocks - self.pool.num_free
        return self.evict(short)[1] if short > 0 else []

    def _host_room(self, num_blocks: int) -> None:
        short = num_blocks - self.host_pool.num_free if self.host_pool is not None else 0
        if short > 0:
            self.evict_host(short)

    def load_back(self, match: Match) -> tuple[Match, list[BlockCopy]]:
        """Copy the host-only tail of `match` into fresh device blocks (evicting others for them).
        If the pool cannot supply them, the match is cut back to its device part. Returns the match
        and the copies to run (write-backs of what was evicted, then the load-backs). Changes the cache."""
        if not match.host_tokens:
            return match, []
        hosted = [n for n in match.path if not n.blocks]  # a suffix of the path
        anchor = hosted[0].parent
        assert anchor is not None
        self.lock(anchor)  # its path must stay on the device while eviction runs
        self._protect(hosted, True)
        needed = sum(len(n.host_blocks) for n in hosted)
        copies = self.make_room(needed)
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

    def evict(self, num_blocks: int) -> tuple[int, list[BlockCopy]]:
        """Free device blocks until num_blocks are free or nothing is left to evict, least recently
        used first, writing back what the host tier can take; the blocks freed and the write-backs
        to run before the freed blocks are reused. Changes the cache."""
        freed = 0
        copies: list[BlockCopy] = []
        while freed < num_blocks and self._lru:
            node = self._lru[0]
            if not node.host_blocks and self.write_back_enabled:
                assert self.host_pool is not None
                self._host_room(len(node.blocks))
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

    def evict_host(self, num_blocks: int) -> int:
        """Drop least recently used host copies until num_blocks host blocks are free (or none is
        droppable); return the host blocks freed."""
        assert self.host_pool is not None
        freed = 0
        while freed < num_blocks and self._host_lru:
            node = self._host_lru[0]
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
        """The tokens from the root to the end of `node`."""
        runs: list[list[int]] = []
        walk: RadixNode | None = node
        while walk is not None and walk.parent is not None:
            runs.append(walk.tokens)
            walk = walk.parent
        return tuple(t for run in reversed(runs) for t in run)

    def clear(self) -> int:
        """Drop everything not locked or pinned from both tiers, writing nothing back (tests, shutdown)."""
        self.write_back_enabled = False
        try:
            freed = self.evict(self.pool.num_blocks + 1)[0]
            if self.host_pool is not None:
                self.evict_host(self.host_pool.num_blocks + 1)
        finally:
            self.write_back_enabled = self.host_pool is not None
        return freed
