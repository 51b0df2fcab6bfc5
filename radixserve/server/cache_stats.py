"""The JSON body of GET /v1/cache/stats: the engine's cache figures, the host-memory tier's and the
per-system-prompt table, shaped for the web UI's dashboard (docs/protocol.md, "Cache and health").

A pure function of an `EngineStats`, so its shape is tested without a server. Every key is present
whether or not the host tier is on (`host.enabled` says which; its figures are then 0), so clients
never have to probe for keys: the cause counters list every known cause (0 until seen), `steps`
is all zeros before the first step, and `speculation` lists every draft source (0 until drafted,
and all 0 with speculation off).

What a `user` key sees (`tenant_cache_stats_json`) has the same keys: its own tenant's request, token
and hit figures where the engine's totals stand, the pool's and the host tier's capacity, and 0 for
every figure that reflects other tenants' traffic (blocks in use, the tree, evictions, preemptions,
the host tier's contents and copies, steps, structured output, speculation, running and waiting).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from radixserve.core import DRAFT_SOURCES
from radixserve.engine.stats import EngineStats, by_cause
from radixserve.server.tenant_stats import TenantUsage


@dataclass
class StepUtilization:
    """Batch-slot and token-budget utilization over the engine's steps (ServerMetrics.observe_step)."""

    steps: int = 0
    slot_sum: float = 0.0
    budget_sum: float = 0.0
    last_slot: float = 0.0
    last_budget: float = 0.0

    def add(self, slot: float, budget: float) -> None:
        self.steps += 1
        self.slot_sum += slot
        self.budget_sum += budget
        self.last_slot, self.last_budget = slot, budget

    def to_json(self) -> dict[str, Any]:
        return {"count": self.steps,
                "mean_slot_utilization": self.slot_sum / self.steps if self.steps else 0.0,
                "mean_token_budget_utilization": self.budget_sum / self.steps if self.steps else 0.0,
                "last_slot_utilization": self.last_slot, "last_token_budget_utilization": self.last_budget}


def _ratio(num: float, den: int) -> float:
    return num / den if den else 0.0


def host_json(st: EngineStats) -> dict[str, Any]:
    """The `host` object: the host-memory tier's pool, what it holds and the copies to and from it."""
    return {
        # sized from --host-cache-mb at start, and never to 0 blocks while on (that is refused)
        "enabled": st.host_blocks_total > 0,
        "blocks": {"total": st.host_blocks_total, "free": st.host_blocks_free,
                   "used": st.host_blocks_total - st.host_blocks_free},
        "nodes": st.host_nodes, "tokens": st.host_tokens, "hit_tokens": st.host_cached_tokens,
        "write_back": {"blocks": st.written_back_blocks, "bytes": st.written_back_bytes, "seconds": st.write_back_s},
        "load_back": {"blocks": st.loaded_blocks, "bytes": st.loaded_bytes, "seconds": st.load_s},
        "dropped_blocks": st.host_dropped_blocks,
    }


def structured_json(st: EngineStats) -> dict[str, Any]:
    """Constrained requests, grammar compiles and cache hits, mask time per masked step, forced tokens."""
    return {
        "constrained_requests": st.constrained_requests,
        "compiles": st.grammar_compiles, "compile_cache_hits": st.grammar_cache_hits,
        "compile_failures": st.grammar_compile_failures,
        "compile_ms_mean": _ratio(st.grammar_compile_s * 1000.0, st.grammar_compiles),
        "mask_steps": st.mask_steps, "mask_ms_per_step": _ratio(st.mask_s * 1000.0, st.mask_steps),
        "forced_tokens": st.forced_tokens, "dead_ends": st.grammar_dead_ends,
    }


def speculation_stats_json(st: EngineStats) -> dict[str, Any]:
    """The `speculation` object: draft tokens proposed and accepted per source (every source of
    core.DRAFT_SOURCES, 0 until drafted), draws that verified drafts and that committed tokens, and
    tokens per step (generated tokens per sequence per step since start; 0 before the first)."""
    sources = [*DRAFT_SOURCES, *sorted((set(st.spec_proposed) | set(st.spec_accepted)) - set(DRAFT_SOURCES))]
    by_source = {s: {"proposed": st.spec_proposed.get(s, 0), "accepted": st.spec_accepted.get(s, 0),
                     "acceptance": _ratio(st.spec_accepted.get(s, 0), st.spec_proposed.get(s, 0))} for s in sources}
    proposed, accepted = sum(st.spec_proposed.values()), sum(st.spec_accepted.values())
    return {"proposed": proposed, "accepted": accepted, "acceptance": _ratio(accepted, proposed),
            "by_source": by_source, "verify_draws": st.spec_verify_draws, "committed_draws": st.committed_draws,
            "tokens_per_step": st.tokens_per_draw}


def cache_stats_json(st: EngineStats, block_size: int, sessions: int, system_prompts: list[dict[str, Any]],
                     steps: dict[str, Any] | None = None) -> dict[str, Any]:
    """`steps`: the batch-utilization summary of the engine's steps (StepUtilization.to_json)."""
    requests = sum(st.requests_finished.values())
    return {
        "hit_rate": st.hit_rate,
        "prompt_tokens": st.prompt_tokens, "cached_tokens": st.cached_tokens,
        "host_cached_tokens": st.host_cached_tokens, "computed_tokens": st.computed_tokens,
        "generation_tokens": st.generation_tokens, "requests": requests, "hit_requests": st.cache_hit_requests,
        "request_hit_rate": _ratio(st.cache_hit_requests, requests),
        "blocks": {"total": st.blocks_total, "free": st.blocks_free, "used": st.blocks_used,
                   "cached": st.blocks_cached, "block_size": block_size},
        "tree": {"nodes": st.tree_nodes, "tokens": st.tree_tokens},
        "evictions": st.evictions, "evicted_blocks": st.evicted_blocks, "preemptions": st.preemptions,
        "swaps": {"out": st.swaps_out, "in": st.swaps_in},
        # hybrid models (docs/hybrid_cache.md): recurrent-state slots and the tree's checkpoints of them
        "states": {"slots": st.state_slots_total, "free": st.state_slots_free, "checkpoints": st.state_checkpoints,
                   "recomputed_tokens": st.state_recomputed_tokens, "checkpoints_taken": st.state_checkpoints_taken,
                   "checkpoints_evicted": st.state_checkpoints_evicted,
                   # --sliding-window-kv window-blocks: the sliding layers' K/V of cached blocks
                   "window_blocks": {"total": st.window_blocks_total, "free": st.window_blocks_free,
                                     "evicted": st.window_blocks_evicted}},
        "admission_blocked": by_cause(st.admission_blocked), "preemptions_by_cause": by_cause(st.preemptions_by_cause),
        "admission": {"new_token_ratio": st.new_token_ratio, "growth_reserve_blocks": st.growth_reserve_blocks},
        "steps": steps if steps is not None else StepUtilization().to_json(),
        "host": host_json(st),
        "structured_output": structured_json(st),
        "speculation": speculation_stats_json(st),
        # pinned prefixes (docs/pins.md): what they hold, and their hits counted apart from the LRU cache's
        "pins": {"count": st.pins, "blocks": st.pinned_blocks, "budget_blocks": st.pin_budget_blocks,
                 "cached_tokens": st.pinned_cached_tokens, "hit_requests": st.pin_hit_requests},
        "running": st.num_running, "waiting": st.num_waiting, "sessions": sessions,
        "system_prompts": system_prompts,
    }


def tenant_cache_stats_json(st: EngineStats, block_size: int, usage: TenantUsage, sessions: int,
                            system_prompts: list[dict[str, Any]]) -> dict[str, Any]:
    """The body a `user` key sees: cache_stats_json's keys over its tenant's own figures (see above)."""
    own = EngineStats(blocks_total=st.blocks_total, host_blocks_total=st.host_blocks_total,
                      state_slots_total=st.state_slots_total,
                      pin_budget_blocks=st.pin_budget_blocks,
                      prompt_tokens=usage.prompt_tokens, cached_tokens=usage.cached_tokens,
                      host_cached_tokens=usage.host_cached_tokens, computed_tokens=usage.computed_tokens,
                      generation_tokens=usage.generation_tokens, cache_hit_requests=usage.hit_requests,
                      requests_finished=Counter({"stop": usage.requests}))
    body = cache_stats_json(own, block_size, sessions, system_prompts)
    body["host"]["blocks"]["free"] = body["host"]["blocks"]["used"] = 0  # how full it is: others' traffic
    return body

