"""What the radix tree dropped, as a numbered stream a router can follow (scale-out routing).

A router that sends requests to several engines keeps an approximate copy of each engine's cached
prefixes: it adds what it routes there and must learn what the engine let go of. The tree appends
one `Dropped` event per node it removes from both tiers (a node that only leaves the device for the
host tier is still a hit, so it is not reported). The event names the node by its namespace, its first
token and the tokens above it, so a reader with its own tree over token ids can cut the same subtree.

Invariants: sequence numbers start at 1 and grow by one per event; the log keeps at most
`max_events` events and `max_tokens` path tokens (oldest go first), so a reader learns from a batch
whether it missed any (`EventBatch.missed`) and must then treat its copy as unreliable. The log is
written by the engine thread and read from another, so both sides take its lock.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

DEFAULT_MAX_EVENTS = 4096
DEFAULT_MAX_TOKENS = 1 << 20


@dataclass(frozen=True)
class Dropped:
    seq: int
    path: tuple[int, ...]  # the tokens above the node, then the node's first token
    namespace: str = ""  # the cache namespace whose subtree it was (SamplingParams.cache_namespace)

    @property
    def depth(self) -> int:
        """Where the dropped subtree starts: everything at or below path[:depth + 1] is gone."""
        return len(self.path) - 1


@dataclass(frozen=True)
class EventBatch:
    events: tuple[Dropped, ...]  # consecutive, oldest first
    last_seq: int  # the newest sequence number written, whether or not it is in `events`

    def missed(self, applied: int) -> bool:
        """Whether a reader that has applied every event up to `applied` lacks some in this batch."""
        return self.last_seq > applied and (not self.events or self.events[0].seq > applied + 1)


class CacheEventLog:
    def __init__(self, max_events: int = DEFAULT_MAX_EVENTS, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        self.max_events, self.max_tokens = max_events, max_tokens
        self._events: deque[Dropped] = deque()
        self._tokens = 0
        self._last_seq = 0
        self._lock = threading.Lock()

    def dropped(self, path: tuple[int, ...], namespace: str = "") -> None:
        with self._lock:
            self._last_seq += 1
            self._events.append(Dropped(self._last_seq, path, namespace))
            self._tokens += len(path)
            while self._events and (len(self._events) > self.max_events or self._tokens > self.max_tokens):
                self._tokens -= len(self._events.popleft().path)

    def since(self, seq: int) -> EventBatch:
        """The events numbered after `seq` that are still kept."""
        with self._lock:
            return EventBatch(tuple(e for e in self._events if e.seq > seq), self._last_seq)

    @property
    def last_seq(self) -> int:
        with self._lock:
            return self._last_seq
