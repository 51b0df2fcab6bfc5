"""The focused measurements the docs cite, each a `radixserve bench NAME` subcommand with its own flags:
CPU kernel micro-timings, bf16 and FP8-cache agreement, speculation's batch cap and a wrong
prediction's cost, tenant isolation probes, pinned prompts under bursts, stats latency under load,
structured-output attacks, lm-eval agreement, the grammar-backend comparison, the host tier's
fits table, and the two helpers of scripts/gpu_check.sh (a random-weight checkpoint, the GPU results
page).

This module owns the table of checks and how one runs. Each check is one module exposing
`add_arguments(parser)` and `run(args) -> int`; the table names it, so `radixserve bench --help`
lists every check without importing one, and a check's module is imported only when it runs, after
the libraries it needs were found.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from dataclasses import dataclass

from radixserve_bench import extra


@dataclass(frozen=True)
class Check:
    name: str  # the subcommand: `radixserve bench NAME`
    module: str  # radixserve_bench.checks.MODULE
    summary: str  # its line in `radixserve bench --help`
    bench_extra: tuple[str, ...] = ()  # import names of the bench extra's libraries it needs
    elsewhere: tuple[str, ...] = ()  # libraries no radixserve extra installs (their pip names are their import names)


CHECKS: dict[str, Check] = {c.name: c for c in (
    Check("cpu-linear", "cpu_linear", "CPU: one matmul, the C++ kernel vs oneDNN, on the embedded model's shapes"),
    Check("cpu-ggml", "cpu_ggml", "CPU: one matmul on GGUF blocks (Q4_0 ... Q6_K) vs fp32 weights, embedded model shapes"),
    Check("cpu-attention", "cpu_attention", "CPU: attention of decodes and longer rows, the C++ paged kernel vs gather + SDPA"),
    Check("cpu-prefill", "cpu_prefill", "CPU: a prompt's prefill with the C++ kernels vs oneDNN (--enforce-eager)"),
    Check("moe", "moe", "routed experts of one MoE layer: batch 1 vs its active-bytes floor, batch 16 vs transformers"),
    Check("cpu-dtype", "cpu_dtype", "CPU: greedy answers in bf16 vs fp32, token by token"),
    Check("gguf-agreement", "gguf_agreement", "greedy answers of the embedded GGUF served as shipped vs its fp32 conversion"),
    Check("llama-agreement", "llama_agreement", "greedy replies on one GGUF: radixserve vs llama-server, and llama.cpp "
          "with flash attention on vs off", bench_extra=("httpx",)),
    Check("kv-fp8", "kv_fp8", "greedy answers with an FP8 KV cache vs the model's dtype, free-running and teacher-forced"),
    Check("spec-batch-cap", "spec_batch_cap", "decode tok/s with speculation on and off, batch by batch"),
    Check("spec-wrong-prediction", "spec_wrong_prediction", "what an entirely wrong prediction costs a request"),
    Check("tenant-probes", "tenant_probes", "what one tenant learns of another's cached prompts (a real server)",
          bench_extra=("httpx",)),
    Check("pin-burst", "pin_burst", "a pinned system prompt under bursts as large as the pool (a real server)",
          bench_extra=("httpx",)),
    Check("stats-latency", "stats_latency", "latency of /v1/cache/stats, /metrics and /health under full prefill load",
          bench_extra=("httpx",)),
    Check("attack", "structured_attack", "a victim's decoding beside a hostile structured-output client (a real server)",
          bench_extra=("httpx",)),
    Check("lm-eval", "lm_eval_agreement", "lm-evaluation-harness through the server vs its hf backend: log-likelihoods"),
    Check("grammar-backends", "grammar_backends", "llguidance vs xgrammar on the structured bench's schemas",
          elsewhere=("xgrammar",)),
    Check("host-tier-fits", "host_tier_fits", "the host tier's no-regression table from `radixserve bench` results"),
    Check("random-checkpoint", "random_checkpoint", "write a random-weight checkpoint of a model family or shape"),
    Check("gpu-results", "gpu_results", "render docs/gpu-results.md from what scripts/gpu_check.sh wrote"),
)}


def refusal(check: Check) -> str | None:
    """None when `check` can import what it needs, else the message that says what to install."""
    command = f"radixserve bench {check.name}"
    absent = [name for name in check.elsewhere if importlib.util.find_spec(name) is None]
    if absent:
        return f"{command} needs {', '.join(absent)}, which no radixserve extra installs: pip install {' '.join(absent)}"
    return extra.require(command, check.bench_extra)


def run_check(check: Check, argv: list[str]) -> int:
    """Parse `argv` with the check's own flags and run it: its exit status (2, with the reason on stderr,
    when a library it needs is missing)."""
    reason = refusal(check)
    if reason:
        print(reason, file=sys.stderr)
        return 2
    module = importlib.import_module(f"radixserve_bench.checks.{check.module}")
    parser = argparse.ArgumentParser(prog=f"radixserve bench {check.name}", description=module.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(parser)
    return int(module.run(parser.parse_args(argv)))
