"""The async engine: a background thread runs the step loop; many asyncio callers stream outputs.

Requests and aborts reach the engine thread through a command queue and run between steps, so the
synchronous engine is only ever touched by that thread (plus `check_integrity` and the like, which
take the step lock). `stats` never takes it: the engine thread publishes a snapshot after every step
and batch of commands (engine/stats_feed.py), before that step's outputs go out, so a caller that
sees its output finished sees it counted; likewise each step's StepInfo goes into a feed that
`drain_steps` empties on the caller's thread (engine/observers.py). A request is checked once, by
`intake` on the caller's thread, and queued as the ValidatedRequest it gives (engine/intake.py).
Outputs travel back to each caller's asyncio.Queue via call_soon_threadsafe. A caller that stops
iterating (aclose, cancellation, disconnect) aborts its request, which frees its blocks. A request
the engine failed on its own (finish_reason "error") raises RequestFailedError in its caller only.
`health()` reports a dead engine thread, or one that has made no progress for a while with work
waiting. Pins and the tree's picture run as commands too (`_call`), so they see the cache between
two steps, never in the middle of one.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from radixserve.cache.events import CacheEventLog
from radixserve.cache.tree_view import TreeView, tree_view
from radixserve.config import EngineConfig
from radixserve.core import Placement, RequestOutput, StepInfo
from radixserve.engine.engine import LLMEngine
from radixserve.engine.intake import ValidatedRequest
from radixserve.engine.observers import StepFeed, StepObserver
from radixserve.engine.pins import PinBudget, PinError, PinInfo
from radixserve.engine.stats import EngineStats
from radixserve.engine.stats_feed import StatsFeed
from radixserve.errors import EngineStoppedError, RequestFailedError
from radixserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from radixserve.engine.beam_search import BeamSearchOutput, BeamSearchParams

log = logging.getLogger(__name__)
T = TypeVar("T")
PIN_ATTEMPTS = 3  # prefills a pin may take when other traffic evicts its prefix before it is held


class AsyncEngine:
    def __init__(self, config: EngineConfig | None = None, engine: LLMEngine | None = None) -> None:
        self.engine = engine or LLMEngine(config or EngineConfig())
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()  # held by the engine thread while it mutates engine state
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._last_progress = time.monotonic()  # a step ran, or the engine was idle
        self.intake = self.engine.intake  # checks requests on the caller's thread (the event loop)
        self._feed = StatsFeed(self.engine)
        self._steps = StepFeed()
        self.engine.add_step_observer(self._steps.publish)
        # the pins as the engine thread last published them (`pins`, `pin_budget` read it without the step lock)
        self._pins_view: tuple[list[PinInfo], PinBudget] = ([], self.engine.pins.budget())
        # outputs of the commands being run, sent once the statistics counting them are published
        self._held: list[tuple[RequestOutput | BaseException, str | None]] | None = None

    # -- facts callers need --------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:  # a transformers tokenizer or None
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_seq_len

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(sorted(self.engine.eos_token_ids))

    @property
    def block_size(self) -> int:
        return self.engine.config.block_size

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="radixserve-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Abort everything in flight (callers get a final 'abort' output) and stop the thread."""
        if self._thread is None or self._stopping:
            self.engine.grammars.close()
            return
        self._submit(self._abort_all)
        self._stopping = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join, 30)
        self.engine.grammars.close()

    def _run(self) -> None:
        while not self._stopping or not self._commands.empty():
            self._drain_commands()
            if self._stopping:
                continue
            if not self.engine.has_unfinished():
                self._last_progress = time.monotonic()
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                with self._lock:
                    stalled = self.engine.stats_totals.stalled_steps
                    outputs = self.engine.step()
                    progressed = self.engine.stats_totals.stalled_steps == stalled
            except Exception:  # the engine isolates request failures; this is a bug in the engine itself
                log.exception("engine step failed; aborting in-flight requests")
                self._fail_all()
                continue
            with self._lock:
                self._publish()
            if progressed:
                self._last_progress = time.monotonic()
            else:  # a scheduler bug left work it cannot schedule: do not spin; /health reports the stall
                self._wake.wait(0.05)
                self._wake.clear()
            for out in outputs:
                self._deliver(out)

    def _drain_commands(self) -> None:
        """Run the queued commands; what they deliver goes out after the snapshot that counts it."""
        ran, self._held = False, []
        try:
            while True:
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                ran = True
                with self._lock:
                    command()
            if ran:
                with self._lock:
                    self._publish()
        finally:
            held, self._held = self._held or [], None
            for item, rid in held:
                self._deliver(item, rid)

    def _publish(self) -> None:
        """On the engine thread, under the step lock: the statistics and the pins, as callers read them."""
        self._feed.publish(self.engine)
        self._publish_pins()

    def _publish_pins(self) -> None:
        self._pins_view = (self.engine.pins.entries(), self.engine.pins.budget())

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wake.set()

    def _deliver(self, item: RequestOutput | BaseException, request_id: str | None = None) -> None:
        if self._held is not None:
            self._held.append((item, request_id))
            return
        rid = request_id or item.request_id  # type: ignore[union-attr]
        stream = self._streams.get(rid)
        if stream is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(stream.put_nowait, item)

    def _abort_all(self) -> None:
        for rid in list(self.engine.requests):
            out = self.engine.abort(rid)
            if out is not None:
                self._deliver(out)

    def _fail_all(self) -> None:
        with self._lock:
            for rid in list(self.engine.requests):
                self.engine.abort(rid)
                self._deliver(RequestFailedError("the engine step failed; see the server log"), rid)
            self._publish()

    # -- requests ------------------------------------------------------------------------------
    def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                 priority: int = 0, cancelled: Callable[[], bool] | None = None,
                 placement: Placement | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's incremental outputs; the last one has finished=True. `priority`: an
        integer, lower runs first under `--policy priority` (fcfs, cache-aware and sjf ignore it).
        A bad request raises RequestError here, before anything is queued (engine/intake.py)."""
        return self.generate_validated(self.intake.check(prompt, params, priority), request_id, cancelled,
                                       placement)

    async def generate_validated(self, request: ValidatedRequest, request_id: str | None = None,
                                 cancelled: Callable[[], bool] | None = None,
                                 placement: Placement | None = None) -> AsyncIterator[RequestOutput]:
        """`generate` for a request `intake` already checked: it is not checked again. `placement` is
        for clients over several replicas (engine/client.py): one engine ignores it.

        `cancelled`, checked once the request is queued, lets a caller whose cancel came before
        this call (and so aborted an id the engine did not know yet) still win: the abort then
        follows the request into the engine's queue."""
        if self._stopping:
            raise EngineStoppedError("the engine is shutting down")
        await self.start()
        # a grammar to compile (a request from another process) or a check again: off the event loop
        request = await asyncio.to_thread(self.intake.admit, request) if self.intake.needs_compile(request) \
            else self.intake.admit(request)
        rid = request_id or uuid.uuid4().hex
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in use")
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[rid] = stream

        def add() -> None:
            try:
                self.engine.add_validated(request, rid)
            except Exception as exc:
                self._deliver(exc, rid)

        self._submit(add)
        if cancelled is not None and cancelled():
            self.abort(rid)
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                if item.error is not None and not item.error_ends_reply:
                    raise RequestFailedError(item.error)
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(rid)
            self._streams.pop(rid, None)

    async def beam_search(self, prompt: list[int], params: BeamSearchParams, priority: int = 0,
                          placement: Placement | None = None) -> BeamSearchOutput:
        """One beam search beside whatever else runs (engine/beam_drivers.py)."""
        from radixserve.engine.beam_drivers import beam_search_async  # it builds on this class

        return await beam_search_async(self, prompt, params, priority)

    def abort(self, request_id: str) -> None:
        """Thread-safe; the request ends with finish_reason 'abort' within one step."""

        def do_abort() -> None:
            out = self.engine.abort(request_id)
            if out is not None:
                self._deliver(out)

        self._submit(do_abort)

    def add_step_observer(self, observer: StepObserver, pool: bool = False) -> None:
        """`observer(StepInfo)` after every step, called on the engine thread: keep it short."""
        self.engine.add_step_observer(observer, pool)

    def drain_steps(self) -> list[StepInfo]:
        """The steps run since the last call, oldest first; any thread, never waits for a step."""
        return self._steps.drain()

    def health(self, stall_s: float) -> str | None:
        """None when healthy; else why not: the engine thread died, or it has made no progress for
        `stall_s` seconds while work was waiting (reads no engine state under the lock, so it answers
        even while a step hangs)."""
        if self._thread is not None and not self._thread.is_alive() and not self._stopping:
            return "the engine thread has stopped"
        idle_for = time.monotonic() - self._last_progress
        if idle_for > stall_s and self.engine.has_unfinished():
            return f"the engine has made no progress for {idle_for:.0f} s with requests waiting"
        return None

    def stats(self) -> EngineStats:
        """The statistics the engine thread last published (engine/stats_feed.py), at once: never
        waits for a step. Shared: do not modify it."""
        return self._feed.latest()

    # -- pinned prefixes and the tree's picture (run on the engine thread, between steps) -----------
    async def _call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine thread between two steps and return what it returns (or raise what it raised)."""
        await self.start()
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()

        def settle(result: T | None, error: BaseException | None) -> None:
            if done.cancelled():
                return
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(result)  # type: ignore[arg-type]

        def command() -> None:
            try:
                result = fn()
                self._publish_pins()  # a pin made or released shows in `pins()` before its caller resumes
            except Exception as exc:
                loop.call_soon_threadsafe(settle, None, exc)
            else:
                loop.call_soon_threadsafe(settle, result, None)

        self._submit(command)
        return await done

    async def pin(self, token_ids: list[int], namespace: str = "", label: str = "") -> PinInfo:
        """Prefill `token_ids` in `namespace` (unless cached) and pin them in the device pool
        (engine/pins.py); PinError past the budget, or when the prefix cannot be kept."""
        pins = self.engine.pins
        await self._call(lambda: pins.check_size(len(token_ids)))
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, cache_namespace=namespace)
        for _ in range(PIN_ATTEMPTS):
            info = await self._call(lambda: pins.pin(token_ids, namespace, label))
            if info is not None:
                return info
            async for _ in self.generate(token_ids, params):  # the prefill that caches it
                pass
        raise PinError(f"the prefix could not be kept in the cache after {PIN_ATTEMPTS} prefills (the pool is "
                       "too busy); try again")

    async def unpin(self, pin_id: str) -> PinInfo | None:
        """Release a pin; None if there is no such pin."""
        return await self._call(lambda: self.engine.pins.unpin(pin_id))

    def pins(self) -> list[PinInfo]:
        """The pins as of the last step or command: at once, never waits for a step."""
        return list(self._pins_view[0])

    def pin_budget(self) -> PinBudget:
        return self._pins_view[1]

    async def cache_tree(self, limit: int, include: Callable[[str], bool] | None = None) -> TreeView:
        """A bounded picture of the radix tree (cache/tree_view.py), of the namespaces `include` allows."""
        return await self._call(lambda: tree_view(self.engine.tree, limit, include))

    # -- introspection (takes the step lock: may wait for the step in progress) -----------------

    def follow_cache_events(self) -> CacheEventLog:
        """Have the radix tree report what it drops (for a scale-out router); idempotent."""
        with self._lock:
            return self.engine.scheduler.follow_cache_events()  # ValueError when the prefix cache is off

    def check_integrity(self) -> None:
        with self._lock:
            self.engine.check_integrity()

    def leaked_blocks(self) -> int:
        with self._lock:
            return self.engine.leaked_blocks()
