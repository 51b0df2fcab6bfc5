"""The router's per-replica view stays bounded (no Ray): prompts that no replica ever cached do not
pile up in it.

The measured failure: 150 unique 1.5k-token prompts, each aborted before its prefill, left 24k-27k
tokens in the views of two replicas whose pools hold 2,048 tokens, since only a replica's reported
drops shrank a view and a replica never drops what it never cached. Now a view evicts its own least
recently used entries past `VIEW_POOL_MULTIPLE` times its replica's pool, and the ingress's word that
a request ended before its prefill (`RoutingTable.finished`) drops that request's entry at once.
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.cache.events import CacheEventLog
from radixserve.engine.stats import EngineStats
from radixserve.scaleout.prefix_index import PrefixIndex
from radixserve.scaleout.routing import VIEW_POOL_MULTIPLE, RoutingTable

BLOCK = 16
POOL_BLOCKS = 128  # 2,048 tokens per replica, as measured
POOL_TOKENS = POOL_BLOCKS * BLOCK
PROMPT = 1500


def table(replicas: list[str]) -> tuple[RoutingTable, dict[str, CacheEventLog]]:
    t = RoutingTable(rng=random.Random(0))
    t.block_size = BLOCK
    t.set_replicas(replicas)
    logs = {r: CacheEventLog() for r in replicas}
    report(t, logs)
    return t, logs


def report(t: RoutingTable, logs: dict[str, CacheEventLog]) -> None:
    """Every replica's periodic report: its pool, and no drop (it never cached these prompts)."""
    for name, log in logs.items():
        t.report(name, EngineStats(blocks_total=POOL_BLOCKS, blocks_free=POOL_BLOCKS), log.since(0))


def unique_prompt(rng: random.Random, length: int = PROMPT) -> list[int]:
    return [rng.randrange(1000, 49_000) for _ in range(length)]


def view_tokens(t: RoutingTable) -> dict[str, int]:
    for index in t.indexes.values():
        index.check_integrity()
    return {name: index.tokens for name, index in t.indexes.items()}


def test_aborted_unique_prompts_leave_the_view_within_a_multiple_of_the_pool() -> None:
    """The measured run, with only what Ray tells the router (sent, completed) and the replicas'
    reports: the LRU bound alone keeps each view within VIEW_POOL_MULTIPLE x its pool."""
    t, logs = table(["a", "b"])
    rng = random.Random(1)
    for i in range(150):
        prompt = unique_prompt(rng)
        d = t.choose(prompt, ["a", "b"])
        t.sent(f"k{i}", d.replica, prompt, d)
        t.completed(f"k{i}", d.replica)  # aborted: nothing is cached, nothing will ever be dropped
        if i % 10 == 9:
            report(t, logs)
    tokens = view_tokens(t)
    assert all(n <= VIEW_POOL_MULTIPLE * POOL_TOKENS for n in tokens.values()), tokens
    assert all(n > 0 for n in tokens.values()), tokens  # the bound evicts down to it, not everything


def test_a_request_that_never_prefilled_leaves_no_entry() -> None:
    t, _ = table(["a", "b"])
    rng = random.Random(2)
    for i in range(150):
        prompt = unique_prompt(rng)
        d = t.choose(prompt, ["a", "b"])
        t.sent(f"k{i}", d.replica, prompt, d, request_id=f"r{i}")
        t.completed(f"k{i}", d.replica)
        t.finished(f"r{i}", prefilled=False)
    assert view_tokens(t) == {"a": 0, "b": 0}


def test_only_the_unshared_tail_of_an_aborted_prompt_goes() -> None:
    """A new system prompt's first request is aborted before its prefill while a second one of the
    same system prompt is in flight: the second's entry stays, so a third still follows it."""
    t, _ = table(["a", "b"])
    rng = random.Random(3)
    system = unique_prompt(rng, 400)
    first, second, third = (system + unique_prompt(rng, 50) for _ in range(3))
    d1 = t.choose(first, ["a", "b"])
    t.sent("k1", d1.replica, first, d1, request_id="r1")
    d2 = t.choose(second, ["a", "b"])
    assert (d2.replica, d2.reason) == (d1.replica, "prefix")
    t.sent("k2", d2.replica, second, d2, request_id="r2")
    t.finished("r1", prefilled=False)
    index = t.indexes[d1.replica]
    assert index.match(first) == 400 and index.match(second) == 450 and index.tokens == 450
    d3 = t.choose(third, ["a", "b"])
    assert (d3.replica, d3.reason, d3.matched) == (d1.replica, "prefix", 400)
    t.sent("k3", d3.replica, third, d3, request_id="r3")
    t.finished("r3", prefilled=True)  # prefilled, then aborted: the replica cached its prompt
    t.finished("r2", prefilled=False)
    assert index.match(third) == 450 and index.match(second) == 400 and index.tokens == 450


def test_a_request_ray_sent_elsewhere_leaves_no_entry_on_the_chosen_replica() -> None:
    t, _ = table(["a", "b"])
    prompt = unique_prompt(random.Random(4), 300)
    d = t.choose(prompt, ["a", "b"])
    other = "b" if d.replica == "a" else "a"
    t.sent("k", other, prompt, d, request_id="r")  # the chosen replica refused it
    assert t.indexes[d.replica].tokens == 0 and t.indexes[other].match(prompt) == 300


def test_the_view_evicts_its_least_recently_used_entries_first() -> None:
    t, logs = table(["a"])
    rng = random.Random(5)
    cap = VIEW_POOL_MULTIPLE * POOL_TOKENS
    old = [unique_prompt(rng, 500) for _ in range(int(cap // 500))]  # the view holds them all, just
    for i, p in enumerate(old):
        t.sent(f"k{i}", "a", p)
        t.completed(f"k{i}", "a")
    assert view_tokens(t)["a"] == len(old) * 500
    conversation = old[0] + [7, 7]
    new = [unique_prompt(rng, 500) for _ in range(2 * len(old))]
    for i, p in enumerate(new):
        t.cached("a", conversation, logs["a"].last_seq)  # a conversation that goes on is used again
        t.sent(f"n{i}", "a", p)
        t.completed(f"n{i}", "a")
        assert view_tokens(t)["a"] <= cap
    index = t.indexes["a"]
    assert index.match(conversation) == 502 and index.match(new[-1]) == 500
    assert all(index.match(p) == 0 for p in old[1:]) and index.match(new[0]) == 0


def test_prompts_in_flight_are_never_evicted() -> None:
    t, _ = table(["a"])
    rng = random.Random(6)
    cap = VIEW_POOL_MULTIPLE * POOL_TOKENS
    busy = [unique_prompt(rng, 500) for _ in range(int(cap // 500) + 2)]  # more than the bound, all running
    for i, p in enumerate(busy):
        t.sent(f"k{i}", "a", p, request_id=f"r{i}")
    index = t.indexes["a"]
    assert all(index.match(p) == 500 for p in busy) and view_tokens(t)["a"] == len(busy) * 500 > cap
    for i in range(len(busy)):
        t.completed(f"k{i}", "a")
        t.finished(f"r{i}", prefilled=True)  # ran: cached, and evictable from now on
    t.sent("next", "a", unique_prompt(rng, 500))
    assert view_tokens(t)["a"] <= cap and index.match(busy[-1]) == 500 and index.match(busy[0]) == 0


def test_a_ref_is_released_only_where_it_was_taken() -> None:
    """A prompt's path cut (the replica dropped it) and built again by later requests: the first
    request's end releases none of their refs, so another prompt in flight on that path is never
    evicted (found by the state machine below)."""
    index = PrefixIndex()
    index.insert([0])
    first = index.insert([0], ref=True)
    assert index.cut([0]) == 1
    index.insert([0])
    longer = index.insert([0, 0], ref=True)
    index.unref([0], first)
    index.check_integrity()
    again = index.insert([0], ref=True)
    index.unref([0, 0], longer)
    index.evict(0)
    index.check_integrity()
    assert index.match([0]) == 1 and index.match([0, 0]) == 1
    index.unref([0], again)
    index.evict(0)
    assert index.tokens == 0


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["insert", "held", "send", "end", "abort", "evict", "cut"]),
                              st.lists(st.integers(0, 3), min_size=1, max_size=10), st.integers(0, 40)),
                    max_size=40))
def test_forgetting_keeps_the_index_sound(ops: list[tuple[str, list[int], int]]) -> None:
    """Whatever is inserted, released, pruned, evicted or cut: the index stays well formed, a prompt
    in flight is never forgotten but by a replica's drop, and eviction reaches its target unless only
    prompts in flight are left."""
    index, in_flight, cut_any = PrefixIndex(), list[tuple[list[int], int]](), False
    for op, tokens, n in ops:
        if op == "insert":
            index.insert(tokens)
        elif op == "held":
            index.insert(tokens, held=True)
        elif op == "send":
            in_flight.append((tokens, index.insert(tokens, ref=True)))
        elif op in ("end", "abort") and in_flight:
            done, ticket = in_flight.pop(n % len(in_flight))
            index.unref(done, ticket)
            if op == "abort":
                index.prune(done)
        elif op == "evict":
            index.evict(n)
            index.check_integrity()
            assert index.tokens <= n or (in_flight and index.tokens <= sum(len(p) for p, _ in in_flight)), index.tokens
        elif op == "cut":
            cut_any |= index.cut(tokens) > 0
        index.check_integrity()
        if not cut_any:
            assert all(index.match(p) == len(p) for p, _ in in_flight)
