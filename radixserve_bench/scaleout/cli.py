"""`radixserve bench scale-out`: the flags of the scale-out scenario and its entry point.

    radixserve bench scale-out                      # 3 systems x 2 workloads on local Ray Serve clusters + routing micro
    radixserve bench scale-out --no-cluster         # the routing micro-benchmark alone (seconds, no Ray)
    radixserve bench scale-out --smoke --model DIR  # tiny workloads: checks the harness end to end

Importing this module is cheap (no Ray, no torch): the parser is built for every `radixserve` run.
"""

from __future__ import annotations

import argparse

from radixserve.scaleout.routing import DEFAULT_MAX_LOAD_GAP
from radixserve_bench.flags import add_model_arguments, add_output_arguments, add_param_argument, ints, names, parse_params
from radixserve_bench.scaleout import SYSTEMS, WORKLOADS


def add_scaleout_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("scenario")
    g.add_argument("--workload", type=names, default=WORKLOADS, help=f"comma list of {', '.join(WORKLOADS)} (default both)")
    g.add_argument("--systems", type=names, default=SYSTEMS, help=f"comma list of {', '.join(SYSTEMS)} (default all)")
    g.add_argument("--replicas", type=int, default=2,
                   help="replicas of cache-aware and power-of-two; one-replica gets this many pools (default 2)")
    g.add_argument("--repeats", type=int, default=1, help="runs per system and workload; medians (default 1)")
    g.add_argument("--smoke", action="store_true", help="tiny workloads and micro-benchmark: checks the harness")
    g.add_argument("--seed", type=int, default=0)
    add_param_argument(g, "shared-prefix.groups=12")
    g.add_argument("--concurrency", type=int, default=4, help="requests in flight (default %(default)s)")
    g.add_argument("--pool-blocks", type=int, default=None, metavar="P",
                   help="KV blocks per replica (default: --pool-fraction of the blocks each workload reuses)")
    g.add_argument("--pool-fraction", type=float, default=0.6, help="P / the blocks a later request reuses (default %(default)s)")
    g.add_argument("--max-load-gap", type=int, default=DEFAULT_MAX_LOAD_GAP,
                   help="the cache-aware router's ClusterConfig.max_load_gap (default %(default)s)")
    g.add_argument("--replica-torch-threads", type=int, default=1, help="torch threads per replica (default 1)")
    g.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per run (default %(default)s)")
    g.add_argument("--no-cluster", action="store_true", help="skip the Ray runs: routing micro-benchmark only")
    g.add_argument("--no-micro", action="store_true", help="skip the routing micro-benchmark")
    g.add_argument("--routing-replicas", type=ints, default=(2, 8), help="micro-benchmark replica counts (2,8)")
    g.add_argument("--routing-prefixes", type=int, default=1000, help="micro-benchmark cached prefixes per replica")
    add_output_arguments(g, "bench-results/scale-out")
    e = p.add_argument_group("engine (every replica)")
    add_model_arguments(e, device_help="auto | cpu | cuda (CUDA: one GPU per replica)")


def options_from_args(args: argparse.Namespace):  # -> ScaleOutOptions, imported lazily
    from radixserve_bench.scaleout.plan import ScaleOutOptions

    return ScaleOutOptions(
        workloads=args.workload, systems=args.systems, replicas=args.replicas, repeats=args.repeats,
        smoke=args.smoke, seed=args.seed, model=args.model, device=args.device, dtype=args.dtype,
        block_size=args.block_size, pool_blocks=args.pool_blocks, pool_fraction=args.pool_fraction,
        concurrency=args.concurrency, max_load_gap=args.max_load_gap, torch_threads=args.replica_torch_threads,
        params=parse_params(args.param), timeout_s=args.timeout, cluster=not args.no_cluster, micro=not args.no_micro,
        micro_replicas=args.routing_replicas, micro_prefixes=args.routing_prefixes, progress=not args.no_progress)


def run_scaleout_command(args: argparse.Namespace) -> int:
    from radixserve_bench.harness import Scenario, run_scenario
    from radixserve_bench.scaleout.chart import write_charts
    from radixserve_bench.scaleout.report import render
    from radixserve_bench.scaleout.runner import run_scaleout

    return run_scenario(Scenario("radixserve bench scale-out", lambda a, argv: run_scaleout(options_from_args(a), argv),
                                 render, write_charts, docs_anchor="radixserve-bench-scale-out"), args)
