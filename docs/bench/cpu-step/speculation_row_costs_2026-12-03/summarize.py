"""A 2026-12-03 trial of speculation's row costs (not kept), from the files beside this script:
`radixserve bench peers` (peers_new_N: the trial's code with speculation on and off; peers_main_N: main
with speculation on), alternated twice, and `radixserve bench spec-batch-cap --batches 1,4,8 --rounds 1`
(edit-style replies), alternated twice; the step's cost curve the trials' defaults came from. The
first trial's files lie beside this script, the second's in per_position/ (no cost curve there).

    python summarize.py > summary.md
    python summarize.py per_position > per_position/summary.md
"""

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).parent / (sys.argv[1] if len(sys.argv) > 1 else "")


def peers(folder: str) -> dict[str, dict[str, dict[str, float]]]:
    results = json.loads((HERE / folder / "results.json").read_text())["results"]
    return {w: {s: r["median"] for s, r in by.items()} for w, by in results.items()}


print("### `radixserve bench peers`, output tok/s (decode: tok/s per request) and mean TTFT ms\n")
print("| workload | run | trial, speculation on | main, speculation on | speculation off | trial / main |")
print("|---|---:|---:|---:|---:|---:|")
for workload in ("decode", "shared-prompt", "multi-turn"):
    for run in (1, 2):
        new, main = peers(f"peers_new_{run}")[workload], peers(f"peers_main_{run}")[workload]
        key = "decode_tok_s_mean" if workload == "decode" else "output_tokens_per_s"
        on, base, off = new["radixserve"], main["radixserve"], new["radixserve-nospec"]
        print(f"| {workload} | {run} | {on[key]:.1f} ({on['ttft_ms_mean']:.0f}) | {base[key]:.1f} "
              f"({base['ttft_ms_mean']:.0f}) | {off[key]:.1f} ({off['ttft_ms_mean']:.0f}) | {on[key] / base[key]:.2f} |")

print("\n### `radixserve bench spec-batch-cap`: edit-style replies, decode tok/s with speculation on / off\n")
print("| decoding sequences | run | trial | main |")
print("|---:|---:|---:|---:|")
for run in (1, 2):
    new = json.loads((HERE / f"spec_batch_cap_new_{run}.json").read_text())["rows"]
    main = json.loads((HERE / f"spec_batch_cap_main_{run}.json").read_text())["rows"]
    for a, b in zip(new, main):
        print(f"| {a['batch']} | {run} | {a['ratio']:.2f}x | {b['ratio']:.2f}x |")

curves = [name for name in ("step_curve_ctx300_1.json", "step_curve_ctx300_2.json", "step_curve_ctx1100.json")
          if (HERE / name).exists()]
if curves:
    print("\n### The step's cost by rows (`radixserve bench step`, the shipped Q4_1, speculation off), median ms\n")
for name in curves:
    rows = json.loads((HERE / name).read_text())["rows"]
    points = sorted((r["batch"], statistics.median(r["step_ms"])) for r in rows)
    print(f"- {name} (context {rows[0]['context']}): " + ", ".join(f"{b} rows {ms:.1f}" for b, ms in points))
