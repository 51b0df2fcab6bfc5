"""Prometheus metrics and the cache statistics the UI shows, on a per-app CollectorRegistry.

Token and request counters are the engine's own cumulative totals (engine.stats()), exposed by a
custom collector at scrape time, so they are monotonic and hit rates derive from counters only.
Latency histograms are observed here, once per finished request (inter-token latency once per
token); the step histograms (time, tokens, batch-slot and token-budget utilization) once per engine
step, from the steps the engine recorded, taken in on the event loop (ServerState.observe_steps): no
server code runs on the engine thread. The admission-blocked and preemption counters are labelled by cause,
every known cause always present; so are the reasons of the connection and generation refusals
(connections.py, admission.py). The families of one engine feature each (structured output, the
host tier, speculative decoding) are feature_metrics.py's. The per-tenant figures and system-prompt
tables (tenant_stats.py, system_prompts.py) are not in the registry: what a scrape shows of them
depends on its caller (app.metrics adds a TenantCollector for it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from radixserve.core import StepInfo
from radixserve.engine.stats import by_cause
from radixserve.server.cache_stats import StepUtilization
from radixserve.server.feature_metrics import constraint_metrics, counter, host_tier_metrics, speculation_metrics
from radixserve.server.system_prompts import SystemPromptTracker
from radixserve.server.tenant_stats import TenantStats

UTILIZATION_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class ServerMetrics:
    """Histograms and server-side counters, plus the collectors that read engine and session state."""

    def __init__(self, system_prompt_labels: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.system_prompt_labels = system_prompt_labels
        self.tenants = TenantStats(system_prompt_labels)  # per tenant: its figures and system-prompt table
        self.by_replica: dict[str, SystemPromptTracker] = {}  # system prompts per engine replica (scaleout/)
        r = self.registry
        self.ttft = Histogram("radixserve_time_to_first_token_seconds", "Arrival to first generated token", registry=r,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.itl = Histogram("radixserve_inter_token_latency_seconds", "Time between generated tokens", registry=r,
                             buckets=(0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5))
        self.e2e = Histogram("radixserve_e2e_request_latency_seconds", "Arrival to finish", registry=r,
                             buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600))
        self.queue = Histogram("radixserve_request_queue_time_seconds", "Arrival to first scheduled", registry=r,
                               buckets=(0.001, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.api_errors = Counter("radixserve_api_errors", "Requests and frames rejected, by error code",
                                  ["code"], registry=r)
        self.server_requests = Counter("radixserve_server_requests", "Generations finished, by API and reason",
                                       ["api", "finish_reason"], registry=r)
        self.step_time = Histogram("radixserve_step_seconds", "Engine step wall time (schedule, forward, sample)",
                                   registry=r, buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                                        1, 2.5, 5, 10))
        self.step_tokens = Histogram("radixserve_step_tokens", "Tokens computed per engine step (decodes + "
                                     "prefill chunks)", registry=r,
                                     buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096))
        self.step_slots = Histogram("radixserve_step_batch_slot_utilization", "Sequences scheduled per step / "
                                    "max_num_seqs", registry=r, buckets=UTILIZATION_BUCKETS)
        self.step_budget = Histogram("radixserve_step_token_budget_utilization", "Tokens computed per step / "
                                     "max_num_batched_tokens", registry=r, buckets=UTILIZATION_BUCKETS)
        self.step_utilization = StepUtilization()
        self.ws_slow_client_disconnects = Counter(
            "radixserve_websocket_slow_client_disconnects", "WebSockets closed because the client stopped "
            "reading and its send buffer filled up", registry=r)

    def replica_prompts(self, replica: str) -> SystemPromptTracker:
        tracker = self.by_replica.get(replica)
        if tracker is None:
            tracker = self.by_replica[replica] = SystemPromptTracker(self.system_prompt_labels)
        return tracker

    def observe_step(self, step: StepInfo) -> None:
        """One engine step, on the event loop (ServerState.observe_steps)."""
        self.step_time.observe(step.duration_s)
        self.step_tokens.observe(step.prefill_tokens + step.decode_tokens)
        self.step_slots.observe(step.slot_utilization)
        self.step_budget.observe(step.token_budget_utilization)
        self.step_utilization.add(step.slot_utilization, step.token_budget_utilization)

    def attach(self, engine_stats: Callable[[], Any | None], sessions: Callable[[], Any | None],
               refusals: Callable[[], dict[str, dict[str, int]]]) -> None:
        self.registry.register(_EngineCollector(engine_stats))
        self.registry.register(_ServerStateCollector(sessions, refusals))


class _EngineCollector(Collector):
    def __init__(self, engine_stats: Callable[[], Any | None]) -> None:
        self.engine_stats = engine_stats

    def describe(self) -> list[Metric]:
        return []  # collected lazily: the engine may still be loading

    def collect(self) -> Iterator[Metric]:
        st = self.engine_stats()
        if st is None:
            return
        yield counter("radixserve_prompt_tokens", "Prompt tokens of admitted requests", st.prompt_tokens)
        yield counter("radixserve_prompt_tokens_cached", "Prompt tokens served from the prefix cache",
                      st.cached_tokens)
        yield counter("radixserve_prompt_tokens_computed", "Prompt tokens computed (prefilled)", st.computed_tokens)
        yield counter("radixserve_generation_tokens", "Generated tokens", st.generation_tokens)
        yield counter("radixserve_cache_hit_requests", "Requests with a prefix-cache hit", st.cache_hit_requests)
        yield counter("radixserve_cache_evictions", "Radix-cache evictions", st.evictions)
        yield counter("radixserve_preemptions", "Requests preempted to free KV blocks", st.preemptions)
        yield counter("radixserve_state_recomputed_tokens", "Hybrid models: cached prompt tokens recomputed because no "
                      "recurrent-state checkpoint was at the match's end", st.state_recomputed_tokens)
        yield counter("radixserve_state_checkpoints_taken", "Hybrid models: recurrent-state checkpoints taken",
                      st.state_checkpoints_taken)
        yield counter("radixserve_state_checkpoints_evicted", "Hybrid models: checkpoints dropped to free a state slot",
                      st.state_checkpoints_evicted)
        yield counter("radixserve_stalled_steps", "Steps that scheduled nothing while work waited (a bug if > 0)",
                      st.stalled_steps)
        yield from constraint_metrics(st)
        fin = CounterMetricFamily("radixserve_requests_finished", "Finished requests by reason",
                                  labels=["finish_reason"])
        for reason in sorted(set(st.requests_finished) | {"stop", "length", "abort", "error"}):
            fin.add_metric([reason], st.requests_finished.get(reason, 0))
        yield fin
        for name, doc, counts in (
                ("radixserve_admission_blocked", "Steps whose admission stopped, by cause", st.admission_blocked),
                ("radixserve_preemptions_by_cause", "Requests preempted, by cause", st.preemptions_by_cause)):
            fam = CounterMetricFamily(name, doc, labels=["cause"])
            for cause, n in by_cause(counts).items():
                fam.add_metric([cause], n)
            yield fam
        blocks = GaugeMetricFamily("radixserve_kv_blocks", "KV blocks by state", labels=["state"])
        for state in ("used", "cached", "free"):
            blocks.add_metric([state], getattr(st, f"blocks_{state}"))
        yield blocks
        yield GaugeMetricFamily("radixserve_kv_blocks_total", "KV blocks in the pool", value=st.blocks_total)
        yield GaugeMetricFamily("radixserve_pins", "Pinned prefixes", value=st.pins)
        yield GaugeMetricFamily("radixserve_pinned_blocks", "KV blocks pinned prefixes hold", value=st.pinned_blocks)
        yield GaugeMetricFamily("radixserve_pin_budget_blocks", "KV blocks pinned prefixes may hold at most",
                                value=st.pin_budget_blocks)
        yield counter("radixserve_prompt_tokens_cached_pinned", "Prompt tokens served from pinned prefixes",
                      st.pinned_cached_tokens)
        yield counter("radixserve_pin_hit_requests", "Requests that read a pinned prefix", st.pin_hit_requests)
        yield GaugeMetricFamily("radixserve_admission_new_token_ratio",
                                "Output-aware admission: expected fraction of max_tokens still to generate",
                                value=st.new_token_ratio)
        yield GaugeMetricFamily("radixserve_admission_growth_reserve_blocks",
                                "Blocks admission kept free for running requests' expected growth",
                                value=st.growth_reserve_blocks)
        yield GaugeMetricFamily("radixserve_requests_running", "Requests running", value=st.num_running)
        yield GaugeMetricFamily("radixserve_requests_waiting", "Requests waiting", value=st.num_waiting)
        yield GaugeMetricFamily("radixserve_radix_tree_nodes", "Radix-tree nodes", value=st.tree_nodes)
        yield GaugeMetricFamily("radixserve_radix_tree_tokens", "Tokens held by the radix tree", value=st.tree_tokens)
        yield from host_tier_metrics(st)
        yield from speculation_metrics(st)


class _ServerStateCollector(Collector):
    def __init__(self, sessions: Callable[[], Any | None], refusals: Callable[[], dict[str, dict[str, int]]]) -> None:
        self.sessions, self.refusals = sessions, refusals

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        store = self.sessions()
        if store is not None:
            yield GaugeMetricFamily("radixserve_sessions", "Chat sessions and stored responses held", value=len(store))
            yield counter("radixserve_sessions_evicted", "Sessions evicted at the cap", store.evicted)
            yield counter("radixserve_sessions_expired", "Sessions expired after idling", store.expired)
        refused = self.refusals()
        for kind, helptext in (("connections", "Connections refused at the cap, closed to make room or timed out"),
                               ("generations", "Generations refused at the per-client or server-wide cap")):
            fam = CounterMetricFamily(f"radixserve_{kind}_refused", helptext, labels=["reason"])
            for reason, count in refused.get(kind, {}).items():
                fam.add_metric([reason], count)
            yield fam
