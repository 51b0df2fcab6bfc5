"""The Starlette app: routes, the model loading in the background, Host/Origin guard and auth
middleware, static UI.

Lifecycle: the app starts answering at once (GET /health is 503 until the model is loaded); the
engine is built in a worker thread and started on the event loop; `state.ready` is set when loading
ends either way. Shutdown (`drain`) refuses new generations, lets running ones finish for
`shutdown_grace_s`, aborts the rest, then stops the engine — nothing is left hanging.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocketClose

from radixserve.chat.template import ChatFormatter
from radixserve.server import pins_api, tree_api
from radixserve.server.admission import ReleaseSlotsMiddleware
from radixserve.server.anthropic import api as anthropic_api
from radixserve.server.api_errors import api_error_handler, error_response
from radixserve.server.auth import needs_key, request_key
from radixserve.server.cache_views import cache_stats, metrics
from radixserve.server.callers import SCOPE_KEY, UNAUTHORIZED, resolve_caller
from radixserve.server.completions import api as completions_api
from radixserve.server.config import ServerConfig
from radixserve.server.http_util import InternalErrorMiddleware
from radixserve.server.log_filters import install as quiet_client_faults
from radixserve.server.metrics import ServerMetrics
from radixserve.server.openai_chat import api as openai_api
from radixserve.server.openai_chat.tools import server_format
from radixserve.server.pipeline.compile_slots import CLIENT
from radixserve.server.pipeline.prompt_worker import PromptWorker
from radixserve.server.replica_header import ReplicaHeaderMiddleware
from radixserve.server.request_guard import RequestGuardMiddleware
from radixserve.server.responses import api as responses_api
from radixserve.server.sessions import rest
from radixserve.server.sessions.store import SessionStore
from radixserve.server.sessions.ws import chat_websocket
from radixserve.server.state import EngineFactory, ServerState
from radixserve.server.validation import ApiError

log = logging.getLogger("radixserve.server")
T = TypeVar("T")
STEP_METRICS_S = 1.0  # how often the step histograms take in the engine's steps (and at every read)


def in_passing_thread(build: Callable[[], T]) -> T:
    """build() run in a thread of its own that then exits. Loading runs torch's parallel loops, and
    OpenMP keeps a team of threads for every thread that ran one for as long as that thread lives:
    an executor thread's team would outlive the load, and with more team threads than CPUs libgomp
    stops spinning at its barriers, so each of the step's ~150 parallel regions would wait for a
    sleeping worker to be woken (measured: 73 against 134 tok/s offline on 2 cores)."""
    result: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(build())
        except BaseException as e:  # re-raised in the caller's thread
            failure.append(e)

    thread = threading.Thread(target=run, name="radixserve-load")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


async def load_engine(state: ServerState) -> None:
    try:
        engine = await asyncio.to_thread(in_passing_thread, state.engine_factory)
        await engine.start()
        if engine.tokenizer is not None:
            # tool calls look as --tool-call-parser says, else as the chat template implies (server/openai_chat/tools.py);
            # their parameters' objects are open or closed as the engine compiles JSON schemas (--open-json-objects)
            grammars = engine.intake.grammars
            fmt = server_format(engine.tokenizer, state.config.tool_call_parser,
                                grammars is not None and grammars.open_objects)
            formatter = ChatFormatter(engine.tokenizer, fmt)
            # its tokenizer is copied before the formatter is in use (the copy is the worker's own)
            state.prompt_worker = await asyncio.to_thread(PromptWorker, formatter)
            state.formatter = formatter
            state.sessions = SessionStore(state.formatter, state.config.max_sessions, state.config.session_ttl_s,
                                          max_bytes=state.config.max_session_bytes_total,
                                          owner_share=state.config.owner_share)
        await pins_api.pin_at_start(state, engine)  # --pin FILE: before any request is served
        state.model_name = state.config.served_model_name or engine.model_name
        state.engine = engine
    except (ValueError, FileNotFoundError) as e:  # the model directory or a config value we refuse: one line
        log.error("loading the model failed: %s", e)
        state.load_error = f"loading the model failed: {e}"
    except Exception as e:  # reported by /health and by `radixserve serve`
        log.exception("loading the model failed")
        state.load_error = f"loading the model failed: {e}"
    finally:
        state.ready.set()


async def drain(state: ServerState) -> None:
    """Refuse new work, give in-flight generations the grace period, then abort what is left."""
    if state.draining:
        return
    state.draining = True
    if not await state.inflight.wait_idle(state.config.shutdown_grace_s) and state.engine is not None:
        log.info("aborting %d generation(s) still running at shutdown", len(state.inflight.ids))
        for rid in list(state.inflight.ids):
            state.engine.abort(rid)
        await state.inflight.wait_idle(5.0)


async def _observe_steps(state: ServerState) -> None:
    """Keeps the step metrics current between scrapes, and the engine's step feed from overflowing."""
    while True:
        await asyncio.sleep(STEP_METRICS_S)
        try:
            state.observe_steps()
        except Exception:  # a metrics bug must not stop the feed from being drained
            log.exception("taking the engine's steps into the step metrics failed")


async def _expire_sessions(state: ServerState) -> None:
    period = min(60.0, max(1.0, state.config.session_ttl_s / 4))
    while True:
        await asyncio.sleep(period)
        if state.sessions is not None:
            state.sessions.expire()


async def health(request: Request) -> Response:
    state: ServerState = request.app.state.server
    if state.engine is not None and not state.draining:
        problem = state.engine.health(state.config.health_stall_s)
        if problem is None:
            return JSONResponse({"status": "ok", "model": state.model_name})
        return JSONResponse({"status": "unhealthy", "detail": problem}, status_code=503)
    status = "error" if state.load_error else ("stopping" if state.draining else "loading")
    return JSONResponse({"status": status, "detail": state.load_error}, status_code=503)


class ApiKeyMiddleware:
    """Resolves the caller (callers.py) of every HTTP request to /v1/* and /metrics from its key (Bearer
    or x-api-key) and stores it in the scope's state; 401 for a missing or unknown key on a server with
    keys. The WebSocket authenticates in its handler. Every request's client address is set in
    compile_slots.CLIENT for its task."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and scope.get("client"):
            CLIENT.set(scope["client"][0])  # this request's task (and its threads) see its address
        if scope["type"] == "http" and needs_key(scope["path"]):
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
            caller = resolve_caller(request_key(headers), self.state.config)
            if caller is None:
                e = ApiError("unauthorized", UNAUTHORIZED, 401)
                await error_response(e, self.state.metrics, path=scope["path"])(scope, receive, send)
                return
            scope.setdefault("state", {})[SCOPE_KEY] = caller
        await self.app(scope, receive, send)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    if not request.url.path.startswith(("/v1", "/metrics", "/health")):
        return PlainTextResponse(str(exc.detail), status_code=exc.status_code)
    return error_response(ApiError(code, str(exc.detail), exc.status_code), headers=exc.headers,
                          path=request.url.path)


def build_app(engine_factory: EngineFactory, config: ServerConfig | None = None) -> Starlette:
    """The app; `app.state.server` is its ServerState (tests reach the engine through it)."""
    config = config or ServerConfig()
    quiet_client_faults()  # a refused upgrade or a non-UTF-8 frame is the client's fault: INFO, no traceback
    server_metrics = ServerMetrics(config.system_prompt_labels)
    state = ServerState(config=config, engine_factory=engine_factory, metrics=server_metrics)
    state.metrics.attach(state.engine_stats, lambda: state.sessions, state.refusals)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state.loop = asyncio.get_running_loop()
        loader = asyncio.create_task(load_engine(state))
        sweeper = asyncio.create_task(_expire_sessions(state))
        stepper = asyncio.create_task(_observe_steps(state))
        try:
            yield
        finally:
            sweeper.cancel()
            stepper.cancel()
            await drain(state)
            with suppress(asyncio.CancelledError):
                await loader
            if state.engine is not None:
                await state.engine.shutdown()
            if state.prompt_worker is not None:
                state.prompt_worker.close()

    routes: list[Any] = [
        Route("/health", health), Route("/metrics", metrics), Route("/v1/cache/stats", cache_stats),
        WebSocketRoute("/v1/chat/ws", chat_websocket), *rest.ROUTES, *openai_api.ROUTES, *completions_api.ROUTES,
        *responses_api.ROUTES, *anthropic_api.ROUTES, *pins_api.ROUTES, *tree_api.ROUTES,
    ]
    middleware = [Middleware(ReleaseSlotsMiddleware), Middleware(InternalErrorMiddleware, metrics=state.metrics),
                  Middleware(ApiKeyMiddleware, state=state)]
    if config.allowed_origins:
        origins = ["*"] if "*" in config.allowed_origins else config.allowed_origins
        middleware.insert(0, Middleware(CORSMiddleware, allow_origins=origins, allow_methods=["*"],
                                        allow_headers=["*"]))
    if config.replica_header:
        middleware.append(Middleware(ReplicaHeaderMiddleware))
    # outermost: a request for a foreign Host or a cross-site state change reaches nothing else
    middleware.insert(0, Middleware(RequestGuardMiddleware, state=state))
    # Routes raise ApiError; this one handler answers it (unexpected exceptions: InternalErrorMiddleware)
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan,
                    exception_handlers={HTTPException: _http_error, ApiError: api_error_handler(state.metrics)})
    # The UI is the router's fallback, not a Mount: a Mount at "/" would match every path and turn a
    # wrong method on an API route (405) into a static-file 404.
    app.router.default = StaticFallback(config.web_dir)
    app.state.server = state
    return app


class StaticFallback:
    """Paths no route matched: the web UI's files (index.html at /), JSON 404s under the API."""

    def __init__(self, web_dir: Path | None) -> None:
        ok = web_dir is not None and (web_dir / "index.html").is_file()
        self.files = StaticFiles(directory=str(web_dir), html=True) if ok else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await WebSocketClose()(scope, receive, send)
            return
        path = scope["path"]
        if path.startswith(("/v1", "/metrics", "/health")):
            await error_response(ApiError("not_found", f"no endpoint {path}", 404), path=path)(scope, receive, send)
        elif self.files is None:
            text = "radixserve: the web UI is not installed; the API is under /v1 (see docs/server.md)"
            await PlainTextResponse(text, status_code=200 if path == "/" else 404)(scope, receive, send)
        else:
            await self.files(scope, receive, send)
