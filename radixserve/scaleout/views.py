"""What the ingress shows of its replicas: the `replicas` and `routing` parts of GET /v1/cache/stats
and the per-replica Prometheus series; the totals are the server's usual figures over the merged
statistics (ClusterEngine.stats).

Per replica: hit rate, tokens, blocks, running/waiting, requests routed and in flight, and the
per-system-prompt rows the ingress recorded for requests that replica served.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from radixserve.scaleout.cluster_engine import ClusterEngine
from radixserve.scaleout.routing import REASONS
from radixserve.server.metrics import ServerMetrics

SYSTEM_PROMPT_ROWS = 10


def cluster_json(engine: ClusterEngine, metrics: ServerMetrics, router: str) -> dict[str, Any]:
    stats = engine.replica_stats()
    with engine.table.lock:
        routed, loads = dict(engine.table.routed), dict(engine.table.loads)
        decisions = {r: engine.table.decisions.get(r, 0) for r in REASONS}
        cached = {name: (index.prefixes, index.tokens) for name, index in engine.table.indexes.items()}
        resyncs = {name: rep.resyncs for name, rep in engine.table.reports.items()}
    replicas = []
    for name, st in stats.items():
        prompts = metrics.by_replica.get(name)
        replicas.append({
            "replica": name, "hit_rate": st.hit_rate, "prompt_tokens": st.prompt_tokens,
            "cached_tokens": st.cached_tokens, "requests": sum(st.requests_finished.values()),
            "blocks": {"total": st.blocks_total, "free": st.blocks_free, "used": st.blocks_used,
                       "cached": st.blocks_cached},
            "running": st.num_running, "waiting": st.num_waiting,
            "routed": routed.get(name, 0), "in_flight": loads.get(name, 0),
            "router_view": {"prefixes": cached.get(name, (0, 0))[0], "tokens": cached.get(name, (0, 0))[1],
                            "resyncs": resyncs.get(name, 0)},
            "system_prompts": prompts.table(SYSTEM_PROMPT_ROWS) if prompts is not None else [],
        })
    return {"replicas": replicas, "routing": {"router": router, "decisions": decisions}}


class ReplicaCollector(Collector):
    """`radixserve_replica_*{replica=...}` series and `radixserve_routing_decisions{reason=...}`."""

    def __init__(self, engine: Callable[[], ClusterEngine | None], metrics: ServerMetrics) -> None:
        self.engine, self.metrics = engine, metrics

    def describe(self) -> list[Metric]:
        return []  # collected lazily: the replicas may still be starting

    def collect(self) -> Iterator[Metric]:
        engine = self.engine()
        if engine is None:
            return
        stats = engine.replica_stats()
        with engine.table.lock:
            decisions = {r: engine.table.decisions.get(r, 0) for r in REASONS}
            routed = dict(engine.table.routed)
        fam = CounterMetricFamily("radixserve_routing_decisions", "Requests routed, by the reason their replica "
                                  "was chosen", labels=["reason"])
        for reason, n in decisions.items():
            fam.add_metric([reason], n)
        yield fam
        counters = {name: CounterMetricFamily(f"radixserve_replica_{name}", doc, labels=["replica"]) for name, doc in (
            ("prompt_tokens", "Prompt tokens of requests a replica admitted"),
            ("prompt_tokens_cached", "Prompt tokens a replica served from its prefix cache"),
            ("routed_requests", "Requests the router sent to a replica"))}
        gauges = {name: GaugeMetricFamily(f"radixserve_replica_{name}", doc, labels=["replica"]) for name, doc in (
            ("hit_rate", "Cached / prompt tokens on a replica"),
            ("requests_running", "Requests running on a replica"),
            ("requests_waiting", "Requests waiting on a replica"),
            ("kv_blocks_total", "KV blocks in a replica's pool"),
            ("kv_blocks_free", "Free KV blocks on a replica"))}
        for replica, st in stats.items():
            counters["prompt_tokens"].add_metric([replica], st.prompt_tokens)
            counters["prompt_tokens_cached"].add_metric([replica], st.cached_tokens)
            counters["routed_requests"].add_metric([replica], routed.get(replica, 0))
            for name, value in (("hit_rate", st.hit_rate), ("requests_running", st.num_running),
                                ("requests_waiting", st.num_waiting), ("kv_blocks_total", st.blocks_total),
                                ("kv_blocks_free", st.blocks_free)):
                gauges[name].add_metric([replica], value)
        yield from counters.values()
        yield from gauges.values()
        prompts = CounterMetricFamily("radixserve_replica_system_prompt_requests", "Requests per replica and "
                                      "system prompt, and whether the whole system prompt was cached",
                                      labels=["replica", "system_prompt", "hit"])
        for replica, tracker in sorted(self.metrics.by_replica.items()):
            for label, counts in sorted(tracker.labelled.items()):
                prompts.add_metric([replica, label, "true"], counts.hit_requests)
                prompts.add_metric([replica, label, "false"], counts.requests - counts.hit_requests)
        yield prompts
