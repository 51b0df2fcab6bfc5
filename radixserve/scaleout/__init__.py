"""Scale-out on Ray Serve: N engine replicas behind one ingress with cache-aware routing.

Ray is an optional extra (`pip install 'radixserve[ray]'`): `routing`, `prefix_index`, `affinity`,
`cluster_pins`, `tree_merge`, `config` and `cli` import without it; everything that talks to Ray
(`app`, `router`, `replica`, `replica_calls`, `cluster_engine`, `local`) needs it. The Python entry
point for your own Ray Serve applications is `radixserve.scaleout.app.build_application`.
"""

from __future__ import annotations

RAY_EXTRA_HINT = "pip install 'radixserve[ray]'"


def ray_available() -> bool:
    """Whether Ray Serve imports (a bare `ray` without the serve extra's packages does not)."""
    try:
        import ray.serve  # noqa: F401
    except ImportError:
        return False
    return True
