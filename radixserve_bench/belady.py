"""Offline cache simulations on a request trace: the unbounded optimum, and bounded pools.

The trace is the requests in send order, each with its full token sequence (prompt + reply). A
request can reuse K/V of any earlier request's sequence except that sequence's last token (a sampled
token's K/V is never computed), and never its own last prompt token (its logits are needed).

- `optimal_hits`: per request, the tokens shareable with an unbounded cache (token granularity):
  the longest common prefix with any earlier sequence, capped at prompt_len - 1.
- `simulate_pool`: a pool of `capacity` blocks at block granularity under Belady's offline policy
  (evict the block whose next use by a later prompt is furthest away) or LRU. A block is identified
  by its whole prefix, so a hit is the run of leading prompt blocks still resident. Ties evict the
  deeper block first, which keeps every resident block's parent resident (a child is never used
  without its parent). The request being served pins its own blocks.
"""

from __future__ import annotations

import bisect
import heapq
from collections import OrderedDict, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from radixserve.cache.radix_tree import common_prefix_len


@dataclass(frozen=True)
class TraceRequest:
    prompt_len: int
    sequence: tuple[int, ...]  # prompt + reply tokens


def optimal_hits(trace: Sequence[TraceRequest], block_size: int = 16) -> list[int]:
    """Earlier sequences are indexed by each of their full-block prefixes, so the deepest shared block
    is found in O(prompt blocks); the exact extension is then checked against every sequence sharing
    it (or, below one block, every sequence with the same first token)."""
    by_prefix: dict[int, list[int]] = defaultdict(list)  # full-block prefix id -> sequence ids
    by_first: dict[int, list[int]] = defaultdict(list)
    cached: list[tuple[int, ...]] = []
    hits = []
    for req in trace:
        prompt = req.sequence[: req.prompt_len]
        candidates: list[int] = by_first.get(prompt[0], []) if prompt else []
        for block_id in block_chain(prompt[: len(prompt) // block_size * block_size], block_size):
            if block_id not in by_prefix:
                break
            candidates = by_prefix[block_id]
        best = max((common_prefix_len(cached[j], prompt) for j in candidates), default=0)  # type: ignore[arg-type]
        hits.append(max(0, min(best, req.prompt_len - 1)))
        kept = req.sequence[:-1]  # the last token has no K/V
        cached.append(kept)
        if kept:
            by_first[kept[0]].append(len(cached) - 1)
        for block_id in block_chain(kept[: len(kept) // block_size * block_size], block_size):
            by_prefix[block_id].append(len(cached) - 1)
    return hits


def block_chain(tokens: Sequence[int], block_size: int) -> list[int]:
    """Identities of the blocks holding `tokens` (a partial last block included): each id stands
    for the whole prefix up to the end of its block."""
    ids, h = [], 0
    for start in range(0, len(tokens), block_size):
        h = hash((h, tuple(tokens[start:start + block_size])))
        ids.append(h)
    return ids


def working_set_blocks(trace: Sequence[TraceRequest], block_size: int) -> int:
    """Distinct blocks an unbounded cache ends up holding for the whole trace."""
    seen: set[int] = set()
    for req in trace:
        seen.update(block_chain(req.sequence[:-1], block_size))
    return len(seen)


@dataclass(frozen=True)
class PoolResult:
    policy: str
    capacity: int
    hit_tokens: int
    prompt_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def simulate_pool(trace: Sequence[TraceRequest], block_size: int, capacity: int, policy: str = "belady") -> PoolResult:
    if policy not in ("belady", "lru"):
        raise ValueError(f"unknown policy {policy!r}")
    if capacity < 1:
        raise ValueError("capacity must be >= 1 block")
    # a prompt can only hit full blocks that end before its last token
    prompt_chains = [block_chain(r.sequence[: (r.prompt_len - 1) // block_size * block_size], block_size)
                     for r in trace]
    seq_chains = [block_chain(r.sequence[:-1], block_size) for r in trace]
    uses: dict[int, list[int]] = defaultdict(list)
    for i, chain in enumerate(prompt_chains):
        for b in chain:
            uses[b].append(i)
    never = len(trace)

    def next_use(b: int, after: int) -> int:
        u = uses.get(b, [])
        k = bisect.bisect_right(u, after)
        return u[k] if k < len(u) else never

    resident: dict[int, tuple[int, int]] = {}  # block -> (next use, depth) for Belady
    heap: list[tuple[int, int, int]] = []
    lru: OrderedDict[int, None] = OrderedDict()
    hit_tokens = prompt_tokens = 0
    for i, req in enumerate(trace):
        prompt_tokens += req.prompt_len
        hit_blocks = 0
        for b in prompt_chains[i]:
            if b not in resident:
                break
            hit_blocks += 1
        hit_tokens += min(hit_blocks * block_size, req.prompt_len - 1)
        pinned = set(seq_chains[i])
        for depth, b in reversed(list(enumerate(seq_chains[i]))):  # leaf first: for LRU, parents end newest
            key = (next_use(b, i), depth)
            if b not in resident and len(resident) >= capacity and not _evict(resident, heap, lru, pinned, policy):
                continue  # the request alone overflows the pool: this block is not cached
            resident[b] = key
            if policy == "belady":
                heapq.heappush(heap, (-key[0], -depth, b))
            else:
                lru[b] = None
                lru.move_to_end(b)
    return PoolResult(policy, capacity, hit_tokens, prompt_tokens)


def _evict(resident: dict[int, tuple[int, int]], heap: list[tuple[int, int, int]], lru: OrderedDict[int, None],
           pinned: set[int], policy: str) -> bool:
    if policy == "lru":
        for b in lru:
            if b not in pinned:
                del lru[b]
                del resident[b]
                return True
        return False
    skipped = []
    evicted = False
    while heap:
        neg_use, neg_depth, b = heapq.heappop(heap)
        if resident.get(b) != (-neg_use, -neg_depth):
            continue  # stale entry
        if b in pinned:
            skipped.append((neg_use, neg_depth, b))
            continue
        del resident[b]
        evicted = True
        break
    for entry in skipped:
        heapq.heappush(heap, entry)
    return evicted
