"""Where a step's time goes: device work, and host work the device had to wait for.

For each launched step, `device_s` runs from the start of its forward to the end of its sampling on
the device, and `idle_s` is how long the device sat idle before it, since the previous step's
sampling ended: host work (scheduling, preparing, post-processing) that was not hidden behind device
work. On CUDA both come from events recorded on the stream and are read when the step resolves,
after its ids were waited for anyway, so measuring adds no wait. On CPU, where the device is the
host, they come from the wall clock, and every host step is unhidden.
Which host work that was (scheduling, batch building, post-processing) is step_phases.py's.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class StepTimes:
    device_s: float
    idle_s: float  # device idle before this step's work: unhidden host time


@dataclass(frozen=True, slots=True)
class StepSpan:
    start: Any  # a CUDA event or a perf_counter() value
    end: Any
    previous_end: Any  # the end of the step launched before this one, None for the first


class StepClock:
    def __init__(self, device: torch.device, keep: int = 4096) -> None:
        self.cuda = device.type == "cuda"
        self.history: deque[StepTimes] = deque(maxlen=keep)
        self._last_end: Any = None

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record()
        return event

    def span(self, start: Any) -> StepSpan:
        """Close a step whose device work began at `start` (its end is marked now)."""
        end = self.mark()
        span = StepSpan(start, end, self._last_end)
        self._last_end = end
        return span

    def resolved(self, span: StepSpan) -> None:
        """The step's results were waited for: its marks are complete; record its times."""
        idle = self._seconds(span.previous_end, span.start) if span.previous_end is not None else 0.0
        self.history.append(StepTimes(self._seconds(span.start, span.end), max(0.0, idle)))

    def _seconds(self, a: Any, b: Any) -> float:
        if self.cuda:
            b.synchronize()
            return float(a.elapsed_time(b)) / 1000.0
        return float(b - a)
