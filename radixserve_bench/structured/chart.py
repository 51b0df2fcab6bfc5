"""The structured workload's chart, structured.png: each constraint's cold compile time (sorted), and
the decode step's time constrained beside unconstrained, with forced tokens off and on. harness.py
writes it beside results.json and table.md and publishes it with them; matplotlib (the bench extra)
is imported only here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

CHART = "structured.png"


def write_charts(results: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (comp, step) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [2, 1]})
    for i, (label, key) in enumerate((("JSON schemas", "schemas"), ("tool calls", "tool_calls"))):
        per = results["compile"][key]["per_constraint"]
        ms = sorted(x["wall_ms"] for x in per.values())
        comp.plot(range(1, len(ms) + 1), ms, marker=".", color=f"C{i}", label=f"{label} (n={len(ms)})")
    comp.set_xlabel("constraint (sorted by compile time)")
    comp.set_ylabel("cold compile, ms")
    comp.set_title("grammar compile time (llguidance)")
    comp.legend()
    labels, values, colors = [], [], []
    for forced, key in (("forced off", "step_no_forced"), ("forced on", "step")):
        for mode, color in (("unconstrained", "C7"), ("constrained", "C1")):
            labels.append(f"{mode}\n{forced}")
            values.append(results[key][mode]["step_ms_mean"])
            colors.append(color)
    bars = step.bar(labels, values, color=colors)
    step.bar_label(bars, labels=[f"{v:.1f} ms" for v in values])
    step.tick_params(axis="x", labelsize=8)
    step.set_ylabel("decode step, ms (mean)")
    s = results["step_no_forced"]
    step.set_title(f"batch {s['batch']}: constrained {s['ratio_step_mean']:.2f}x (forced off)")
    fig.tight_layout()
    fig.savefig(out / CHART, dpi=110)
    plt.close(fig)
    return [CHART]
