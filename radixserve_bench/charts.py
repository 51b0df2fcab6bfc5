"""PNG charts of a results document (matplotlib, headless): output throughput per system, TTFT
distributions, cumulative cache hit rate over time, pool blocks in use over time, for multi-turn
the mean TTFT of each turn, for returning-chats the host tier's hits and first / returning-turn
TTFT, and for the speculation workloads decode speed per request with tokens per step. Timelines
show the first repeat; bars show medians with min-max whiskers."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from radixserve_bench.returning import WORKLOAD as RETURNING
from radixserve_bench.speculation import COMPARED
from radixserve_bench.systems import SYSTEM_DESCRIPTIONS


def _color(system: str) -> str:
    """The same color for a system in every chart."""
    names = list(SYSTEM_DESCRIPTIONS)
    return f"C{names.index(system) % 10}" if system in names else "gray"


def _workloads(results: dict) -> list[str]:
    return list(results["results"])


def _first(entry: dict) -> dict:
    return entry["repeats"][0]


def throughput(results: dict, path: Path) -> None:
    names = _workloads(results)
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    for ax, wname in zip(axes[0], names):
        per_system = results["results"][wname]
        systems = list(per_system)
        med = [per_system[s]["median"]["output_tokens_per_s"] for s in systems]
        runs = [[r["metrics"]["output_tokens_per_s"] for r in per_system[s]["repeats"]] for s in systems]
        err = [[m - min(r) for m, r in zip(med, runs)], [max(r) - m for m, r in zip(med, runs)]]
        ax.bar(range(len(systems)), med, yerr=err, capsize=3, color=[_color(s) for s in systems])
        ax.set_xticks(range(len(systems)), systems, rotation=30, ha="right", fontsize=8)
        ax.set_title(wname)
        ax.set_ylabel("output tokens / s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ttft(results: dict, path: Path) -> None:
    names = _workloads(results)
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    for ax, wname in zip(axes[0], names):
        per_system = results["results"][wname]
        systems = list(per_system)
        data = [[q["ttft_ms"] for r in per_system[s]["repeats"] for q in r["requests"]] for s in systems]
        ax.boxplot(data, showfliers=True)
        ax.set_xticks(range(1, len(systems) + 1), systems, rotation=30, ha="right", fontsize=8)
        ax.set_yscale("log")
        ax.set_title(f"{wname}: TTFT, all repeats")
        ax.set_ylabel("ms (log)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def hit_rate(results: dict, path: Path) -> None:
    names = _workloads(results)
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    for ax, wname in zip(axes[0], names):
        optimal = None
        for sname, entry in results["results"][wname].items():
            points = _first(entry)["timeline"]["hit_rate"]
            if points:
                ax.step([p[0] for p in points], [p[1] for p in points], where="post", label=sname, color=_color(sname))
            optimal = _first(entry)["metrics"]["optimal_hit_rate"]
        if optimal is not None:
            ax.axhline(optimal, color="gray", linestyle="--", linewidth=1, label="optimal (unbounded)")
        ax.set_ylim(0, 1)
        ax.set_title(f"{wname}: cumulative hit rate")
        ax.set_xlabel("seconds")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def blocks(results: dict, path: Path) -> None:
    names = _workloads(results)
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    for ax, wname in zip(axes[0], names):
        for sname, entry in results["results"][wname].items():
            points = _first(entry)["timeline"]["blocks"]
            if not points:
                continue
            ax.plot([p[0] for p in points], [p[1] for p in points], label=f"{sname} in use", color=_color(sname))
            static = _first(entry)["metrics"].get("static_reservation_blocks")
            if sname == "radixserve" and static:
                ax.axhline(static, color=_color(sname), linestyle="--", linewidth=1, label="static reservation (peak)")
        ax.set_title(f"{wname}: KV blocks held by live requests")
        ax.set_xlabel("seconds")
        ax.set_ylabel("blocks")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ttft_by_turn(results: dict, path: Path) -> bool:
    per_system = results["results"].get("multi-turn")
    if not per_system:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for sname, entry in per_system.items():
        m = entry["median"]
        turns = sorted(int(k.removeprefix("ttft_ms_turn")) for k in m if k.startswith("ttft_ms_turn"))
        ax.plot(turns, [m[f"ttft_ms_turn{t}"] for t in turns], marker="o", label=sname, color=_color(sname))
    ax.set_xlabel("turn")
    ax.set_ylabel("mean TTFT, ms (log)")
    ax.set_yscale("log")
    ax.set_title("multi-turn: TTFT by turn")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def host_tier(results: dict, path: Path) -> bool:
    """returning-chats: hit rate split into device hits and host load-backs, and mean TTFT by turn."""
    per_system = results["results"].get(RETURNING)
    if not per_system:
        return False
    systems = list(per_system)
    med = [per_system[s]["median"] for s in systems]
    fig, (hits, turns) = plt.subplots(1, 2, figsize=(11, 4))
    host = [m["hit_rate"] * m.get("host_hit_share", 0.0) for m in med]
    device = [m["hit_rate"] - h for m, h in zip(med, host)]
    colors = [_color(s) for s in systems]
    hits.bar(range(len(systems)), device, color=colors, label="device pool")
    hits.bar(range(len(systems)), host, bottom=device, color=colors, hatch="//", alpha=0.5, label="loaded from host")
    hits.set_xticks(range(len(systems)), systems, rotation=20, ha="right", fontsize=8)
    hits.set_ylim(0, 1)
    hits.set_ylabel("hit rate (median)")
    hits.set_title(f"{RETURNING}: prompt tokens served from cache")
    hits.legend(fontsize=7)
    for sname, m in zip(systems, med):
        ks = sorted(int(k.removeprefix("ttft_ms_turn")) for k in m if k.startswith("ttft_ms_turn"))
        turns.plot(ks, [m[f"ttft_ms_turn{k}"] for k in ks], marker="o", label=sname, color=_color(sname))
    turns.xaxis.set_major_locator(MaxNLocator(integer=True))
    turns.set_xlabel("turn (1: first; later: returning after every other conversation's turn)")
    turns.set_ylabel("mean TTFT, ms (log)")
    turns.set_yscale("log")
    turns.set_title(f"{RETURNING}: TTFT by turn")
    turns.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def speculation(results: dict, path: Path) -> bool:
    """Mean decode tok/s per request per system on each speculation workload, labelled with tokens per step."""
    names = [w for w in COMPARED if any("decode_tok_s_mean" in e["median"] for e in results["results"].get(w, {}).values())]
    if not names:
        return False
    fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 4), squeeze=False)
    for ax, wname in zip(axes[0], names):
        per_system = {s: e for s, e in results["results"][wname].items() if "decode_tok_s_mean" in e["median"]}
        systems = list(per_system)
        med = [per_system[s]["median"]["decode_tok_s_mean"] for s in systems]
        runs = [[r["metrics"].get("decode_tok_s_mean", m) for r in per_system[s]["repeats"]] for s, m in zip(systems, med)]
        err = [[m - min(r) for m, r in zip(med, runs)], [max(r) - m for m, r in zip(med, runs)]]
        bars = ax.bar(range(len(systems)), med, yerr=err, capsize=3, color=[_color(s) for s in systems])
        steps = [per_system[s]["median"].get("tokens_per_step") for s in systems]
        ax.bar_label(bars, [f"{t:.2f} tok/step" if t else "" for t in steps], fontsize=7)
        ax.set_xticks(range(len(systems)), systems, rotation=30, ha="right", fontsize=8)
        ax.set_title(f"{wname}: decode speed")
        ax.set_ylabel("decode tokens / s per request (mean)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_charts(results: dict, out_dir: Path) -> list[str]:
    """Every chart that applies to `results`, written into `out_dir`; their file names."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, fn in (("throughput.png", throughput), ("ttft.png", ttft), ("hit_rate.png", hit_rate),
                     ("blocks.png", blocks)):
        fn(results, out_dir / name)
        written.append(name)
    for name, maybe in (("ttft_by_turn.png", ttft_by_turn), ("host_tier.png", host_tier),
                        ("speculation.png", speculation)):
        if maybe(results, out_dir / name):
            written.append(name)
    return written
