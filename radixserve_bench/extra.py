"""The `bench` optional extra (`pip install 'radixserve[bench]'`): the libraries only the benchmark
harness uses, and the one check that they are installed.

Invariants: nothing outside radixserve_bench imports these libraries, and inside it they are imported
only by the code of a subcommand that runs after `require` passed (charts, the text source, the
scale-out HTTP client), so `radixserve serve` and `radixserve bench micro | step | kernels` run
without the extra. pyproject.toml's `bench` extra lists the same distributions.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable

# import name -> distribution name (what pip installs)
BENCH_LIBRARIES = {
    "matplotlib": "matplotlib",  # the PNG charts
    "chitchat_dataset": "chitchat-dataset",  # the real English text of the workloads
    "httpx": "httpx",  # the scale-out scenario's HTTP client
}
INSTALL_HINT = "pip install 'radixserve[bench]'"


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: a module in sys.modules without a spec
        return False


def missing(modules: Iterable[str]) -> list[str]:
    """The distributions of `modules` (import names of the extra) that cannot be imported."""
    return [BENCH_LIBRARIES[m] for m in modules if not _installed(m)]


def require(command: str, modules: Iterable[str]) -> str | None:
    """None when `command` can import `modules`, else the message that says what to install."""
    absent = missing(modules)
    if not absent:
        return None
    return f"{command} needs the bench extra: {INSTALL_HINT} (missing: {', '.join(absent)})"
