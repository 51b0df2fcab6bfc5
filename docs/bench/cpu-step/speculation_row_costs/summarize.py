"""The A/B of 2026-12-02 (docs/speculation.md, "Scheduling"): the code of main ("old") against the
fitted paying rate (a local branch, not landed: docs/speculation.md describes it; "new"),
alternated, each run `radixserve bench peers` alone. Prints the table the doc quotes:
python docs/bench/cpu-step/speculation_row_costs/summarize.py"""

import json
from pathlib import Path

HERE = Path(__file__).parent
METRICS = ("output_tokens_per_s", "ttft_ms_mean", "ttft_ms_p50")

print("| run | workload | system | output tok/s | TTFT mean ms | TTFT p50 ms |")
print("|---|---|---|---:|---:|---:|")
for name in ("old_1", "new_1", "old_2", "new_2", "old_3", "new_3", "dec_old_1", "dec_new_1", "dec_old_2", "dec_new_2"):
    results = json.loads((HERE / name / "results.json").read_text())["results"]
    for workload, systems in results.items():
        for system, figures in systems.items():
            m = figures["median"]
            print(f"| {name} | {workload} | {system} | " + " | ".join(f"{m[k]:,.1f}" for k in METRICS) + " |")
print()
print("| run | batch | spec on tok/s | spec off tok/s | on / off |")
print("|---|---:|---:|---:|---:|")
for name in ("edit_style_old_1", "edit_style_new_1", "edit_style_old_2", "edit_style_new_2"):
    for row in json.loads((HERE / f"{name}.json").read_text())["rows"]:
        print(f"| {name} | {row['batch']} | {row['spec_on_tok_s']:.1f} | {row['spec_off_tok_s']:.1f} | {row['ratio']:.2f}x |")
