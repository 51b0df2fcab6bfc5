"""The returning-chats scenario's own figures: what the host-memory tier buys when conversations go
idle and come back after their history has left a bounded device pool.

Per run (every system on returning-chats): mean TTFT of the conversations' first turns and of their
returning turns (every later turn), the returning turns' hit rate, and the prompt tokens the host
tier loaded back (and their share of all hits). Per workload, from the medians of the repeats (so
the published ratios are always computed from the measurements in the same document):

- hit rate with the tier / hit rate of an ample (never evicting) pool — the tier should keep almost
  every hit an unbounded device pool would have;
- returning-turn mean TTFT with the tier / with the tier off — a load-back should cost a fraction
  of recomputing the history.
"""

from __future__ import annotations

import statistics
from typing import Any

from radixserve_bench.driver import RunTrace
from radixserve_bench.metrics import percentile
from radixserve_bench.systems import BOUNDED, BOUNDED_HOST, REFERENCE

WORKLOAD = "returning-chats"
HIT_RATE_GOAL = 0.95  # host tier / ample pool, at least
TTFT_GOAL = 0.25  # returning-turn TTFT, host tier / recompute, at most
MIB = 2**20


def kv_block_bytes(spec: Any, block_size: int, device: str, dtype: str, kv_cache_dtype: str = "auto",
                   gguf_quantized: bool = False) -> int:
    """Bytes of one KV block of `spec` as the engine will lay it out (same device, dtype and cache dtype
    rules; `gguf_quantized`: the model is a GGUF file served with its quantized weights)."""
    from radixserve.model.device import resolve_device_dtype
    from radixserve.model.kv_cache import KVLayout, resolve_kv_dtype

    _, torch_dtype = resolve_device_dtype(device, dtype)
    return KVLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, block_size, torch_dtype,
                    resolve_kv_dtype(kv_cache_dtype, gguf_quantized)).bytes_per_block


def host_cache_mb(blocks: int, block_bytes: int) -> float:
    """The `host_cache_mb` that holds exactly `blocks` blocks (exact: a multiple of bytes over 2**20)."""
    return blocks * block_bytes / MIB


def returning_metrics(trace: RunTrace) -> dict[str, float]:
    """metrics.RETURNING_METRICS of one run."""
    first = [r for r in trace.records if r.turn == 0]
    later = [r for r in trace.records if r.turn > 0]
    if not first or not later:
        raise ValueError(f"{trace.system} on {trace.workload}: needs first and returning turns")
    cached = sum(r.cached_tokens for r in trace.records)
    host = sum(r.host_cached_tokens for r in trace.records)
    later_ttft = [1000 * r.ttft_s for r in later]
    return {
        "first_turn_ttft_ms_mean": statistics.fmean(1000 * r.ttft_s for r in first),
        "returning_ttft_ms_mean": statistics.fmean(later_ttft),
        "returning_ttft_ms_p50": percentile(later_ttft, 50),
        "returning_hit_rate": sum(r.cached_tokens for r in later) / sum(r.prompt_len for r in later),
        "host_cached_tokens": float(host),
        "host_hit_share": host / cached if cached else 0.0,
    }


def _ratio(num: dict[str, float] | None, den: dict[str, float] | None, key: str) -> tuple[float, float, float] | None:
    if not num or not den or key not in num or not den.get(key):
        return None
    return num[key], den[key], num[key] / den[key]


def host_tier_ratios(results: dict) -> dict[str, dict[str, float]]:
    """Per returning-chats workload in `results`, the two ratios and the medians they divide."""
    per_system = results["results"].get(WORKLOAD)
    if not per_system:
        return {}
    med = {name: entry.get("median") for name, entry in per_system.items()}
    out: dict[str, float] = {}
    hit = _ratio(med.get(BOUNDED_HOST), med.get(REFERENCE), "hit_rate")
    if hit:
        out["hit_rate_host"], out["hit_rate_ample"], out["hit_rate_host_vs_ample"] = hit
    ttft = _ratio(med.get(BOUNDED_HOST), med.get(BOUNDED), "returning_ttft_ms_mean")
    if ttft:
        out["returning_ttft_ms_host"], out["returning_ttft_ms_recompute"], out["returning_ttft_host_vs_recompute"] = ttft
    return {WORKLOAD: out} if out else {}


def target_values(results: dict) -> list[tuple[str, str, float, float | None]]:
    """(name, op, goal, value) of the two host-tier targets; value None where not measured."""
    r = results.get("host_tier", {}).get(WORKLOAD, {})
    return [(f"{WORKLOAD} hit rate, host tier / ample pool", ">=", HIT_RATE_GOAL, r.get("hit_rate_host_vs_ample")),
            (f"{WORKLOAD} returning-turn mean TTFT, host tier / recompute", "<=", TTFT_GOAL,
             r.get("returning_ttft_host_vs_recompute"))]


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{x:,.0f}"


def report_lines(results: dict) -> list[str]:
    per_system = results["results"].get(WORKLOAD, {})
    if not per_system:
        return []
    lines = ["", "Host tier: hits, and time to first token of first and returning turns:", "",
             "| system | pool blocks | host MiB | hit rate | loaded from host (share of hits) | returning-turn hit rate "
             "| TTFT ms, first turns | TTFT ms, returning turns: mean / p50 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, entry in per_system.items():
        m = entry["median"]
        host_mb = results.get("systems", {}).get(name, {}).get("settings", {}).get("host_cache_mb") or 0.0
        lines.append(f"| {name} | {_ms(m.get('pool_blocks'))} | {host_mb:,.1f} | {m['hit_rate']:.1%} "
                     f"| {m.get('host_hit_share', 0.0):.1%} | {m.get('returning_hit_rate', 0.0):.1%} "
                     f"| {_ms(m.get('first_turn_ttft_ms_mean'))} | {_ms(m.get('returning_ttft_ms_mean'))} / "
                     f"{_ms(m.get('returning_ttft_ms_p50'))} |")
    r = results.get("host_tier", {}).get(WORKLOAD, {})
    lines += ["", "Ratios, computed from the medians above:", ""]
    if "hit_rate_host_vs_ample" in r:
        lines.append(f"- hit rate, {BOUNDED_HOST} / {REFERENCE}: {r['hit_rate_host']:.1%} / {r['hit_rate_ample']:.1%} "
                     f"= {r['hit_rate_host_vs_ample']:.3f} (goal >= {HIT_RATE_GOAL:g})")
    else:
        lines.append(f"- hit rate, {BOUNDED_HOST} / {REFERENCE}: not measured (both systems must run)")
    if "returning_ttft_host_vs_recompute" in r:
        lines.append(f"- returning-turn mean TTFT, {BOUNDED_HOST} / {BOUNDED}: {_ms(r['returning_ttft_ms_host'])} ms / "
                     f"{_ms(r['returning_ttft_ms_recompute'])} ms = {r['returning_ttft_host_vs_recompute']:.3f} "
                     f"(goal <= {TTFT_GOAL:g})")
    else:
        lines.append(f"- returning-turn mean TTFT, {BOUNDED_HOST} / {BOUNDED}: not measured (both systems must run)")
    return lines
