"""One CPU matmul on GGUF blocks at a time: the C++ kernel on each quantized format (Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), with int8 and with fp32 activations, against the same kernel on fp32
weights, on the embedded model's shapes, as
micro-timings that guide the kernel's design (claims about a model's decode come from `radixserve
bench step` and `bench peers`).

Each shape is timed with enough same-shaped weights in rotation (about 300 MB of fp32, and as many
packed copies) that none stays in cache, the best of three passes. Rows are reported as weights
per second (millions of weights multiplied per microsecond's share) and as GB/s of the bytes the
kernel read (the packed weight); 512 rows as GFLOP/s.

    radixserve bench cpu-ggml --json docs/bench/quantized/ggml_kernels.json

`--layers N` times, instead, the four projections of a decoder layer (qkv, o, gate_up, down) as a
decode step calls them: N layers' distinct weights of each type, one row, layer after layer, the
median of `--repeats` passes (the thirty layers of the embedded model are 66 MB in Q4_1, so every
pass reads them from memory, each weight after a different one, as inside a step):

    radixserve bench cpu-ggml --layers 30 --types Q4_1,Q8_0 --activations int8 --json FILE
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from radixserve.kernels.cpu_extension import load_extension
from radixserve.kernels.cpu_linear import BlockedLinear
from radixserve.kernels.ggml_quants import ACTIVATIONS, FORMATS, SUPPORTED_TYPES, QuantizedLinear, pack_ggml
from radixserve_bench.checks.cpu_linear import ROTATION_BYTES, SHAPES, best_seconds
from radixserve_bench.checks.micro_result import write_result

ROW_COUNTS = (1, 4, 16, 512)
LAYER_SHAPES = ("qkv", "o", "gate_up", "down")  # a decoder layer's projections, in the order a step calls them


def random_packed(type_name: str, out: int, inp: int, rng: np.random.Generator, activations: str) -> torch.Tensor:
    """A packed weight of random quants with small finite fp16 scales."""
    fmt = FORMATS[type_name]
    blocks = rng.integers(0, 256, size=(out, inp // fmt.group, fmt.block_bytes), dtype=np.uint8)
    for start, _, kind in fmt.fields:
        if kind == "half":
            scales = rng.uniform(-0.02, 0.02, size=blocks.shape[:2]).astype(np.float16)
            blocks[..., start:start + 2] = scales.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return pack_ggml([(type_name, blocks.reshape(out, -1))], inp, activations)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    parser.add_argument("--types", default=",".join(SUPPORTED_TYPES), help="GGUF types to time (comma-separated)")
    parser.add_argument("--activations", default="int8,float32",
                        help=f"how the quantized kernels take their inputs ({', '.join(ACTIVATIONS)}; comma-separated)")
    parser.add_argument("--layers", type=positive, default=None,
                        help="time N layers' four projections at one row in step order instead of each shape alone")
    parser.add_argument("--repeats", type=positive, default=11, help="passes over the layers (--layers), median")


def positive(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not at least 1")
    return value


def layer_rows(types: list[str], activations: list[str], layers: int, repeats: int) -> list[dict[str, Any]]:
    """One row per type and activations: the layers' four projections at one row, in step order."""
    rng = np.random.default_rng(0)
    shapes = [SHAPES[name] for name in LAYER_SHAPES]
    linear = torch.ops.radixserve.linear
    rows: list[dict[str, Any]] = []
    for type_name in types:
        if any(inp % FORMATS[type_name].group for _, inp in shapes):
            raise SystemExit(f"radixserve bench cpu-ggml: {type_name}'s blocks of {FORMATS[type_name].group} inputs "
                             f"do not divide the layers' {sorted({inp for _, inp in shapes})} inputs")
        for kind in activations:
            stack = [[random_packed(type_name, out, inp, rng, kind) for out, inp in shapes] for _ in range(layers)]
            inputs = [torch.randn(1, inp) for _, inp in shapes]
            passes = []
            for _ in range(repeats + 1):  # the first pass unmeasured
                started = time.perf_counter()
                for layer in stack:
                    for x, (out, _), packed in zip(inputs, shapes, layer):
                        linear(x, packed, None, out)
                passes.append(time.perf_counter() - started)
            seconds = statistics.median(passes[1:])
            read = sum(packed.numel() for layer in stack for packed in layer)
            row: dict[str, Any] = {"shape": "layers", "layers": layers, "rows": 1, "weights": type_name,
                                   "activations": kind, "us": seconds * 1e6, "bytes": read,
                                   "GBps": read / seconds / 1e9, "passes_us": [t * 1e6 for t in passes[1:]]}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "passes_us"}))
    return rows


def run(args: argparse.Namespace) -> int:
    types, activations = args.types.split(","), args.activations.split(",")
    unknown = [t for t in types if t not in FORMATS] + [a for a in activations if a not in ACTIVATIONS]
    if unknown:
        raise SystemExit(f"radixserve bench cpu-ggml: unknown {', '.join(unknown)} (types: {', '.join(FORMATS)}; "
                         f"activations: {', '.join(ACTIVATIONS)})")
    load_extension()
    if args.layers:
        write_result(layer_rows(types, activations, args.layers, args.repeats), args.json)
        return 0
    rng = np.random.default_rng(0)
    generator = torch.Generator().manual_seed(0)
    rows: list[dict[str, Any]] = []
    for name, (out, inp) in SHAPES.items():
        copies = max(2, ROTATION_BYTES // (out * inp * 4))
        kinds: dict[tuple[str, str], list[torch.nn.Module]] = {
            ("fp32", "float32"): [BlockedLinear(torch.randn(out, inp, generator=generator), None)
                                  for _ in range(copies)]}
        for type_name in types:
            for kind in activations:
                if inp % FORMATS[type_name].group == 0:
                    kinds[type_name, kind] = [
                        QuantizedLinear(random_packed(type_name, out, inp, rng, kind), out, inp)
                        for _ in range(copies)]
        for count in ROW_COUNTS:
            if count == 512 and name == "lm_head":
                continue  # a prefill chunk's logits are never all taken
            x = torch.randn(count, inp, generator=generator)
            for (weights_kind, inputs_kind), weights in kinds.items():
                seconds = best_seconds(lambda m, x: m(x), weights[:4] if count == 512 else weights, x)
                packed = weights[0].weight
                assert isinstance(packed, torch.Tensor)
                read = packed.numel() * packed.element_size()
                row: dict[str, Any] = {"shape": name, "out": out, "in": inp, "rows": count, "weights": weights_kind,
                                       "activations": inputs_kind, "us": seconds * 1e6, "bytes": read}
                if count < 512:
                    row["Gweights_per_s"] = out * inp / seconds / 1e9
                    row["GBps"] = read / seconds / 1e9
                else:
                    row["GFLOPs"] = 2 * count * out * inp / seconds / 1e9
                rows.append(row)
                print(json.dumps(row))
    write_result(rows, args.json)
    return 0
