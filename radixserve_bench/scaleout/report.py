"""The scale-out scenario's figures as text: each system's hit rate against one-replica's (from the
medians of the repeats, so the ratios are always those of the numbers beside them), the targets, and
the Markdown table printed to stdout and written to table.md.

Targets: per workload, cache-aware hit rate / one-replica's >= 0.95 (power-of-two's ratio is shown for
contrast, not a target); per replica count, the routing overhead's p99 <= 1 ms at the benchmarked
number of cached prefixes per replica (the issue names 1,000).
"""

from __future__ import annotations

from typing import Any

from radixserve.scaleout.routing import REASONS
from radixserve_bench.report import number, target_lines
from radixserve_bench.results import Target
from radixserve_bench.scaleout import HIT_RATE_GOAL, REFERENCE, ROUTING_US_GOAL


def _median(results: dict[str, Any], workload: str, system: str) -> dict[str, float] | None:
    entry = results.get("results", {}).get(workload, {}).get(system)
    return entry.get("median") if entry else None


def hit_rate_ratios(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per workload, every other system's median hit rate / one-replica's."""
    out: dict[str, dict[str, float]] = {}
    for workload, per_system in results.get("results", {}).items():
        ref = _median(results, workload, REFERENCE)
        if not ref or not ref.get("hit_rate"):
            continue
        out[workload] = {name: entry["median"]["hit_rate"] / ref["hit_rate"] for name, entry in per_system.items()
                         if name != REFERENCE and "hit_rate" in entry.get("median", {})}
    return out


def evaluate_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    targets = []
    ratios = results.get("hit_rate_vs_one_replica", {})
    for workload in results.get("results", {}):
        targets.append(Target(f"{workload} hit rate, cache-aware / {REFERENCE}", ">=", HIT_RATE_GOAL,
                              ratios.get(workload, {}).get("cache-aware")))
    for n, r in results.get("routing_overhead", {}).items():
        targets.append(Target(f"routing overhead p99 (us per request), {n} replicas, "
                              f"{r['prefixes_per_replica']:,} cached prefixes each", "<=", ROUTING_US_GOAL,
                              r["p99_us"]))
    return [t.as_dict() for t in targets]


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x:.1%}"


def _decisions(m: dict[str, float], router: str) -> str:
    if router == "power-of-two":
        return "Ray's choice (not the rule)"
    parts = [f"{r} {int(m.get(f'decisions_{r}', 0))}" for r in REASONS if m.get(f"decisions_{r}")]
    return ", ".join(parts) or "—"


def _per_replica(entry: dict[str, Any]) -> str:
    counts = sorted((rep.get("requests") or 0 for rep in entry["repeats"][0].get("replicas", [])), reverse=True)
    return " / ".join(str(c) for c in counts) or "—"


def _cores(results: dict[str, Any]) -> str:
    machine = results.get("machine", {})
    return machine.get("gpu") or f"{machine.get('cpu_count')} CPU cores"


def workload_lines(results: dict[str, Any], workload: str) -> list[str]:
    w = results["workloads"][workload]
    sz = w["sizing"]
    systems = results.get("systems", {}).get(workload, {})
    ratios = results.get("hit_rate_vs_one_replica", {}).get(workload, {})
    cores = _cores(results)
    lines = ["", f"## {w['description']}", "",
             (f"Working set {sz['working_set_blocks']} blocks of {results.get('options', {}).get('block_size')} "
              f"tokens, of which {sz['reused_blocks']} are reused by a later request; P = {sz['pool_blocks']} "
              f"blocks per replica ({sz['pool_blocks'] / max(1, sz['reused_blocks']):.0%} of the reused blocks); "
              f"one-replica: {sz['replicas']} x P = {sz['replicas'] * sz['pool_blocks']} blocks."), "",
             f"| system | replicas x blocks | hit rate | / {REFERENCE} | hit rate (usage) | requests per replica "
             f"| routing decisions | evicted blocks | req/s ({cores}) | total tok/s ({cores}) "
             f"| out tok/s ({cores}) |",
             "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for name, entry in results["results"][workload].items():
        m, s = entry["median"], systems.get(name, {})
        ratio = "1 (reference)" if name == REFERENCE else number(ratios.get(name), 3)
        lines.append(f"| {name} | {s.get('replicas')} x {s.get('blocks_per_replica')} | {_pct(m.get('hit_rate'))} "
                     f"| {ratio} | {_pct(m.get('client_hit_rate'))} | {_per_replica(entry)} "
                     f"| {_decisions(m, s.get('router', ''))} | {number(m.get('evicted_blocks'), 0)} "
                     f"| {number(m.get('requests_per_s'), 2)} | {number(m.get('total_tokens_per_s'))} "
                     f"| {number(m.get('output_tokens_per_s'))} |")
    return lines


def routing_lines(results: dict[str, Any]) -> list[str]:
    micro = results.get("routing_overhead")
    if not micro:
        return []
    lines = ["", "## Routing overhead (RoutingTable.choose() + sent(), no Ray, no model)", "",
             "| replicas | cached prefixes per replica | prompt tokens | requests | median µs | p99 µs | mean µs "
             "| max µs |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n, r in micro.items():
        lo, hi = r["prompt_len"]
        lines.append(f"| {n} | {r['prefixes_per_replica']:,} | {lo:,}-{hi:,} | {r['requests']:,} "
                     f"| {r['median_us']:.1f} | {r['p99_us']:.1f} | {r['mean_us']:.1f} | {r['max_us']:.1f} |")
    return lines


def _target_lines(results: dict[str, Any]) -> list[str]:
    lines = target_lines(results.get("targets") or [])
    if not lines:
        return []
    contrast = [f"{w}: {r['power-of-two']:.3f}" for w, r in results.get("hit_rate_vs_one_replica", {}).items()
                if "power-of-two" in r]
    if contrast:
        lines += ["", f"For contrast (not a target), power-of-two hit rate / {REFERENCE}: " + "; ".join(contrast) + "."]
    return lines


def _preamble(results: dict[str, Any]) -> str:
    machine, versions, opts = results.get("machine", {}), results.get("versions", {}), results.get("options", {})
    command = f"Command: `{results.get('command')}`"
    if not results.get("results"):
        return f"Routing micro-benchmark only, on {machine.get('cpu')}; python {versions.get('python')}. {command}"
    return (f"Model {results.get('model', {}).get('name')} on {machine.get('gpu') or machine.get('cpu')} "
            f"({machine.get('cpu_count')} cores shared by every replica, the Ray Serve proxy and ingress, and the "
            f"client; torch threads per replica: {opts.get('torch_threads')}); torch {versions.get('torch')}, "
            f"ray {versions.get('ray')}. Each system is a fresh local Ray Serve application; medians of "
            f"{opts.get('repeats')} repeat(s); greedy OpenAI chat requests over HTTP. {command}")


def render(results: dict[str, Any]) -> str:
    lines = [f"# radixserve bench scale-out — {results.get('date', '')}", "", _preamble(results)]
    for workload in results.get("results", {}):
        lines += workload_lines(results, workload)
    lines += routing_lines(results)
    lines += _target_lines(results)
    if results.get("results"):
        lines += ["", ("Throughput is measured on the machine above, where every replica competes for the same "
                       "cores: it shows the cost of each system's misses there, not what the replicas would do "
                       "on devices of their own.")]
    return "\n".join(lines) + "\n"
