"""Everything one server app holds: config, engine (once loaded), sessions, metrics, in-flight requests.

The engine loads in a worker thread after the app starts, so until `engine` is set every endpoint
but /health and the static UI answers 503. `draining` is set when shutdown begins: new generations
are refused while the running ones finish or are aborted; `InFlight` tracks them for that.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from radixserve.chat.template import ChatFormatter
from radixserve.engine.client import EngineClient
from radixserve.engine.stats import EngineStats
from radixserve.server.admission import GenerationLimits
from radixserve.server.config import ServerConfig
from radixserve.server.connections import ConnectionGuard
from radixserve.server.metrics import ServerMetrics
from radixserve.server.pin_book import PinBook
from radixserve.server.pipeline.compile_slots import CompileSlots
from radixserve.server.pipeline.logprobs import TokenTexts
from radixserve.server.pipeline.prompt_worker import PromptWorker
from radixserve.server.rate_limit import CreationRateLimiter
from radixserve.server.sessions.store import SessionStore
from radixserve.server.validation import ApiError

EngineFactory = Callable[[], EngineClient]


@dataclass
class InFlight:
    """Engine request ids the server has running, so shutdown can drain or abort them."""

    ids: set[str] = field(default_factory=set)
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, rid: str) -> None:
        self.ids.add(rid)
        self._idle.clear()

    def discard(self, rid: str) -> None:
        self.ids.discard(rid)
        if not self.ids:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        if not self.ids:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False


@dataclass
class ServerState:
    config: ServerConfig
    engine_factory: EngineFactory
    metrics: ServerMetrics
    engine: EngineClient | None = None
    formatter: ChatFormatter | None = None
    sessions: SessionStore | None = None
    model_name: str = ""
    load_error: str | None = None
    draining: bool = False
    started_at: float = field(default_factory=time.time)
    loop: asyncio.AbstractEventLoop | None = None  # the server's event loop, once running
    inflight: InFlight = field(default_factory=InFlight)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    # the SessionTurn in flight per session id, so deleting a session can cancel it
    session_generations: dict[str, Any] = field(default_factory=dict)
    # session creations per client address (REST create and fork, WebSocket session.create)
    creation_limiter: CreationRateLimiter = field(default_factory=CreationRateLimiter)
    compile_slots: CompileSlots = field(default_factory=CompileSlots)  # grammar compiles in flight per client
    _token_texts: TokenTexts | None = None  # per-token text for logprobs, built on first use
    # API requests generating, per client and in all (admission.py)
    generations: GenerationLimits = field(default_factory=GenerationLimits)
    connections: ConnectionGuard | None = None  # set by the uvicorn runner (runner.py); None under Ray Serve's proxy
    prompt_worker: PromptWorker | None = None  # tokenizes large prompts and turns off the event loop, once loaded
    pins: PinBook = field(default_factory=PinBook)  # the pins this server made: tenants, origins, expiry
    # more of GET /v1/cache/stats, from whoever built the app around a multi-replica engine (scaleout/)
    extra_cache_stats: Callable[[], dict[str, Any]] | None = None

    def refusals(self) -> dict[str, dict[str, int]]:
        """Connections the guard refused or closed and generations refused at a cap, by reason."""
        guard = self.connections
        closed = guard.closed_by_reason() if guard is not None else {"refused_over_cap": 0, "evicted_idle": 0,
                                                                     "timed_out": 0}
        return {"connections": closed, "generations": dict(self.generations.refused)}

    def require_engine(self) -> EngineClient:
        if self.engine is None:
            why = "the model failed to load (see GET /health)" if self.load_error else "the model is still loading"
            raise ApiError("unavailable", why, 503)
        return self.engine

    def require_chat(self) -> tuple[ChatFormatter, SessionStore]:
        self.require_engine()
        if self.formatter is None or self.sessions is None:
            raise ApiError("unsupported", "this model has no tokenizer, so chat endpoints are unavailable", 400)
        return self.formatter, self.sessions

    def require_prompts(self) -> PromptWorker:
        """What tokenizes chat prompts (inline when small, off the event loop when large)."""
        self.require_chat()
        assert self.prompt_worker is not None, "set with the formatter when the model loads"
        return self.prompt_worker

    def require_model(self, model: str) -> None:
        """404 `model_not_found` unless `model` is the served model's name (what every generating API
        checks its `model` field against)."""
        if model != self.model_name:
            raise ApiError("model_not_found", f"the model {model!r} does not exist; this server serves "
                           f"{self.model_name!r}", 404, param="model")

    def limit_creation(self, client: str | None) -> None:
        """Count one session creation by `client` (its address); 429 rate_limited over its allowance."""
        cfg = self.config
        self.creation_limiter.check(client, cfg.session_create_rate, cfg.session_create_burst)

    def token_texts(self) -> TokenTexts:
        """The (text, bytes) of single tokens of the engine's tokenizer, as logprobs show them."""
        engine = self.require_engine()
        if self._token_texts is None or self._token_texts.tokenizer is not engine.tokenizer:
            self._token_texts = TokenTexts(engine.tokenizer)
        return self._token_texts

    def engine_stats(self) -> EngineStats | None:
        """The engine's last published figures, with the compile figures of the compiler that checks
        requests as they are now (compiles happen at the check, on this side, without a step)."""
        if self.engine is None:
            return None
        grammars = getattr(self.engine.intake, "grammars", None)
        st = self.engine.stats()
        return st.with_compiles(grammars.stats) if grammars is not None else st

    def observe_steps(self) -> None:
        """Take the steps the engine ran since the last call into the step metrics; on the event loop,
        as every metric update is (the engine thread only records its steps: engine/observers.py)."""
        if self.engine is not None:
            for step in self.engine.drain_steps():
                self.metrics.observe_step(step)
