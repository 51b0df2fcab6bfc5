"""peers.png (matplotlib, headless): per workload, output tok/s per system (medians, min-max whiskers
over the repeats, each bar labelled with its share of replies equal to the reference's), and beneath
it the mean and median TTFT per system. A system keeps its color in every panel."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from radixserve_bench.peers import REFERENCE, SYSTEMS

CHART = "peers.png"


def _color(system: str) -> str:
    return f"C{SYSTEMS.index(system)}" if system in SYSTEMS else "gray"


def write_charts(results: dict[str, Any], out: Path) -> list[str]:
    names = list(results["results"])
    if not names:
        return []
    fig, axes = plt.subplots(2, len(names), figsize=(4.6 * len(names), 7.5), squeeze=False)
    load = results.get("machine", {}).get("load_average") or []
    fig.suptitle(f"radixserve bench peers: {results.get('model', {}).get('name', '')}"
                 + (f" (load average at the end {load[0]:.1f}; a shared machine)" if load else ""), fontsize=10)
    for col, workload in enumerate(names):
        per_system = results["results"][workload]
        systems = list(per_system)
        xs = range(len(systems))
        colors = [_color(s) for s in systems]
        med = [per_system[s]["median"]["output_tokens_per_s"] for s in systems]
        runs = [[r["metrics"]["output_tokens_per_s"] for r in per_system[s]["repeats"]] for s in systems]
        err = [[m - min(r) for m, r in zip(med, runs)], [max(r) - m for m, r in zip(med, runs)]]
        top = axes[0][col]
        bars = top.bar(xs, med, yerr=err, capsize=3, color=colors)
        same = results.get("agreement", {}).get(workload, {})
        top.bar_label(bars, ["reference" if s == REFERENCE else
                             (f"same {same[s]['share']:.0%}" if same.get(s, {}).get("share") is not None else "")
                             for s in systems], fontsize=7)
        top.set_xticks(xs, systems, rotation=25, ha="right", fontsize=8)
        top.set_title(f"{workload} (x{results['workloads'][workload]['concurrency']} in flight)", fontsize=9)
        top.set_ylabel("output tokens / s")
        bottom = axes[1][col]
        width = 0.4
        bottom.bar([x - width / 2 for x in xs], [per_system[s]["median"]["ttft_ms_mean"] for s in systems], width,
                   color=colors, label="mean")
        bottom.bar([x + width / 2 for x in xs], [per_system[s]["median"]["ttft_ms_p50"] for s in systems], width,
                   color=colors, alpha=0.5, hatch="//", label="p50")
        bottom.set_xticks(xs, systems, rotation=25, ha="right", fontsize=8)
        bottom.set_ylabel("time to first token, ms")
        bottom.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / CHART, dpi=110)
    plt.close(fig)
    return [CHART]
