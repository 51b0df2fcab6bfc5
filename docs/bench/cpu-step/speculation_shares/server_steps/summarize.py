"""The steps of a step log (serve_with_step_log.py) by kind: decode-only steps (decodes and verifications
of drafts) and steps with prompt rows, by sequences in the step; what each kind cost and yielded.

    python summarize.py steps_speculation_on.jsonl steps_speculation_off.jsonl
"""

import json
import sys

WARMUP_STEPS = 4  # the warm-up request's steps, before the workload's

for path in sys.argv[1:]:
    with open(path) as lines:
        steps = [json.loads(line) for line in lines][WARMUP_STEPS:]
    print(f"### {path}: {len(steps)} steps, {sum(s['duration_s'] for s in steps):.2f} s\n")
    print("| kind | sequences | steps | s | ms/step | decode rows/step | drafts/step | prompt rows/step | tokens committed |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    kinds: dict[tuple[str, int], list[dict]] = {}
    for s in steps:
        kinds.setdefault(("with prompt rows" if s["prefill_tokens"] else "decode only", s["num_seqs"]), []).append(s)
    for (kind, seqs), group in sorted(kinds.items()):
        n, t = len(group), sum(s["duration_s"] for s in group)
        decode_rows = sum(s["decode_tokens"] for s in group) / n
        print(f"| {kind} | {seqs} | {n} | {t:.2f} | {1000 * t / n:.1f} | {decode_rows:.1f} "
              f"| {sum(s['draft_tokens'] for s in group) / n:.1f} | {sum(s['prefill_tokens'] for s in group) / n:.1f} "
              f"| {sum(s['committed_tokens'] for s in group)} |")
    for kind in ("decode only", "with prompt rows"):
        group = [s for (k, _), g in kinds.items() if k == kind for s in g]
        t = sum(s["duration_s"] for s in group)
        committed = sum(s["committed_tokens"] for s in group)
        print(f"\n{kind}: {len(group)} steps, {t:.2f} s, {committed} tokens committed ({committed / t:.0f} per s), "
              f"{sum(s['prefill_tokens'] for s in group)} prompt tokens")
    print()
