"""Running the application: `ServeCluster` starts Ray (a local instance, or the cluster RAY_ADDRESS
names), Ray Serve's HTTP proxy on the configured host and port, and the application, and waits until
the ingress answers /health; leaving it shuts Serve and Ray down, so nothing is left running.
`run_cluster` is the foreground `radixserve serve --replicas N`.

Port 0 means any free port. The proxy binds in another process, after the port was found free, and
Ray's own processes take ports meanwhile; so a free port that is gone by then is retried with another.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from dataclasses import replace
from types import FrameType
from typing import Any

import httpx
import ray
from ray import serve

from radixserve.config import EngineConfig
from radixserve.scaleout.app import ClusterConfig, build_application
from radixserve.server.config import ServerConfig
from radixserve.server.runner import url_for

PORT_ATTEMPTS = 5


class ServeCluster:
    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig, cluster: ClusterConfig,
                 num_cpus: int | None = None, startup_timeout_s: float = 600.0) -> None:
        self.engine_config, self.server_config, self.cluster = engine_config, server_config, cluster
        self.num_cpus, self.startup_timeout_s = num_cpus, startup_timeout_s
        self._started_ray = False
        self._owns_serve = False
        self.port = server_config.port  # the bound one, once started

    @property
    def url(self) -> str:
        return url_for(self.server_config.host, self.port)

    @property
    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://", 1) + "/v1/chat/ws"

    def __enter__(self) -> ServeCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        # a guest on a cluster someone else runs (RAY_ADDRESS, or Ray already up here) removes only its
        # own application on exit, never Serve itself
        self._owns_serve = not (ray.is_initialized() or os.environ.get("RAY_ADDRESS"))
        try:
            if not ray.is_initialized():
                ray.init(num_cpus=self.num_cpus, include_dashboard=False, log_to_driver=False,
                         configure_logging=False)
                self._started_ray = True
            self._start_proxy()
            app = build_application(self.engine_config, replace(self.server_config, port=self.port), self.cluster)
            serve.run(app, name=self.cluster.app_name, route_prefix="/", blocking=False)
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _start_proxy(self) -> None:
        host, fixed = self.server_config.host, self.server_config.port != 0
        for attempt in range(1 if fixed else PORT_ATTEMPTS):
            port = self.server_config.port if fixed else _free_port(host)
            try:
                serve.start(http_options={"host": host, "port": port})
            except Exception as e:  # noqa: BLE001 - Ray reports a failed bind as a wrapped RuntimeError
                if self._owns_serve:
                    serve.shutdown()
                if fixed or not self._owns_serve or attempt == PORT_ATTEMPTS - 1:
                    raise RuntimeError(f"Ray Serve's proxy could not listen on {host}:{port}") from e
                continue
            self.port = port
            return

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            try:
                r = httpx.get(self.url + "/health", timeout=5.0)
                if r.status_code == 200:
                    return
                last = r.text
                if r.json().get("status") == "error":
                    raise RuntimeError(f"the ingress failed to start: {r.json().get('detail')}")
            except (httpx.HTTPError, ValueError) as e:
                last = type(e).__name__
            time.sleep(0.5)
        raise TimeoutError(f"the application did not become healthy in {self.startup_timeout_s:.0f} s ({last})")

    def stop(self) -> None:
        if ray.is_initialized():
            try:
                if self._owns_serve:
                    serve.shutdown()
                else:
                    serve.delete(self.cluster.app_name)
            finally:
                if self._started_ray:
                    ray.shutdown()
                    self._started_ray = False


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host.strip("[]"), 0))
        return int(s.getsockname()[1])


def run_cluster(engine_config: EngineConfig, server_config: ServerConfig, cluster: ClusterConfig) -> int:
    """Foreground: serve until Ctrl-C or SIGTERM; returns the exit code."""
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous: dict[int, Any] = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    print(f"radixserve: starting Ray Serve with {cluster.replicas} engine replicas ({cluster.router} routing) ...",
          flush=True)
    try:
        with ServeCluster(engine_config, server_config, cluster) as c:
            print(f"radixserve: serving at {c.url} (web UI at /); OpenAI API at {c.url}/v1", flush=True)
            stop.wait()
            print("radixserve: stopping the replicas ...", flush=True)
    except (RuntimeError, TimeoutError, ValueError) as e:
        print(f"radixserve: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 0
