"""The step recorder: everything the engine measures and counts about its steps, in one place, called
at the step's boundaries (`LLMEngine.step`, `_launch`, `_resolve`).

Owns the step's clocks — device vs unhidden host time (`step_clock.StepClock`), the host wall clock
per phase (`step_phases.StepPhases`), the prefill cost feed of preemption decisions
(`host_tier.CostFeed`) — the step observers (`observers.StepObservers`), the engine's cumulative
counters (`totals`, an EngineStats that `EngineStats.collect` starts from), the count of steps run,
and the integrity check run after every step under RADIXSERVE_CHECK_INTEGRITY=1.

Invariants: every `step()` call is one `begin` ... `end` (the phases add up to the call); a launched
step's `LaunchRecord` travels with it until it resolves (with overlap, one call later), so its device
span and prefill tokens are the ones of the step that ran; an observer sees the counters the step's
commit moved (tokens, draws, forced tokens), taken as differences around it; the pool figures are
counted only when an observer is registered.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radixserve.cache.block_pool import BlockPool
from radixserve.core import Batch, RequestOutput
from radixserve.engine.host_tier import CostFeed
from radixserve.engine.observers import PoolCounts, StepObservers, decode_tokens
from radixserve.engine.sampler import SampleResult
from radixserve.engine.stats import EngineStats
from radixserve.engine.step_clock import StepClock, StepSpan
from radixserve.engine.step_phases import FORWARD, SCHEDULE, WAIT, StepPhases
from radixserve.model.runner import ModelRunner
from radixserve.scheduler import Scheduler
from radixserve.scheduler.step_results import Committed


@dataclass
class LaunchRecord:
    """What the recorder keeps of one launched step until it resolves."""

    start: Any  # the clock's mark where its device work began
    span: StepSpan | None = None
    prefill_tokens: int = 0  # tokens of the step beyond one per sampled row: what preemption costs weigh
    decodes: tuple[int, int] = (0, 0)  # the step's decode and draft tokens (observers.decode_tokens)


@dataclass
class _Before:
    """The counters and pool as a step began (observers see the differences)."""

    started: float
    peak: PoolCounts
    forced: int
    tokens: int
    draws: int


class StepRecorder:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, pool: BlockPool, forced_tokens: Callable[[], int],
                 integrity: Callable[[], None]) -> None:
        self.clock = StepClock(runner.device)
        self.phases = StepPhases(runner.build_time)
        self.cost_feed = CostFeed(scheduler.costs, self.clock, runner.host_cache)
        self.observers = StepObservers()
        self.totals = EngineStats()
        self.steps = 0
        self.check_integrity = os.environ.get("RADIXSERVE_CHECK_INTEGRITY", "") not in ("", "0")
        self._scheduler, self._pool, self._forced_tokens, self._integrity = scheduler, pool, forced_tokens, integrity
        self._started = 0.0
        self._before: _Before | None = None

    def begin(self) -> None:
        self.phases.begin()
        self._started = time.monotonic()

    def end(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        self.phases.end()
        return outputs

    def lap(self, phase: int) -> None:
        self.phases.lap(phase)

    def scheduled(self) -> None:
        """A step with work was scheduled: the pool at its peak (blocks allocated, nothing released yet)
        and the counters before it, for the observers."""
        if self.observers:
            totals = self.totals
            self._before = _Before(self._started, self.observers.pool_counts(self._pool, self._scheduler),
                                   self._forced_tokens(), totals.generation_tokens, totals.committed_draws)

    def launching(self, batch: Batch) -> LaunchRecord:
        """The forward of `batch` is about to be queued: request timings, prompt tokens computed."""
        now = time.monotonic()
        for item in batch.items:
            req = item.seq.request
            if req.timing.first_scheduled is None:
                req.timing.first_scheduled = now
            self.totals.computed_tokens += max(0, min(item.start + item.num_tokens, item.seq.num_prompt_tokens)
                                               - item.start)
        record = LaunchRecord(self.clock.mark(), decodes=decode_tokens(batch))
        self.lap(SCHEDULE)
        return record

    def forwarded(self, record: LaunchRecord, batch: Batch) -> None:
        """The forward of `batch` (what ran of it) is queued; read before `Scheduler.launched`, whose
        pending slots make no chunk reach its sequence's last token."""
        self.lap(FORWARD)  # batch building inside it is lapped apart (step_phases.py)
        record.prefill_tokens = batch.num_tokens - sum(it.logit_rows for it in batch.items if it.samples)

    def launched(self, record: LaunchRecord, sampled: SampleResult | None) -> None:
        """The step's sampling is queued: its device span closes, and its ids start for the host."""
        record.span = self.clock.span(record.start)
        if sampled is not None:
            sampled.start_copy()
        self.lap(FORWARD)

    def resolved(self, record: LaunchRecord) -> None:
        """The step's ids are on the host: the rest of the call is post-processing."""
        self.lap(WAIT)
        assert record.span is not None, "a step resolves after its launch"
        self.clock.resolved(record.span)
        self.cost_feed.observe(record.prefill_tokens)

    def committed(self, done: Committed) -> None:
        self.totals.generation_tokens += done.tokens
        self.totals.committed_draws += len(done.touched)

    def stepped(self, batch: Batch, record: LaunchRecord) -> None:
        """A step with work ran (its own launch, and whatever resolved): check, then tell the observers."""
        self.steps += 1
        if self.check_integrity:
            self._integrity()
        before, self._before = self._before, None
        if before is not None:
            totals = self.totals
            self.observers.notify(self.steps, batch, record.decodes, before.started, before.peak,
                                  self._pool, self._scheduler, self._forced_tokens() - before.forced,
                                  (totals.generation_tokens - before.tokens, totals.committed_draws - before.draws))
