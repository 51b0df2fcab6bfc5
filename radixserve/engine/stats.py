"""Engine statistics: the pool and cache counts plus cumulative token and request counters.

Counters only ever grow (hit rates are ratios of counters, never a per-batch gauge); the gauges
(blocks, queue lengths, tree size) are read fresh on every `collect`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixserve.core import Request
    from radixserve.engine.engine import LLMEngine


@dataclass
class EngineStats:
    # gauges
    blocks_total: int = 0
    blocks_free: int = 0
    blocks_used: int = 0  # owned by at least one live sequence
    blocks_cached: int = 0  # held only by the radix tree: evictable
    tree_nodes: int = 0
    tree_tokens: int = 0
    num_running: int = 0
    num_waiting: int = 0
    # counters
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the cache (finished requests)
    computed_tokens: int = 0  # prompt positions actually run through the model (incl. recompute)
    generation_tokens: int = 0
    cache_hit_requests: int = 0
    requests_finished: Counter[str] = field(default_factory=Counter)
    evictions: int = 0  # tree nodes evicted
    evicted_blocks: int = 0
    preemptions: int = 0
    stalled_steps: int = 0  # steps with work waiting that scheduled nothing (a liveness bug if ever > 0)

    @classmethod
    def collect(cls, engine: LLMEngine) -> EngineStats:
        pool, tree = engine.pool, engine.tree
        seq_owned = {b for s in engine.live_sequences() for b in s.block_table}
        tree_owned = set(tree.block_refs()) if tree is not None else set()
        s = replace(engine.stats_totals, requests_finished=Counter(engine.stats_totals.requests_finished))
        s.blocks_total = pool.num_blocks
        s.blocks_free = pool.num_free
        s.blocks_used = len(seq_owned)
        s.blocks_cached = len(tree_owned - seq_owned)
        s.tree_nodes = tree.num_nodes if tree is not None else 0
        s.tree_tokens = tree.num_tokens if tree is not None else 0
        s.evictions = tree.evictions if tree is not None else 0
        s.evicted_blocks = tree.evicted_blocks if tree is not None else 0
        s.num_running = len(engine.scheduler.running)
        s.num_waiting = len(engine.scheduler.waiting)
        s.preemptions = engine.scheduler.preemptions
        return s

    def count_finished(self, req: Request) -> None:
        self.requests_finished[req.sequences[0].finish_reason or "abort"] += 1
        self.cached_tokens += req.cached_tokens
        self.cache_hit_requests += int(req.cached_tokens > 0)
