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

Prefixes are matched within the request's cache namespace (SamplingParams.cache_namespace) only: a
replica's index keeps one trie per namespace (prefix_index.py), and drops are cut from the namespace
they name (`Dropped.namespace`). So another tenant's prefix never pulls a request anywhere: a
request nobody in its own namespace sent before is a `miss`, placed by load alone.

The table is also where the router keeps what each replica last reported (`ReplicaReport`: its
engine statistics, the cache events it dropped and its pins), so the ingress reads one place for all.

Each index is bounded: past `view_pool_multiple` times its replica's pool (device and host blocks,
as last reported, times `block_size`) it forgets its least recently used entries down to
`VIEW_LOW_WATER` of that; only the prompts of requests in flight may exceed it. And a request the
ingress says ended before its prefill (`finished`), or that Ray sent to another replica than the
rule chose, leaves nothing of its own in the index: the replica never cached it, so it will never
report dropping it.
Invariants: `loads` counts requests routed and not yet completed, never below 0; an index exists
exactly for the replicas in `replicas`. The table is shared by threads: callers hold `lock`.
"""

from __future__ import annotations

import random
import threading
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from radixserve.cache.events import EventBatch
from radixserve.engine.pins import PinBudget, PinInfo
from radixserve.engine.stats import EngineStats
from radixserve.scaleout.prefix_index import PrefixIndex

# "fallback": Ray sent the request to another replica than the rule chose (the chosen one refused it)
REASONS = ("session", "prefix", "imbalance", "miss", "failover", "fallback")
DEFAULT_MAX_LOAD_GAP = 8
DEFAULT_MIN_PREFIX_FRACTION = 0.5
# A replica's index holds at most this many times its pool's tokens: it leads the replica's tree by
# the prompts in flight and by drops not yet reported (0.5 s), so exactly the pool would forget hits
VIEW_POOL_MULTIPLE = 2.0
VIEW_LOW_WATER = 0.9  # an index over its bound forgets down to this fraction of it (amortizes the scan)
DEFAULT_BLOCK_SIZE = 16  # until the ingress learns the replicas' (ClusterEngine.start)
MAX_TRACKED = 100_000  # requests in flight remembered by id (the oldest is forgotten past it)


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
    # what finished requests cached there (event number when served, namespace, tokens): a drop
    # reported later but numbered before that happened first, so it must not erase them
    recent: list[tuple[int, str, tuple[int, ...]]] = field(default_factory=list)
    pins: tuple[PinInfo, ...] = ()  # the replica's pins (engine/pins.py), as last reported
    pin_budget: PinBudget | None = None


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
        self.block_size, self.view_pool_multiple = DEFAULT_BLOCK_SIZE, VIEW_POOL_MULTIPLE
        # calls that are not generations (facts, pins, the tree view), sent and not yet completed:
        # their completions must not be remembered as ones that overtook a generation's routing
        self._untracked: Counter[tuple[str, str]] = Counter()
        # request id -> (replica, namespace, prompt) of a request in flight whose prompt its index holds
        # a ref on; and request id -> prefilled, for an end the ingress saw before the router saw the sending
        # request id -> replica, namespace, prompt, and the index's ticket for its ref
        self._tracked: OrderedDict[str, tuple[str, str, tuple[int, ...], int]] = OrderedDict()
        self._finished_early: OrderedDict[str, bool] = OrderedDict()
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

    def choose(self, tokens: Sequence[int], among: Sequence[str], prefer: str | None = None,
               namespace: str = "") -> Decision:
        """Decide for one request of cache namespace `namespace`; `among` are the replicas that may
        take it (all known ones). Counted once the request is sent (`sent`): Ray may ask again for
        the same request. The chosen replica is believed to hold the prompt from now on, not only
        once it is sent: Ray routes requests concurrently, and one of the same prefix chosen in
        between must find it there."""
        decision = self._decide(tokens, among, prefer, namespace)
        self._index(decision.replica, namespace, tokens)
        return decision

    def _decide(self, tokens: Sequence[int], among: Sequence[str], prefer: str | None, namespace: str) -> Decision:
        if not among:
            raise ValueError("no replica to route to")
        if prefer is not None and prefer in among:
            return Decision(prefer, "session", self._match(prefer, tokens, namespace))
        matched = {r: self._match(r, tokens, namespace) for r in among}
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

    def _match(self, replica: str, tokens: Sequence[int], namespace: str) -> int:
        index = self.indexes.get(replica)
        return index.match(tokens, namespace) if index is not None else 0

    def _least_loaded(self, names: Sequence[str]) -> str:
        def key(r: str) -> tuple[int, int]:
            index = self.indexes.get(r)
            return self.loads[r], index.tokens if index is not None else 0

        low = min(key(r) for r in names)
        return self._rng.choice([r for r in names if key(r) == low])

    # -- what happened afterwards -------------------------------------------------------------
    def sent(self, key: str, replica: str, tokens: Sequence[int], decision: Decision | None = None,
             request_id: str | None = None, namespace: str = "") -> None:
        """Request `key` (of cache namespace `namespace`) went to `replica` (`decision`: the rule's,
        when it decided; Ray may have fallen back to another replica). With `request_id`, the
        prompt's entry is held for the request until the ingress reports its end (`finished`)."""
        if decision is not None:
            self.decisions[decision.reason if decision.replica == replica else "fallback"] += 1
            if decision.replica != replica:  # what `choose` entered there will never be cached there
                self._prune(decision.replica, namespace, tokens)
        self.routed[replica] += 1
        self._track(request_id, replica, namespace, tokens)
        if self._take((key, replica), self._completed_early):
            return
        self._in_flight[(key, replica)] += 1
        self.loads[replica] += 1

    def sent_other(self, key: str, replica: str) -> None:
        """A call that is no generation (facts, pins, the tree view) went to `replica`: not routed by
        the rule, not counted as load; only its completion is expected."""
        if not self._take((key, replica), self._completed_early):
            self._untracked[(key, replica)] += 1

    def completed(self, key: str, replica: str) -> None:
        """A request `key` on `replica` ended, or was refused there; only what `sent` counted is taken back."""
        if self._take((key, replica), self._in_flight):
            self.loads[replica] = max(0, self.loads[replica] - 1)
        elif self._take((key, replica), self._untracked):
            pass
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

    def _track(self, request_id: str | None, replica: str, namespace: str, tokens: Sequence[int]) -> None:
        prefilled = None if request_id is None else self._finished_early.pop(request_id, None)
        if request_id is None or prefilled is not None:  # untracked, or already over
            self._index(replica, namespace, tokens, held=bool(prefilled))
            if prefilled is False:
                self._prune(replica, namespace, tokens)
            return
        old = self._tracked.pop(request_id, None)
        if old is not None:  # sent again: the replica it went to first refused it
            self._release(*old, prune=True)
        ticket = self._index(replica, namespace, tokens, ref=True)
        if ticket is not None:
            self._tracked[request_id] = (replica, namespace, tuple(tokens), ticket)
        while len(self._tracked) > MAX_TRACKED:  # never finished (cannot happen unless ends are lost)
            self._release(*self._tracked.popitem(last=False)[1], prune=False)

    def finished(self, request_id: str, prefilled: bool) -> None:
        """The ingress saw request `request_id` end; `prefilled`: it produced a token, so its replica
        computed (and cached) its prompt. One that did not leaves nothing of its own in the index."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            self._finished_early[request_id] = prefilled
            while len(self._finished_early) > MAX_TRACKED:
                self._finished_early.popitem(last=False)
            return
        replica, namespace, tokens, ticket = tracked
        if prefilled:
            self._index(replica, namespace, tokens, held=True)
        self._release(replica, namespace, tokens, ticket, prune=not prefilled)

    def _release(self, replica: str, namespace: str, tokens: Sequence[int], ticket: int, prune: bool) -> None:
        index = self.indexes.get(replica)
        if index is not None:
            index.unref(tokens, ticket, namespace)
            if prune:
                index.prune(tokens, namespace)

    def _prune(self, replica: str, namespace: str, tokens: Sequence[int]) -> None:
        index = self.indexes.get(replica)
        if index is not None:
            index.prune(tokens, namespace)

    def cached(self, replica: str, tokens: Sequence[int], served_seq: int, namespace: str = "") -> None:
        """The replica cached `tokens` in `namespace` (a finished request's prompt and reply);
        `served_seq`: its newest cache event when it took the request."""
        if self._index(replica, namespace, tokens, held=True) is not None:
            self.reports[replica].recent.append((served_seq, namespace, tuple(tokens)))

    def _index(self, replica: str, namespace: str, tokens: Sequence[int], held: bool = False,
               ref: bool = False) -> int | None:
        """Insert into `replica`'s index; its ticket (PrefixIndex.insert), or None where it keeps none."""
        index, rep = self.indexes.get(replica), self.reports.get(replica)
        if index is None or rep is None or rep.cacheless:
            return None
        ticket = index.insert(tokens, namespace, held=held, ref=ref)
        self._bound(replica)
        return ticket

    def view_limit(self, replica: str) -> int | None:
        """The most tokens `replica`'s index keeps (None until its pool is known)."""
        rep = self.reports.get(replica)
        if rep is None or rep.stats is None:
            return None
        pool = (rep.stats.blocks_total + rep.stats.host_blocks_total) * self.block_size
        return int(self.view_pool_multiple * pool) if pool > 0 else None

    def _bound(self, replica: str) -> None:
        limit, index = self.view_limit(replica), self.indexes.get(replica)
        if limit is not None and index is not None and index.tokens > limit:
            index.evict(int(limit * VIEW_LOW_WATER))

    def report(self, replica: str, stats: EngineStats | None, events: EventBatch | None,
               pins: tuple[PinInfo, ...] = (), pin_budget: PinBudget | None = None) -> None:
        """A replica's periodic report: its statistics, the cache events since the last one, and its pins."""
        index, rep = self.indexes.get(replica), self.reports.get(replica)
        if index is None or rep is None:
            return
        rep.stats, rep.pins, rep.pin_budget = stats, pins, pin_budget
        if events is None:  # the replica runs without a prefix cache
            rep.cacheless, self.indexes[replica] = True, PrefixIndex()
            return
        if events.missed(rep.events_seq):
            self.indexes[replica] = PrefixIndex()  # what it dropped is unknown: believe nothing
            rep.resyncs += 1
        else:
            for e in events.events:
                if e.seq > rep.events_seq and index.cut(e.path, e.namespace):
                    for seq, namespace, tokens in rep.recent:
                        if seq >= e.seq and namespace == e.namespace:  # cached after that drop: still there
                            index.insert(tokens, namespace, held=True)
        rep.events_seq = max(rep.events_seq, events.last_seq)
        rep.recent = [r for r in rep.recent if r[0] > rep.events_seq]
        self._bound(replica)
