"""Running the application: `ServeCluster` starts Ray (a local instance, or the cluster RAY_ADDRESS
names), Ray Serve's HTTP proxy on the configured host and port, and the application, and waits until
the ingress answers /health; leaving it first drains the ingress (the server's shutdown: running
generations get `shutdown_grace_s`, then end with "abort"), then shuts Serve and Ray down, so
nothing is left running. `run_cluster` is the foreground `radixserve serve --replicas N`; SIGINT and
SIGTERM both stop it that way and it exits 0. (`ray.init` replaces a SIGTERM handler with its own
and a C-level one that aborts the process, so the handler the program had is installed again.)

A stop signal may reach Ray's own processes too: a service manager signals every process of the
unit's process group (`kill -TERM -- -PGID`) or of its cgroup (systemd's default KillMode), and the
OOM killer picks whom it likes. A GCS that got SIGTERM stops accepting connections at once but its
process lingers, and the raylet lingers too, trying to reach it; every Serve call of the graceful
stop then blocks in Ray's client until it gives up after 60 s and ends the process with exit 1. So
the foreground command (`on_cluster_lost`) watches the GCS while it stops Serve: once the GCS no
longer accepts connections there is nothing left to stop gracefully (Serve's state lived in it), and
the command kills every process it started, Ray's included, and exits 0 at once (see
`_watch_gcs` for why this and not keeping Ray's processes out of the signal's way).

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
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
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
DRAIN_SLACK_S = 10.0  # beyond the server's shutdown grace: aborted generations still have to end
GCS_PROBE_S = 0.25  # how often a stop checks that Ray's GCS still accepts connections
GCS_CONNECT_S = 2.0  # a probe that times out proves nothing (a busy machine): only a refusal counts


class StartCancelled(Exception):
    """`ServeCluster.cancel` was set while it started; what had started is stopped again."""


class ServeCluster:
    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig, cluster: ClusterConfig,
                 num_cpus: int | None = None, startup_timeout_s: float = 600.0,
                 cancel: threading.Event | None = None, on_cluster_lost: Callable[[], None] | None = None) -> None:
        self.engine_config, self.server_config, self.cluster = engine_config, server_config, cluster
        self.num_cpus, self.startup_timeout_s = num_cpus, startup_timeout_s
        self.cancel = cancel  # set while starting (a signal): stop waiting for the replicas, undo the start
        # called (on another thread) when the GCS stops accepting connections while Serve is being
        # stopped: the stop's Serve calls then never return, so it must end the process (run_cluster)
        self.on_cluster_lost = on_cluster_lost
        self._started_ray = False
        self._owns_serve = False
        self._serving = False  # ours answered /health, so it may have generations to drain
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
                keep = _sigterm_handler()
                ray.init(num_cpus=self.num_cpus, include_dashboard=False, log_to_driver=False,
                         configure_logging=False)
                self._started_ray = True
                if keep is not None:
                    # ray.init replaces the program's SIGTERM handler with sys.exit, and its core worker
                    # puts a C-level crash handler under it that aborts the process (exit -6, Ray left
                    # running): installing the program's own handler again restores both levels
                    signal.signal(signal.SIGTERM, keep)
            self._start_proxy()
            app = build_application(self.engine_config, replace(self.server_config, port=self.port), self.cluster)
            serve.run(app, name=self.cluster.app_name, route_prefix="/", blocking=False)
            self._wait_healthy()
            self._serving = True
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
            if self.cancel is not None and self.cancel.is_set():
                raise StartCancelled("stopped before the application was ready")
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
                # not around ray.shutdown: it stops the GCS itself
                with _watch_gcs(self.on_cluster_lost):
                    self._drain()
                    if self._owns_serve:
                        serve.shutdown()
                    else:
                        serve.delete(self.cluster.app_name)
            finally:
                if self._started_ray:
                    ray.shutdown()
                    self._started_ray = False


    def _drain(self) -> None:
        """Let the ingress finish (or abort) its generations while the proxy still delivers them."""
        if not self._serving:
            return
        self._serving = False
        timeout = self.server_config.shutdown_grace_s + DRAIN_SLACK_S
        try:
            serve.get_app_handle(self.cluster.app_name).drain.remote().result(timeout_s=timeout)
        except Exception as e:  # noqa: BLE001 - the application is deleted next whatever happened here
            print(f"radixserve: draining the ingress failed ({type(e).__name__}); stopping anyway",
                  file=sys.stderr, flush=True)


@contextmanager
def _watch_gcs(on_lost: Callable[[], None] | None) -> Iterator[None]:
    """Call `on_lost` (once, on a watcher thread) if Ray's GCS stops accepting connections in the block.

    Why watch instead of keeping Ray's processes out of the signal's way (starting them in a
    session of their own, so that a group SIGTERM reaches only this process, which then stops them in
    order): that covers only a signal to the process group, not one to the cgroup or a GCS that dies
    otherwise, and it needs Ray's private process launcher. Why a refused connection: a stopped GCS's
    process stays alive for seconds, so whether it runs says nothing; its closed listening socket
    is refused at once, while a busy or slow GCS still accepts (a probe that times out counts for
    nothing). Whenever the signal reaches the GCS, before or during the stop, the next probe sees it.
    """
    if on_lost is None:
        yield
        return
    host, _, port = str(ray.get_runtime_context().gcs_address).rpartition(":")
    done = threading.Event()

    def watch() -> None:
        while not done.wait(GCS_PROBE_S):
            try:
                with socket.create_connection((host.strip("[]"), int(port)), timeout=GCS_CONNECT_S):
                    pass
            except ConnectionRefusedError:
                if not done.is_set():
                    on_lost()
                return
            except OSError:  # a timeout, or no route for a moment: not proof that the GCS is gone
                continue

    watcher = threading.Thread(target=watch, name="radixserve-gcs-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


def _descendants(pid: int) -> list[int]:
    """Every process under `pid`, found through /proc (Linux; elsewhere none: Ray's own fate sharing
    ends its processes with this one)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        ppid = int(stat.rsplit(b")", 1)[1].split()[1])  # "pid (comm) state ppid ...": comm may hold anything
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def _abandon_lost_cluster() -> None:
    """The GCS went away while Serve was being stopped: kill what is left and exit 0 at once.

    Nothing graceful is possible any more and the main thread is blocked in a Serve call that would
    end the process with exit 1 after 60 s, as could Ray's exit hooks: so the process ends here,
    with os._exit. Ray's workers (the replicas, Serve's controller and proxy) are the raylet's
    children, so they are listed before anything is killed."""
    print("radixserve: Ray's GCS is gone (the stop signal reached Ray's own processes too); "
          "killing what is left of the cluster", file=sys.stderr, flush=True)
    for pid in _descendants(os.getpid()):
        with suppress(OSError):  # exited meanwhile
            os.kill(pid, signal.SIGKILL)
    sys.stdout.flush()
    os._exit(0)


def _sigterm_handler() -> Any:
    """The SIGTERM handler this program installed itself, if any (and this is the thread that may)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    handler = signal.getsignal(signal.SIGTERM)
    return handler if callable(handler) else None


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host.strip("[]"), 0))
        return int(s.getsockname()[1])


def run_cluster(engine_config: EngineConfig, server_config: ServerConfig, cluster: ClusterConfig) -> int:
    """Foreground: serve until Ctrl-C or SIGTERM (either drains the ingress, then stops Serve and
    Ray); returns the exit code: 0 for a stop by signal, also one during startup."""
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous: dict[int, Any] = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    print(f"radixserve: starting Ray Serve with {cluster.replicas} engine replicas ({cluster.router} routing) ...",
          flush=True)
    try:
        with ServeCluster(engine_config, server_config, cluster, cancel=stop, on_cluster_lost=_abandon_lost_cluster) as c:
            print(f"radixserve: serving at {c.url} (web UI at /); OpenAI API at {c.url}/v1", flush=True)
            stop.wait()
            print("radixserve: stopping the replicas ...", flush=True)
    except StartCancelled as e:  # a signal while starting: as asked, not a failure
        print(f"radixserve: {e}", flush=True)
    except (RuntimeError, TimeoutError, ValueError) as e:
        print(f"radixserve: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 0
