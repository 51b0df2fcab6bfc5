"""The engine's statistics as last published: what `AsyncEngine.stats()` answers, at once, without a
lock and without waiting for the step in progress. (Reading them under the step lock made GET
/v1/cache/stats and /metrics wait behind every step: seconds under load, over a minute behind long
prefills, so Prometheus scrapes timed out exactly when they mattered: issue 24.)

Invariants:
- only the stepping thread publishes, with the engine's lock held, after every step and every batch
  of commands; each publish is a new EngineStats that is never changed afterwards, so a reader on
  any thread gets one consistent snapshot by reading one attribute (readers share it: read-only);
- counters and the O(1) gauges (queues, tree size, free host blocks, admission) are those of the last
  publish; the COUNTED gauges (blocks free/used/cached, the host tier's nodes and tokens), which take
  a pass over every block table or tree node, are recounted at most every `recount_s` while the
  engine is busy, so the hot path pays for that pass rarely, and on every publish while it is idle,
  so an idle engine's snapshot equals `EngineStats.collect(engine)` exactly.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from radixserve.engine.stats import EngineStats

if TYPE_CHECKING:
    from radixserve.engine.engine import LLMEngine

RECOUNT_S = 1.0  # how stale the block counts may get while the engine is busy


class StatsFeed:
    def __init__(self, engine: LLMEngine, recount_s: float = RECOUNT_S) -> None:
        """Call before the stepping thread starts (the first snapshot is counted here)."""
        self.recount_s = recount_s
        self._latest = EngineStats.collect(engine)
        self._counted_at = time.monotonic()

    def latest(self) -> EngineStats:
        """The last published snapshot; any thread, never blocks. Do not modify it."""
        return self._latest

    def publish(self, engine: LLMEngine) -> None:
        """Replace the snapshot with the engine's figures now (stepping thread, engine lock held)."""
        now = time.monotonic()
        if not engine.has_unfinished() or now - self._counted_at >= self.recount_s:
            self._latest, self._counted_at = EngineStats.collect(engine), now
        else:
            self._latest = EngineStats.collect(engine, counted=self._latest)
