"""Per-client rate limit of session creation (REST create and fork, WebSocket session.create) and of
stored responses (POST /v1/responses with `store`), which take places in the same store.

Owner shares (sessions/store.py) stop one owner from evicting others, but owner secrets cost nothing to
mint; this bounds how fast one client address can create sessions at all, whatever secrets it uses.

A token bucket per client address: `burst` creations at once, refilled at `rate` a second; rate 0
turns the limit off. A refusal is a 429 `rate_limited` whose `retry_after` says when the next
creation will be allowed. Invariants: memory is bounded (at most `max_clients` buckets; the one used
longest ago goes first, and a bucket idle for burst/rate seconds is full anyway, so dropping it
forgets nothing); rate and burst are read per call, so the config can change on a running server.
Behind a reverse proxy every client has the proxy's address: raise the limits or turn them off there.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable

from radixserve.server.validation import ApiError

MAX_CLIENTS = 65536


class CreationRateLimiter:
    def __init__(self, clock: Callable[[], float] = time.monotonic, max_clients: int = MAX_CLIENTS) -> None:
        self.clock, self.max_clients = clock, max_clients
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # client -> (tokens, when)

    def __len__(self) -> int:
        return len(self._buckets)

    def clear(self) -> None:
        self._buckets.clear()

    def check(self, client: str | None, rate: float, burst: int) -> None:
        """Take one creation from `client`'s allowance; ApiError(rate_limited, 429) when it has none."""
        if rate <= 0:
            return
        key, now = client or "unknown", self.clock()
        tokens, when = self._buckets.pop(key, (float(burst), now))
        tokens = min(float(burst), tokens + (now - when) * rate)
        if tokens < 1.0:
            self._buckets[key] = (tokens, now)
            wait = max(1, math.ceil((1.0 - tokens) / rate))
            raise ApiError("rate_limited", f"too many sessions or stored responses created from this address: at "
                           f"most {burst} at once and {rate:g} a second (--session-create-rate); retry in {wait} s",
                           429, retry_after=wait)
        self._buckets[key] = (tokens - 1.0, now)
        while len(self._buckets) > self.max_clients:
            self._buckets.popitem(last=False)
