"""How many threads the CPU forward uses: the cores this process may actually run on.

torch sizes its thread pool from the machine's cores, but a container or `taskset` often grants
fewer: a 2-core cgroup quota on a 64-core host would otherwise run 64 threads that take turns on 2
cores, each matmul waiting for the slowest. The cores available are the fewest of the CPU affinity
mask and the cgroup's CPU quota (cgroup v2 `cpu.max`, or v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`),
rounded up, at least 1. An explicit count (`--cpu-threads`, a replica's share) wins over both, and so
does an operator's `OMP_NUM_THREADS` (or `MKL_NUM_THREADS`): torch's pool is then left as that set it.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)
CGROUP = Path("/sys/fs/cgroup")
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def cgroup_cpu_limit(root: Path = CGROUP) -> float | None:
    """The cgroup's CPU quota in cores, None when unlimited or unreadable."""
    for quota_file, period_file in ((root / "cpu.max", None), (root / "cpu" / "cpu.cfs_quota_us",
                                                               root / "cpu" / "cpu.cfs_period_us")):
        try:
            if period_file is None:
                quota, period = quota_file.read_text().split()[:2]
            else:
                quota, period = quota_file.read_text().strip(), period_file.read_text().strip()
        except (OSError, ValueError):
            continue
        if quota in ("max", "-1"):
            return None
        try:
            return int(quota) / int(period) if int(period) > 0 and int(quota) > 0 else None
        except ValueError:
            return None
    return None


def available_cores(root: Path = CGROUP) -> int:
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_cpu_limit(root)
    cores = affinity if quota is None else min(affinity, math.ceil(quota))
    return max(1, cores)


def configure_cpu_threads(requested: int | None = None) -> int:
    """Size torch's intra-op pool: `requested`, else the available cores unless the operator's
    environment set it; returns the size."""
    chosen = next((name for name in THREAD_ENV if os.environ.get(name)), None)
    if requested is not None:
        reason = "asked for"
        torch.set_num_threads(requested)
    elif chosen is not None:
        reason = f"{chosen} set"
    else:
        cores = available_cores()
        reason = f"{os.cpu_count()} CPUs; the affinity mask and cgroup quota allow {cores}"
        torch.set_num_threads(cores)
    log.info("CPU forward: %d threads (%s)", torch.get_num_threads(), reason)
    return torch.get_num_threads()
