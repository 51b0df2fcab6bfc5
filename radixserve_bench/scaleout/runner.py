"""Runs the scale-out scenario: every repeat runs every workload on every system, each run on a fresh
local Ray Serve application (radixserve.scaleout.bench_cluster: a cold cluster, nothing cached, no
warm-up request, which would be cached on one replica and bias the routing), then folds the repeats
into medians in the bench's results shape (`results.<workload>.<system>.median/repeats`, checked by
metrics.check_complete) and adds the routing micro-benchmark, the environment and the targets.

Per run: the totals of GET /v1/cache/stats once every replica reported the run (hit rate = cached /
prompt tokens), the same from the responses' usage (a cross-check), throughput over the makespan,
requests per replica and the router's decisions.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any

import httpx

from radixserve.config import EngineConfig
from radixserve.scaleout.routing import REASONS
from radixserve_bench import results as results_mod
from radixserve_bench.flags import BenchConfigError
from radixserve_bench.harness import model_facts, progress_bar
from radixserve_bench.metrics import fold_repeats
from radixserve_bench.scaleout import SCENARIO
from radixserve_bench.scaleout.client import ChatRun, drive_chat, model_name, settled_stats
from radixserve_bench.scaleout.plan import (
    ChatWorkload,
    ScaleOutOptions,
    Sizing,
    SystemSpec,
    build_chat_workload,
    chat_trace,
    size_pool,
    system_specs,
    workload_params,
)
from radixserve_bench.scaleout.report import evaluate_targets, hit_rate_ratios
from radixserve_bench.scaleout.routing_micro import run_routing_micro

RUN_METRICS = ("requests", "duration_s", "requests_per_s", "output_tokens_per_s", "total_tokens_per_s",
               "prompt_tokens", "cached_tokens", "hit_rate", "client_hit_rate", "max_replica_share",
               "evicted_blocks", "preemptions", *(f"decisions_{r}" for r in REASONS))


def run_metrics(run: ChatRun, stats: dict[str, Any]) -> dict[str, float]:
    """The figures of one run from its records and the cluster's settled statistics."""
    prompt = sum(r.prompt_tokens for r in run.records)
    output = sum(r.completion_tokens for r in run.records)
    replicas = [rep["requests"] for rep in stats.get("replicas", [])]
    decisions = stats.get("routing", {}).get("decisions", {})
    m = {"requests": float(len(run.records)), "duration_s": run.duration_s,
         "requests_per_s": len(run.records) / run.duration_s, "output_tokens_per_s": output / run.duration_s,
         "total_tokens_per_s": (prompt + output) / run.duration_s,
         "prompt_tokens": float(stats["prompt_tokens"]), "cached_tokens": float(stats["cached_tokens"]),
         "hit_rate": stats["cached_tokens"] / stats["prompt_tokens"] if stats["prompt_tokens"] else 0.0,
         "client_hit_rate": sum(r.cached_tokens for r in run.records) / prompt if prompt else 0.0,
         "max_replica_share": max(replicas) / sum(replicas) if sum(replicas) else 0.0,
         "evicted_blocks": float(stats.get("evicted_blocks", 0)), "preemptions": float(stats.get("preemptions", 0))}
    return m | {f"decisions_{r}": float(decisions.get(r, 0)) for r in REASONS}


def run_detail(run: ChatRun, stats: dict[str, Any], settled: bool) -> dict[str, Any]:
    keep = ("replica", "hit_rate", "prompt_tokens", "cached_tokens", "requests", "routed", "blocks", "router_view")
    return {"stats_settled": settled,
            "replicas": [{k: rep.get(k) for k in keep} for rep in stats.get("replicas", [])],
            "decisions": stats.get("routing", {}).get("decisions", {}),
            "requests": [{"session": r.session_id, "turn": r.turn, "replica": r.replica, "prompt_tokens": r.prompt_tokens,
                          "cached_tokens": r.cached_tokens, "completion_tokens": r.completion_tokens,
                          "send_s": round(r.send_s, 4), "e2e_ms": round(1000 * r.e2e_s, 1)} for r in run.records]}


async def measure(url: str, w: ChatWorkload, timeout_s: float,
                  on_record: Callable[[Any], None] | None = None) -> tuple[ChatRun, dict[str, Any], bool]:
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s) as client:
        run = await drive_chat(client, w, await model_name(client), timeout_s, on_record)
        stats, settled = await settled_stats(client, w.num_requests)
    return run, stats, settled


def _engine_config(o: ScaleOutOptions, model_dir: str, spec: SystemSpec) -> EngineConfig:
    return EngineConfig(model=model_dir, num_blocks=spec.blocks_per_replica, block_size=o.block_size,
                        device=o.device, dtype=o.dtype, seed=o.seed)


def _prepare(o: ScaleOutOptions) -> tuple[tuple[str, str], Any, list[ChatWorkload], dict[str, Sizing]]:
    from radixserve.chat.template import ChatFormatter

    model_dir, display_name, spec, tokenizer = model_facts(o.model)
    if tokenizer is None:
        raise BenchConfigError(f"the model in {model_dir} has no tokenizer: the chat endpoint needs one")
    formatter = ChatFormatter(tokenizer)

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids))

    workloads, sizing = [], {}
    for name in o.workloads:
        w = build_chat_workload(name, workload_params(name, o), encode, decode, o.seed, o.concurrency)
        trace = chat_trace(w, formatter.prompt_tokens, encode, decode, o.seed)
        longest = max(len(r.sequence) for r in trace)
        if longest > spec.max_position_embeddings:
            raise BenchConfigError(f"{name}: a conversation reaches ~{longest} tokens, over the model's context")
        workloads.append(w)
        sizing[name] = size_pool(trace, o.block_size, o.replicas, o.pool_fraction, o.pool_blocks)
    return (model_dir, display_name), spec, workloads, sizing


def run_clusters(o: ScaleOutOptions, results: dict[str, Any]) -> tuple[tuple[str, str], Any]:
    """Fills results' workloads, systems, planned_systems and results; returns the model (dir, name)
    and its spec."""
    from radixserve.scaleout import RAY_EXTRA_HINT, ray_available

    if not ray_available():
        raise BenchConfigError(f"the scale-out runs need Ray Serve, an optional extra: {RAY_EXTRA_HINT} "
                               "(--no-cluster runs the routing micro-benchmark alone)")
    from radixserve.scaleout.bench_cluster import local_cluster
    from radixserve.scaleout.config import ClusterConfig

    model, spec, workloads, sizing = _prepare(o)
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    bar = progress_bar(sum(w.num_requests for w in workloads) * len(o.systems) * o.repeats, "scale-out", o.progress)
    try:
        for repeat in range(o.repeats):
            for w in workloads:
                for s in system_specs(o.systems, sizing[w.name]):
                    bar.set_postfix_str(f"repeat {repeat + 1}/{o.repeats} {w.name} {s.name} (starting)")
                    cluster = ClusterConfig(replicas=s.replicas, router=s.router, max_load_gap=o.max_load_gap,
                                            torch_threads=o.torch_threads)
                    with local_cluster(_engine_config(o, model[0], s), cluster, num_cpus=os.cpu_count()) as url:
                        bar.set_postfix_str(f"repeat {repeat + 1}/{o.repeats} {w.name} {s.name}")
                        run, stats, settled = asyncio.run(measure(url, w, o.timeout_s, lambda _: bar.update(1)))
                    runs.setdefault((w.name, s.name), []).append(
                        {"repeat": repeat, "metrics": run_metrics(run, stats), **run_detail(run, stats, settled)})
                    results["systems"].setdefault(w.name, {})[s.name] = s.__dict__
    finally:
        bar.close()
    for w in workloads:
        results["workloads"][w.name] = {"description": w.describe(), "params": w.params, "concurrency": w.concurrency,
                                        "num_requests": w.num_requests, "sizing": sizing[w.name].__dict__}
        results["planned_systems"][w.name] = list(o.systems)
        results["results"][w.name] = {name: fold_repeats(RUN_METRICS, reps)
                                      for (wname, name), reps in runs.items() if wname == w.name}
    return model, spec


def run_scaleout(o: ScaleOutOptions, argv: list[str] | None = None) -> dict[str, Any]:
    results: dict[str, Any] = {"scenario": SCENARIO, "workloads": {}, "systems": {}, "planned_systems": {},
                               "results": {}}
    model, spec = run_clusters(o, results) if o.cluster else (("", "none (routing micro-benchmark only)"), None)
    if o.micro:
        results["routing_overhead"] = run_routing_micro(o.micro_replicas, o.micro_prefixes, smoke=o.smoke)
    results_mod.add_environment(results, o, model, spec, argv)
    results["versions"]["ray"] = results_mod.version("ray")
    results["hit_rate_vs_one_replica"] = hit_rate_ratios(results)
    results["targets"] = evaluate_targets(results)
    return results
