"""The Ray Serve application: N engine replicas behind one HTTP/WebSocket ingress speaking radixserve's
whole API (the server app over a ClusterEngine), with cache-aware routing between them.

`build_application(engine_config, server_config, cluster)` returns the application for people who
compose their own Ray Serve deployments (`serve.run(app)`); `run_cluster` is `radixserve serve
--replicas N`. Ray Serve does the rest: it places the replicas (one GPU each when the model runs on
CUDA), health-checks them and restarts the ones that die.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from starlette.applications import Starlette

from radixserve.config import EngineConfig
from radixserve.scaleout.cluster_engine import ClusterEngine
from radixserve.scaleout.config import ENGINE_DEPLOYMENT, ClusterConfig
from radixserve.scaleout.replica import EngineReplica
from radixserve.scaleout.router import CacheAwareRouter, PowerOfTwoRouter
from radixserve.scaleout.views import ReplicaCollector, cluster_json
from radixserve.server.app import build_app, drain
from radixserve.server.config import ServerConfig
from radixserve.server.state import ServerState

# by import path: Ray imports the class where the handle routes (the ingress process)
ROUTERS = {"cache-aware": f"{CacheAwareRouter.__module__}.{CacheAwareRouter.__qualname__}",
           "power-of-two": f"{PowerOfTwoRouter.__module__}.{PowerOfTwoRouter.__qualname__}"}


def _gpus(engine_config: EngineConfig, cluster: ClusterConfig) -> float:
    if cluster.gpus_per_replica is not None:
        return cluster.gpus_per_replica
    if engine_config.device == "auto":
        import torch

        return 1.0 if torch.cuda.is_available() else 0.0
    return 1.0 if engine_config.device.startswith("cuda") else 0.0


class Ingress:
    """The one HTTP/WebSocket entry: radixserve's server app, its engine the replicas."""

    def __init__(self, engine: DeploymentHandle, server_config: ServerConfig, cluster: ClusterConfig) -> None:
        self.engine_handle, self.server_config, self.cluster = engine, server_config, cluster
        self._state: ServerState | None = None

    async def drain(self) -> None:
        """The server's shutdown drain (refuse new generations, give running ones `shutdown_grace_s`,
        abort the rest), called through a handle before the application is deleted: Ray Serve's own
        shutdown would otherwise stop its proxy with streams still open, cutting them mid-reply."""
        state = self._state
        if state is None or state.loop is None:
            return
        if state.loop is asyncio.get_running_loop():
            await drain(state)
        else:  # the app's loop is Ray's user-code loop; a handle call may run on another one
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(drain(state), state.loop))

    def __serve_build_asgi_app__(self) -> Starlette:
        cluster, handle = self.cluster, self.engine_handle
        # the router's table is keyed by the names the application really runs under (serve.run's)
        key = f"{handle.app_name}/{handle.deployment_name}"
        app = build_app(lambda: ClusterEngine(handle, key),
                        replace(self.server_config, replica_header=True))
        state = self._state = app.state.server

        def engine() -> ClusterEngine | None:
            return state.engine if isinstance(state.engine, ClusterEngine) else None

        def extra() -> dict[str, Any]:
            e = engine()
            return cluster_json(e, state.metrics, cluster.router) if e is not None else {}

        state.extra_cache_stats = extra
        state.metrics.registry.register(ReplicaCollector(engine, state.metrics))
        return app


def build_application(engine_config: EngineConfig, server_config: ServerConfig | None = None,
                      cluster: ClusterConfig | None = None) -> Any:
    """The Ray Serve application (a `serve.Application`): `serve.run(app, name=cluster.app_name,
    route_prefix="/")` serves it through Ray Serve's HTTP proxy."""
    cluster = cluster or ClusterConfig()
    server_config = server_config or ServerConfig()
    router: dict[str, Any] = {
        "request_router_class": ROUTERS[cluster.router],
        "request_router_kwargs": {"max_load_gap": cluster.max_load_gap,
                                  "min_prefix_fraction": cluster.min_prefix_fraction},
        "request_routing_stats_period_s": cluster.stats_period_s,
        "request_routing_stats_timeout_s": max(10.0, 4 * cluster.stats_period_s)}
    replica = serve.deployment(
        name=ENGINE_DEPLOYMENT, num_replicas=cluster.replicas, max_ongoing_requests=cluster.max_ongoing_requests,
        ray_actor_options={"num_cpus": 0, "num_gpus": _gpus(engine_config, cluster)},
        health_check_period_s=cluster.health_check_period_s, request_router_config=RequestRouterConfig(**router),
    )(EngineReplica)
    ingress = serve.deployment(name="ingress", num_replicas=1, max_ongoing_requests=10_000,
                               ray_actor_options={"num_cpus": 0})(serve.ingress()(Ingress))
    return ingress.bind(replica.bind(engine_config, cluster.torch_threads, server_config.health_stall_s),
                        server_config, cluster)
