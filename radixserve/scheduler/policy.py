"""Scheduling policies: the order in which waiting sequences are admitted and running ones kept.

- `fcfs`: arrival order.
- `cache-aware`: longest cached prefix first (ties by arrival), so hot prefixes are reused before
  eviction; a sequence waiting more than `max_wait_steps` steps goes ahead of every hit (oldest
  first), so hits cannot starve it. Ranking costs one tree walk per waiting sequence, so when more
  than `cache_aware_max_queue` sequences wait it falls back to arrival order.
- `priority`: lower `Request.priority` first (as in vLLM), then arrival.
- `sjf`: shortest expected job first. A job's size is the tokens it still has to compute (its
  uncomputed prompt, without looking up the cache) plus the tokens it may still generate
  (`max_tokens` minus what it generated); its rank is log2 of that, so one "job-size step" is a
  doubling.

Aging (`priority` and `sjf`): a sequence's effective rank is its rank minus the seconds it has waited
since it first entered the queue (preemption does not reset the clock) divided by `aging_s`. So
every `aging_s` seconds of waiting are worth one priority level, or one halving of the job, and a
request outranked by a gap of G levels (or a job 2**G times longer) goes ahead of any fresh arrival
after G * aging_s seconds. Aging alone cannot close a gap of 2**31 levels, so a request queued
`max_queue_wait_s` ago (overdue) ranks ahead of every younger one whatever the priorities, oldest
first, and may preempt them: no request waits past that for others that outrank it, whatever values
they send. `aging_s = 0` turns aging off and `max_queue_wait_s = 0` the bound (strict order, which can
starve). `fcfs` and `cache-aware` ignore priority.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from radixserve.cache.radix_tree import RadixTree
from radixserve.config import EngineConfig
from radixserve.core import Sequence

Rank = tuple[float, ...]


def job_tokens(seq: Sequence) -> int:
    """Tokens still to compute or generate: what shortest-job-first ranks by."""
    to_generate = max(0, seq.request.params.max_tokens - seq.num_generated)
    return len(seq.token_ids) - seq.num_computed + to_generate


class Policy:
    def __init__(self, config: EngineConfig, tree: RadixTree | None, clock: Callable[[], float]) -> None:
        self.config = config
        self.tree = tree
        self.clock = clock

    @property
    def ranks_by_merit(self) -> bool:
        """priority and sjf: a sequence's rank is its own merit (aged), comparable across sequences."""
        return self.config.policy in ("priority", "sjf")

    def rank(self, seq: Sequence, now: float | None = None) -> Rank:
        """Lower goes first. Under fcfs and cache-aware, arrival order."""
        policy = self.config.policy
        if policy == "priority":
            base = float(seq.request.priority)
        elif policy == "sjf":
            base = math.log2(max(2, job_tokens(seq)))
        else:
            return seq.sort_key
        now = self.clock() if now is None else now
        queued, bound = seq.request.queued_at, self.config.max_queue_wait_s
        if bound > 0 and queued is not None and now - queued >= bound:
            return (-math.inf, queued, *seq.sort_key)  # overdue: ahead of every younger request
        return (base - self.aging(seq, now), *seq.sort_key)

    def aging(self, seq: Sequence, now: float) -> float:
        """Rank levels earned by waiting."""
        queued = seq.request.queued_at
        if self.config.aging_s <= 0 or queued is None:
            return 0.0
        return max(0.0, now - queued) / self.config.aging_s

    def waiting_order(self, waiting: list[Sequence], step: int) -> list[Sequence]:
        config, tree = self.config, self.tree
        if config.policy == "cache-aware" and tree is not None and len(waiting) <= config.cache_aware_max_queue:
            overdue_after = step - config.max_wait_steps

            def key(s: Sequence) -> tuple[int, ...]:
                assert s.waiting_since is not None
                if s.waiting_since < overdue_after:
                    return (0, 0, *s.sort_key)
                return (1, -tree.match(s.token_ids[:-1], split=False, namespace=s.namespace).length, *s.sort_key)

            return sorted(waiting, key=key)
        now = self.clock()
        return sorted(waiting, key=lambda s: self.rank(s, now))
