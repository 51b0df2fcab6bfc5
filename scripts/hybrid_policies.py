"""Compare hybrid-model checkpoint policies from `radixserve bench agent` runs (docs/bench/hybrid.md):
one run directory (`--out`) per policy, state-slot count, eviction or the cache off, all of one
workload. Writes OUT/table.md, OUT/policies.png and each run's results.json as OUT/<run>.json.

Token hit rate is the servers' cached prompt tokens over prompt tokens, every turn; the state memory
is the engine's state slots times the bytes of one (model/state_cache.StateLayout of the run's model,
its sliding-window layers as the run's --sliding-window-kv kept them), and with window blocks their
pool's blocks times a block's bytes too (each every sliding layer's K/V of a block); the KV pool's
memory is its blocks times a block's bytes. Runs from before 2026-12-01 evening, when window blocks
came with window states, record no `state_slots`: their slots are the options'.
Tokens per GB of pool: the tokens the radix tree held when the run was over (`bench agent`'s
`cache_held`) over the state and KV memory together.

    python scripts/hybrid_policies.py docs/bench/hybrid/policies /tmp/pol/branches-8 /tmp/pol/off ...
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

from radixserve.config import DEFAULT_CPU_KV_MB
from radixserve.model.kv_cache import KVLayout
from radixserve.model.spec import load_spec
from radixserve.model.state_cache import StateLayout


def _row(run_dir: Path) -> dict[str, Any]:
    results = json.loads((run_dir / "results.json").read_text())
    options = results["options"]
    (api, by_cache), = results["runs"].items()
    (cache, run), = by_cache.items()
    spec = load_spec(options["model"])
    held = run.get("cache_held") or {}
    layout = held.get("sliding_window_kv", options.get("sliding_window_kv"))  # as the engine resolved the flag
    if layout in ("window", "window-blocks"):
        spec = spec.with_window_states()
    states = StateLayout(tuple(spec.recurrents), torch.float32)
    kv = KVLayout(len(spec.paged_attentions), spec.num_kv_heads, spec.head_dim, options["block_size"], torch.float32)
    slots = held.get("state_slots", options.get("state_slots"))
    if not spec.is_hybrid or cache == "off":
        slots = 0
    elif slots is None:  # the engine's default (engine/sizing.py, CPU): what the KV budget's memory holds
        slots = max(4, min(2 * options["max_num_seqs"], states.slots_for_budget(DEFAULT_CPU_KV_MB)))
    summary = run["summary"]
    windows = f"sliding-window K/V: {layout}, " if layout else ""
    label = (f"{run_dir.name}: cache off" if cache == "off" else f"{run_dir.name}: {windows}"
             f"{options.get('state_checkpoints', 'branches')}, {options.get('state_eviction', 'lru')}, {slots} slots")
    window_blocks = held.get("window_blocks", 0)
    if window_blocks:  # each holds a block of every sliding layer's K/V (cache/window_blocks.py)
        label += f", {window_blocks} window blocks"
    if "eviction_lookahead" in options:  # (runs before the option existed evicted least recently used first)
        label += f", eviction lookahead {options['eviction_lookahead']}"
    window_mb = window_blocks * options["block_size"] * sum(layer.conv_dim * 4 for layer in states.layers) / 2**20
    state_mb = slots * states.bytes_per_slot / 2**20 + window_mb
    kv_mb = run["num_blocks"] * kv.bytes_per_block / 2**20
    return {"run": run_dir.name, "label": label, "api": api, "turns": summary["turns"],
            "prompt_tokens": summary["prompt_tokens"], "cached_tokens": summary["cached_tokens"],
            "computed_tokens": summary["computed_tokens"], "hit_rate": summary["cached_fraction"],
            "later_hit_rate": summary["later_cached_fraction"], "ttft_turn1_ms": summary["ttft_ms_turn1_mean"],
            "ttft_later_ms": summary["ttft_ms_later_mean"], "duration_s": run["duration_s"],
            "state_mb": state_mb, "kv_mb": kv_mb, "num_blocks": run["num_blocks"],
            "held_tokens": held.get("tree_tokens"),
            "tokens_per_gb": held["tree_tokens"] / ((state_mb + kv_mb) * 2**20 / 1e9) if held else None,
            "errors": len(run["errors"])}


def _table(rows: list[dict[str, Any]]) -> str:
    lines = ["| run | token hit rate | turns 2+ | prompt tokens computed | state memory | KV pool "
             "| tokens held at the end, per GB of pool | TTFT turn 1 / 2+, s | run, s | errors |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        held = "" if r["held_tokens"] is None else f"{r['held_tokens']:,}, {r['tokens_per_gb']:,.0f}"
        lines.append(f"| {r['label']} | {r['hit_rate']:.1%} | {r['later_hit_rate']:.1%} | {r['computed_tokens']:,} | "
                     f"{r['state_mb']:.0f} MB | {r['kv_mb']:.0f} MB ({r['num_blocks']} blocks) | {held} | "
                     f"{r['ttft_turn1_ms'] / 1000:.1f} / {r['ttft_later_ms'] / 1000:.1f} | {r['duration_s']:.0f} | "
                     f"{r['errors']} |")
    return "\n".join(lines) + "\n"


def _chart(rows: list[dict[str, Any]], path: Path) -> None:
    fig, (hits, memory) = plt.subplots(1, 2, figsize=(12, 0.5 * len(rows) + 1.5))
    labels = [r["label"] for r in rows]
    hits.barh(labels, [100 * r["hit_rate"] for r in rows], color="C0")
    hits.set_xlabel("token hit rate, % of prompt tokens")
    hits.invert_yaxis()
    memory.barh(labels, [r["state_mb"] for r in rows], color="C1")
    memory.set_xlabel("state slots' (and window blocks') memory, MB")
    memory.invert_yaxis()
    memory.set_yticklabels([])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(out: Path, run_dirs: list[Path]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rows = [_row(d) for d in run_dirs]
    (out / "table.md").write_text(_table(rows))
    _chart(rows, out / f"{out.name}.png")
    for d in run_dirs:
        shutil.copy(d / "results.json", out / f"{d.name}.json")
    print(_table(rows))


if __name__ == "__main__":
    main(Path(sys.argv[1]), [Path(a) for a in sys.argv[2:]])
