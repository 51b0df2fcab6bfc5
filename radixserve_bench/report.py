"""The human-readable report: a Markdown table of absolute figures per workload, radixserve's ratio
to each peer, the bounded-pool comparison with Belady, the host tier's figures and ratios
(returning-chats), speculative decoding's table and ratios (speculation.py), the targets, and the
micro-benchmarks.
The same text is printed to stdout and written to table.md."""

from __future__ import annotations

from typing import Any

from radixserve_bench import returning, speculation
from radixserve_bench.systems import REFERENCE


def number(x: float | None, digits: int = 1) -> str:
    """A figure for a table: thousands grouped without decimals, smaller ones to `digits` places."""
    if x is None:
        return "—"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}f}"


def _trio(m: dict[str, float], prefix: str) -> str:
    return " / ".join(number(m.get(f"{prefix}_p{q}"), 0) for q in (50, 90, 99))


def _system_table(per_system: dict[str, Any]) -> list[str]:
    lines = [("| system | req/s | out tok/s | total tok/s | TTFT ms p50 / p90 / p99 | ITL ms p50 / p90 / p99 "
              "| E2E ms p50 / p90 / p99 | hit rate | hit / optimal | peak blocks / static |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, entry in per_system.items():
        m = entry["median"]
        blocks = (f"{number(m['peak_blocks_used'], 0)} / {number(m['static_reservation_blocks'], 0)}"
                  if "peak_blocks_used" in m else "—")
        lines.append(f"| {name} | {number(m['requests_per_s'], 2)} | {number(m['output_tokens_per_s'])} "
                     f"| {number(m['total_tokens_per_s'])} | {_trio(m, 'ttft_ms')} | {_trio(m, 'itl_ms')} "
                     f"| {_trio(m, 'e2e_ms')} | {m['hit_rate']:.1%} | {m['hit_rate_vs_optimal']:.3f} | {blocks} |")
    return lines


def _turn_table(per_system: dict[str, Any]) -> list[str]:
    turns = sorted({int(k.removeprefix("ttft_ms_turn")) for e in per_system.values() for k in e["median"]
                    if k.startswith("ttft_ms_turn")})
    if not turns:
        return []
    lines = ["", "Mean TTFT by turn (ms):", "",
             "| system | " + " | ".join(f"turn {t}" for t in turns) + " |",
             "|---|" + "---:|" * len(turns)]
    for name, entry in per_system.items():
        m = entry["median"]
        lines.append(f"| {name} | " + " | ".join(number(m.get(f"ttft_ms_turn{t}"), 0) for t in turns) + " |")
    return lines


def _ratio_lines(ratios: dict[str, dict[str, float]]) -> list[str]:
    if not ratios:
        return []
    lines = ["", f"{REFERENCE} relative to each peer (x; throughput above 1 and latency below 1 favour {REFERENCE}):",
             "", "| peer | out tok/s | total tok/s | mean TTFT | p50 E2E |", "|---|---:|---:|---:|---:|"]
    for peer, r in ratios.items():
        lines.append(f"| {peer} | {number(r.get('output_tokens_per_s'), 2)} | {number(r.get('total_tokens_per_s'), 2)} "
                     f"| {number(r.get('ttft_ms_mean'), 2)} | {number(r.get('e2e_ms_p50'), 2)} |")
    return lines


def _bounded_lines(per_system: dict[str, Any]) -> list[str]:
    out = []
    for name, entry in per_system.items():
        m = entry["median"]
        if "belady_hit_rate" not in m:
            continue
        out += ["", (f"{name}: pool of {number(m['pool_blocks'], 0)} blocks = {m['pool_fraction']:.0%} of the "
                     f"{number(m['working_set_blocks'], 0)}-block working set; hit rate {m['hit_rate']:.1%} vs offline "
                     f"Belady {m['belady_hit_rate']:.1%} (ratio {m['hit_rate_vs_belady']:.3f}) and simulated LRU "
                     f"{m['lru_sim_hit_rate']:.1%}.")]
    return out


def describe_target(t: dict[str, Any]) -> str:
    if t["value"] is None:
        return "not measured"
    status = "met" if t["met"] else "missed"
    return f"{status} by {abs(t['margin']):.0%}" if t["margin"] is not None else status


def target_lines(targets: list[dict[str, Any]]) -> list[str]:
    if not targets:
        return []
    lines = ["", "## Targets", "", "| target | value | goal | status |", "|---|---:|---:|---|"]
    for t in targets:
        note = f" ({t['note']})" if t.get("note") else ""
        lines.append(f"| {t['name']}{note} | {number(t['value'], 3)} | {t['op']} {t['threshold']:g} "
                     f"| {describe_target(t)} |")
    return lines


def render(results: dict) -> str:
    machine = results.get("machine", {})
    versions = results.get("versions", {})
    opts = results.get("options", {})
    lines = [f"# radixserve bench — {results.get('date', '')}", "",
             (f"Model {results.get('model', {}).get('name')} on {machine.get('gpu') or machine.get('cpu')} "
              f"({machine.get('cpu_count')} cores, {machine.get('torch_threads')} torch threads); "
              f"torch {versions.get('torch')}, transformers {versions.get('transformers')}. "
              f"Medians of {opts.get('repeats')} repeat(s); every request generates exactly its output length, "
              f"greedy unless its workload samples. Command: `{results.get('command')}`")]
    for wname, per_system in results["results"].items():
        w = results["workloads"][wname]
        lines += ["", f"## {w['description']}", ""]
        lines += _system_table(per_system)
        lines += _turn_table(per_system) if wname == "multi-turn" else []
        lines += _ratio_lines(results.get("ratios", {}).get(wname, {}))
        lines += _bounded_lines(per_system)
        lines += returning.report_lines(results) if wname == returning.WORKLOAD else []
        lines += speculation.report_lines(results, wname)
    lines += target_lines(results.get("targets") or [])
    micro = results.get("micro")
    if micro:
        lines += ["", "## Micro-benchmarks (no model)", "",
                  "| scheduler, running sequences | CPU ms / step | of which schedule() | wall ms / step |",
                  "|---|---:|---:|---:|"]
        for n, s in micro["scheduler"].items():
            lines.append(f"| {n} | {s['cpu_ms_per_step']:.3f} | {s['schedule_cpu_ms_per_step']:.3f} "
                         f"| {s['wall_ms_per_step']:.3f} |")
        r = micro["radix"]
        lines += ["", (f"Radix tree, {int(r['prompts'])} prompts of {int(r['prompt_len'])} tokens in "
                       f"{int(r['groups'])} shared-prefix groups: insert {r['insert_tokens_per_s'] / 1e6:.1f} M tok/s "
                       f"({r['insert_us_per_prompt']:.0f} µs / prompt), match "
                       f"{r['match_tokens_per_s'] / 1e6:.1f} M tok/s ({r['match_us_per_prompt']:.0f} µs / prompt).")]
    if results.get("skipped"):
        lines += ["", "Skipped: " + "; ".join(results["skipped"]) + "."]
    return "\n".join(lines) + "\n"
