"""The attention of decode steps on CPU, thirty layers of the embedded model's shapes (9 q heads, 3 kv
heads, head_dim 64, context 512, fp32): the C++ kernel reading the paged cache in place
(`radixserve::paged_attention`) against the gather into kept buffers plus one padded SDPA call that
runs without the extension (`TorchAttentionBackend._short`), and with `--fp16` the kernel over the
same values in an fp16 cache (`--kv-cache-dtype fp16`). The rows' blocks lie one after another, or with
`--scattered` in a random order over a pool four times their size, as a long-running server's free list
leaves them. Micro-timings that guide the design; claims about the step come from `radixserve bench step`.

    radixserve bench cpu-attention --json docs/bench/cpu-step/attention_kernels.json
    radixserve bench cpu-attention --fp16 --batches 1 --contexts 512,2048,8192 --json docs/bench/quantized/attention_fp16.json
    radixserve bench cpu-attention --scattered --batches 1,4 --contexts 512,2048 --repeats 11 --json FILE
      (three runs with and three without --scattered, per kernel: docs/bench/cpu-step/attention-ab/)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from radixserve.kernels.cpu_extension import load_extension
from radixserve.model.attention import SHORT_QUERY, AttentionMetadata, TorchAttentionBackend
from radixserve_bench.checks.micro_result import write_result

HEADS, KV_HEADS, DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30


def measure(batch: int, context: int, repeats: int, generator: torch.Generator, fp16: bool = False,
            scattered: bool = False) -> dict[str, Any]:
    """Milliseconds for thirty layers' attention of `batch` decodes at `context`, each way (medians)."""
    width = -(-context // BLOCK)
    blocks = (4 if scattered else 1) * batch * width + 1
    caches = [(torch.randn(blocks, BLOCK, KV_HEADS, DIM, generator=generator),
               torch.randn(blocks, BLOCK, KV_HEADS, DIM, generator=generator)) for _ in range(LAYERS)]
    order = torch.randperm(blocks, generator=generator) if scattered else torch.arange(blocks)
    table = order[:batch * width].to(torch.int32).view(batch, width)
    q = torch.randn(batch, HEADS, DIM, generator=generator)
    lens, news = [context] * batch, [1] * batch
    out = torch.empty_like(q)
    backend = TorchAttentionBackend()
    meta = AttentionMetadata(slot_mapping=torch.zeros(batch, dtype=torch.long),
                             cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32),
                             seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=table,
                             query_lens=news, seq_lens_host=lens)
    plan = backend.short_plan(meta, BLOCK, q.device)
    assert plan is not None

    def in_place() -> None:
        for k, v in caches:
            torch.ops.radixserve.paged_attention(q, k, v, table, lens, news, DIM**-0.5, SHORT_QUERY, out)

    def gather_and_sdpa() -> None:
        for k, v in caches:
            backend._short(q, k, v, plan, DIM**-0.5, out)

    halves = [(k.half(), v.half()) for k, v in caches] if fp16 else []

    def in_place_fp16() -> None:
        for k, v in halves:
            torch.ops.radixserve.paged_attention(q, k, v, table, lens, news, DIM**-0.5, SHORT_QUERY, out)

    row: dict[str, Any] = {"batch": batch, "context": context, "layers": LAYERS, "scattered": scattered}
    ways = [("in_place", in_place), ("gather_sdpa", gather_and_sdpa)] + ([("in_place_fp16", in_place_fp16)] if fp16 else [])
    for name, run in ways:
        run()
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            run()
            times.append(1000 * (time.perf_counter() - started))
        row[f"{name}_ms"] = statistics.median(times)
    return row


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--contexts", default="512", help="context lengths, comma-separated")
    parser.add_argument("--fp16", action="store_true", help="also time the kernel over an fp16 cache")
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--repeats", type=int, default=7, help="timed passes over the layers (median)")
    parser.add_argument("--scattered", action="store_true",
                        help="the rows' blocks in a random order over a pool four times their size")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")


def run(args: argparse.Namespace) -> int:
    load_extension()
    generator = torch.Generator().manual_seed(0)
    rows: list[dict[str, Any]] = []
    for context in (int(c) for c in args.contexts.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            rows.append(measure(batch, context, args.repeats, generator, args.fp16, args.scattered))
            print(json.dumps(rows[-1]))
    write_result(rows, args.json)
    return 0
