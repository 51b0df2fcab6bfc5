"""Figures of one run, computed from its trace: throughput, latency percentiles, cache hits against
the unbounded optimum, and pool blocks in use against a static reservation.

Every metric is a plain float keyed by name; `median_metrics` folds repeats. Decode speed per
request (`decode_tok_s_*`: the tokens after the first one's arrival over the time to the last; one
step may hand out several tokens under speculative decoding) is computed wherever a request has it;
the speculation workloads require it (speculation.py). Which metrics a system
must report is fixed here (`expected_metrics`), and `check_complete` is what the smoke test runs.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence

from radixserve_bench.belady import TraceRequest, optimal_hits
from radixserve_bench.driver import RequestRecord, RunTrace
from radixserve_bench.systems.base import PoolSample

LATENCIES = ("ttft_ms", "itl_ms", "e2e_ms")
STATS = ("mean", "p50", "p90", "p99")
CORE_METRICS = (
    "requests", "duration_s", "requests_per_s", "output_tokens_per_s", "total_tokens_per_s",
    "prompt_tokens", "output_tokens", "cached_tokens", "hit_rate", "optimal_hit_rate", "hit_rate_vs_optimal",
    *(f"{lat}_{s}" for lat in LATENCIES for s in STATS),
)
POOL_METRICS = ("pool_blocks", "peak_blocks_used", "static_reservation_blocks", "peak_vs_static")
BOUNDED_POOL_METRICS = ("working_set_blocks", "pool_fraction", "belady_hit_rate", "lru_sim_hit_rate",
                        "hit_rate_vs_belady")
# returning-chats (computed in returning.py, which needs this module's percentile)
RETURNING_METRICS = ("first_turn_ttft_ms_mean", "returning_ttft_ms_mean", "returning_ttft_ms_p50",
                     "returning_hit_rate", "host_cached_tokens", "host_hit_share")


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    if not values:
        raise ValueError("percentile of no values")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(prefix: str, values: Sequence[float]) -> dict[str, float]:
    return {f"{prefix}_mean": statistics.fmean(values), **{f"{prefix}_p{q}": percentile(values, q) for q in (50, 90, 99)}}


def trace_requests(trace: RunTrace) -> list[TraceRequest]:
    return [TraceRequest(r.prompt_len, tuple(r.sequence)) for r in trace.records]


def run_metrics(trace: RunTrace, block_size: int) -> dict[str, float]:
    recs = trace.records
    duration = trace.duration_s
    prompt = sum(r.prompt_len for r in recs)
    output = sum(r.output_len for r in recs)
    cached = sum(r.cached_tokens for r in recs)
    optimal = sum(optimal_hits(trace_requests(trace), block_size))
    itls = [x for r in recs for x in r.itl_s] or [0.0]  # one-token outputs have no inter-token gap
    m: dict[str, float] = {
        "requests": float(len(recs)),
        "duration_s": duration,
        "requests_per_s": len(recs) / duration,
        "output_tokens_per_s": output / duration,
        "total_tokens_per_s": (prompt + output) / duration,
        "prompt_tokens": float(prompt),
        "output_tokens": float(output),
        "cached_tokens": float(cached),
        "hit_rate": cached / prompt if prompt else 0.0,
        "optimal_hit_rate": optimal / prompt if prompt else 0.0,
        # nothing shareable means nothing was missed
        "hit_rate_vs_optimal": cached / optimal if optimal else 1.0,
    }
    m |= summarize("ttft_ms", [1000 * r.ttft_s for r in recs])
    m |= summarize("itl_ms", [1000 * x for x in itls])
    m |= summarize("e2e_ms", [1000 * r.e2e_s for r in recs])
    m |= decode_speeds("decode_tok_s", recs)
    turns = sorted({r.turn for r in recs})
    if len(turns) > 1:
        for k in turns:
            m[f"ttft_ms_turn{k + 1}"] = statistics.fmean(1000 * r.ttft_s for r in recs if r.turn == k)
            m |= decode_speeds(f"decode_tok_s_turn{k + 1}", [r for r in recs if r.turn == k], mean_only=True)
    return m


def decode_speeds(prefix: str, recs: Sequence[RequestRecord], mean_only: bool = False) -> dict[str, float]:
    """Mean (`prefix`_mean, or `prefix` alone with mean_only) and median decode tokens per second per
    request, over the requests that have one; nothing when none has."""
    speeds = [x for x in (r.decode_tokens_per_s for r in recs) if x is not None]
    if not speeds:
        return {}
    if mean_only:
        return {prefix: statistics.fmean(speeds)}
    return {f"{prefix}_mean": statistics.fmean(speeds), f"{prefix}_p50": percentile(speeds, 50)}


def pool_metrics(trace: RunTrace, block_size: int, pool_blocks: int) -> dict[str, float]:
    """Peak blocks held by live requests, against what reserving each running request's maximum
    length (prompt + output, no sharing) for its whole run would have needed at the same moments."""
    peak_used = max((s.blocks_used for s in trace.pool_samples), default=0)
    events: list[tuple[float, int]] = []
    for r in trace.records:
        need = -(-(r.prompt_len + r.output_len) // block_size)
        began = r.scheduled_time if r.scheduled_time is not None else r.send_time
        events += [(began, need), (r.finish_time, -need)]
    static_peak = level = 0
    for _, delta in sorted(events, key=lambda e: (e[0], e[1])):  # releases before claims at equal times
        level += delta
        static_peak = max(static_peak, level)
    return {"pool_blocks": float(pool_blocks), "peak_blocks_used": float(peak_used),
            "static_reservation_blocks": float(static_peak),
            "peak_vs_static": peak_used / static_peak if static_peak else 0.0}


def hit_rate_timeline(trace: RunTrace) -> list[tuple[float, float]]:
    """Cumulative hit rate (cached / prompt tokens of finished requests) at each request's finish."""
    out, cached, prompt = [], 0, 0
    for r in sorted(trace.records, key=lambda r: r.finish_time):
        cached += r.cached_tokens
        prompt += r.prompt_len
        out.append((r.finish_time - trace.start, cached / prompt))
    return out


def blocks_timeline(samples: Iterable[PoolSample], start: float) -> list[tuple[float, int, int]]:
    return [(s.t - start, s.blocks_used, s.blocks_cached) for s in samples]


def median_metrics(runs: Sequence[dict[str, float]]) -> dict[str, float]:
    keys = [k for k in runs[0] if all(k in r for r in runs)]
    return {k: statistics.median(r[k] for r in runs) for k in keys}


def fold_repeats(expected: Iterable[str], runs: list[dict]) -> dict:
    """One (workload, system) entry of the results: the metrics it must have, the medians of its
    repeats' metrics and the repeats themselves (what check_complete reads)."""
    return {"expected_metrics": list(expected), "median": median_metrics([r["metrics"] for r in runs]), "repeats": runs}


def expected_metrics(has_pool: bool, bounded_pool: bool, returning: bool = False) -> tuple[str, ...]:
    return (CORE_METRICS + (POOL_METRICS if has_pool else ()) + (BOUNDED_POOL_METRICS if bounded_pool else ())
            + (RETURNING_METRICS if returning else ()))


def check_complete(results: dict) -> list[str]:
    """Every planned (workload, system) pair has a median with every expected metric, all finite."""
    problems = []
    for wname, per_system in results["results"].items():
        for sname, entry in per_system.items():
            median = entry.get("median")
            if not median:
                problems.append(f"{wname}/{sname}: no results")
                continue
            for key in entry["expected_metrics"]:
                value = median.get(key)
                if not isinstance(value, (int, float)) or not math.isfinite(value):
                    problems.append(f"{wname}/{sname}: metric {key} is {value!r}")
    for wname in results["workloads"]:
        missing = set(results["planned_systems"][wname]) - set(results["results"].get(wname, {}))
        problems += [f"{wname}/{s}: not run" for s in sorted(missing)]
    return problems
