"""The routing-overhead micro-benchmark: what the cache-aware rule costs per request, with no Ray and
no model: `RoutingTable.choose()`, which records the prompt in the chosen replica's PrefixIndex, plus
`sent()`, under the table's lock, exactly the work CacheAwareRouter does for each request.

Setup: every replica's index holds `prefixes` prompts of `prompt_len` (1,000-2,000) tokens. Prompts
come in groups that share a `shared_len`-token head (a system prompt; `group_size` prompts per
group), each group on one replica, as cache-aware routing would leave them. Then `requests` requests
are timed one by one (time.perf_counter_ns): half a known head with a new tail (a new question to a
known system prompt), two fifths a cached prompt plus a new turn (a conversation's next turn), one
tenth all new tokens (a miss). Each request completes before the next, so loads stay level.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from radixserve.scaleout.routing import REASONS, RoutingTable
from radixserve_bench.metrics import percentile

VOCAB = 49152
_TOKENS = list(range(VOCAB))  # shared int objects: a million-token index stores pointers, not new ints


def _tokens(rng: random.Random, n: int) -> list[int]:
    return rng.choices(_TOKENS, k=n)


def routing_overhead(replicas: int, prefixes: int = 1000, requests: int = 2000,
                     prompt_len: tuple[int, int] = (1000, 2000), shared_len: int = 512, group_size: int = 10,
                     seed: int = 0) -> dict[str, Any]:
    lo, hi = prompt_len
    if replicas < 1 or prefixes < 1 or requests < 1 or not 0 < shared_len < lo <= hi or group_size < 1:
        raise ValueError("need replicas, prefixes, requests, group_size >= 1 and 0 < shared_len < min <= max length")
    rng = random.Random(f"routing:{seed}:{replicas}")
    names = [f"replica-{i}" for i in range(replicas)]
    table = RoutingTable(rng=random.Random(seed))
    table.set_replicas(names)
    heads: list[list[int]] = []
    cached: list[list[int]] = []
    for name in names:
        for i in range(prefixes):
            if i % group_size == 0:
                heads.append(_tokens(rng, shared_len))
            prompt = heads[-1] + _tokens(rng, rng.randint(lo, hi) - shared_len)
            table.indexes[name].insert(prompt)
            cached.append(prompt)
    held = min(table.indexes[n].prefixes for n in names)

    times_ns = []
    for i in range(requests):
        kind = rng.random()
        if kind < 0.5:
            prompt = rng.choice(heads) + _tokens(rng, rng.randint(lo, hi) - shared_len)
        elif kind < 0.9:
            base = rng.choice(cached)
            prompt = base + _tokens(rng, rng.randint(16, 64))
        else:
            prompt = _tokens(rng, rng.randint(lo, hi))
        t0 = time.perf_counter_ns()
        with table.lock:
            decision = table.choose(prompt, names)
            table.sent(f"r{i}", decision.replica, prompt, decision)
        times_ns.append(time.perf_counter_ns() - t0)
        with table.lock:
            table.completed(f"r{i}", decision.replica)
    us = [t / 1000 for t in times_ns]
    return {"replicas": replicas, "prefixes_per_replica": held, "prompt_len": [lo, hi], "shared_len": shared_len,
            "requests": requests, "median_us": statistics.median(us), "p99_us": percentile(us, 99),
            "mean_us": statistics.fmean(us), "max_us": max(us),
            "decisions": {r: table.decisions.get(r, 0) for r in REASONS}}


def run_routing_micro(replica_counts: tuple[int, ...] = (2, 8), prefixes: int = 1000,
                      smoke: bool = False) -> dict[str, dict[str, Any]]:
    """Per replica count (keyed by it as text, for JSON)."""
    if smoke:
        return {str(n): routing_overhead(n, prefixes=min(prefixes, 40), requests=100, prompt_len=(100, 200),
                                         shared_len=50, group_size=5) for n in replica_counts}
    return {str(n): routing_overhead(n, prefixes=prefixes) for n in replica_counts}
