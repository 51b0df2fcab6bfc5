"""The agent workload's chart, agents.png: per turn, the mean share of the prompt served from the cache
and the mean TTFT, each API with the cache on (solid) and off (dashed); and the scheduler phase's
scheduler's CPU time per step (and the wall-clock schedule phase less the grammar masks)
against the running sequences, with the 0.3 ms target. harness.py writes it
beside results.json and table.md; matplotlib (the bench extra) is imported only here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

CHART = "agents.png"
API_COLORS = {"chat": "C0", "responses": "C1", "anthropic": "C2"}


def write_charts(results: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from radixserve_bench.agents.analysis import SCHEDULER_TARGET_MS

    sched = results.get("scheduler")
    fig, axes = plt.subplots(1, 3 if sched else 2, figsize=(16 if sched else 11, 4.2))
    cached, ttft = axes[0], axes[1]
    for api, modes in results["runs"].items():
        for cache, run in modes.items():
            by_turn = run["summary"]["by_turn"]
            turns = sorted(int(k) for k in by_turn)
            style = dict(color=API_COLORS.get(api, "gray"), linestyle="-" if cache == "on" else "--", marker=".",
                         label=f"{api}, cache {cache}")
            cached.plot(turns, [by_turn[str(k)]["cached_fraction"] for k in turns], **style)
            ttft.plot(turns, [by_turn[str(k)]["ttft_ms"] for k in turns], **style)
    cached.set_ylim(-0.02, 1.02)
    cached.set_xlabel("turn")
    cached.set_ylabel("cached / prompt tokens (mean over tasks)")
    cached.set_title("prompt served from the cache, per turn")
    cached.legend(fontsize=7)
    ttft.set_yscale("log")
    ttft.set_xlabel("turn")
    ttft.set_ylabel("TTFT, ms (mean over tasks, log)")
    ttft.set_title("time to first token, per turn")
    ttft.legend(fontsize=7)
    if sched:
        ax = axes[2]
        samples = sched.get("samples") or []
        ax.scatter([s[1] for s in samples], [s[0] for s in samples], s=6, alpha=0.5, label="scheduler CPU")
        walls = [(s[1], s[2]) for s in samples if s[2] is not None]
        if walls:
            ax.scatter([w[0] for w in walls], [w[1] for w in walls], s=6, alpha=0.3, color="gray",
                       label="schedule phase less masks (wall)")
        ax.set_xlabel("sequences running in the step")
        ax.axhline(SCHEDULER_TARGET_MS, color="red", linestyle="--", linewidth=1, label=f"target {SCHEDULER_TARGET_MS} ms")
        ax.set_yscale("log")
        ax.set_ylabel("ms per step (log)")
        ax.set_title(f"scheduler per step, {sched['loops']} agent loops in flight")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / CHART, dpi=110)
    plt.close(fig)
    return [CHART]
