"""The token hit rate of a `radixserve bench agent` run over time (docs/bench/hybrid.md): its turns in
the order they were sent, in groups of N, each group's hit rate, longest prompt and turns that read
less than half their prompt from the cache or nothing. Shows where a cache stops holding a workload.

    python scripts/agent_hits_over_time.py RUN_DIR/results.json [--group 18] [--api chat] [--cache on]
"""

from __future__ import annotations

import argparse
import json
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results")
    parser.add_argument("--group", type=int, default=18, help="turns per row")
    parser.add_argument("--api", default="chat")
    parser.add_argument("--cache", default="on")
    args = parser.parse_args()
    with open(args.results) as f:
        turns = sorted(json.load(f)["runs"][args.api][args.cache]["turns"], key=lambda t: t["send_s"])
    print("| turns, in the order sent | token hit rate | longest prompt | turns under half cached | turns with no hit |")
    print("|---|---:|---:|---:|---:|")
    for first in range(0, len(turns), args.group):
        group = turns[first:first + args.group]
        prompt = sum(t["prompt_tokens"] for t in group)
        cached = sum(t["cached_tokens"] for t in group)
        print(f"| {first + 1}–{first + len(group)} | {cached / prompt:.1%} | {max(t['prompt_tokens'] for t in group):,} "
              f"| {sum(t['cached_tokens'] < t['prompt_tokens'] / 2 for t in group)} "
              f"| {sum(t['cached_tokens'] == 0 for t in group)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
