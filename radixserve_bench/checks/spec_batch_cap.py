"""Measure where speculative decoding stops paying as the batch grows (the default of
--speculative-max-batch for this device): decode tok/s of an edit-style workload (replies that repeat
most of their prompt, drafted by prompt lookup) with speculation on and off, batch by batch, each on
a fresh engine, interleaved over rounds. Prints a markdown table and writes JSON with --json.

    radixserve bench spec-batch-cap --batches 1,2,4,8,16 --rounds 2 --json out.json

`--max-rows N` sets --speculative-max-rows (default: the device's; a large N measures drafting with the
batch cap alone).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from radixserve.engine import LLM
from radixserve.sampling_params import SamplingParams

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "lambda", "sigma", "omega",
         "value", "total", "count", "index", "result", "buffer", "stream", "token", "cache", "block"]


def snippet(i: int) -> str:
    """A small deterministic Python function, different for every i."""
    a, b, c = WORDS[i % len(WORDS)], WORDS[(i * 7 + 3) % len(WORDS)], WORDS[(i * 11 + 5) % len(WORDS)]
    return (f"def update_{a}({b}, {c}):\n    {a} = {b} + {c}\n    if {a} > {i}:\n        {a} = {a} - {c}\n"
            f"    return {a} * {b}\n")


def prompts(batch: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": "Rename the function to `compute` and return the whole code:\n```python\n"
              + snippet(i) + "```"}] for i in range(batch)]


def decode_tok_s(llm: LLM, batch: int, max_tokens: int) -> float:
    start = time.perf_counter()
    outs = llm.chat(prompts(batch), SamplingParams(temperature=0.0, max_tokens=max_tokens))
    elapsed = time.perf_counter() - start
    first = max(o.timing.first_token or 0.0 for o in outs) - min(o.timing.arrival for o in outs)
    tokens = sum(o.usage.completion_tokens for o in outs)
    return tokens / max(1e-9, elapsed - first)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-rows", type=int, default=None)
    ap.add_argument("--json", default=None)


def run(a: argparse.Namespace) -> int:
    batches = [int(b) for b in a.batches.split(",")]
    engines = {spec: LLM(num_speculative_tokens=8 if spec else 0, speculative_max_batch=max(batches),
                         speculative_max_rows=a.max_rows,
                         enable_prefix_cache=False, max_num_seqs=max(batches)) for spec in (True, False)}
    for llm in engines.values():
        decode_tok_s(llm, 1, 8)  # warm-up
    rows = []
    for batch in batches:
        runs: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(a.rounds):
            for spec, llm in engines.items():
                runs[spec].append(decode_tok_s(llm, batch, a.max_tokens))
        on, off = statistics.median(runs[True]), statistics.median(runs[False])
        rows.append({"batch": batch, "spec_on_tok_s": on, "spec_off_tok_s": off, "ratio": on / off})
    print("| batch | spec on tok/s | spec off tok/s | on / off |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['spec_on_tok_s']:.1f} | {r['spec_off_tok_s']:.1f} | {r['ratio']:.2f}x |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "rounds": a.rounds, "max_tokens": a.max_tokens, "max_rows": a.max_rows}, f,
                      indent=1)
    return 0
