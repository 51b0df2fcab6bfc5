"""The peers scenario's figures as the Markdown table printed to stdout and written to table.md: per
workload and system the medians of the repeats (output tok/s, TTFT, per-request decode speed), the
share of replies equal to the reference's, and the machine's load around each server, since the
figures of a shared machine mean little without it."""

from __future__ import annotations

from typing import Any

from radixserve_bench.peers import REFERENCE
from radixserve_bench.report import number


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x:.0%}"


def _gist(error: str) -> str:
    """An error's first line and, when it carries a server's log, that log's last line (its exception)."""
    lines = [x.strip() for x in error.splitlines() if x.strip()]
    return lines[0] if len(lines) < 2 else f"{lines[0]} … {lines[-1]}"


def _loads(results: dict[str, Any]) -> list[str]:
    lines = []
    for system, facts in results.get("systems", {}).items():
        spans = ", ".join(f"{r['load_average_before'][0]:.1f} → {r['load_average_after'][0]:.1f}" for r in facts["repeats"])
        lines.append(f"- {system}: {facts['description']}; 1-min load average before → after: {spans}")
    return lines


def render(results: dict[str, Any]) -> str:
    machine = results.get("machine", {})
    model = results.get("model", {})
    lines = [f"## radixserve bench peers: {model.get('name', '?')}", "",
             f"{machine.get('cpu', '?')}, {machine.get('cpu_count', '?')} cores; load average at the end "
             f"{', '.join(f'{x:.2f}' for x in machine.get('load_average') or [])}. On a shared machine these are "
             "not publishable figures.", "", *_loads(results)]
    lines += [f"- {line}" for line in results.get("skipped", {}).values()]
    lines += [f"- {system}: failed: {_gist(error)}" for system, error in results.get("errors", {}).items()]
    agreement = results.get("agreement", {})
    for workload, per_system in results.get("results", {}).items():
        desc = results["workloads"][workload]["description"]
        lines += ["", f"### {desc}", "",
                  f"| system | output tok/s | TTFT mean ms | TTFT p50 ms | decode tok/s per request | forced length "
                  f"| same reply as {REFERENCE} |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for system, entry in per_system.items():
            m = entry["median"]
            same = agreement.get(workload, {}).get(system, {})
            lines.append(f"| {system} | {number(m.get('output_tokens_per_s'))} | {number(m.get('ttft_ms_mean'), 0)} | "
                         f"{number(m.get('ttft_ms_p50'), 0)} | {number(m.get('decode_tok_s_mean'))} | "
                         f"{_pct(m.get('forced_length_share'))} | "
                         f"{'(reference)' if system == REFERENCE else _pct(same.get('share'))} |")
    return "\n".join(lines) + "\n"
