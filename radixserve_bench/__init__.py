"""`radixserve bench`: workloads, peer systems, metrics, reports and charts for the prefix cache, and
the focused measurements the docs cite (`checks/`).

Data flows one way: workloads (token-level, deterministic by seed) -> driver (closed/open loop
clients against one system) -> traces -> metrics / cache simulations -> report (table, JSON, charts).

Packaging: a top-level package of the radixserve distribution, beside the runtime package rather than
inside it. It ships in the same distribution (pyproject's package find lists both), so `pip install
-e .` and `make setup` install it with no second project to keep in step, and `bash
scripts/gpu_check.sh` runs it from a checkout on PYTHONPATH like the runtime. What makes it optional
is its libraries, not its code: the `bench` extra (`pip install 'radixserve[bench]'`, extra.py)
installs them, and a subcommand that needs them says so and exits before importing them. The
runtime never imports this package; `radixserve bench` (radixserve/cli.py) imports `cli` here only
when it runs. The import name carries the project's prefix because a plain `bench` would collide
with other distributions' top-level packages.
"""
