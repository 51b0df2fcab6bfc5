"""One CPU matmul at a time: the C++ kernel (`BlockedLinear`) against oneDNN's packed weights
(`PackedLinear`) on the embedded model's shapes, as micro-timings that guide the kernel's design
(claims about the step come from `radixserve bench step`).

Each shape is timed with enough same-shaped weights in rotation (about 300 MB) that none stays in
cache, the best of three passes; 1, 4 and 16 rows as GB/s of weights read, 512 rows (a prefill
chunk) as GFLOP/s.

    radixserve bench cpu-linear --json docs/bench/cpu-step/linear_kernels.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from radixserve.kernels.cpu_extension import load_extension
from radixserve.kernels.cpu_linear import BlockedLinear, PackedLinear
from radixserve_bench.checks.micro_result import write_result

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
ROTATION_BYTES = 300 << 20


def best_seconds(run: Any, weights: list[torch.nn.Module], x: torch.Tensor) -> float:
    """Seconds per product: the best of three passes over every weight once."""
    run(weights[0], x)
    passes = []
    for _ in range(3):
        started = time.perf_counter()
        for weight in weights:
            run(weight, x)
        passes.append((time.perf_counter() - started) / len(weights))
    return min(passes)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")


def run(args: argparse.Namespace) -> int:
    load_extension()
    generator = torch.Generator().manual_seed(0)
    rows: list[dict[str, Any]] = []
    for name, (out, inp) in SHAPES.items():
        copies = max(2, ROTATION_BYTES // (out * inp * 4))
        plain = [torch.randn(out, inp, generator=generator) for _ in range(copies)]
        kinds: dict[str, list[torch.nn.Module]] = {"kernel": [BlockedLinear(w, None) for w in plain],
                                                  "onednn": [PackedLinear(w, None) for w in plain]}
        del plain
        for count in (1, 4, 16, 512):
            if count == 512 and name == "lm_head":
                continue  # a prefill chunk's logits are never all taken
            x = torch.randn(count, inp, generator=generator)
            row: dict[str, Any] = {"shape": name, "out": out, "in": inp, "rows": count}
            for kind, weights in kinds.items():
                seconds = best_seconds(lambda m, x: m(x), weights[:4] if count == 512 else weights, x)
                row[f"{kind}_us"] = seconds * 1e6
                row[f"{kind}_GBps" if count < 512 else f"{kind}_GFLOPs"] = \
                    out * inp * 4 / seconds / 1e9 if count < 512 else 2 * count * out * inp / seconds / 1e9
            rows.append(row)
            print(json.dumps(row))
    write_result(rows, args.json)
    return 0
