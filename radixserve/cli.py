"""The `radixserve` command: chat, generate, serve and bench subcommands.

Engine flags are declared once here and shared by every subcommand that starts an engine.
"""

from __future__ import annotations

import argparse
import sys

from radixserve.config import (
    ATTENTION_BACKENDS,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    POLICIES,
    PREEMPTION_MODES,
    QUANTIZED_ACTIVATIONS,
    SLIDING_WINDOW_KV,
    STATE_CHECKPOINT_POLICIES,
    STATE_EVICTIONS,
    EngineConfig,
)
from radixserve.model.embedded import EmbeddedModelMissingError


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="HF model directory or llama.cpp GGUF file (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block (default %(default)s)")
    g.add_argument("--kv-cache-memory-mb", type=float, default=None,
                   help="KV block pool budget in MiB (default: 256 on CPU; on CUDA what --gpu-memory-utilization leaves)")
    g.add_argument("--state-slots", type=int, default=None,
                   help="hybrid models (recurrent layers): slots for running sequences' recurrent states and the "
                        "prefix cache's checkpoints of them (default: what as much memory as the KV budget holds, "
                        "4 to 2 x --max-num-seqs)")
    g.add_argument("--state-checkpoints", choices=STATE_CHECKPOINT_POLICIES, default=d.state_checkpoints,
                   help="hybrid models: where the prefix cache checkpoints recurrent states: branches (request ends "
                        "and branch points), request-ends, or every-block (every block boundary of a prompt too) "
                        "(default %(default)s)")
    g.add_argument("--state-eviction", choices=STATE_EVICTIONS, default=d.state_eviction,
                   help="hybrid models: which checkpoint goes when state slots run out: lru, or saved-compute "
                        "(recency plus the prefill tokens it saves) (default %(default)s)")
    g.add_argument("--eviction-lookahead", type=int, default=d.eviction_lookahead,
                   help="the prefix cache's evictions (KV blocks, window blocks, state checkpoints) keep the cached "
                        "prefixes of this many waiting requests for last, the one admitted last going first; 0: least "
                        "recently used alone (default %(default)s)")
    g.add_argument("--sliding-window-kv", choices=SLIDING_WINDOW_KV, default=d.sliding_window_kv,
                   help="models with sliding-window layers (Gemma 3, gpt-oss): window keeps each sequence's last "
                        "window of their K/V as a state, resumed from the prefix cache's checkpoints like a "
                        "recurrent layer's; all keeps every token's K/V in the paged pool; window-blocks pages the "
                        "sliding layers' K/V in window blocks of their own, which attention reads in place and "
                        "the prefix cache drops block by block, so a hit resumes at any token; auto: window-blocks "
                        "where the model mixes sliding and full layers and has no recurrent ones, else all on CUDA "
                        "(where window states would give up CUDA graphs) unless the layers' head shapes differ, "
                        "else window (default %(default)s)")
    g.add_argument("--window-blocks", type=int, default=None,
                   help="--sliding-window-kv window-blocks: blocks of the sliding layers' K/V, for the running "
                        "sequences' windows and the prefix cache (default: what as much memory as the KV budget "
                        "holds)")
    g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                   help="CUDA: fraction of device memory for weights, activations, graphs and the KV pool "
                        "(default %(default)s)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="run every step eagerly: no CUDA graphs (CUDA), no C++ kernels or compiled C++ layers "
                        "(CPU: oneDNN matmuls and the Python layers), no padded static-buffer decode path")
    g.add_argument("--cpu-threads", type=int, default=None,
                   help="CPU: torch threads (default: the cores the affinity mask and cgroup quota allow, "
                        "or OMP_NUM_THREADS when set)")
    o = g.add_mutually_exclusive_group()
    o.add_argument("--overlap", dest="overlap", action="store_const", const=True, default=None,
                   help="prepare the next step while the device runs this one (default on CUDA, off on CPU)")
    o.add_argument("--no-overlap", dest="overlap", action="store_const", const=False,
                   help="run each step to the end before preparing the next (debugging, equality tests)")
    g.add_argument("--quantized-activations", choices=QUANTIZED_ACTIVATIONS, default=d.quantized_activations,
                   help="CPU, a GGUF's quantized weights: int8 quantizes each row of inputs to 8 bits per block "
                        "of 32 for integer dot products, as llama.cpp does; float32 computes exactly what the "
                        "dequantized model (--dtype float32) computes, slower (default %(default)s)")
    g.add_argument("--load-format", choices=LOAD_FORMATS, default=d.load_format,
                   help="auto: the checkpoint's weights | dummy: random weights of its shapes, for speed tests")
    g.add_argument("--num-blocks", type=int, default=None, help="explicit KV pool size in blocks (overrides memory)")
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="token budget per step, decodes + prefill chunks (default %(default)s)")
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="running sequences at most (default %(default)s)")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--policy", choices=POLICIES, default=d.policy, help="scheduling policy (default %(default)s)")
    g.add_argument("--max-wait-steps", type=int, default=d.max_wait_steps,
                   help="cache-aware: a request waiting this many steps goes ahead of cache hits (default %(default)s)")
    g.add_argument("--aging-s", type=float, default=d.aging_s,
                   help="priority, sjf: seconds of waiting worth one priority level / one job-size step (a doubling); "
                        "0 turns aging off (default %(default)s)")
    g.add_argument("--preempt-gap", type=float, default=d.preempt_gap,
                   help="priority, sjf: a waiting request outranking a running one by this many levels preempts it "
                        "when it cannot be admitted otherwise; 0 turns this off (default %(default)s)")
    g.add_argument("--preempt-min-run-s", type=float, default=d.preempt_min_run_s,
                   help="never preempt for an urgent request one that has run less than this (default %(default)s)")
    g.add_argument("--max-queue-wait-s", type=float, default=d.max_queue_wait_s,
                   help="priority, sjf: a request queued this long ago goes ahead of (and may preempt) every younger "
                        "one whatever their priorities: the bound on any wait; 0 turns it off (default %(default)s)")
    g.add_argument("--new-token-ratio", type=float, default=d.new_token_ratio,
                   help="output-aware admission: keep free blocks for this fraction of what running requests may "
                        "still generate (decays while nothing is preempted); 0 turns it off (default %(default)s)")
    g.add_argument("--host-cache-mb", type=float, default=d.host_cache_mb,
                   help="host-memory KV tier in MiB (pinned on CUDA): evicted prefixes are written back there and "
                        "loaded back on a hit instead of recomputed; 0 turns it off (default %(default)s)")
    g.add_argument("--preemption-mode", choices=PREEMPTION_MODES, default=d.preemption_mode,
                   help="swap: a preempted sequence's KV waits in the host tier; recompute: it is cached as an "
                        "evictable prefix; auto: swap when the host tier has room and copying is cheaper "
                        "(default %(default)s)")
    g.add_argument("--no-prefix-cache", action="store_true", help="disable the radix prefix cache")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default=d.attention_backend,
                   help="attention implementation (default %(default)s: triton on CUDA, torch otherwise)")
    g.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "float16", "bfloat16"],
                   help="weights/KV dtype (default %(default)s: fp32 on CPU, bf16 on CUDA; a GGUF model, the "
                        "default one included, keeps its quantized weights on CPU unless a dtype or --enforce-eager is given)")
    g.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=KV_CACHE_DTYPES,
                   help="KV cache storage: auto (the model's dtype; fp16 for a GGUF file's quantized weights on CPU, "
                        "as llama.cpp keeps K/V), model (the model's dtype always), fp16 (half an fp32 model's bytes; "
                        "docs/quantized.md) or fp8 (e4m3 with a scale per token and head: 1.94x the cached tokens of "
                        "bf16 per GB, 3.88x fp32's; docs/kv_fp8.md); default %(default)s")
    g.add_argument("--device", default=d.device, help="auto | cpu | cuda (default %(default)s)")
    g.add_argument("--seed", type=int, default=d.seed, help="engine seed for unseeded requests (default %(default)s)")
    g.add_argument("--speculation", choices=["on", "off"], default="on",
                   help="speculative decoding: decoding sequences draft tokens from the radix tree, a request's "
                        "prediction and their own prompt and output, verified in one step; the output is "
                        "unchanged (default %(default)s)")
    g.add_argument("--num-speculative-tokens", type=int, default=d.num_speculative_tokens,
                   help="the most draft tokens a sequence verifies per step; adapts down per sequence "
                        "(default %(default)s)")
    g.add_argument("--speculative-max-batch", type=int, default=None,
                   help="no drafts in a step with more decoding sequences than this (default: the device's "
                        "measured figure, see docs/speculation.md)")
    g.add_argument("--speculative-max-rows", type=int, default=None,
                   help="the most rows (decode tokens plus drafts) a drafting step runs; drafts fill what the "
                        "step's decodes leave (default: the device's measured figure, see docs/speculation.md)")
    g.add_argument("--pin-budget", type=float, default=d.pin_budget,
                   help="the fraction of the device pool pinned prefixes may hold (POST /v1/cache/pins, --pin); "
                        "never so much that the longest sequence could not fit beside them; 0 turns pinning off "
                        "(default %(default)s)")
    g.add_argument("--grammar-compile-workers", type=int, default=d.grammar_compile_workers,
                   help="processes that compile structured-output grammars first, so one that would crash or "
                        "stall the server kills a worker instead (default %(default)s)")
    g.add_argument("--grammar-cache-mb", type=float, default=d.grammar_cache_mb,
                   help="memory the compiled grammars kept for reuse may hold, estimated from their size; the "
                        "least recently used go first (default %(default)s)")
    g.add_argument("--grammar-compile-timeout", type=float, default=d.grammar_compile_timeout_s,
                   help="seconds a grammar may take to compile; then its worker is killed and the request "
                        "gets a 400 (default %(default)s)")
    g.add_argument("--grammar-worker-memory-mb", type=int, default=d.grammar_worker_memory_mb,
                   help="address space of each grammar compile worker (default %(default)s)")
    g.add_argument("--grammar-max-lexer-states", type=int, default=d.grammar_max_lexer_states,
                   help="lexer states one grammar may build (about 1-2 kB each); a reply whose grammar needs more "
                        "ends with finish_reason error (default %(default)s)")
    g.add_argument("--open-json-objects", action="store_true",
                   help="read JSON schemas (response_format, tool parameters) as JSON Schema does: an object "
                        "admits undeclared keys unless it says additionalProperties: false (default: closed "
                        "objects, as OpenAI's strict mode; see docs/structured_output.md)")


def engine_config_from_args(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=a.model, block_size=a.block_size, kv_cache_memory_mb=a.kv_cache_memory_mb, num_blocks=a.num_blocks,
        state_slots=a.state_slots, state_checkpoints=a.state_checkpoints,
        state_eviction=a.state_eviction, eviction_lookahead=a.eviction_lookahead,
        sliding_window_kv=a.sliding_window_kv, window_blocks=a.window_blocks,
        max_num_batched_tokens=a.max_num_batched_tokens, max_num_seqs=a.max_num_seqs,
        max_model_len=a.max_model_len, policy=a.policy, max_wait_steps=a.max_wait_steps, aging_s=a.aging_s,
        preempt_gap=a.preempt_gap, preempt_min_run_s=a.preempt_min_run_s, max_queue_wait_s=a.max_queue_wait_s,
        new_token_ratio=a.new_token_ratio,
        enable_prefix_cache=not a.no_prefix_cache,
        attention_backend=a.attention_backend, dtype=a.dtype, kv_cache_dtype=a.kv_cache_dtype, device=a.device,
        quantized_activations=a.quantized_activations,
        seed=a.seed,
        gpu_memory_utilization=a.gpu_memory_utilization, enforce_eager=a.enforce_eager, overlap=a.overlap,
        cpu_threads=a.cpu_threads,
        load_format=a.load_format, host_cache_mb=a.host_cache_mb, preemption_mode=a.preemption_mode,
        num_speculative_tokens=a.num_speculative_tokens if a.speculation == "on" else 0,
        speculative_max_batch=a.speculative_max_batch, speculative_max_rows=a.speculative_max_rows,
        pin_budget=a.pin_budget, grammar_compile_workers=a.grammar_compile_workers, grammar_cache_mb=a.grammar_cache_mb,
        grammar_compile_timeout_s=a.grammar_compile_timeout, grammar_worker_memory_mb=a.grammar_worker_memory_mb,
        grammar_max_lexer_states=a.grammar_max_lexer_states,
        open_json_objects=a.open_json_objects,
    )


def build_parser() -> argparse.ArgumentParser:
    """The command line: `radixserve chat | generate | serve | bench` (docs/cli.md is rendered from it)."""
    parser = argparse.ArgumentParser(prog="radixserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p_chat = sub.add_parser("chat", help="multi-turn terminal chat with per-turn cache figures")
    add_engine_arguments(p_chat)
    p_chat.add_argument("--system", default="You are a helpful assistant.", help="system prompt")
    p_chat.add_argument("--max-tokens", type=int, default=256)
    p_chat.add_argument("--temperature", type=float, default=0.0)

    p_gen = sub.add_parser("generate", help="generate completions for prompts given as arguments")
    add_engine_arguments(p_gen)
    p_gen.add_argument("prompts", nargs="+", help="prompt texts")
    p_gen.add_argument("--max-tokens", type=int, default=64)
    p_gen.add_argument("--temperature", type=float, default=0.0)
    p_gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")

    p_serve = sub.add_parser("serve", help="start the HTTP/WebSocket chat server")
    add_engine_arguments(p_serve)
    from radixserve.server.cli import add_server_arguments

    add_server_arguments(p_serve)
    from radixserve.scaleout.cli import add_scaleout_arguments

    add_scaleout_arguments(p_serve)

    # the benchmark parses its own flags (radixserve_bench.cli.main), so no other subcommand imports it:
    # a '+' prefix makes this parser take every following word, dashes included, as one pass-through
    p_bench = sub.add_parser("bench", help="benchmarks against peers (see `radixserve bench -h`)", add_help=False,
                             prefix_chars="+")
    p_bench.add_argument("bench_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _dispatch(args)
    except (FileNotFoundError, ValueError, EmbeddedModelMissingError) as exc:  # user errors: no traceback
        print(f"radixserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "chat":
        from radixserve.terminal_chat import run_chat

        return run_chat(engine_config_from_args(args), args)
    if args.command == "generate":
        from radixserve.terminal_chat import run_generate

        return run_generate(engine_config_from_args(args), args)
    if args.command == "serve" and args.replicas != 1:
        from radixserve.scaleout.cli import run_scaled

        return run_scaled(engine_config_from_args(args), args)
    if args.command == "serve":
        from radixserve.server.cli import run_server

        return run_server(engine_config_from_args(args), args)
    return _run_bench(args.bench_args)


def _run_bench(argv: list[str]) -> int:
    """`radixserve bench ARGS...`: the benchmark is its own top-level package (radixserve_bench), imported
    only here; an install without it gets a message, not a traceback."""
    try:
        from radixserve_bench.cli import main as bench_main
    except ModuleNotFoundError as exc:
        if exc.name != "radixserve_bench":
            raise
        print("radixserve bench: the benchmark package radixserve_bench is not installed; install radixserve from "
              "its checkout with the bench extra: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    return bench_main(argv)


if __name__ == "__main__":
    sys.exit(main())
