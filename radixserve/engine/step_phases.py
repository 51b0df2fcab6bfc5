"""Where the host's time in one `LLMEngine.step()` goes, phase by phase (host wall clock).

Each `step()` call is cut into consecutive laps of `time.perf_counter`, each lap charged to one phase:

- **schedule**: `Scheduler.schedule`, the block copies, and the launch's bookkeeping around the
  forward (request timings, prompt-logprob asks, `Scheduler.launched`, grammar masks, penalty rows).
- **build**: batch building: from the call into `ModelRunner.run` until `ModelRunner.prepare` (eager
  path) or `PaddedDecoder._fill` (padded decode path) returns, i.e. choosing the path, `build_inputs`
  and staging the inputs as tensors.
- **forward**: the rest of `ModelRunner.run` (the model forward and logits) plus sampling: device
  work. On CPU it runs on the host; on CUDA it is only the time spent queueing the kernels.
- **wait**: from the launch's end until the resolved step's sampled ids are on the host (on CUDA,
  waiting for the device; on CPU next to nothing).
- **post**: the rest: committing into the scheduler, detokenization and stop checks, building the
  RequestOutputs, observers and integrity checks.

The phases add up to the whole call. Host work is schedule + build + post. With overlap a call
launches one step and resolves the previous one, so its post is the previous step's.

Batch building happens inside the model layer, which knows nothing of the engine's clocks: the
runner counts its own building seconds (`ModelRunner.build_time`, read as an attribute: no call into
the model layer), and a lap charged to forward
hands what that count grew by in the lap to build. Cost: eight perf_counter laps and one tuple per
step, about 1 µs on a 2-core VM (a step takes milliseconds).

The clock is injectable (`clock=`, `time.perf_counter` by default) so a test charges exact, made-up
laps: a real clock's laps grow on a busy machine and no bound on them is safe.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from time import perf_counter

from radixserve.model.batch_inputs import BuildTime

SCHEDULE, BUILD, FORWARD, WAIT, POST = range(5)
PHASES = ("schedule", "build", "forward", "wait", "post")
HOST_PHASES = ("schedule", "build", "post")


@dataclass(frozen=True, slots=True)
class PhaseTimes:
    """One step() call's seconds per phase."""

    schedule_s: float
    build_s: float
    forward_s: float
    wait_s: float
    post_s: float

    @property
    def host_s(self) -> float:
        return self.schedule_s + self.build_s + self.post_s

    @property
    def total_s(self) -> float:
        return self.host_s + self.forward_s + self.wait_s


class StepPhases:
    """The phase clock: `begin` at the top of a step, `lap(PHASE)` at each boundary, `end` at the bottom."""

    __slots__ = ("history", "_acc", "_last", "_build_time", "_built", "_clock")

    def __init__(self, build_time: BuildTime, keep: int = 4096, clock: Callable[[], float] = perf_counter) -> None:
        # raw tuples (schedule, build, forward, wait, post): a tuple per step is the cheapest record
        self.history: deque[tuple[float, ...]] = deque(maxlen=keep)
        self._acc = [0.0] * len(PHASES)
        self._clock = clock
        self._last = clock()
        self._build_time = build_time  # the runner's running count of batch-building seconds
        self._built = build_time.seconds

    def begin(self) -> None:
        self._acc = [0.0] * len(PHASES)
        self._last = self._clock()

    def lap(self, phase: int) -> None:
        """Charge the time since the previous mark to `phase` (to forward: less the batch building
        the runner counted meanwhile, which goes to build)."""
        now = self._clock()
        spent = now - self._last
        if phase == FORWARD:
            built, self._built = self._built, self._build_time.seconds
            building = min(spent, self._built - built)
            self._acc[BUILD] += building
            spent -= building
        self._acc[phase] += spent
        self._last = now

    def end(self) -> None:
        self.lap(POST)
        self.history.append(tuple(self._acc))

    def times(self) -> list[PhaseTimes]:
        return [PhaseTimes(*t) for t in self.history]


def phase_ms(times: list[PhaseTimes]) -> dict[str, list[float]]:
    """Per phase (and "host", their host share), each step's milliseconds."""
    out = {name: [1000 * getattr(t, f"{name}_s") for t in times] for name in PHASES}
    out["host"] = [1000 * t.host_s for t in times]
    return out


def median_ms(per_step: dict[str, list[float]]) -> dict[str, float]:
    """`{phase}_ms`: the median of each phase's per-step milliseconds (NaN when no step was seen)."""
    return {f"{name}_ms": statistics.median(v) if v else float("nan") for name, v in per_step.items()}
