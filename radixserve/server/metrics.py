"""Prometheus metrics and the cache statistics the UI shows, on a per-app CollectorRegistry.

Token and request counters are the engine's own cumulative totals (engine.stats()), exposed by a
custom collector at scrape time, so they are monotonic and hit rates derive from counters only.
Latency histograms are observed here, once per finished request (inter-token latency once per
token); the step histograms (time, tokens, batch-slot and token-budget utilization) once per engine
step, from the steps the engine recorded, taken in on the event loop (ServerState.observe_steps): no
server code runs on the engine thread. The admission-blocked and preemption counters are labelled by cause,
every known cause always present; so are the reasons of the connection and generation refusals
(connections.py, admission.py). The families of one engine feature each (structured output, the
host tier, speculative decoding) are feature_metrics.py's. System prompts are keyed by a hash of their token IDs;
`SystemPromptTracker` keeps exact per-prompt counters for the JSON table and bounded, monotonic label
sets for Prometheus: a prompt gets its own label value on its first request while fewer than `labels`
prompts have one, and keeps it (labels are never taken back, so its first request counts under its
label too); every other request counts under "other", requests without a system prompt under "none".
A request "hit" when its cached tokens cover its whole system prompt (for "none": the template's own
preamble, e.g. SmolLM2's default system prompt).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from radixserve.core import StepInfo
from radixserve.engine.stats import by_cause
from radixserve.server.cache_stats import StepUtilization
from radixserve.server.feature_metrics import constraint_metrics, counter, host_tier_metrics, speculation_metrics

NONE_KEY, OTHER_KEY = "none", "other"
UTILIZATION_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
MAX_TRACKED = 4096  # exact per-prompt rows kept for the JSON table


@dataclass
class PromptCounts:
    requests: int = 0
    hit_requests: int = 0  # the whole system prompt came from the cache
    cached_tokens: int = 0
    computed_tokens: int = 0

    def add(self, hit: bool, prompt_tokens: int, cached_tokens: int) -> None:
        self.requests += 1
        self.hit_requests += int(hit)
        self.cached_tokens += cached_tokens
        self.computed_tokens += prompt_tokens - cached_tokens

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "hit_rate": self.hit_requests / self.requests if self.requests else 0.0}


class SystemPromptTracker:
    def __init__(self, labels: int, max_tracked: int = MAX_TRACKED) -> None:
        self.labels, self.max_tracked = labels, max_tracked
        self.exact: dict[str, PromptCounts] = {}
        self.previews: dict[str, str] = {NONE_KEY: "(no system prompt)", OTHER_KEY: "(other system prompts)"}
        self.labelled: dict[str, PromptCounts] = {NONE_KEY: PromptCounts(), OTHER_KEY: PromptCounts()}
        self.total = PromptCounts()
        self.untracked = PromptCounts()  # exact rows dropped to stay within max_tracked

    def record(self, key: str, preview: str, system_len: int, prompt_tokens: int, cached_tokens: int) -> None:
        hit = cached_tokens >= system_len > 0
        self.total.add(hit, prompt_tokens, cached_tokens)
        if key not in self.exact and len(self.exact) >= self.max_tracked:
            self._drop_smallest()
        row = self.exact.setdefault(key, PromptCounts())
        row.add(hit, prompt_tokens, cached_tokens)
        self.previews.setdefault(key, preview)
        label = self._label_for(key)
        self.labelled.setdefault(label, PromptCounts()).add(hit, prompt_tokens, cached_tokens)

    def _label_for(self, key: str) -> str:
        # A label is decided on a prompt's first request, so that request counts under it too: moving
        # it out of "other" later would make "other" go down, which a Prometheus counter must not.
        if key in self.labelled or len(self.labelled) - 2 < self.labels:
            return key
        return OTHER_KEY

    def _drop_smallest(self) -> None:
        victim = min((k for k in self.exact if k not in self.labelled), key=lambda k: self.exact[k].requests,
                     default=None)
        if victim is not None:
            c = self.exact.pop(victim)
            self.previews.pop(victim, None)
            for f in ("requests", "hit_requests", "cached_tokens", "computed_tokens"):
                setattr(self.untracked, f, getattr(self.untracked, f) + getattr(c, f))

    def table(self, top: int) -> list[dict[str, Any]]:
        """The `top` busiest system prompts by request count, then "other" for the rest."""
        ranked = sorted(self.exact.items(), key=lambda kv: kv[1].requests, reverse=True)
        shown, rest = ranked[:top], PromptCounts(**asdict(self.untracked))
        for _, c in ranked[top:]:
            for f in ("requests", "hit_requests", "cached_tokens", "computed_tokens"):
                setattr(rest, f, getattr(rest, f) + getattr(c, f))
        rows = [{"id": k, "preview": self.previews.get(k, ""), **c.to_json()} for k, c in shown]
        if rest.requests:
            rows.append({"id": OTHER_KEY, "preview": self.previews[OTHER_KEY], **rest.to_json()})
        return rows


class ServerMetrics:
    """Histograms and server-side counters, plus the collectors that read engine and session state."""

    def __init__(self, system_prompt_labels: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.system_prompts = SystemPromptTracker(system_prompt_labels)
        self.by_replica: dict[str, SystemPromptTracker] = {}  # the same, per engine replica (scaleout/)
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
            tracker = self.by_replica[replica] = SystemPromptTracker(self.system_prompts.labels)
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
        self.registry.register(_ServerStateCollector(self.system_prompts, sessions, refusals))


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
    def __init__(self, tracker: SystemPromptTracker, sessions: Callable[[], Any | None],
                 refusals: Callable[[], dict[str, dict[str, int]]]) -> None:
        self.tracker, self.sessions, self.refusals = tracker, sessions, refusals

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        fams = {
            "requests": CounterMetricFamily("radixserve_system_prompt_requests",
                                            "Requests per system prompt", labels=["system_prompt"]),
            "hit_requests": CounterMetricFamily("radixserve_system_prompt_hit_requests",
                                                "Requests whose whole system prompt was cached",
                                                labels=["system_prompt"]),
            "cached_tokens": CounterMetricFamily("radixserve_system_prompt_cached_tokens",
                                                 "Cached prompt tokens of requests per system prompt",
                                                 labels=["system_prompt"]),
            "computed_tokens": CounterMetricFamily("radixserve_system_prompt_computed_tokens",
                                                   "Computed prompt tokens of requests per system prompt",
                                                   labels=["system_prompt"]),
        }
        info = InfoMetricFamily("radixserve_system_prompt", "Preview of each labelled system prompt",
                                labels=["system_prompt"])
        for key, counts in list(self.tracker.labelled.items()):
            for field_name, fam in fams.items():
                fam.add_metric([key], getattr(counts, field_name))
            info.add_metric([key], {"preview": self.tracker.previews.get(key, "")[:60]})
        yield from fams.values()
        yield info
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
