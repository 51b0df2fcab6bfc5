"""Engine statistics: the pool and cache counts plus cumulative token and request counters.

`collect` builds them from what the scheduler and the tree publish about themselves
(scheduler/snapshot.py, cache/tree_stats.py) and the engine's own counters (the step recorder's `totals`, the host
tier's copy timings); it reads no other component's attributes.

Counters only ever grow (hit rates are ratios of counters, never a per-batch gauge); the gauges
(blocks, queue lengths, tree size) are read fresh on every `collect`, except that `collect(counted=)`
copies the COUNTED ones (a pass over every block table or tree node to count) from an earlier
snapshot, so it costs no more than reading counters (engine/stats_feed.py publishes that after every
step). `admission_blocked` and `preemptions_by_cause` are keyed by cause; `by_cause` reports them
with every known cause present.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from radixserve.cache.tree_stats import TreeStats, tree_stats
from radixserve.core import CopyKind
from radixserve.scheduler.snapshot import snapshot

if TYPE_CHECKING:
    from radixserve.core import Request
    from radixserve.engine.engine import LLMEngine
    from radixserve.engine.grammar.book import ConstraintStats
    from radixserve.engine.grammar.compiler import CompileStats
    from radixserve.engine.speculation import Verified
    from radixserve.model.host_kv import HostKVCache
    from radixserve.scheduler.scheduler import Scheduler


# Causes the scheduler counts, reported with 0 until seen so series never appear late: "blocks" (no KV
# blocks even after eviction), "max_num_seqs" (the running set is full), "watermark" (free blocks
# below the admission watermark), "urgent" (a running sequence preempted for a more urgent one).
KNOWN_CAUSES = ("blocks", "max_num_seqs", "urgent", "watermark")
# the fields read fresh (not accumulated): a sum over replicas still means something, a sum over time not
GAUGES = frozenset({"blocks_total", "blocks_free", "blocks_used", "blocks_cached", "tree_nodes", "tree_tokens",
                    "num_running", "num_waiting", "host_blocks_total", "host_blocks_free", "host_nodes",
                    "host_tokens", "new_token_ratio", "growth_reserve_blocks", "pins", "pinned_blocks",
                    "pin_budget_blocks"})
# the gauges that take a pass over every block table or radix-tree node to count: kept together, so
# blocks free + used + cached always add up to the pool
COUNTED = ("blocks_free", "blocks_used", "blocks_cached", "host_nodes", "host_tokens")


def by_cause(counts: Counter[str]) -> dict[str, int]:
    """Every known cause (0 when never seen) plus any other the scheduler counted, sorted by name."""
    return {cause: counts.get(cause, 0) for cause in sorted(set(KNOWN_CAUSES) | set(counts))}


@dataclass
class EngineStats:
    # gauges
    blocks_total: int = 0
    blocks_free: int = 0
    blocks_used: int = 0  # owned by at least one live sequence, or on a pinned path
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
    # hybrid models' recurrent states (docs/hybrid_cache.md; all 0 for attention-only models): gauges ...
    state_slots_total: int = 0
    state_slots_free: int = 0
    state_checkpoints: int = 0  # slots the radix tree holds as checkpoints
    # ... and counters
    state_recomputed_tokens: int = 0  # cached K/V recomputed because no checkpoint was at the match's end
    state_checkpoints_taken: int = 0
    state_checkpoints_evicted: int = 0
    # window blocks (--sliding-window-kv window-blocks; all 0 without): gauges, then a counter
    window_blocks_total: int = 0
    window_blocks_free: int = 0
    window_blocks_evicted: int = 0  # companions dropped to make room
    # the host-memory tier (all 0 while it is off): gauges
    host_blocks_total: int = 0
    host_blocks_free: int = 0
    host_nodes: int = 0  # radix-tree nodes whose K/V lives only in host memory
    host_tokens: int = 0  # the tokens those nodes cover
    # pinned prefixes (engine/pins.py): gauges
    pins: int = 0
    pinned_blocks: int = 0  # device blocks their paths hold
    pin_budget_blocks: int = 0  # ... at most (0: pinning is off)
    # ... and counters: hits on them, counted apart from the LRU cache's (finished requests)
    pinned_cached_tokens: int = 0  # the part of cached_tokens that pinned prefixes held
    pin_hit_requests: int = 0  # requests that took at least one pinned token
    # the host-memory tier: counters
    host_cached_tokens: int = 0  # the part of cached_tokens loaded back from the host tier (finished requests)
    written_back_blocks: int = 0  # device blocks copied to the host tier (eviction write-back, swap-out)
    written_back_bytes: int = 0
    write_back_s: float = 0.0  # time those copies took (on CUDA: measured by device events, once completed)
    loaded_blocks: int = 0  # host blocks copied back to the device (load-back on a hit, swap-in)
    loaded_bytes: int = 0
    load_s: float = 0.0
    host_dropped_blocks: int = 0  # host blocks dropped (least recently used) to make room
    swaps_out: int = 0  # preemptions by swap (the rest of `preemptions` recompute)
    swaps_in: int = 0  # swapped sequences resumed
    admission_blocked: Counter[str] = field(default_factory=Counter)  # steps whose admission stopped, by cause
    preemptions_by_cause: Counter[str] = field(default_factory=Counter)
    # output-aware admission (gauges): the new-token ratio now, and the blocks the last admission pass
    # kept free for the running sequences' expected growth
    new_token_ratio: float = 0.0
    growth_reserve_blocks: int = 0
    # structured output (engine/grammar/): counters
    constrained_requests: int = 0
    grammar_compiles: int = 0  # constraints compiled (cache misses)
    grammar_cache_hits: int = 0
    grammar_compile_failures: int = 0  # refused: invalid, unsupported or too slow to compile
    grammar_compile_s: float = 0.0
    mask_steps: int = 0  # steps that masked at least one draw
    mask_rows: int = 0
    mask_s: float = 0.0  # host time filling the masks
    forced_tokens: int = 0  # tokens a grammar forced, appended without sampling
    grammar_dead_ends: int = 0  # requests ended because their grammar allowed no token
    # speculative decoding (scheduler/drafts.py, engine/speculation.py): counters
    spec_proposed: Counter[str] = field(default_factory=Counter)  # draft tokens verified, by source
    spec_accepted: Counter[str] = field(default_factory=Counter)  # ... and kept, by source
    spec_verify_draws: int = 0  # draws that verified drafts
    committed_draws: int = 0  # draws that committed tokens: generation_tokens / this = tokens per step

    @property
    def tokens_per_draw(self) -> float:
        """Generated tokens per sequence per step (1 without speculation or forced tokens)."""
        return self.generation_tokens / self.committed_draws if self.committed_draws else 0.0

    @classmethod
    def collect(cls, engine: LLMEngine, counted: EngineStats | None = None) -> EngineStats:
        """The engine's figures now; with `counted`, the COUNTED gauges are that snapshot's instead."""
        sched = snapshot(engine.scheduler, count_blocks=counted is None)
        tree = tree_stats(engine.tree, count_host=counted is None)
        totals = engine.recorder.totals
        s = replace(totals, requests_finished=Counter(totals.requests_finished))
        s.blocks_total, s.num_running, s.num_waiting = sched.blocks_total, sched.num_running, sched.num_waiting
        s.preemptions, s.swaps_out, s.swaps_in = sched.preemptions, sched.swaps_out, sched.swaps_in
        s.admission_blocked = Counter(sched.admission_blocked)
        s.preemptions_by_cause = Counter(sched.preemptions_by_cause)
        s.new_token_ratio, s.growth_reserve_blocks = sched.new_token_ratio, sched.growth_reserve_blocks
        s.tree_nodes, s.tree_tokens = tree.nodes, tree.tokens
        budget = engine.pins.budget()
        s.pins, s.pinned_blocks, s.pin_budget_blocks = len(engine.pins.held_nodes()), budget.used_blocks, budget.budget_blocks
        s.evictions, s.evicted_blocks = tree.evictions, tree.evicted_blocks
        s.add_states(engine.scheduler)
        if sched.blocks is not None:
            s.blocks_free, s.blocks_used, s.blocks_cached = sched.blocks.free, sched.blocks.used, sched.blocks.cached
        if tree.host_only is not None:
            s.host_nodes, s.host_tokens = tree.host_only.nodes, tree.host_only.tokens
        if counted is not None:
            for name in COUNTED:
                setattr(s, name, getattr(counted, name))
        s.add_constraints(engine.grammars.stats, engine.constraints.stats)
        host = engine.runner.host_cache
        if tree.host_blocks_total and host is not None:
            s.add_host_tier(tree, host)
        return s

    def add_states(self, scheduler: Scheduler) -> None:
        """A hybrid model's state slots and checkpoints, or the window group's blocks (nothing for a model
        of paged attention layers only)."""
        states, cache = scheduler.states, scheduler.cache
        if states is None and cache.windows is None:
            return
        self.state_recomputed_tokens, self.state_checkpoints_taken = cache.recomputed_state_tokens, cache.checkpoints_taken
        if states is not None:
            self.state_slots_total, self.state_slots_free = states.num_blocks, states.num_free
            if scheduler.tree is not None:
                self.state_checkpoints, self.state_checkpoints_evicted = (scheduler.tree.num_checkpoints,
                                                                          scheduler.tree.checkpoints_evicted)
        if cache.windows is not None:
            self.window_blocks_total, self.window_blocks_free = cache.windows.pool.num_blocks, cache.windows.pool.num_free
            self.window_blocks_evicted = cache.windows.evicted

    @property
    def hit_rate(self) -> float:
        """Cached / prompt tokens of the requests admitted so far (0 before any)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def add_counters(self, other: EngineStats) -> None:
        """Add `other`'s counters (not its gauges) to these: a replica that is gone still counts."""
        for f in fields(self):
            if f.name not in GAUGES:
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def to_dict(self) -> dict[str, Any]:
        """Plain types only (counters as dicts), for a process that may not have radixserve."""
        return {f.name: dict(v) if isinstance(v := getattr(self, f.name), Counter) else v for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineStats:
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {k: Counter(v) if isinstance(v, dict) else v for k, v in d.items() if k in known}
        return cls(**values)

    @classmethod
    def merged(cls, parts: Sequence[EngineStats]) -> EngineStats:
        """Several engines' statistics as one (replicas behind one endpoint): every count and gauge
        summed, the new-token ratio averaged."""
        total = cls()
        for f in fields(cls):
            values = [getattr(p, f.name) for p in parts]
            if f.name == "new_token_ratio":
                setattr(total, f.name, sum(values) / len(values) if values else 0.0)
            elif isinstance(getattr(total, f.name), Counter):
                setattr(total, f.name, sum(values, Counter()))
            else:
                setattr(total, f.name, sum(values, type(getattr(total, f.name))()))
        return total

    def add_host_tier(self, tree: TreeStats, host: HostKVCache) -> None:
        """The host tier's pool and the copies to and from it (in blocks, bytes and device time)."""
        self.host_blocks_total, self.host_blocks_free = tree.host_blocks_total, tree.host_blocks_free
        self.written_back_blocks, self.loaded_blocks = tree.written_back_blocks, tree.loaded_blocks
        self.host_dropped_blocks = tree.host_dropped_blocks
        done = host.completed()
        self.written_back_bytes = tree.written_back_blocks * host.bytes_per_block
        self.loaded_bytes = tree.loaded_blocks * host.bytes_per_block
        self.write_back_s = done.seconds.get(CopyKind.TO_HOST, 0.0)
        self.load_s = done.seconds.get(CopyKind.TO_DEVICE, 0.0)

    def add_constraints(self, compiles: CompileStats, book: ConstraintStats) -> None:
        self.constrained_requests, self.forced_tokens, self.grammar_dead_ends = \
            book.requests, book.forced_tokens, book.dead_ends
        self.mask_steps, self.mask_rows, self.mask_s = book.mask_steps, book.mask_rows, book.mask_s
        self.set_compiles(compiles)

    def set_compiles(self, compiles: CompileStats) -> None:
        self.grammar_compiles, self.grammar_cache_hits = compiles.compiles, compiles.cache_hits
        self.grammar_compile_failures, self.grammar_compile_s = compiles.failures, compiles.compile_s_total

    def with_compiles(self, compiles: CompileStats) -> EngineStats:
        """A copy with these compile figures: the ones of the compiler that checks requests, live (a
        refused constraint never reaches a step, so a published snapshot would miss it)."""
        copy = replace(self)
        copy.set_compiles(compiles)
        return copy

    def count_verified(self, verified: Verified) -> None:
        self.spec_proposed.update(verified.proposed)
        self.spec_accepted.update(verified.accepted)
        self.spec_verify_draws += verified.draws

    def count_finished(self, req: Request) -> None:
        self.requests_finished[req.sequences[0].finish_reason or "abort"] += 1
        self.cached_tokens += req.cached_tokens
        self.cache_hit_requests += int(req.cached_tokens > 0)
        self.host_cached_tokens += req.host_cached_tokens
        self.pinned_cached_tokens += req.pinned_cached_tokens
        self.pin_hit_requests += int(req.pinned_cached_tokens > 0)
