"""Which replica a request goes to, and why: the cache-aware rule, free of Ray so it is tested alone.

The rule, in order:
1. `session`: the request names the replica its session lives on, and that replica is up.
2. `prefix`: the replica believed to hold the longest prefix of the prompt (prefix_index.py), if
   that prefix is at least `min_prefix_fraction` of the prompt, unless its in-flight requests exceed
   the least-loaded replica's by more than `max_load_gap`; then
3. `imbalance`: the least-loaded replica instead.
4. `miss` (no replica holds enough of the prompt) and `failover` (the session's replica is gone): the
   least-loaded replica; among equals the one holding the fewest tokens, so new prefixes spread.
The fraction is what keeps the chat template's few shared opening tokens, which every prompt
matches, from pulling all new conversations onto one replica (SGLang's router has the same rule).
Ties between equal prefixes go to the less loaded replica. Every decision is counted by reason.

The table is also where the router keeps what each replica last reported (`ReplicaReport`: its
engine statistics and the cache events it dropped), so the ingress reads one place for both.
Invariants: `loads` counts requests routed and not yet completed, never below 0; an index exists
exactly for the replicas in `replicas`. The table is shared by threads: callers hold `lock`.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from radixserve.cache.events import EventBatch
from radixserve.engine.stats import EngineStats
from radixserve.scaleout.prefix_index import PrefixIndex

# "fallback": Ray sent the request to another replica than the rule chose (the chosen one refused it)
REASONS = ("session", "prefix", "imbalance", "miss", "failover", "fallback")
DEFAULT_MAX_LOAD_GAP = 8
DEFAULT_MIN_PREFIX_FRACTION = 0.5


@dataclass(frozen=True)
class Decision:
    replica: str
    reason: str
    matched: int  # prompt tokens the chosen replica is believed to hold


@dataclass
class ReplicaReport:
    """What a replica last told the router (its `record_routing_stats`), decoded."""

    stats: EngineStats | None = None
    events_seq: int = 0  # the newest cache event applied to this replica's index
    resyncs: int = 0  # times events were missed and the index was cleared
    cacheless: bool = False  # the replica runs without a prefix cache: nothing to index
    # what finished requests cached there, with the replica's event number when each was served: a
    # drop reported later but numbered before that happened first, so it must not erase them
    recent: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)


_tables: dict[str, RoutingTable] = {}
_tables_lock = threading.Lock()


def table_for(key: str) -> RoutingTable:
    """The routing table of one deployment in this process (`key`: "app/deployment")."""
    with _tables_lock:
        table = _tables.get(key)
        if table is None:
            table = _tables[key] = RoutingTable()
        return table


class RoutingTable:
    def __init__(self, max_load_gap: int = DEFAULT_MAX_LOAD_GAP, min_prefix_fraction: float = DEFAULT_MIN_PREFIX_FRACTION,
                 rng: random.Random | None = None) -> None:
        self.max_load_gap, self.min_prefix_fraction = max_load_gap, min_prefix_fraction
        self.indexes: dict[str, PrefixIndex] = {}
        self.loads: Counter[str] = Counter()
        self.reports: dict[str, ReplicaReport] = {}
        self.decisions: Counter[str] = Counter({r: 0 for r in REASONS})
        self.routed: Counter[str] = Counter()  # requests sent, per replica
        self.retired = EngineStats()  # the counters of replicas gone, so totals never go backwards
        # Ray names a completion by (request key, replica), and calls made while serving one ingress
        # request (a WebSocket's turns) share its key: so both are counted as multisets
        self._in_flight: Counter[tuple[str, str]] = Counter()
        self._completed_early: Counter[tuple[str, str]] = Counter()  # completions seen before their routing
        self._rng = rng or random.Random()
        self.lock = threading.Lock()

    @property
    def replicas(self) -> list[str]:
        return sorted(self.indexes)

    def set_replicas(self, names: Iterable[str]) -> None:
        """The replicas now up; a new one starts with an empty index, a gone one is forgotten."""
        names = set(names)
        for gone in set(self.indexes) - names:
            del self.indexes[gone]
            self.loads.pop(gone, None)
            rep = self.reports.pop(gone, None)
            if rep is not None and rep.stats is not None:
                self.retired.add_counters(rep.stats)
        for new in names - set(self.indexes):
            self.indexes[new] = PrefixIndex()
            self.reports[new] = ReplicaReport()

    def choose(self, tokens: Sequence[int], among: Sequence[str], prefer: str | None = None) -> Decision:
        """Decide for one request; `among` are the replicas that may take it (all known ones). Counted
        once the request is sent (`sent`): Ray may ask again for the same request. The chosen replica
        is believed to hold the prompt from now on, not only once it is sent: Ray routes requests
        concurrently, and one of the same prefix chosen in between must find it there."""
        decision = self._decide(tokens, among, prefer)
        self._index(decision.replica, tokens)
        return decision

    def _decide(self, tokens: Sequence[int], among: Sequence[str], prefer: str | None) -> Decision:
        if not among:
            raise ValueError("no replica to route to")
        if prefer is not None and prefer in among:
            return Decision(prefer, "session", self._match(prefer, tokens))
        matched = {r: self._match(r, tokens) for r in among}
        least = min(self.loads[r] for r in among)
        best = max(matched.values())
        if best > 0 and best >= self.min_prefix_fraction * len(tokens):
            holders = [r for r in among if matched[r] == best]
            pick = self._least_loaded(holders)
            if self.loads[pick] - least <= self.max_load_gap:
                return Decision(pick, "prefix", best)
            pick = self._least_loaded(among)
            return Decision(pick, "imbalance", matched[pick])
        pick = self._least_loaded(among)
        return Decision(pick, "failover" if prefer is not None else "miss", matched[pick])

    def _match(self, replica: str, tokens: Sequence[int]) -> int:
        index = self.indexes.get(replica)
        return index.match(tokens) if index is not None else 0

    def _least_loaded(self, names: Sequence[str]) -> str:
        def key(r: str) -> tuple[int, int]:
            index = self.indexes.get(r)
            return self.loads[r], index.tokens if index is not None else 0

        low = min(key(r) for r in names)
        return self._rng.choice([r for r in names if key(r) == low])

    # -- what happened afterwards -------------------------------------------------------------
    def sent(self, key: str, replica: str, tokens: Sequence[int], decision: Decision | None = None) -> None:
        """Request `key` went to `replica` (`decision`: the rule's, when it decided; Ray may have
        fallen back to another replica)."""
        if decision is not None:
            self.decisions[decision.reason if decision.replica == replica else "fallback"] += 1
        if decision is None or decision.replica != replica:  # `choose` indexed the replica it chose
            self._index(replica, tokens)
        self.routed[replica] += 1
        if self._take((key, replica), self._completed_early):
            return
        self._in_flight[(key, replica)] += 1
        self.loads[replica] += 1

    def completed(self, key: str, replica: str) -> None:
        """A request `key` on `replica` ended, or was refused there; only what `sent` counted is taken back."""
        if self._take((key, replica), self._in_flight):
            self.loads[replica] = max(0, self.loads[replica] - 1)
        elif len(self._completed_early) < 100_000:
            self._completed_early[(key, replica)] += 1

    @staticmethod
    def _take(item: tuple[str, str], counts: Counter[tuple[str, str]]) -> bool:
        if counts[item] <= 0:
            counts.pop(item, None)
            return False
        counts[item] -= 1
        if not counts[item]:
            del counts[item]
        return True

    def cached(self, replica: str, tokens: Sequence[int], served_seq: int) -> None:
        """The replica cached `tokens` (a finished request's prompt and reply); `served_seq`: its
        newest cache event when it took the request."""
        if self._index(replica, tokens):
            self.reports[replica].recent.append((served_seq, tuple(tokens)))

    def _index(self, replica: str, tokens: Sequence[int]) -> bool:
        index, rep = self.indexes.get(replica), self.reports.get(replica)
        if index is None or rep is None or rep.cacheless:
            return False
        index.insert(tokens)
        return True

    def report(self, replica: str, stats: EngineStats | None, events: EventBatch | None) -> None:
        """A replica's periodic report: its statistics, and the cache events since the last one."""
        index, rep = self.indexes.get(replica), self.reports.get(replica)
        if index is None or rep is None:
            return
        rep.stats = stats
        if events is None:  # the replica runs without a prefix cache
            rep.cacheless, self.indexes[replica] = True, PrefixIndex()
            return
        if events.missed(rep.events_seq):
            self.indexes[replica] = PrefixIndex()  # what it dropped is unknown: believe nothing
            rep.resyncs += 1
        else:
            for e in events.events:
                if e.seq > rep.events_seq and index.cut(e.path):
                    for seq, tokens in rep.recent:
                        if seq >= e.seq:  # cached after that drop: still there
                            index.insert(tokens)
        rep.events_seq = max(rep.events_seq, events.last_seq)
        rep.recent = [(seq, tokens) for seq, tokens in rep.recent if seq > rep.events_seq]
