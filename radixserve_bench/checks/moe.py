"""One MoE layer's routed experts at decode sizes: `kernels.moe.routed_experts` on this machine's path
(the C++ kernel on CPU, the Triton kernels on CUDA) against the floor that reading the active experts'
weights sets, and against the plain-torch reference and transformers' eager experts (the expert part of
`Qwen3MoeSparseMoeBlock`, the router left out of both) holding the same weights.

The floor of a step is the bytes of the experts its tokens route to over the machine's read bandwidth,
measured as the best sum over a 1 GiB tensor. Routing deals the experts like cards (`_deal`): a batch
reads as many distinct experts as it can, and the steps timed in turn walk every expert of enough
copies of the layer (`--rotation-mb`) before one is read again, so none comes from cache, as in a model
of many layers. Each time is the best of `--rounds` passes, each pass measuring the bandwidth again.

    radixserve bench moe --json moe.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from radixserve.kernels.moe import ExpertActivation, ExpertWeights, prepare, routed_experts, routed_experts_reference
from radixserve_bench.checks.micro_result import write_result

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
Run = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden", type=int, default=2048, help="hidden size (Qwen3-30B-A3B's)")
    parser.add_argument("--intermediate", type=int, default=768, help="each expert's intermediate size (Qwen3-30B-A3B's)")
    parser.add_argument("--experts", type=int, default=32, help="experts in the layer (Qwen3-30B-A3B: 128, scaled down)")
    parser.add_argument("--top-k", type=int, default=4, help="experts per token (Qwen3-30B-A3B: 8, scaled down)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16], help="tokens per step")
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["float32", "bfloat16"],
                        help="the weights' and activations' dtypes")
    parser.add_argument("--rounds", type=int, default=5, help="passes per batch size; each time is the best")
    parser.add_argument("--rotation-mb", type=int, default=1200,
                        help="weights timed in turn, at least two copies of the layer (CPU: above the last-level cache)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _read_bandwidth(device: torch.device, big: torch.Tensor) -> float:
    """Bytes per second of the best of three sums over `big`."""
    best = float("inf")
    for _ in range(3):
        _synchronize(device)
        started = time.perf_counter()
        big.sum()
        _synchronize(device)
        best = min(best, time.perf_counter() - started)
    return big.numel() * big.element_size() / best


def _transformers_experts(layer: ExpertWeights, args: argparse.Namespace) -> torch.nn.Module:
    """transformers' eager Qwen3-MoE experts sharing `layer`'s tensors."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=args.hidden, moe_intermediate_size=args.intermediate,
                            num_experts=args.experts, num_experts_per_tok=args.top_k)
    config._experts_implementation = "eager"
    with torch.device("meta"):
        experts = Qwen3MoeSparseMoeBlock(config).experts
    experts.gate_up_proj = torch.nn.Parameter(layer.gate_up, requires_grad=False)
    experts.down_proj = torch.nn.Parameter(layer.down, requires_grad=False)
    return experts


def _deal(experts: int, top_k: int, batch: int, steps: int, seed: int) -> list[torch.Tensor]:
    """`steps` routings [batch, top_k] dealing the experts like cards from shuffled decks: each token
    k distinct experts, no expert twice before every expert served once, so consecutive steps read
    different experts (none from cache) and a batch reads as many experts as its k * batch pairs can."""
    generator = torch.Generator().manual_seed(seed)
    deck: list[int] = []
    routings = []
    for _ in range(steps):
        tokens = []
        for _ in range(batch):
            if len(deck) < top_k:  # the rest of a deck could repeat an expert within the token
                deck = torch.randperm(experts, generator=generator).tolist()
            tokens.append(deck[:top_k])
            deck = deck[top_k:]
        routings.append(torch.tensor(tokens))
    return routings


def _measure(args: argparse.Namespace, dtype: torch.dtype, device: torch.device) -> list[dict[str, Any]]:
    generator = torch.Generator(device=device).manual_seed(0)
    hidden, inter, experts, top_k = args.hidden, args.intermediate, args.experts, args.top_k
    expert_bytes = 3 * inter * hidden * torch.tensor([], dtype=dtype).element_size()
    copies = max(2, -(-(args.rotation_mb << 20) // (experts * expert_bytes)))
    layers = [ExpertWeights(
        (torch.randn(experts, 2 * inter, hidden, generator=generator, device=device) * hidden**-0.5).to(dtype),
        (torch.randn(experts, hidden, inter, generator=generator, device=device) * inter**-0.5).to(dtype),
    ) for _ in range(copies)]
    prepared = [prepare(layer, device) for layer in layers]
    eager = [_transformers_experts(layer, args) for layer in layers]
    activation = ExpertActivation("silu")
    runs: dict[str, Run] = {
        "kernel": lambda i, x, ids, w: routed_experts(x, ids, w, prepared[i], activation),
        "reference": lambda i, x, ids, w: routed_experts_reference(x, ids, w, layers[i], activation),
        "transformers": lambda i, x, ids, w: eager[i](x, ids, w.to(dtype)),
    }
    big = torch.ones(1 << 28, device=device)
    rows = []
    for batch in args.batches:
        steps = max(1, -(-experts // (batch * top_k)))  # a copy's steps until each of its experts served
        cases = [(i, torch.randn(batch, hidden, generator=generator, device=device).to(dtype), ids.to(device),
                  torch.softmax(torch.randn(batch, top_k, generator=generator, device=device), dim=-1))
                 for i in range(copies) for ids in _deal(experts, top_k, batch, steps, generator.initial_seed() + i)]
        best = dict.fromkeys(runs, float("inf"))
        bandwidth = 0.0
        for _ in range(args.rounds):
            bandwidth = max(bandwidth, _read_bandwidth(device, big))
            for name, run in runs.items():
                run(*cases[-1])  # its experts are the furthest from the next ones read
                _synchronize(device)
                started = time.perf_counter()
                for case in cases:
                    run(*case)
                _synchronize(device)
                best[name] = min(best[name], (time.perf_counter() - started) / len(cases))
        active = sum(len(set(case[2].reshape(-1).tolist())) for case in cases) / len(cases)
        floor = active * expert_bytes / bandwidth
        row: dict[str, Any] = {"device": device.type, "dtype": str(dtype).removeprefix("torch."), "batch": batch,
                               "hidden": hidden, "intermediate": inter, "experts": experts, "top_k": top_k,
                               "active_experts": active, "read_GBps": bandwidth / 1e9, "floor_ms": floor * 1e3}
        row.update({f"{name}_ms": seconds * 1e3 for name, seconds in best.items()})
        row["kernel_vs_floor"] = best["kernel"] / floor
        row["kernel_vs_transformers"] = best["kernel"] / best["transformers"]
        rows.append(row)
        print(json.dumps(row))
    return rows


def run(args: argparse.Namespace) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        from radixserve.kernels.cpu_extension import load_extension

        load_extension()
    rows: list[dict[str, Any]] = []
    with torch.inference_mode():
        for name in args.dtypes:
            rows += _measure(args, DTYPES[name], device)
    write_result(rows, args.json)
    return 0
