"""The scale-out router's pure parts, without Ray: the per-replica prefix index, the tree's drop events
that correct it, the routing rule, and merged statistics.

The strongest check is `TestTreeMirror`: the radix-tree state machine of test_radix_tree, with an
index that sees every insert and every reported drop; after every step the index must answer every
prefix query exactly as the tree does, i.e. the events lose nothing and cut nothing extra.
"""

from __future__ import annotations

import random
import subprocess
import sys
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant
from test_radix_tree import CacheMachine

from radixserve.cache.events import CacheEventLog
from radixserve.engine.stats import EngineStats
from radixserve.scaleout.affinity import SessionAffinity
from radixserve.scaleout.config import ClusterConfig
from radixserve.scaleout.prefix_index import PrefixIndex
from radixserve.scaleout.routing import Decision, RoutingTable

small_tokens = st.lists(st.integers(0, 3), min_size=1, max_size=12)


def brute_match(held: set[tuple[int, ...]], tokens: list[int]) -> int:
    """The longest prefix of `tokens` that is a prefix of some held sequence."""
    best = 0
    for h in held:
        n = 0
        while n < min(len(h), len(tokens)) and h[n] == tokens[n]:
            n += 1
        best = max(best, n)
    return best


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["insert", "cut"]), small_tokens), max_size=30),
       probes=st.lists(small_tokens, min_size=1, max_size=8))
def test_prefix_index_matches_a_brute_force_model(ops: list[tuple[str, list[int]]], probes: list[list[int]]) -> None:
    index, held = PrefixIndex(), set()
    for op, tokens in ops:
        if op == "insert":
            index.insert(tokens)
            held.add(tuple(tokens))
        else:  # drop everything continuing tokens[:-1] with tokens[-1]
            index.cut(tokens)
            depth = len(tokens) - 1
            cut = {h[:depth] for h in held if len(h) > depth and list(h[:depth + 1]) == tokens}
            held = {h for h in held if not (len(h) > depth and list(h[:depth + 1]) == tokens)} | {c for c in cut if c}
        index.check_integrity()
        for p in probes + [list(h) for h in held]:
            assert index.match(p) == brute_match(held, p), (p, held)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["insert", "cut", "evict"]), st.sampled_from(["", "t1", "t2"]),
                              small_tokens), max_size=30))
def test_each_namespace_answers_only_for_itself(ops: list[tuple[str, str, list[int]]]) -> None:
    """Per namespace the index is the brute-force model of that namespace alone; eviction may take
    any namespace's leaves, and a namespace left empty is dropped."""
    index = PrefixIndex()
    held: dict[str, set[tuple[int, ...]]] = {"": set(), "t1": set(), "t2": set()}
    for op, ns, tokens in ops:
        if op == "insert":
            index.insert(tokens, ns)
            held[ns].add(tuple(tokens))
        elif op == "cut":
            index.cut(tokens, ns)
            depth = len(tokens) - 1
            gone = {h for h in held[ns] if len(h) > depth and list(h[:depth + 1]) == tokens}
            held[ns] = (held[ns] - gone) | {h[:depth] for h in gone if depth}
        else:
            index.evict(0)  # nothing is referenced: everything goes
            held = {k: set() for k in held}
        index.check_integrity()
        assert index.namespaces == sorted(k for k, v in held.items() if v)
        for space in held:
            for p in [list(h) for v in held.values() for h in v]:
                assert index.match(p, space) == brute_match(held[space], p), (space, p, held)


class TreeMirror(CacheMachine):
    """The tree machine (with its namespaces), mirrored by a PrefixIndex fed its inserts and its drop
    events: each namespace's trie answers as that namespace's tree, so drops are cut where they belong."""

    def __init__(self) -> None:
        super().__init__()
        self.tree.events = CacheEventLog(max_events=1 << 20, max_tokens=1 << 30)
        self.index, self.applied = PrefixIndex(), 0
        self.probes: list[tuple[str, list[int]]] = []
        tree_insert = self.tree.insert

        def insert(tokens: list[int], blocks: list[int], known: object = None, namespace: str = "") -> object:
            self.index.insert(tokens, namespace)
            self.probes.append((namespace, list(tokens)))
            return tree_insert(tokens, blocks, known, namespace=namespace)  # type: ignore[arg-type]

        self.tree.insert = insert  # type: ignore[method-assign]

    @invariant()
    def index_answers_as_the_tree(self) -> None:
        assert self.tree.events is not None
        batch = self.tree.events.since(self.applied)
        assert not batch.missed(self.applied)
        for e in batch.events:
            self.index.cut(e.path, e.namespace)
        self.applied = batch.last_seq
        self.index.check_integrity()
        for ns, p in self.probes[-12:] + [(s.namespace, s.tokens) for s in self.seqs]:
            for other in {ns, "", "a"}:  # its own namespace, and others that may hold the same tokens
                assert self.index.match(p, other) == self.tree.match(p, split=False, namespace=other).length, (other, p)


TestTreeMirror = TreeMirror.TestCase
TestTreeMirror.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)


def test_event_log_is_bounded_and_reports_what_a_reader_missed() -> None:
    log = CacheEventLog(max_events=3)
    for i in range(5):
        log.dropped((i, i + 1))
    batch = log.since(0)
    assert [e.seq for e in batch.events] == [3, 4, 5] and batch.last_seq == 5
    assert batch.missed(0) and batch.missed(1) and not batch.missed(2) and not batch.missed(5)
    assert log.since(5).events == () and not log.since(5).missed(5)
    tokens = CacheEventLog(max_events=100, max_tokens=4)
    tokens.dropped((1, 2, 3))
    tokens.dropped((4, 5))  # 5 tokens kept would exceed 4: the oldest goes
    assert [e.path for e in tokens.since(0).events] == [(4, 5)]


def table(replicas: list[str], gap: int = 2) -> RoutingTable:
    t = RoutingTable(max_load_gap=gap, rng=random.Random(0))
    t.set_replicas(replicas)
    return t


_keys = iter(range(10**9))


def route(t: RoutingTable, tokens: list[int], among: list[str], prefer: str | None = None) -> tuple[str, Decision]:
    """Decide and send one request, as the router does; returns its key and the decision."""
    d = t.choose(tokens, among, prefer)
    key = f"req{next(_keys)}"
    t.sent(key, d.replica, tokens, d)
    return key, d


def test_a_shared_prefix_follows_the_replica_that_holds_it() -> None:
    t = table(["a", "b"])
    system = list(range(100, 140))
    key, first = route(t, system + [1, 2], ["a", "b"])
    assert first.reason == "miss" and first.matched == 0
    t.completed(key, first.replica)
    again = t.choose(system + [7, 8, 9], ["a", "b"])
    assert (again.replica, again.reason, again.matched) == (first.replica, "prefix", len(system))
    assert t.decisions["miss"] == 1 and t.decisions["prefix"] == 0  # counted when sent, not when chosen


def test_requests_chosen_before_the_first_is_sent_follow_it() -> None:
    """Ray routes concurrently: a group's second request may be chosen before its first is sent."""
    t = table(["a", "b"])
    system = list(range(100, 140))
    first = t.choose(system + [1], ["a", "b"])
    second = t.choose(system + [2], ["a", "b"])
    assert (second.replica, second.reason, second.matched) == (first.replica, "prefix", len(system))
    t.sent("k1", first.replica, system + [1], first)
    t.sent("k2", second.replica, system + [2], second)
    assert t.decisions["miss"] == 1 and t.decisions["prefix"] == 1


def test_a_short_shared_opening_is_a_miss() -> None:
    t = table(["a", "b"])
    t.sent("k", "a", [1, 2, 3] + [10] * 20)  # a chat template's opening tokens, then one conversation
    t.completed("k", "a")
    d = t.choose([1, 2, 3] + [20] * 20, ["a", "b"])  # shares 3 of 23 tokens with a: below the fraction
    assert (d.replica, d.reason, d.matched) == ("b", "miss", 0)
    t.min_prefix_fraction = 0.1
    assert t.choose([1, 2, 3] + [20] * 20, ["a", "b"]).reason == "prefix"


def test_misses_go_to_the_least_loaded_then_to_the_emptier_cache() -> None:
    t = table(["a", "b", "c"])
    t.sent("ka", "a", [1, 2, 3])
    t.sent("kb", "b", [4, 5, 6])
    assert t.choose([9, 9], ["a", "b", "c"]).replica == "c"  # a and b each have one in flight
    t.completed("ka", "a")
    t.completed("kb", "b")
    t.sent("kc", "c", [7] * 50)
    t.completed("kc", "c")
    picks = [t.choose([800 + i, 900 + i], ["a", "b", "c"]).replica for i in range(20)]
    assert set(picks) == {"a", "b"}  # equal loads: the replicas holding fewer tokens, so new prefixes spread
    assert abs(picks.count("a") - picks.count("b")) <= 2


def test_a_loaded_holder_loses_to_the_least_loaded_beyond_the_gap() -> None:
    t = table(["a", "b"], gap=2)
    prompt = list(range(30))
    for i in range(3):
        t.sent(f"k{i}", "a", prompt)
    d = t.choose(prompt, ["a", "b"])
    assert (d.replica, d.reason, d.matched) == ("b", "imbalance", 0)
    t.completed("k0", "a")  # 2 in flight on a, 0 on b: within the gap
    assert t.choose(prompt, ["a", "b"]).reason == "prefix"


def test_loads_count_only_what_was_sent_and_completed() -> None:
    t = table(["a", "b"])
    t.sent("ws", "a", [1])  # one WebSocket connection: its turns share the request key
    t.sent("ws", "a", [2])
    t.completed("x", "a")  # a refusal Ray reports for a request that was never sent there
    assert t.loads["a"] == 2
    t.completed("ws", "a")
    t.completed("ws", "a")
    t.completed("ws", "a")
    assert t.loads["a"] == 0
    t.completed("early", "b")  # a completion that overtook its routing
    t.sent("early", "b", [3])
    assert t.loads["b"] == 0


def test_a_fallback_is_counted_as_such() -> None:
    t = table(["a", "b"])
    d = t.choose([1, 2], ["a", "b"])
    other = "b" if d.replica == "a" else "a"
    t.sent("k", other, [1, 2], d)  # Ray sent it elsewhere: the chosen replica refused
    assert t.decisions["fallback"] == 1 and t.decisions[d.reason] == 0


def test_a_session_stays_on_its_replica_and_fails_over_when_it_is_gone() -> None:
    t = table(["a", "b"], gap=0)
    t.sent("k", "b", [5] * 10)
    t.sent("k", "a", [1, 2, 3])
    for _ in range(4):
        t.sent("k", "a", [0])  # "a" is busy: a session there still stays
    assert t.choose([1, 2, 3, 4], ["a", "b"], prefer="a").reason == "session"
    t.set_replicas(["b", "c"])  # "a" died, "c" replaced it
    d = t.choose([1, 2, 3, 4], ["b", "c"], prefer="a")
    assert d.reason == "failover" and d.replica in {"b", "c"}
    assert "a" not in t.loads and t.replicas == ["b", "c"]


def test_reports_apply_drops_once_and_clear_an_index_that_missed_some() -> None:
    t = table(["a"])
    t.sent("k", "a", [1, 2, 3, 4])
    t.sent("k", "a", [1, 2, 9])
    log = CacheEventLog(max_events=2)
    log.dropped((1, 2, 9))
    t.report("a", EngineStats(prompt_tokens=7), log.since(0))
    assert t.indexes["a"].match([1, 2, 9]) == 2 and t.indexes["a"].match([1, 2, 3, 4]) == 4
    t.report("a", EngineStats(prompt_tokens=7), log.since(0))  # the same report again: nothing changes
    assert t.indexes["a"].match([1, 2, 3, 4]) == 4
    assert t.reports["a"].stats == EngineStats(prompt_tokens=7)
    for path in ((1, 2, 3), (5,), (6,)):
        log.dropped(path)
    t.report("a", EngineStats(), log.since(1))  # event 2 fell out of the window before this report
    assert t.indexes["a"].match([1, 2, 3, 4]) == 0 and t.reports["a"].resyncs == 1


def test_a_late_drop_report_does_not_erase_what_was_cached_again() -> None:
    t = table(["a"])
    prompt = list(range(50))
    log = CacheEventLog()
    t.cached("a", prompt, served_seq=log.last_seq)
    log.dropped(tuple(prompt[:11]))  # the replica evicts the prompt from position 10 ...
    t.cached("a", prompt, served_seq=log.last_seq)  # ... then a request caches it again, before the report
    log.dropped((7, 7))  # and later drops something else
    t.report("a", EngineStats(), log.since(0))
    assert t.indexes["a"].match(prompt) == 50
    t.cached("a", prompt + [99], served_seq=log.last_seq)
    log.dropped(tuple(prompt[:21]))  # a drop after that request: it does erase
    t.report("a", EngineStats(), log.since(0))
    assert t.indexes["a"].match(prompt + [99]) == 20
    assert t.reports["a"].recent == []  # every insert older than the last applied event is settled


SYSTEM = list(range(100, 140))


def test_another_namespaces_prefix_does_not_attract_a_request() -> None:
    """Tenant A's prompt sits on replica "a"; B's identical prompt is placed by load alone, whichever
    way the load points, and never counted as a prefix hit."""
    for busy, expected in (("a", "b"), ("b", "a")):
        t = table(["a", "b"], gap=8)
        t.sent("ka", "a", SYSTEM, namespace="A")
        t.completed("ka", "a")
        t.sent("busy", busy, [7, 7, 7])  # one request in flight, in the shared namespace
        assert t.choose(SYSTEM, ["a", "b"], namespace="A") == Decision("a", "prefix", len(SYSTEM))
        d = t.choose(SYSTEM, ["a", "b"], namespace="B")
        assert d == Decision(expected, "miss", 0), (busy, d)
    t = table(["a", "b"])
    t.sent("ka", "a", SYSTEM, namespace="A")
    t.completed("ka", "a")
    assert t.choose(SYSTEM, ["a", "b"]).reason == "miss"  # the shared namespace is a namespace too


def test_a_prompt_routed_in_flight_attracts_only_its_own_namespace() -> None:
    """Ray routes concurrently: what `choose` entered for A is not a prefix for B."""
    t = table(["a", "b"])
    first = t.choose(SYSTEM + [1], ["a", "b"], namespace="A")
    other = t.choose(SYSTEM + [2], ["a", "b"], namespace="B")
    same = t.choose(SYSTEM + [3], ["a", "b"], namespace="A")
    assert other.reason == "miss" and other.replica != first.replica  # the emptier replica
    assert (same.replica, same.reason) == (first.replica, "prefix")


def test_drops_cut_only_their_own_namespace() -> None:
    t = table(["a"])
    log = CacheEventLog()
    for ns in ("A", "B"):
        t.cached("a", SYSTEM, served_seq=0, namespace=ns)
    log.dropped(tuple(SYSTEM[:11]), "B")  # B's copy from position 10 on
    t.report("a", EngineStats(), log.since(0))
    index = t.indexes["a"]
    assert (index.match(SYSTEM, "A"), index.match(SYSTEM, "B")) == (40, 10)
    t.cached("a", SYSTEM + [1], served_seq=log.last_seq, namespace="B")  # cached again after the drop
    log.dropped(tuple(SYSTEM[:21]), "A")
    log.dropped((SYSTEM[0],), "B")  # then B's whole tree went, after that entry: it goes too
    t.report("a", EngineStats(), log.since(0))
    assert (index.match(SYSTEM, "A"), index.match(SYSTEM, "B")) == (20, 0)
    assert index.namespaces == ["A"]  # B has nothing left: its root is gone


def test_a_late_drop_keeps_what_its_namespace_cached_again_and_no_other() -> None:
    t = table(["a"])
    log = CacheEventLog()
    t.cached("a", SYSTEM, served_seq=log.last_seq, namespace="A")
    log.dropped((SYSTEM[0],), "A")  # A's prompt is evicted ...
    t.cached("a", SYSTEM, served_seq=log.last_seq, namespace="A")  # ... cached again, before the report
    t.cached("a", SYSTEM, served_seq=0, namespace="B")  # B's was cached before the drop: unaffected
    t.report("a", EngineStats(), log.since(0))
    assert t.indexes["a"].match(SYSTEM, "A") == 40 and t.indexes["a"].match(SYSTEM, "B") == 40
    t.indexes["a"].check_integrity()


def test_requests_tracked_in_flight_release_their_own_namespace() -> None:
    t = table(["a"])
    d = t.choose(SYSTEM, ["a"], namespace="A")
    t.sent("k1", "a", SYSTEM, d, request_id="r1", namespace="A")
    t.sent("k2", "a", SYSTEM, request_id="r2", namespace="B")
    t.finished("r2", prefilled=False)  # B's request never prefilled: only B's entry goes
    assert t.indexes["a"].match(SYSTEM, "A") == 40 and t.indexes["a"].match(SYSTEM, "B") == 0
    t.finished("r1", prefilled=True)
    t.indexes["a"].evict(0)
    assert t.indexes["a"].tokens == 0 and t.indexes["a"].namespaces == []


def test_sessions_are_per_namespace() -> None:
    homes = SessionAffinity(limit=3)
    homes.set("A", "s1", "a")
    assert homes.get("A", "s1") == "a"
    assert homes.get("B", "s1") is None  # B naming A's session id is not steered to A's replica
    homes.set("B", "s1", "b")  # nor does B's use of the id move A's session
    assert (homes.get("A", "s1"), homes.get("B", "s1")) == ("a", "b")
    assert homes.get("A", None) is None
    assert homes.get("A", "s1") == "a"  # read last: B's s1 is now the least recently used
    homes.set("A", "s2", "b")
    homes.set("A", "s3", "b")  # past the limit: the least recently used goes
    assert len(homes) == 3 and homes.get("B", "s1") is None and homes.get("A", "s1") == "a"


def test_calls_that_are_no_generation_leave_no_trace() -> None:
    """Facts, pins and tree-view calls: no load, nothing remembered once they completed, in either order."""
    t = table(["a"])
    t.sent_other("k", "a")
    t.completed("k", "a")
    t.completed("k2", "a")  # its completion overtook its routing
    t.sent_other("k2", "a")
    assert t.loads["a"] == 0 and not t._untracked and not t._completed_early and t.routed["a"] == 0


def test_totals_keep_a_replica_that_is_gone() -> None:
    t = table(["a", "b"])
    t.report("a", EngineStats(prompt_tokens=10, cached_tokens=4, blocks_total=8), None)
    t.report("b", EngineStats(prompt_tokens=5, blocks_total=8), CacheEventLog().since(0))
    assert t.reports["a"].cacheless and not t.reports["b"].cacheless
    t.sent("k", "a", [1, 2, 3])  # a replica without a prefix cache is not indexed
    assert t.indexes["a"].tokens == 0
    t.set_replicas(["b"])
    assert (t.retired.prompt_tokens, t.retired.cached_tokens, t.retired.blocks_total) == (10, 4, 0)


def test_merged_stats_sum_counts_and_average_the_ratio() -> None:
    a = EngineStats(blocks_total=10, prompt_tokens=5, write_back_s=0.5, requests_finished=Counter(stop=2),
                    new_token_ratio=0.2)
    b = EngineStats(blocks_total=20, prompt_tokens=7, write_back_s=1.0, requests_finished=Counter(stop=1, length=1),
                    new_token_ratio=0.4)
    m = EngineStats.merged([a, b])
    assert (m.blocks_total, m.prompt_tokens, m.write_back_s) == (30, 12, 1.5)
    assert m.requests_finished == Counter(stop=3, length=1) and m.new_token_ratio == pytest.approx(0.3)
    assert EngineStats.merged([]) == EngineStats()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"replicas": 0}, "replicas must be >= 1"),
    ({"router": "random"}, "router must be one of cache-aware, power-of-two"),
    ({"max_load_gap": -1}, "max_load_gap must be >= 0"),
    ({"min_prefix_fraction": 1.5}, "min_prefix_fraction must be in"),
])
def test_bad_cluster_settings_are_clear_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ClusterConfig(**kwargs)  # type: ignore[arg-type]


def test_replicas_without_ray_name_the_extra(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import radixserve.scaleout.cli as scaleout_cli
    from radixserve.cli import main

    monkeypatch.setattr(scaleout_cli, "ray_available", lambda: False)
    assert main(["serve", "--replicas", "2"]) == 2
    err = capsys.readouterr().err
    assert "--replicas 2 needs Ray Serve" in err and "pip install 'radixserve[ray]'" in err
    assert main(["serve", "--replicas", "0"]) == 2
    assert "replicas must be >= 1" in capsys.readouterr().err


def test_one_replica_serves_without_importing_ray() -> None:
    """`serve` with the default `--replicas 1` is the single-process server: Ray is never imported."""
    code = ("import sys, radixserve.server.cli as s; s.run_server = lambda *a: 0\n"
            "from radixserve.cli import main\nassert main(['serve']) == 0\n"
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
