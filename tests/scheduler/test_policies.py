"""Scheduling policies without a model (a fake clock, one second per step): aging bounds how long a
low-priority or long request waits under a stream of better-ranked ones (and without aging it
starves), sjf admits the shortest job first, cache-aware the hot prefix first and arrival order on
a long queue, urgent arrivals preempt under priority (never a sequence younger than the minimum run
time), and output-aware admission keeps blocks for the running sequences' growth. The engine tests
at the end check outputs against transformers with urgent preemption and the growth reserve."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from test_engine import assert_matches, make_llm, random_prompts

from radixserve import SamplingParams
from radixserve.cache.block_pool import BlockPool
from radixserve.cache.radix_tree import RadixTree
from radixserve.config import EngineConfig
from radixserve.core import Request, Sequence, SequenceStatus
from radixserve.scheduler.no_op_model import no_op_step
from radixserve.scheduler.scheduler import Scheduler

_orders = itertools.count()


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(clock: FakeClock, **kw: Any) -> Scheduler:
    # one token per step (no speculation), so step counts are what the policies decide
    config = EngineConfig(**({"block_size": 4, "num_blocks": 64, "max_num_batched_tokens": 64,
                              "new_token_ratio": 0.0, "num_speculative_tokens": 0} | kw))
    pool = BlockPool(config.num_blocks or 1, 4)
    return Scheduler(config, pool, RadixTree(pool), clock=clock)


def add(sched: Scheduler, tokens: list[int], max_tokens: int = 2, priority: int = 0) -> Sequence:
    order = next(_orders)
    req = Request(f"r{order}", tokens, SamplingParams(max_tokens=max_tokens), priority=priority, order=order)
    s = Sequence(req, 0, list(tokens), len(tokens))
    sched.add(s)  # which makes it its request's
    return s


def step(sched: Scheduler, clock: FakeClock) -> list[Sequence]:
    """One step: schedule, pretend the model ran (token 7), finish at max_tokens; 1 s passes."""
    batch = sched.schedule()
    no_op_step(sched, batch, 7)
    sched.check_integrity()
    clock.now += 1.0
    return [it.seq for it in batch.items]


def steps_until_done(sched: Scheduler, clock: FakeClock, target: Sequence, arrivals: Any, limit: int) -> int | None:
    """Steps until `target` finishes while `arrivals(step)` keeps adding work; None if it never does."""
    for n in range(limit):
        arrivals(n)
        step(sched, clock)
        if target.status is SequenceStatus.FINISHED:
            return n + 1
    return None


@pytest.mark.parametrize("aging_s", [2.0, 0.0])
def test_priority_aging_bounds_the_wait_and_without_it_a_request_starves(aging_s: float) -> None:
    clock = FakeClock()
    sched = make(clock, policy="priority", aging_s=aging_s, max_num_seqs=1, preempt_gap=0.0, max_queue_wait_s=0.0)
    low = add(sched, [1] * 6, priority=2)
    # a higher-priority request arrives every step, more than one slot can serve
    done = steps_until_done(sched, clock, low, lambda n: add(sched, [2, n % 50 + 3, 4], priority=0), 300)
    if aging_s == 0:
        assert done is None, "with aging off the low-priority request should starve"
        return
    # it outranks every arrival later than gap * aging_s = 4 s after it; the ones before take 3 steps
    # each (one prompt step and two tokens), then it runs its own 3
    assert done is not None and done <= (2 * 2.0 + 1) * 3 + 3, done


@pytest.mark.parametrize("aging_s", [1.0, 0.0])
def test_sjf_aging_lets_a_long_job_through_a_stream_of_short_ones(aging_s: float) -> None:
    clock = FakeClock()
    sched = make(clock, policy="sjf", aging_s=aging_s, max_num_seqs=1, preempt_gap=0.0, max_queue_wait_s=0.0)
    long = add(sched, list(range(10, 74)), max_tokens=64)  # 128 tokens of work: rank log2(128) = 7
    done = steps_until_done(sched, clock, long, lambda n: add(sched, [2, n % 50 + 3], max_tokens=2), 400)
    if aging_s == 0:
        assert done is None, "with aging off the long job should starve"
        return
    # short jobs rank log2(4) = 2: the long one outranks arrivals 5 s younger than it; it then runs 65 steps
    assert done is not None and done <= (5 + 1) * 3 + 65 + 3, done


@pytest.mark.parametrize("flood_priority", [-(2**31), -10])
def test_a_flood_of_urgent_priorities_cannot_starve_a_request(flood_priority: int) -> None:
    """Issue 24 item 2: a running priority-0 request, preempted by a flood of the most urgent value,
    was never resumed (aging closes one level per aging_s; the gap was 2**31 levels). Queued
    max_queue_wait_s ago, it goes ahead of every younger request and preempts one to resume."""
    clock = FakeClock()
    sched = make(clock, policy="priority", max_num_seqs=1)  # default aging (10 s), bound (20 s), urgent preemption
    victim = add(sched, [1] * 6, max_tokens=30)
    step(sched, clock)  # it runs
    done = steps_until_done(sched, clock, victim, lambda n: [add(sched, [2, n % 50 + 3, 4], max_tokens=4,
                                                                 priority=flood_priority) for _ in range(2)], 400)
    # overdue after 20 s; the flood request running then has at most its min run time (1 s) left to
    # be preemptible, then the victim recomputes its prompt and what it generated, and finishes
    assert done is not None and done <= 20 + 1 + 2 + 30, done


def test_sjf_orders_a_mixed_queue_shortest_first() -> None:
    clock = FakeClock()
    sched = make(clock, policy="sjf", max_num_seqs=1)
    jobs = {"mid": add(sched, [1] * 20, max_tokens=8), "short": add(sched, [2] * 4, max_tokens=2),
            "long": add(sched, [3] * 40, max_tokens=30)}
    order: list[str] = []
    for _ in range(120):
        for s in step(sched, clock):
            name = next(k for k, v in jobs.items() if v is s)
            if name not in order:
                order.append(name)
    assert order == ["short", "mid", "long"]


def test_cache_aware_admits_the_hot_prefix_first_and_falls_back_to_arrival_order() -> None:
    clock = FakeClock()
    sched = make(clock, policy="cache-aware", max_num_seqs=1, cache_aware_max_queue=3)
    hot = list(range(100, 140))
    add(sched, hot + [1])
    while sched.has_work():
        step(sched, clock)
    cold, warm = add(sched, list(range(300, 340))), add(sched, hot + [2])
    assert sched.waiting_in_order() == [warm, cold]  # the hot prefix first
    calls = 0
    match = sched.tree.match  # type: ignore[union-attr]

    def counting(*a: Any, **k: Any) -> Any:
        nonlocal calls
        calls += 1
        return match(*a, **k)

    sched.tree.match = counting  # type: ignore[union-attr, method-assign]
    more = [add(sched, list(range(500 + i, 540 + i))) for i in range(2)]
    assert sched.waiting_in_order() == [cold, warm, *more] and calls == 0  # 4 waiting > 3: arrival order


def test_urgent_arrival_preempts_the_lowest_ranked_after_its_minimum_run_time() -> None:
    clock = FakeClock()
    sched = make(clock, policy="priority", num_blocks=8, preempt_gap=1.0, preempt_min_run_s=3.0, aging_s=0.0)
    lows = [add(sched, [i] * 12, max_tokens=20, priority=5) for i in (1, 2)]  # 2 x (12 + 20) tokens fill 8 blocks
    step(sched, clock)
    urgent = add(sched, [9] * 12, max_tokens=2, priority=0)
    step(sched, clock)  # the lows have run 1 s: below the minimum run time, nobody is preempted
    assert urgent.status is SequenceStatus.WAITING and sched.preemptions_by_cause["urgent"] == 0
    clock.now += 2.0
    ran = step(sched, clock)
    assert urgent in ran and sched.preemptions_by_cause["urgent"] >= 1
    assert lows[1].status is SequenceStatus.WAITING  # the later of the two equals is preempted first
    same = add(sched, [8] * 12, max_tokens=2, priority=5)  # no better than the running: never preempts
    before = sched.preemptions_by_cause["urgent"]
    step(sched, clock)
    assert sched.preemptions_by_cause["urgent"] == before and same.status is SequenceStatus.WAITING


def test_output_aware_admission_keeps_room_for_growth() -> None:
    clock = FakeClock()
    runs = {}
    for ratio in (0.0, 1.0):
        sched = make(clock, num_blocks=12, new_token_ratio=ratio, new_token_ratio_min=ratio)
        for i in range(4):  # 4 x (8 + 16) tokens need 24 blocks at their longest, the pool has 12
            add(sched, [i + 1] * 8, max_tokens=16)
        while sched.has_work():
            step(sched, clock)
        runs[ratio] = sched
    assert runs[0.0].preemptions > 0 and runs[0.0].admission_blocked["watermark"] == 0
    assert runs[1.0].preemptions == 0 and runs[1.0].admission_blocked["watermark"] > 0
    assert runs[1.0].growth.reserved_blocks >= 0


def test_growth_ratio_decays_and_resets_on_preemption() -> None:
    sched = make(FakeClock(), new_token_ratio=0.5, new_token_ratio_min=0.1, new_token_ratio_decay=0.1)
    for _ in range(10):
        sched.growth.step()
    assert sched.growth.ratio == pytest.approx(0.1)
    sched.growth.preempted()
    assert sched.growth.ratio == 0.5


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_urgent_preemption_and_growth_reserve_keep_outputs_equal_to_transformers(arch: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm = make_llm(arch, num_blocks=8, max_num_batched_tokens=48, policy="priority", preempt_min_run_s=0.0,
                   new_token_ratio=0.0)
    engine = llm.engine
    lows = random_prompts([40] * 3, seed=41)
    low_ids = [engine.add_request(p, params, priority=3) for p in lows]
    urgent = random_prompts([30], seed=42)[0]
    urgent_id = ""
    outs: dict[str, list[int]] = {}
    order: list[str] = []
    for n in range(300):
        if n == 2:  # the lows hold the pool by now
            urgent_id = engine.add_request(urgent, params, priority=0)
        if n > 2 and not engine.has_unfinished():
            break
        for out in engine.step():
            outs.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            if out.finished:
                order.append(out.request_id)
    assert engine.stats().preemptions_by_cause["urgent"] > 0
    assert order.index(urgent_id) < max(order.index(r) for r in low_ids)
    from test_engine import reference

    for rid, prompt in zip([*low_ids, urgent_id], [*lows, urgent]):
        assert outs[rid] == reference(arch, tuple(prompt), 16)
    engine.check_integrity()
    assert engine.leaked_blocks() == 0
    # the growth reserve on the same pressure: the same outputs
    assert_matches(arch, make_llm(arch, num_blocks=8, max_num_batched_tokens=48), random_prompts([40] * 6, seed=3),
                   params)


def test_the_growth_reserve_is_visible_in_stats_json_and_metrics() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from radixserve.server.cache_stats import cache_stats_json
    from radixserve.server.metrics import _EngineCollector

    llm = make_llm("llama", num_blocks=12, max_num_batched_tokens=48, new_token_ratio=1.0, new_token_ratio_min=1.0)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)  # 4 x (1 + 3 blocks) > 12
    engine = llm.engine
    for p in random_prompts([8] * 4, seed=7):
        engine.add_request(p, params)
    reserves = []
    while engine.has_unfinished():
        engine.step()
        reserves.append(engine.stats().growth_reserve_blocks)
    st = engine.stats()
    assert max(reserves) > 0 and st.new_token_ratio == 1.0 and st.admission_blocked["watermark"] > 0
    body = cache_stats_json(st, 16, 0, [])
    assert body["admission"] == {"new_token_ratio": 1.0, "growth_reserve_blocks": st.growth_reserve_blocks}
    registry = CollectorRegistry()
    registry.register(_EngineCollector(lambda: st))
    text = generate_latest(registry).decode()
    assert "radixserve_admission_new_token_ratio 1.0" in text
    assert f"radixserve_admission_growth_reserve_blocks {float(st.growth_reserve_blocks)}" in text
    assert 'radixserve_admission_blocked_total{cause="watermark"}' in text


def test_a_request_admitted_as_urgent_is_scheduled_once_in_its_step() -> None:
    """Regression: the urgent admission put the head into the running set, and the same step's
    prefill loop scheduled it a second time."""
    clock = FakeClock()
    sched = make(clock, policy="priority", num_blocks=8, preempt_gap=1.0, preempt_min_run_s=0.0, aging_s=0.0)
    for i in (1, 2):
        add(sched, [i] * 12, max_tokens=20, priority=5)
    step(sched, clock)
    urgent = add(sched, [9] * 12, max_tokens=2, priority=0)
    batch = sched.schedule()
    assert [it.seq for it in batch.items].count(urgent) == 1
    no_op_step(sched, batch, 7)
    sched.check_integrity()


def test_urgent_preemption_does_not_preempt_for_nothing() -> None:
    """A head the victims' blocks cannot make room for preempts nobody."""
    clock = FakeClock()
    sched = make(clock, policy="priority", num_blocks=8, preempt_gap=2.0, preempt_min_run_s=0.0, aging_s=0.0)
    add(sched, [1] * 23, max_tokens=8, priority=1)  # 6 blocks, not a victim (gap 1 < 2)
    add(sched, [2] * 7, max_tokens=8, priority=5)  # 2 blocks, a victim
    step(sched, clock)
    add(sched, [9] * 12, max_tokens=2, priority=0)  # needs 3 blocks: more than the victim could free
    step(sched, clock)
    assert sched.preemptions_by_cause["urgent"] == 0
