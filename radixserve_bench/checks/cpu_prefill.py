"""Does the C++ matmul kernel cost prefill anything? A 512-token prompt's prefill (one step, then the
first token) on two engines of the embedded model: the C++ kernels (the default) and oneDNN's matmuls
with the Python layers (`--enforce-eager`), alternating, fresh random prompts each time so nothing
hits the cache. A prefill chunk's attention runs SDPA on both; only the matmuls differ.

    radixserve bench cpu-prefill --json docs/bench/cpu-step/prefill_kernels.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from radixserve.engine import LLM
from radixserve.model.embedded import resolve_model
from radixserve.sampling_params import SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=6, help="prefills per engine; the first is not counted")
    parser.add_argument("--json", type=Path, default=None)


def run(args: argparse.Namespace) -> int:
    path = resolve_model(None)[0]
    engines = {"kernels": LLM(model=path, num_speculative_tokens=0).engine,
               "onednn_eager": LLM(model=path, num_speculative_tokens=0, enforce_eager=True).engine}
    rng = random.Random(0)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            engine.add_request([rng.randrange(1000, 49000) for _ in range(args.tokens)],
                               SamplingParams(max_tokens=1, temperature=0.0))
            started = time.perf_counter()
            while engine.has_unfinished():
                engine.step()
            times[name].append(1000 * (time.perf_counter() - started))
    result = {"tokens": args.tokens, "ms": times,
              "median_ms": {name: statistics.median(ms[1:]) for name, ms in times.items()},
              "date": time.strftime("%Y-%m-%d")}
    result["kernels_over_onednn"] = result["median_ms"]["kernels"] / result["median_ms"]["onednn_eager"]
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0
