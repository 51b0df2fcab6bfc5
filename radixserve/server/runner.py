"""Running the app on uvicorn: in the foreground (`radixserve serve`) or in a background thread
(tests, benchmarks, UI tests), always bound where the config says (127.0.0.1 by default).

`RadixUvicornServer` drains generations before uvicorn closes connections, so WebSocket clients get
their final `done` frames on shutdown. `BackgroundServer` is a context manager that starts the
server on a free port (port 0), waits until the model is loaded, and always stops the thread.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn
from starlette.applications import Starlette

from radixserve.server.app import build_app, drain
from radixserve.server.config import ServerConfig
from radixserve.server.connections import ConnectionGuard, ConnectionLimits, guarded_http_protocol
from radixserve.server.hosts import WILDCARD_BINDS
from radixserve.server.state import EngineFactory, ServerState

WS_TRANSPORT_SLACK = 4  # uvicorn drops frames over this many times our own limit (close 1009)


def uvicorn_config(app: Starlette, config: ServerConfig, **overrides: Any) -> uvicorn.Config:
    # uvicorn's own HTTP protocol under a ConnectionGuard: a connection cap below the descriptor limit
    # and header/body timeouts, which uvicorn lacks (see connections.py)
    guard = ConnectionGuard(ConnectionLimits(config.max_connections, config.header_timeout_s, config.body_timeout_s))
    app.state.server.connections = guard  # its counters are metrics
    return uvicorn.Config(
        app, host=config.host, port=config.port, log_level="warning", lifespan="on", ws="websockets-sansio",
        ws_max_size=max(16 * 2**20, WS_TRANSPORT_SLACK * config.max_message_bytes),
        timeout_graceful_shutdown=math.ceil(config.shutdown_grace_s) + 5, http=guarded_http_protocol(guard),
        timeout_keep_alive=config.keep_alive_timeout_s, **overrides,  # type: ignore[arg-type]  # a float is fine
    )


class RadixUvicornServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState,
                 on_ready: Callable[[RadixUvicornServer], None] | None = None) -> None:
        super().__init__(config)
        self.state, self.on_ready = state, on_ready
        self._watch: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self._watch = asyncio.create_task(self._report_ready())

    async def _report_ready(self) -> None:
        await self.state.ready.wait()
        if self.on_ready is not None:
            self.on_ready(self)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await drain(self.state)
        await super().shutdown(sockets)

    @property
    def bound_port(self) -> int:
        for server in getattr(self, "servers", []):
            for sock in server.sockets:
                return int(sock.getsockname()[1])
        return self.config.port


def url_for(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


class BackgroundServer:
    """`with BackgroundServer(factory, cfg) as srv:` -> srv.url, srv.state, srv.engine; stopped on exit."""

    def __init__(self, engine_factory: EngineFactory, config: ServerConfig | None = None,
                 startup_timeout_s: float = 300.0) -> None:
        self.config = config or ServerConfig(port=0, web_dir=None)
        self.app = build_app(engine_factory, self.config)
        self.state: ServerState = self.app.state.server
        self.server = RadixUvicornServer(uvicorn_config(self.app, self.config), self.state)
        self.startup_timeout_s = startup_timeout_s
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def __enter__(self) -> BackgroundServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            self.server.run()
        except BaseException as e:  # noqa: BLE001 - reported by start()
            self._error = e

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="radixserve-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self.startup_timeout_s
        while not (self.server.started and self.state.ready.is_set()):
            if self._error is not None or not self._thread.is_alive():
                raise RuntimeError(f"server failed to start: {self._error!r}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError("server did not become ready in time")
            time.sleep(0.05)
        if self.state.load_error:
            self.stop()
            raise RuntimeError(self.state.load_error)

    def stop(self, timeout_s: float = 60.0) -> None:
        if self._thread is None:
            return
        self.server.should_exit = True
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self.server.force_exit = True
            self._thread.join(10.0)
        self._thread = None

    @property
    def port(self) -> int:
        return self.server.bound_port

    @property
    def url(self) -> str:
        return url_for(self.config.host, self.port)

    @property
    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://", 1) + "/v1/chat/ws"

    @property
    def engine(self) -> Any:
        return self.state.engine


def log_to_stderr() -> None:
    """radixserve's own INFO lines (threads and packing chosen, engine start-up time, requests the
    scheduler ended) on stderr, as `radixserve: ...`; left alone if the embedding program set a handler."""
    logger = logging.getLogger("radixserve")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("radixserve: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def serve_forever(engine_factory: EngineFactory, config: ServerConfig) -> int:
    """Foreground server for `radixserve serve`; returns the process exit code."""
    log_to_stderr()
    app = build_app(engine_factory, config)
    state: ServerState = app.state.server
    failed = False

    def on_ready(server: RadixUvicornServer) -> None:
        nonlocal failed
        if state.load_error:
            failed = True
            print(f"radixserve: {state.load_error}", file=sys.stderr, flush=True)
            server.should_exit = True
            return
        # everything loading allocated (the model, tokenizer and transformers' modules: ~450k objects,
        # a 265 ms full collection on the embedded model) lives as long as the server: kept out of the
        # collector, so a collection while serving walks only what requests allocated
        gc.freeze()
        url = url_for(config.host, server.bound_port)
        ui = " (web UI at /)" if config.web_dir is not None and (config.web_dir / "index.html").is_file() else ""
        print(f"radixserve: serving {state.model_name} at {url}{ui}; OpenAI API at {url}/v1", flush=True)
        if config.host.strip("[]") in WILDCARD_BINDS and not config.allowed_hosts:
            # binding every address does not make every Host valid (DNS rebinding); say what to do
            print("radixserve: only the Hosts 127.0.0.1, localhost and [::1] are answered; list the names or "
                  "addresses clients use with --allowed-hosts (or '*')", flush=True)

    server = RadixUvicornServer(uvicorn_config(app, config), state, on_ready)
    print("radixserve: loading the model (GET /health answers 503 until it is ready) ...", flush=True)
    server.run()
    return 1 if failed else 0
