"""Background responses (`background: true`): a generation that runs on the server's event loop
without its client, polled by GET /v1/responses/{id} and stopped by POST /v1/responses/{id}/cancel.

A `BackgroundRun` owns one ResponseRun (run.py) and the asyncio task that drives it. The POST that
made it answers at once with the stored body ("queued"); the task marks it "in_progress" when it
starts, and the run settles it (run.py): completed or incomplete with its reply, "failed" with its
error, or "cancelled" with what it wrote when its owner cancelled it. With `stream: true` the task
writes the response's events (events.response_events, exactly as a foreground stream has them) into
an `EventLog` that the POST's stream follows and GET ...?stream=true&starting_after=N follows again
from event N + 1 while the run lives; a client that leaves stops only its own reading.

Limits: a background run is a generation like any other — it keeps the generation slot its POST
took (admission.py; the slot leaves the request's scope with the run and is released when the run
ends, however it ends), its stored entry took its room in the store before it began, and its engine
request is in the server's in-flight set, so shutdown gives it the grace period and then aborts it
like a foreground one; the run is then settled "failed". A task the loop itself cancels (the loop
closing) settles it the same way.

Cancel (OpenAI's rules): only a background response can be cancelled (any other: 400 "Cannot cancel
a synchronous response."); a running one is cancelled at once — its task cancelled, which closes its
engine stream and so aborts the engine request — and its body returned, "cancelled"; cancelling a
cancelled one again returns it as it is; one that already ended otherwise is a 400 naming its status.
DELETE of a running background response cancels it too (nobody else would read it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, MutableMapping
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from radixserve.server.admission import SLOTS_KEY, Slot
from radixserve.server.api_errors import report_error
from radixserve.server.responses.events import response_events
from radixserve.server.responses.run import ResponseRun
from radixserve.server.responses.store import StoredResponse
from radixserve.server.validation import ApiError

log = logging.getLogger("radixserve.server")
_TASKS: set[asyncio.Task[None]] = set()  # the loop holds tasks weakly: a running one must not be collected


@dataclass
class EventLog:
    """A stream's events as the run wrote them, for readers that come and go."""

    events: list[str] = field(default_factory=list)
    closed: bool = False
    _wake: asyncio.Event = field(default_factory=asyncio.Event)

    def append(self, event: str) -> None:
        self.events.append(event)
        self._wake.set()
        self._wake = asyncio.Event()

    def close(self) -> None:
        self.closed = True
        self._wake.set()

    async def follow(self, start: int = 0) -> AsyncGenerator[str, None]:
        """Events `start`, `start` + 1, ... as they come, until the log closes."""
        i = start
        while True:
            while i < len(self.events):
                yield self.events[i]
                i += 1
            if self.closed:
                return
            await self._wake.wait()


@dataclass
class BackgroundRun:
    run: ResponseRun
    slots: list[Slot]  # the generation slots its POST took; released when it ends
    log: EventLog | None  # its events, when it streams
    task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def start(self) -> None:
        assert self.task is None, "started once"
        self.task = asyncio.get_running_loop().create_task(self._main(), name=f"background {self.run.head.id}")
        _TASKS.add(self.task)
        # also for a task cancelled before its first step, whose body (and its finally) never runs
        self.task.add_done_callback(self._ended)

    async def _main(self) -> None:
        run = self.run
        try:
            run.started()
            if self.log is None:
                async with aclosing(run.deltas()) as deltas:
                    async for _ in deltas:
                        pass
            else:
                async with aclosing(response_events(run.head, run.deltas(), run.final,
                                                    run.state.metrics)) as events:
                    async for event in events:
                        self.log.append(event)
        except ApiError as e:  # settled "failed" by the run; counted as a refusal would be
            report_error(e, run.state.metrics)
        except Exception:  # a fault outside the generation (the events' shaping): still settled below
            log.exception("background response %s failed", run.head.id)
        finally:
            self._release()

    def _release(self) -> None:
        """The run settled (a task cancelled before its deltas began, or an error after them), its slots
        released, its log closed, and the stored entry no longer holding it (its texts, tokens and
        events are not in the store's byte count). Idempotent."""
        self.run.settle()
        for slot in self.slots:
            slot.release()
        if self.log is not None:
            self.log.close()
        if self.run.entry is not None and self.run.entry.background is self:
            self.run.entry.background = None

    def _ended(self, task: asyncio.Task[None]) -> None:
        _TASKS.discard(task)
        self._release()

    async def cancel(self) -> None:
        """Stop the run, settled "cancelled" (a no-op once it has ended)."""
        if not self.running:
            return
        assert self.task is not None
        self.run.cancelled = True
        self.task.cancel()
        await asyncio.wait({self.task})  # wait, not await: this caller's own cancellation stays its own


def take_slots(scope: MutableMapping[str, Any]) -> list[Slot]:
    """The generation slots the request took (admission.hold_generation), now the background run's to
    release: the request's middleware releases only what is left in its scope."""
    slots: list[Slot] = scope.get(SLOTS_KEY) or []
    taken = list(slots)
    slots.clear()
    return taken


def launch(run: ResponseRun, scope: MutableMapping[str, Any]) -> BackgroundRun:
    """Start `run` in the background, holding the request's slots; its stored entry knows it."""
    assert run.entry is not None, "a background response is stored"
    background = BackgroundRun(run, take_slots(scope), EventLog() if run.head.ask.stream else None)
    run.entry.background = background
    background.start()
    return background


async def cancel_response(entry: StoredResponse) -> dict[str, Any]:
    """POST /v1/responses/{id}/cancel on a found entry: its body once cancelled (module docstring)."""
    if not entry.body.get("background"):
        raise ApiError("invalid_field", "Cannot cancel a synchronous response.", param="response_id")
    if entry.background is not None:  # still running
        await entry.background.cancel()
    status = entry.body.get("status")
    if status != "cancelled":
        raise ApiError("invalid_field", f"Cannot cancel a {status} response.", param="response_id")
    return entry.body
