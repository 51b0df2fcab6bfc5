"""`radixserve bench`: the command line of the benchmark.

    radixserve bench [run] --workload shared-prefix|multi-turn|random|bounded-pool|returning-chats|
                                      regenerate|regenerate-sampled|edit|edit-prediction|all
                           --systems a,b --repeats N
                           --smoke --out DIR --publish docs/bench/full-run ...
    radixserve bench micro      # scheduler and radix-tree micro-benchmarks only
    radixserve bench step       # the engine's decode step vs the memory roofline (radixserve_bench/step_bench.py)
    radixserve bench kernels    # the Triton kernel benchmark (radixserve_bench/kernel_bench.py)
    radixserve bench scale-out  # N Ray Serve replicas vs one: hit rates, routing (radixserve_bench/scaleout/)
    radixserve bench structured # JSON-schema validity, grammar compile times, constrained step (radixserve_bench/structured/)
    radixserve bench agent      # agent tool loops on chat / Responses / Messages: cache hits, TTFT (radixserve_bench/agents/)
    radixserve bench peers      # radixserve beside llama.cpp's llama-server and vLLM CPU (`make peers`; radixserve_bench/peers/)
    radixserve bench CHECK ...  # one focused measurement the docs cite (radixserve_bench/checks/): cpu-linear,
                                # kv-fp8, attack, tenant-probes, ... each with its own flags (`radixserve bench CHECK -h`)

`run` is the default, so `radixserve bench --smoke` works; put run options after `run` if you
name it. The run writes results.json, table.md and PNG charts to --out, prints the table, and with
--publish copies them (plus a README.md showing them) to a directory such as docs/bench/full-run. The exit
status is 1 when the results are incomplete (a metric missing or not finite), whatever the ratios.

`radixserve` hands every word after `bench` to `main` here, so no other subcommand imports the
benchmark; `run`, `scale-out` and the checks that talk HTTP first check for the bench extra's libraries
(extra.py) they need.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from radixserve.config import KV_CACHE_DTYPES, QUANTIZED_ACTIVATIONS, SLIDING_WINDOW_KV
from radixserve_bench import extra
from radixserve_bench.agents.cli import add_agent_arguments
from radixserve_bench.checks import CHECKS, run_check
from radixserve_bench.flags import add_model_arguments, add_output_arguments, add_param_argument, ints, names, parse_params
from radixserve_bench.peers.cli import add_peers_arguments
from radixserve_bench.scaleout.cli import add_scaleout_arguments
from radixserve_bench.systems import SYSTEM_DESCRIPTIONS
from radixserve_bench.workloads import LOAD_MODES, WORKLOADS


def _add_run_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("benchmark")
    g.add_argument("--workload", default="all", help=f"{' | '.join(WORKLOADS)} | all, or a comma list (default all)")
    g.add_argument("--systems", default=None,
                   help="comma list of " + ", ".join(SYSTEM_DESCRIPTIONS) + " (default: all that apply here)")
    g.add_argument("--repeats", type=int, default=3, help="runs per system and workload; medians are reported")
    g.add_argument("--smoke", action="store_true", help="tiny workloads: checks the harness end to end in seconds")
    add_output_arguments(g, "bench-results")
    g.add_argument("--seed", type=int, default=0, help="workload seed (default %(default)s)")
    add_param_argument(g, "shared-prefix.groups=8")
    g.add_argument("--load", choices=LOAD_MODES, default=None,
                   help="override every workload's load mode (rounds: clients take the sessions' turns round-robin)")
    g.add_argument("--concurrency", type=int, default=None, help="closed loop and rounds: clients in flight")
    g.add_argument("--request-rate", type=float, default=None, help="open loop: Poisson arrivals per second")
    g.add_argument("--pool-fraction", type=float, default=0.25,
                   help="radixserve-pool25(-host)'s pool as a fraction of the working set (default %(default)s)")
    g.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per run (default %(default)s)")
    g.add_argument("--no-micro", action="store_true", help="skip the micro-benchmarks")
    e = p.add_argument_group("engine (same for every system)")
    add_model_arguments(e)
    e.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget per step")
    e.add_argument("--max-num-seqs", type=int, default=256, help="running sequences at most")
    e.add_argument("--num-blocks", type=int, default=None, help="pool size in blocks (default: ample per workload)")
    e.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="draft tokens per step of every radixserve system but radixserve-nospec (default: the engine's)")
    e.add_argument("--speculative-max-batch", type=int, default=None,
                   help="no drafts in a step with more decoding sequences than this (default: the engine's)")
    e.add_argument("--speculative-max-rows", type=int, default=None,
                   help="the most rows (decodes plus drafts) a drafting step runs (default: the engine's)")
    e.add_argument("--prompt-lookup-tokens", type=int, default=10,
                   help="hf-prompt-lookup's prompt_lookup_num_tokens (default %(default)s)")


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    _add_run_arguments(parser)
    sub = parser.add_subparsers(dest="bench_command", metavar="{run,micro,step,kernels,scale-out,structured,agent,peers,CHECK}")
    _add_run_arguments(sub.add_parser("run", help="run workloads against systems (the default)"))
    p_micro = sub.add_parser("micro", help="scheduler and radix-tree micro-benchmarks (no model)")
    p_micro.add_argument("--smoke", action="store_true", help="few steps, short prompts")
    p_micro.add_argument("--out", default=None, help="also write micro.json here")
    p_micro.add_argument("--block-size", type=int, default=16)
    _add_step_arguments(sub.add_parser("step", help="time LLMEngine.step() decoding; ms/step, tok/s, roofline"))
    _add_passthrough(sub, "kernels", "Triton kernel benchmark (arguments are passed through)")
    add_scaleout_arguments(sub.add_parser(
        "scale-out", help="2 Ray Serve replicas (cache-aware / power-of-two routing) vs one with twice the pool; "
                          "routing overhead"))
    _add_structured_arguments(sub.add_parser(
        "structured", help="structured output and tool calls: validity, grammar compile times, constrained step cost"))
    add_agent_arguments(sub.add_parser(
        "agent", help="agent tool loops on chat, Responses and Messages: per-turn cache hits and TTFT, cache on vs off; "
                      "the scheduler's step with 64 loops in flight"))
    add_peers_arguments(sub.add_parser(
        "peers", help="radixserve beside llama.cpp's llama-server and vLLM CPU (built by `make peers`): "
                      "batch-1 decode, a shared system prompt, multi-turn; tok/s, TTFT, equal greedy replies"))
    for check in CHECKS.values():
        _add_passthrough(sub, check.name, check.summary)


def _add_passthrough(sub: argparse._SubParsersAction, name: str, summary: str) -> None:
    """A subcommand whose options belong to a module imported only when it runs: a '+' prefix makes its
    parser take every following word, dashes included, as `passthrough_args`."""
    p = sub.add_parser(name, help=summary, add_help=False, prefix_chars="+")
    p.add_argument("passthrough_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    """`radixserve bench`'s command line (docs/cli.md is rendered from it)."""
    parser = argparse.ArgumentParser(prog="radixserve bench")
    add_bench_arguments(parser)
    return parser


def main(argv: list[str]) -> int:
    """`radixserve bench ARGS...`: parse ARGS here, then run."""
    return run_bench(build_parser().parse_args(argv))


def run_bench(args: argparse.Namespace) -> int:
    command = getattr(args, "bench_command", None) or "run"
    if command in CHECKS:
        return run_check(CHECKS[command], args.passthrough_args)
    refusal = extra.require("radixserve bench" if command == "run" else f"radixserve bench {command}",
                            _extra_needed(command, args))
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    if command == "micro":
        return _run_micro(args)
    if command == "kernels":
        return _run_kernels(args.passthrough_args)
    if command == "step":
        return _run_step(args)
    if command == "scale-out":
        from radixserve_bench.scaleout.cli import run_scaleout_command

        return run_scaleout_command(args)
    if command == "structured":
        return _run_structured(args)
    if command == "agent":
        from radixserve_bench.agents.cli import run_agent_command

        return run_agent_command(args)
    if command == "peers":
        from radixserve_bench.peers.cli import run_peers_command

        return run_peers_command(args)
    return _run(args)


def _extra_needed(command: str, args: argparse.Namespace) -> tuple[str, ...]:
    """The bench extra's libraries (import names) that `command` run with `args` imports."""
    if command == "structured":
        return () if args.no_charts else ("matplotlib",)
    if command == "agent":  # its client talks HTTP; its tool outputs are the text source's
        return ("httpx", "chitchat_dataset", *(() if args.no_charts else ("matplotlib",)))
    if command == "peers":  # its client talks HTTP; its prompts are the text source's
        return ("httpx", "chitchat_dataset", *(() if args.no_charts else ("matplotlib",)))
    if command not in ("run", "scale-out"):
        return ()
    charts = () if args.no_charts else ("matplotlib",)
    if command == "scale-out":  # its runner talks HTTP; --no-cluster builds no workload and draws no chart
        return ("httpx",) if args.no_cluster else ("httpx", "chitchat_dataset", *charts)
    return ("chitchat_dataset", *charts)


def _add_step_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", default="embedded", choices=("embedded", "llama-3.2-1b", "llama-3.1-8b"),
                   help="embedded: SmolLM2-135M with its weights; llama-*: the real shapes, random weights")
    p.add_argument("--model", default=None, help="a model directory instead of --shape")
    p.add_argument("--load-format", default=None, choices=("auto", "dummy"),
                   help="default: dummy for the llama shapes, auto (the checkpoint) otherwise")
    p.add_argument("--batch", type=ints, default=None, help="batch sizes (default 1,16,64,128; 1,4 on CPU)")
    p.add_argument("--context", type=int, default=512, help="prompt tokens per sequence (default %(default)s)")
    p.add_argument("--steps", type=int, default=None, help="timed decode steps per row (default 32; 8 on CPU)")
    p.add_argument("--warmup", type=int, default=3, help="untimed decode steps first (default %(default)s)")
    p.add_argument("--rounds", type=int, default=1, help="run each batch's rows this many times, interleaved, "
                   "pooling their timed steps (a drifting machine then weighs on every row alike)")
    p.add_argument("--sampling", type=names, default=("greedy", "top-p"), help="greedy,top-p (default both)")
    p.add_argument("--graphs", type=names, default=("on", "off"),
                   help="on (enforce_eager=False), off (enforce_eager=True), or on,off (default)")
    p.add_argument("--overlap", type=names, default=("on",),
                   help="on (overlap scheduling; the default here), off (--no-overlap), or on,off")
    p.add_argument("--penalties", type=names, default=("off",),
                   help="off (the default), on (every request penalised: presence, frequency, repetition and a "
                        "logit_bias), or off,on (both, with their ratio)")
    p.add_argument("--speculation", type=names, default=("off",),
                   help="off (plain decode steps; the default), on (the engine drafts: a step may commit several "
                        "tokens per sequence), or on,off")
    p.add_argument("--num-speculative-tokens", type=int, default=8, help="draft tokens per step with speculation on")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    p.add_argument("--quantized-activations", default="int8", choices=QUANTIZED_ACTIVATIONS,
                   help="a GGUF's quantized weights on CPU: int8 (as llama.cpp) or float32 (default %(default)s)")
    p.add_argument("--sliding-window-kv", default="auto", choices=SLIDING_WINDOW_KV,
                   help="where sliding-window layers keep their K/V, as `serve` takes it (default %(default)s)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: the largest batch")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: max(8192, largest batch)")
    p.add_argument("--num-blocks", type=int, default=None, help="default: every row fits")
    p.add_argument("--bandwidth-mib", type=int, default=None, help="copy size of the bandwidth test (1024; CPU 256)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hf-forward", default=None, choices=("on", "off"),
                   help="also time transformers' own eager decode forward of each batch (radixserve_bench/hf_step.py; "
                        "default on on CPU, off on CUDA)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write every number as JSON here")


def _run_step(args: argparse.Namespace) -> int:
    from radixserve_bench.step_bench import StepBenchOptions, run_step_bench
    from radixserve_bench.step_table import render_table

    options = StepBenchOptions(
        shape=args.shape, model=args.model, load_format=args.load_format, batches=args.batch, context=args.context,
        steps=args.steps, warmup=args.warmup, sampling=args.sampling, graphs=args.graphs, overlap=args.overlap,
        penalties=args.penalties, rounds=args.rounds, speculation=args.speculation,
        num_speculative_tokens=args.num_speculative_tokens, device=args.device,
        dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, quantized_activations=args.quantized_activations,
        sliding_window_kv=args.sliding_window_kv, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, num_blocks=args.num_blocks,
        bandwidth_mib=args.bandwidth_mib, seed=args.seed, hf_forward=args.hf_forward)
    result = run_step_bench(options)
    print(render_table(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def _add_structured_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--schemas", type=names, default=(), help="comma list of schema names (default: the whole catalog)")
    g.add_argument("--max-schemas", type=int, default=None, help="only the first N schemas")
    g.add_argument("--tools", type=int, default=None, help="only the first N tools (default all)")
    g.add_argument("--max-tokens", type=int, default=256, help="tokens per reply at most (default %(default)s)")
    g.add_argument("--samples", type=int, default=2, help="sampled replies per schema and tool, besides greedy (default 2)")
    g.add_argument("--temperature", type=float, default=0.8, help="of the sampled replies (default %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="sampled reply k uses seed + k (default %(default)s)")
    g.add_argument("--cached-repeats", type=int, default=20, help="cached compiles timed per constraint (default 20)")
    g.add_argument("--step-batch", type=int, default=16, help="batch of the step test (default %(default)s)")
    g.add_argument("--step-steps", type=int, default=16, help="timed steps per round and mode (default %(default)s)")
    g.add_argument("--step-warmup", type=int, default=3, help="untimed decode steps first (default %(default)s)")
    g.add_argument("--step-rounds", type=int, default=4, help="rounds of (unconstrained, constrained), alternating (default 4)")
    add_output_arguments(g, "bench-results/structured")
    e = p.add_argument_group("engine")
    add_model_arguments(e)
    e.add_argument("--max-num-seqs", type=int, default=64, help="running sequences at most (default %(default)s)")
    e.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step (default %(default)s)")
    e.add_argument("--num-blocks", type=int, default=None, help="pool size in blocks (default: what memory allows)")
    e.add_argument("--torch-threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")


def _run_structured(args: argparse.Namespace) -> int:
    from radixserve_bench.harness import Scenario, run_scenario
    from radixserve_bench.structured.chart import write_charts
    from radixserve_bench.structured.report import render
    from radixserve_bench.structured.runner import StructuredBenchOptions, run_structured

    options = StructuredBenchOptions(
        model=args.model, device=args.device, dtype=args.dtype, seed=args.seed, schemas=args.schemas,
        max_schemas=args.max_schemas, tools=args.tools, max_tokens=args.max_tokens, samples=args.samples,
        temperature=args.temperature, cached_repeats=args.cached_repeats, step_batch=args.step_batch,
        step_steps=args.step_steps, step_warmup=args.step_warmup, step_rounds=args.step_rounds,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        num_blocks=args.num_blocks, torch_threads=args.torch_threads)
    return run_scenario(Scenario("radixserve bench structured", lambda a, argv: run_structured(options, argv), render,
                                 write_charts, docs_anchor="radixserve-bench-structured"), args)


def _run_kernels(argv: list[str]) -> int:
    try:
        from radixserve_bench import kernel_bench
    except ImportError as e:
        print(f"radixserve bench kernels: the kernel benchmark is not available ({e})", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog="radixserve bench kernels", description=kernel_bench.__doc__)
    kernel_bench.add_arguments(parser)
    return int(kernel_bench.main(parser.parse_args(argv)) or 0)


def _run_micro(args: argparse.Namespace) -> int:
    from radixserve_bench.micro import run_micro

    micro = run_micro(smoke=args.smoke, block_size=args.block_size)
    text = json.dumps(micro, indent=2)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "micro.json").write_text(text + "\n")
    return 0


def options_from_args(args: argparse.Namespace):  # -> BenchOptions, imported lazily
    from radixserve_bench.plan import BenchOptions

    workloads = WORKLOADS if args.workload == "all" else names(args.workload)
    return BenchOptions(
        workloads=workloads, systems=names(args.systems) if args.systems else None, repeats=args.repeats,
        smoke=args.smoke, seed=args.seed,
        model=args.model, device=args.device, dtype=args.dtype, block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        num_blocks=args.num_blocks, pool_fraction=args.pool_fraction, load=args.load, concurrency=args.concurrency,
        request_rate=args.request_rate, params=parse_params(args.param), timeout_s=args.timeout,
        micro=not args.no_micro, progress=not args.no_progress, num_speculative_tokens=args.num_speculative_tokens,
        speculative_max_batch=args.speculative_max_batch, speculative_max_rows=args.speculative_max_rows,
        prompt_lookup_tokens=args.prompt_lookup_tokens,
    )


def _run(args: argparse.Namespace) -> int:
    from radixserve_bench.harness import Scenario, run_scenario
    from radixserve_bench.report import render
    from radixserve_bench.runner import run_benchmark

    return run_scenario(Scenario("radixserve bench", lambda a, argv: run_benchmark(options_from_args(a), argv), render,
                                 _charts), args)


def _charts(results: dict, out: Path) -> list[str]:
    from radixserve_bench.charts import write_charts  # matplotlib: only when charts are drawn

    return write_charts(results, out)
