"""The agent workload's figures, computed from what the runs recorded: per turn, per run (API x cache
mode), cache on against off, the scheduler phase's steps, the headline figures and the issue's targets.

Per turn k of a task: `computed` = prompt - cached (the prefill tokens the server computed), and from
turn 2 on `new_tokens` = prompt_k - (prompt_{k-1} + completion_{k-1}), the tokens the turn adds to
what the server saw last turn (the tool result with its framing), and `beyond_new` = computed -
new_tokens, what was computed again of the conversation the server had already seen (a cache hit
ends at a block boundary, so up to a block of it is normal). TTFT is the client's (send to the first
streamed event carrying part of the reply, so it includes the decode steps before a call's name is
out); beside it each run keeps the server's own (`server_ttft_ms_mean`: arrival to the first generated
token, every turn, from its time-to-first-token histogram).

Two readings of the issue's "turns 2+ compute <= 5% of their prompt tokens", both reported: per turn,
what was computed beyond the turn's new tokens (what the cache decides), and per task, the prompt
tokens computed over all its turns 2+ divided by their prompt tokens (the literal reading: a turn's
new tool output must be computed whatever the cache holds, so this depends on how long the outputs
are beside the context).

Invariants: nothing here measures; a run with any error has NaN headline figures.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import Any

from radixserve_bench.metrics import percentile
from radixserve_bench.results import Target

NAN = float("nan")
SCHEDULER_TARGET_MS = 0.3
PHASE_NAMES = ("schedule", "build", "forward", "wait", "post")  # engine/step_phases.PHASES, in its order


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else NAN


def turn_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The error-free turns with their derived figures, task by task, turn by turn."""
    by_task: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        by_task[r["task_id"]].append(r)
    rows = []
    for task, recs in by_task.items():
        prev: dict[str, Any] | None = None
        for r in sorted(recs, key=lambda r: r["turn"]):
            if r["error"] is not None or r["prompt_tokens"] is None:
                break  # the loop stopped here
            row = {"task_id": task, "turn": r["turn"], "kind": r["kind"], "prompt_tokens": r["prompt_tokens"],
                   "cached_tokens": r["cached_tokens"], "computed_tokens": r["prompt_tokens"] - r["cached_tokens"],
                   "completion_tokens": r["completion_tokens"], "finish": r["finish"], "call": r["call_name"],
                   "send_s": round(r["send_s"], 3),
                   "ttft_ms": round(1000 * r["ttft_s"], 2) if r["ttft_s"] is not None else None,
                   "e2e_ms": round(1000 * r["e2e_s"], 2) if r["e2e_s"] is not None else None}
            if prev is not None:
                row["new_tokens"] = r["prompt_tokens"] - prev["prompt_tokens"] - prev["completion_tokens"]
                row["beyond_new"] = row["computed_tokens"] - row["new_tokens"]
            rows.append(row)
            prev = row
    return rows


def summarize_turns(rows: list[dict[str, Any]]) -> dict[str, Any]:
    later = [r for r in rows if r["turn"] >= 2]
    prompt, cached = sum(r["prompt_tokens"] for r in rows), sum(r["cached_tokens"] for r in rows)
    later_prompt, later_cached = sum(r["prompt_tokens"] for r in later), sum(r["cached_tokens"] for r in later)
    tasks: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in later:
        tasks[r["task_id"]].append(r)
    ttft_later = [r["ttft_ms"] for r in later if r["ttft_ms"] is not None]
    by_turn: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_turn[r["turn"]].append(r)
    return {
        "turns": len(rows), "later_turns": len(later),
        "prompt_tokens": prompt, "cached_tokens": cached, "computed_tokens": prompt - cached,
        "completion_tokens": sum(r["completion_tokens"] or 0 for r in rows),
        "cached_fraction": cached / prompt if prompt else NAN,
        "later_cached_fraction": later_cached / later_prompt if later_prompt else NAN,
        "later_cached_fraction_min": min((r["cached_tokens"] / r["prompt_tokens"] for r in later), default=NAN),
        "later_computed_fraction_max": max((r["computed_tokens"] / r["prompt_tokens"] for r in later), default=NAN),
        "later_task_computed_fraction_max": max(
            (sum(r["computed_tokens"] for r in rs) / sum(r["prompt_tokens"] for r in rs) for rs in tasks.values()),
            default=NAN),
        "later_new_tokens": sum(r["new_tokens"] for r in later),
        "later_beyond_new_tokens": sum(max(0, r["beyond_new"]) for r in later),
        "later_beyond_new_fraction_max": max((max(0, r["beyond_new"]) / r["prompt_tokens"] for r in later), default=NAN),
        "ttft_ms_turn1_mean": _mean([r["ttft_ms"] for r in rows if r["turn"] == 1 and r["ttft_ms"] is not None]),
        "ttft_ms_later_mean": _mean(ttft_later),
        "ttft_ms_later_p50": percentile(ttft_later, 50) if ttft_later else NAN,
        "cut_calls": sum(1 for r in rows if r["kind"] == "call" and r["finish"] in ("length", "incomplete", "max_tokens")),
        "by_turn": {str(k): {"turns": len(rs), "prompt_tokens": _mean([r["prompt_tokens"] for r in rs]),
                             "cached_fraction": _mean([r["cached_tokens"] / r["prompt_tokens"] for r in rs]),
                             "ttft_ms": _mean([r["ttft_ms"] for r in rs if r["ttft_ms"] is not None])}
                    for k, rs in sorted(by_turn.items())},
    }


def analyse_run(run: dict[str, Any], num_blocks: int, api: str, cache: str) -> dict[str, Any]:
    """One run's document: its summary, every turn, and every error."""
    rows = turn_rows(run["records"])
    errors = [f"{r['task_id']} turn {r['turn']}: {r['error']}" for r in run["records"] if r["error"]]
    summary = summarize_turns(rows)
    ttft_s, ttft_n = run.get("server_ttft") or (0.0, 0.0)
    summary["server_ttft_ms_mean"] = 1000 * ttft_s / ttft_n if ttft_n else NAN
    return {"api": api, "cache": cache, "num_blocks": num_blocks, "duration_s": run["duration_s"],
            "requests": len(run["records"]), "errors": errors, "summary": summary, "turns": rows,
            "cache_held": run.get("cache_held")}


def compare(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per API with both modes: cache on over cache off."""
    out = {}
    for api, modes in runs.items():
        if "on" not in modes or "off" not in modes:
            continue
        on, off = modes["on"]["summary"], modes["off"]["summary"]
        out[api] = {"ttft_later_ratio": on["ttft_ms_later_mean"] / off["ttft_ms_later_mean"]
                    if off["ttft_ms_later_mean"] else NAN,
                    "server_ttft_ratio": on["server_ttft_ms_mean"] / off["server_ttft_ms_mean"]
                    if off["server_ttft_ms_mean"] else NAN,
                    "computed_tokens_ratio": on["computed_tokens"] / off["computed_tokens"] if off["computed_tokens"] else NAN,
                    "off_cached_tokens": off["cached_tokens"]}
    return out


Watched = tuple[int, int, int, int, float, tuple[float, float, float, float]]  # runner.StepWatch.steps


def summarize_steps(entries: list[tuple[float, ...]], watched: list[Watched], loops: int) -> dict[str, Any]:
    """The scheduler phase's steps. From the step observer, per step: running sequences, grammar-mask
    seconds and the scheduler's CPU seconds on the engine thread: `scheduler_cpu_ms`, the target's
    figure, is Scheduler.schedule + launched + commit less the engine's stop test that commit calls (the
    scheduler micro-benchmark's step), with each part and the stop test apart. From the engine's phase
    clock, per step that ran a
    forward: wall-clock phases; its `schedule` phase also holds the grammar masks of constrained rows
    (every forced call is one) and, in a server, the waits for the interpreter lock while the event loop
    runs. When both saw the same steps they are paired: `schedule_less_masks_ms`."""
    ran = [e for e in entries if e[PHASE_NAMES.index("forward")] > 0]
    ms = {name: [1000 * e[i] for e in ran] for i, name in enumerate(PHASE_NAMES)}
    schedule = ms["schedule"]
    out: dict[str, Any] = {"steps": len(watched), "phase_steps": len(ran), "paired": len(watched) == len(ran) and bool(ran)}
    if schedule:
        out |= {"schedule_ms_mean": statistics.fmean(schedule), "schedule_ms_p50": percentile(schedule, 50),
                **{f"{name}_ms_p50": percentile(ms[name], 50) for name in ("build", "forward", "post")},
                "step_ms_p50": percentile([sum(e) * 1000 for e in ran], 50)}
    if watched:
        running = [w[0] for w in watched]
        masks = [1000 * w[4] for w in watched]
        cpu = [1000 * sum(w[5][:3]) for w in watched]
        for k, name in enumerate(("schedule", "launched", "commit", "stop_test")):
            part = [1000 * w[5][k] for w in watched]
            out |= {f"{name}_cpu_ms_p50": percentile(part, 50), f"{name}_cpu_ms_mean": statistics.fmean(part)}
        out |= {"running_mean": statistics.fmean(running), "running_p50": percentile(running, 50),
                "running_max": max(running), "scheduled_mean": statistics.fmean(w[1] for w in watched),
                "mask_ms_mean": statistics.fmean(masks), "mask_ms_p50": percentile(masks, 50),
                "scheduler_cpu_ms_mean": statistics.fmean(cpu),
                **{f"scheduler_cpu_ms_p{q}": percentile(cpu, q) for q in (50, 90, 99)},
                "scheduler_cpu_ms_max": max(cpu)}
        busy = [c for c, w in zip(cpu, watched) if w[0] >= loops // 2]
        out |= {"busy_threshold": loops // 2, "busy_steps": len(busy),
                "busy_scheduler_cpu_ms_p50": percentile(busy, 50) if busy else NAN}
    walls: list[float | None] = [None] * len(watched)
    if out["paired"]:
        walls = [max(0.0, s - 1000 * w[4]) for s, w in zip(schedule, watched)]
        own = [x for x in walls if x is not None]
        out |= {"schedule_less_masks_ms_mean": statistics.fmean(own), "schedule_less_masks_ms_p50": percentile(own, 50)}
    out["samples"] = [[round(1000 * sum(w[5][:3]), 4), w[0], None if x is None else round(x, 4)]
                      for w, x in zip(watched, walls)]
    return out


def _fail_nan(value: float, run: dict[str, Any] | None) -> float:
    return NAN if run is None or run["errors"] else value


def headline(results: dict[str, Any]) -> dict[str, Any]:
    """The figures metrics.check_complete requires to be finite (NaN where a run had errors)."""
    m: dict[str, float] = {}
    for api, modes in results["runs"].items():
        on, off = modes.get("on"), modes.get("off")
        if on is not None:
            m[f"{api}.later_cached_fraction"] = _fail_nan(on["summary"]["later_cached_fraction"], on)
            m[f"{api}.later_beyond_new_fraction_max"] = _fail_nan(on["summary"]["later_beyond_new_fraction_max"], on)
        if off is not None:
            m[f"{api}.off.later_cached_fraction"] = _fail_nan(off["summary"]["later_cached_fraction"], off)
        if api in results["comparison"]:
            m[f"{api}.ttft_later_ratio"] = _fail_nan(_fail_nan(results["comparison"][api]["ttft_later_ratio"], on), off)
    sched = results.get("scheduler")
    if sched is not None:
        m["scheduler.scheduler_cpu_ms_p50"] = NAN if sched["errors"] else sched.get("scheduler_cpu_ms_p50", NAN)
    return {"expected_metrics": list(m), "median": m}


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def evaluate_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    targets = []
    for api, modes in results["runs"].items():
        on = modes.get("on")
        if on is not None:
            s = on["summary"]
            targets.append(Target(f"{api}: turns 2+, worst turn's tokens computed beyond its new input / its prompt",
                                  "<=", 0.05, _finite(s["later_beyond_new_fraction_max"])))
            targets.append(Target(f"{api}: turns 2+, worst task's prompt tokens computed / prompt tokens", "<=", 0.05,
                                  _finite(s["later_task_computed_fraction_max"]),
                                  "literal reading: includes the new tool outputs, which no cache holds"))
        if api in results["comparison"]:
            targets.append(Target(f"{api}: mean TTFT of turns 2+, cache on / off", "<=", 0.3,
                                  _finite(results["comparison"][api]["ttft_later_ratio"])))
    sched = results.get("scheduler")
    if sched is not None:
        note = (f"the engine thread's CPU time in Scheduler.schedule, launched and commit less the stop test; mean "
                f"{sched.get('scheduler_cpu_ms_mean', NAN):.3f}, p99 {sched.get('scheduler_cpu_ms_p99', NAN):.3f} ms over "
                f"{sched['steps']} steps, {sched.get('running_mean', NAN):.1f} sequences running on average")
        targets.append(Target(f"scheduler ms per step (median), {sched['loops']} agent loops in flight", "<=",
                              SCHEDULER_TARGET_MS, _finite(sched.get("scheduler_cpu_ms_p50")), note))
    return [t.as_dict() for t in targets]
