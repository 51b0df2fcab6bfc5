"""The scale-out scenario's chart, scale_out.png: the median hit rate per system and workload, and the
requests per replica of the first repeat. harness.py writes it beside results.json and table.md and
publishes it with them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from radixserve_bench.scaleout import SYSTEMS

CHART = "scale_out.png"


def write_charts(results: dict[str, Any], out: Path) -> list[str]:
    """The chart in `out` when clusters ran (the routing micro-benchmark alone draws none); its name."""
    if not results.get("results"):
        return []
    write_chart(results, out / CHART)
    return [CHART]


def write_chart(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(results["results"])
    systems = [s for s in SYSTEMS if any(s in results["results"][w] for w in workloads)]
    fig, (hits, spread) = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / max(1, len(systems))
    for i, s in enumerate(systems):
        values = [results["results"][w].get(s, {}).get("median", {}).get("hit_rate", 0.0) for w in workloads]
        bars = hits.bar([x + i * width for x in range(len(workloads))], values, width, label=s, color=f"C{i}")
        hits.bar_label(bars, labels=[f"{v:.0%}" for v in values], fontsize=7)
    hits.set_xticks([x + width * (len(systems) - 1) / 2 for x in range(len(workloads))], workloads)
    hits.set_ylim(0, 1)
    hits.set_ylabel("hit rate (cached / prompt tokens)")
    hits.set_title("prefix-cache hit rate, whole cluster")
    hits.legend(fontsize=8)
    labels: list[str] = []
    tallest = 1
    for w in workloads:
        for s in systems:
            entry = results["results"][w].get(s)
            if entry is None:
                continue
            counts = sorted((rep.get("requests") or 0 for rep in entry["repeats"][0].get("replicas", [])),
                            reverse=True)
            x, bottom = len(labels), 0
            for j, c in enumerate(counts):
                spread.bar(x, c, bottom=bottom, color=f"C{systems.index(s)}", alpha=max(0.25, 1.0 - 0.35 * j),
                           edgecolor="white")
                bottom += c
            tallest = max(tallest, bottom)
            spread.text(x, bottom, " / ".join(str(c) for c in counts), ha="center", va="bottom", fontsize=7)
            labels.append(f"{w}\n{s}")
    spread.set_xticks(range(len(labels)), labels, fontsize=7, rotation=30, ha="right")
    spread.set_ylim(0, tallest * 1.12)
    spread.set_ylabel("requests (one shade per replica)")
    spread.set_title("requests per replica (first repeat)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
