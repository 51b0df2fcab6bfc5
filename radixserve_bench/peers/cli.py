"""`radixserve bench peers`: the flags of the peers scenario and its entry point.

    make peers                          # builds llama-server and vLLM CPU into .peers/ (once)
    radixserve bench peers              # every system present, the three workloads, docs/bench/peers/
    radixserve bench peers --smoke --systems radixserve --model DIR   # tiny workloads: checks the harness

Importing this module is cheap (argparse only): the parser is built for every `radixserve` run.
"""

from __future__ import annotations

import argparse

from radixserve_bench.flags import add_output_arguments, add_param_argument, names, parse_params
from radixserve_bench.peers import SYSTEMS, WORKLOADS


def add_peers_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("scenario")
    g.add_argument("--workload", type=names, default=WORKLOADS, help=f"comma list of {', '.join(WORKLOADS)} (default all)")
    g.add_argument("--systems", type=names, default=(),
                   help=f"comma list of {', '.join(SYSTEMS)} (default all; those not built are skipped)")
    g.add_argument("--repeats", type=int, default=1, help="fresh servers per system; medians (default 1)")
    g.add_argument("--smoke", action="store_true", help="tiny workloads: checks the harness end to end")
    g.add_argument("--seed", type=int, default=0)
    add_param_argument(g, "shared-prompt.prompts_per_group=16")
    g.add_argument("--threads", type=int, default=2, help="compute threads of every server (default %(default)s)")
    g.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per workload run (default %(default)s)")
    g.add_argument("--startup-timeout", type=float, default=900.0,
                   help="seconds a server may take to start (default %(default)s)")
    add_output_arguments(g, "docs/bench/peers")
    m = p.add_argument_group("models and peers")
    m.add_argument("--model", default=None,
                   help="HF model directory for radixserve and vLLM (default: the embedded SmolLM2-135M-Instruct; "
                        "radixserve serves its own default, vLLM the converted fp32 directory)")
    m.add_argument("--gguf", default=None, help="llama-server's model (default: the embedded model's shipped GGUF; "
                                                "with --model and no --gguf llama.cpp is skipped)")
    m.add_argument("--extra-args", action="append", default=[], metavar="SYSTEM=ARGS",
                   help="more command-line words for one system's server, e.g. vllm-cpu='-O0' (repeatable)")
    m.add_argument("--logs", default=None, metavar="DIR",
                   help="keep each server's output here as SYSTEM-REPEAT.log (default: a temporary folder, removed)")
    m.add_argument("--peers-dir", default=None, help="where `make peers` built the peers (default: the repository's .peers/)")


def options_from_args(args: argparse.Namespace):  # -> PeersOptions, imported lazily
    from radixserve_bench.flags import BenchConfigError
    from radixserve_bench.peers.servers import parse_extra_args
    from radixserve_bench.peers.workload import PeersOptions

    try:
        extra_args = parse_extra_args(args.extra_args)
    except ValueError as e:
        raise BenchConfigError(str(e)) from None
    return PeersOptions(workloads=args.workload, systems=args.systems, repeats=args.repeats, smoke=args.smoke,
                        seed=args.seed, model=args.model, params=parse_params(args.param), timeout_s=args.timeout,
                        progress=not args.no_progress, gguf=args.gguf, peers_dir=args.peers_dir, threads=args.threads,
                        startup_timeout_s=args.startup_timeout, extra_args=extra_args, logs_dir=args.logs)


def run_peers_command(args: argparse.Namespace) -> int:
    from radixserve_bench.harness import Scenario, run_scenario
    from radixserve_bench.peers.chart import write_charts
    from radixserve_bench.peers.report import render
    from radixserve_bench.peers.runner import run_peers

    return run_scenario(Scenario("radixserve bench peers", lambda a, argv: run_peers(options_from_args(a), argv),
                                 render, write_charts, docs_anchor="radixserve-bench-peers"), args)
