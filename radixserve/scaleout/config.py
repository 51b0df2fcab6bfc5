"""How the scale-out application is shaped: replicas, routing and reporting (the engine and the
server keep their own configs). Importable without Ray, so flags are checked before Ray loads."""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.scaleout.routing import DEFAULT_MAX_LOAD_GAP, DEFAULT_MIN_PREFIX_FRACTION

ROUTER_NAMES = ("cache-aware", "power-of-two")
ENGINE_DEPLOYMENT = "engine"


@dataclass(frozen=True)
class ClusterConfig:
    replicas: int = 2
    router: str = "cache-aware"  # or "power-of-two" (Ray Serve's default rule, for comparison)
    max_load_gap: int = DEFAULT_MAX_LOAD_GAP  # in-flight requests a prefix hit may exceed the least loaded by
    min_prefix_fraction: float = DEFAULT_MIN_PREFIX_FRACTION  # of the prompt, for a cached prefix to count
    app_name: str = "radixserve"
    gpus_per_replica: float | None = None  # None: 1 when the engine runs on CUDA, else 0
    torch_threads: int | None = None  # per replica (CPU): keeps N replicas from oversubscribing the cores
    max_ongoing_requests: int = 256  # per replica: the engine batches, so Ray should not hold requests back
    stats_period_s: float = 0.5  # how often replicas report statistics and dropped prefixes
    health_check_period_s: float = 2.0

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.router not in ROUTER_NAMES:
            raise ValueError(f"router must be one of {', '.join(ROUTER_NAMES)}, got {self.router!r}")
        if not 0.0 <= self.min_prefix_fraction <= 1.0:
            raise ValueError(f"min_prefix_fraction must be in [0, 1], got {self.min_prefix_fraction}")
        if self.max_load_gap < 0 or self.max_ongoing_requests < 1 or self.stats_period_s <= 0:
            raise ValueError("max_load_gap must be >= 0, max_ongoing_requests >= 1 and stats_period_s > 0")

    @property
    def table_key(self) -> str:
        return f"{self.app_name}/{ENGINE_DEPLOYMENT}"
