"""The attention of decode steps (with `--queries`, of longer rows) on CPU, thirty layers of the embedded
model's shapes (9 q heads, 3 kv heads, head_dim 64, context 512, fp32): the C++ kernel reading the paged
cache in place (`radixserve::paged_attention`) against the gather into kept buffers plus one padded SDPA call that
runs without the extension (`TorchAttentionBackend._short`), and with `--fp16` the kernel over the
same values in an fp16 cache (`--kv-cache-dtype fp16`). The rows' blocks lie one after another, or with
`--scattered` in a random order over a pool four times their size, as a long-running server's free list
leaves them; with `--shared N` the rows' first N tokens are the same blocks, as a shared system prompt
leaves them (rows that read them one after another find them in the last-level cache); with `--cold MB`
each pass first writes MB megabytes outside the timing, so that it reads its K/V from memory, as a
decode step does after its weights went through the caches (without it, the K/V stays cached from
pass to pass, and short contexts time far faster than inside a step). `--queries Q`
gives each row Q new tokens: a verification of drafts, or a prefill chunk over a cached prefix (the
gather and SDPA way takes short rows only, so longer ones time the kernel alone). Each way's output is
checked against the other's. Micro-timings that guide the design; claims about the step come from
`radixserve bench step`.

    radixserve bench cpu-attention --json docs/bench/cpu-step/attention_kernels.json
    radixserve bench cpu-attention --fp16 --batches 1 --contexts 512,2048,8192 --json docs/bench/quantized/attention_fp16.json
    radixserve bench cpu-attention --scattered --batches 1,4 --contexts 512,2048 --repeats 11 --json FILE
      (three runs with and three without --scattered, per kernel: docs/bench/cpu-step/attention-ab/)
    radixserve bench cpu-attention --batches 1,8 --contexts 1100 --shared 1024 --queries 1,40 --repeats 11 --json FILE
      (the shared-prompt workload's decodes and prefills: docs/bench/cpu-step/attention-ab2/)
    radixserve bench cpu-attention --fp16 --batches 1 --contexts 300,1024,4096 --repeats 11 --cold 128 --json FILE
      (K/V read from memory, as inside a step: docs/bench/quantized/avx2/attention_cold/)
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


def block_table(batch: int, context: int, shared: int, scattered: bool,
                generator: torch.Generator) -> tuple[torch.Tensor, int]:
    """The table [batch, blocks of the context] and the pool's size: the first `shared` tokens' whole
    blocks the same in every row, the rest each row's own; the pool's blocks in order, or scattered over
    a pool four times their size."""
    width, common = -(-context // BLOCK), min(shared, context) // BLOCK
    used = common + batch * (width - common)
    pool = (4 if scattered else 1) * used + 1
    order = (torch.randperm(pool, generator=generator) if scattered else torch.arange(pool)).to(torch.int32)
    own = order[common:used].view(batch, width - common)
    return torch.cat([order[:common].expand(batch, common), own], dim=1), pool


def measure(batch: int, context: int, repeats: int, generator: torch.Generator, fp16: bool = False,
            scattered: bool = False, shared: int = 0, queries: int = 1, cold_mb: int = 0) -> dict[str, Any]:
    """Milliseconds for thirty layers' attention of `batch` rows of `queries` new tokens at `context`,
    each way (medians); with `cold_mb`, each pass after that many MB were written outside the timing."""
    table, blocks = block_table(batch, context, shared, scattered, generator)
    caches = [(torch.randn(blocks, BLOCK, KV_HEADS, DIM, generator=generator),
               torch.randn(blocks, BLOCK, KV_HEADS, DIM, generator=generator)) for _ in range(LAYERS)]
    q = torch.randn(batch * queries, HEADS, DIM, generator=generator)
    lens, news = [context] * batch, [queries] * batch
    longest = max(SHORT_QUERY, queries)  # the kernel takes rows of up to this many queries
    outputs = {name: torch.empty_like(q) for name in ("in_place", "gather_sdpa", "in_place_fp16")}
    backend = TorchAttentionBackend()
    meta = AttentionMetadata(slot_mapping=torch.zeros(batch * queries, dtype=torch.long),
                             cu_seqlens_q=torch.arange(0, batch * queries + 1, queries, dtype=torch.int32),
                             seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=table,
                             query_lens=news, seq_lens_host=lens)
    plan = backend.short_plan(meta, BLOCK, q.device) if queries <= SHORT_QUERY else None

    def in_place() -> None:
        for k, v in caches:
            torch.ops.radixserve.paged_attention(q, k, v, table, lens, news, DIM**-0.5, longest, outputs["in_place"])

    def gather_and_sdpa() -> None:
        assert plan is not None
        for k, v in caches:
            backend._short(q, k, v, plan, DIM**-0.5, outputs["gather_sdpa"])

    halves = [(k.half(), v.half()) for k, v in caches] if fp16 else []

    def in_place_fp16() -> None:
        for k, v in halves:
            torch.ops.radixserve.paged_attention(q, k, v, table, lens, news, DIM**-0.5, longest,
                                                 outputs["in_place_fp16"])

    row: dict[str, Any] = {"batch": batch, "context": context, "layers": LAYERS, "scattered": scattered,
                           "shared": min(shared, context) // BLOCK * BLOCK, "queries": queries, "cold_mb": cold_mb}
    # between a layer's attention in one decode step and in the next, the step streams every weight
    # (the embedded model's: ~90 MB), so the K/V has left the caches: writing more than the last-level
    # cache holds does the same
    evictor = torch.zeros(cold_mb * 2**20 // 4)
    ways = [("in_place", in_place)] + ([("gather_sdpa", gather_and_sdpa)] if plan is not None else []) + (
        [("in_place_fp16", in_place_fp16)] if fp16 else [])
    for name, run in ways:
        run()
        times = []
        for _ in range(repeats):
            evictor.add_(1.0)
            started = time.perf_counter()
            run()
            times.append(1000 * (time.perf_counter() - started))
        row[f"{name}_ms"] = statistics.median(times)
    if plan is not None:  # the last layer's output both ways: the timings are of the same attention
        torch.testing.assert_close(outputs["in_place"], outputs["gather_sdpa"], rtol=1e-4, atol=1e-5)
    return row


def megabytes(text: str) -> int:
    """--cold's value: a whole number of MB, 0 or more."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"a number of MB, 0 or more, not {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--contexts", default="512", help="context lengths, comma-separated")
    parser.add_argument("--fp16", action="store_true", help="also time the kernel over an fp16 cache")
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--repeats", type=int, default=7, help="timed passes over the layers (median)")
    parser.add_argument("--scattered", action="store_true",
                        help="the rows' blocks in a random order over a pool four times their size")
    parser.add_argument("--shared", type=int, default=0,
                        help="tokens at the start of every row held once, in the same blocks (whole blocks)")
    parser.add_argument("--queries", default="1",
                        help="new tokens per row, comma-separated (1: decodes; more: verifications, prefill chunks)")
    parser.add_argument("--cold", type=megabytes, default=0, metavar="MB",
                        help="before each timed pass, write this many MB outside the timing, so that the pass "
                             "reads its K/V from memory as a decode step does after its weights went through the "
                             "caches (more than the last-level cache, e.g. 128); 0: the K/V stays cached")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")


def run(args: argparse.Namespace) -> int:
    load_extension()
    generator = torch.Generator().manual_seed(0)
    rows: list[dict[str, Any]] = []
    for context in (int(c) for c in args.contexts.split(",")):
        for queries in (int(n) for n in args.queries.split(",")):
            for batch in (int(b) for b in args.batches.split(",")):
                rows.append(measure(batch, context, args.repeats, generator, args.fp16, args.scattered, args.shared,
                                    queries, args.cold))
                print(json.dumps(rows[-1]))
    write_result(rows, args.json)
    return 0
