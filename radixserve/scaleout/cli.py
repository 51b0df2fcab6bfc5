"""`radixserve serve --replicas N [--router ...]`: the scale-out flags, and the clear error without Ray."""

from __future__ import annotations

import argparse
import sys

from radixserve.config import EngineConfig
from radixserve.scaleout import RAY_EXTRA_HINT, ray_available
from radixserve.scaleout.config import ROUTER_NAMES, ClusterConfig


def add_scaleout_arguments(p: argparse.ArgumentParser) -> None:
    d = ClusterConfig()
    g = p.add_argument_group("scale-out (Ray Serve; needs the optional extra: " + RAY_EXTRA_HINT + ")")
    g.add_argument("--replicas", type=int, default=1,
                   help="engine replicas behind one endpoint; 1 (default) is the single-process server without Ray")
    g.add_argument("--router", choices=ROUTER_NAMES, default=d.router,
                   help="how requests pick a replica (default %(default)s; power-of-two is Ray Serve's default rule)")
    g.add_argument("--max-load-gap", type=int, default=d.max_load_gap,
                   help="in-flight requests by which the replica holding a prompt's longest prefix may exceed the "
                        "least-loaded one before the request goes to the least loaded (default %(default)s)")
    g.add_argument("--min-prefix-fraction", type=float, default=d.min_prefix_fraction,
                   help="a replica's cached prefix counts for routing only if it covers this fraction of the prompt "
                        "(default %(default)s)")
    g.add_argument("--replica-torch-threads", type=int, default=None,
                   help="torch CPU threads per replica (CPU runs: cores / replicas keeps them from competing)")


def cluster_config_from_args(a: argparse.Namespace) -> ClusterConfig:
    return ClusterConfig(replicas=a.replicas, router=a.router, max_load_gap=a.max_load_gap,
                         min_prefix_fraction=a.min_prefix_fraction, torch_threads=a.replica_torch_threads)


def run_scaled(engine_config: EngineConfig, args: argparse.Namespace) -> int:
    cluster = cluster_config_from_args(args)  # a bad value raises ValueError: the CLI's clear error
    if not ray_available():
        print(f"radixserve serve: --replicas {args.replicas} needs Ray Serve, an optional extra: {RAY_EXTRA_HINT}",
              file=sys.stderr)
        return 2
    from radixserve.scaleout.local import run_cluster
    from radixserve.server.cli import server_config_from_args

    return run_cluster(engine_config, server_config_from_args(args), cluster)
