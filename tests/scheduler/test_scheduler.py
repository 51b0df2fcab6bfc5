"""The scheduler without a model: token budget, decodes first, policies, preemption victims, and
waiting for an in-flight prefill of a shared prefix instead of computing it twice."""

from __future__ import annotations

from typing import Any

from radixserve.cache.block_pool import BlockPool
from radixserve.cache.radix_tree import RadixTree
from radixserve.config import EngineConfig
from radixserve.core import Request, Sequence, SequenceStatus
from radixserve.sampling_params import SamplingParams
from radixserve.scheduler.no_op_model import no_op_step
from radixserve.scheduler.scheduler import Scheduler


def make(policy: str = "fcfs", num_blocks: int = 64, budget: int = 32, cache: bool = True, **kw: Any) -> Scheduler:
    # output-aware admission off unless a test asks: these tests pin down the other rules
    kw = {"new_token_ratio": 0.0} | kw
    config = EngineConfig(block_size=4, num_blocks=num_blocks, max_num_batched_tokens=budget, policy=policy, **kw)
    pool = BlockPool(num_blocks, 4)
    return Scheduler(config, pool, RadixTree(pool) if cache else None)


def seq(tokens: list[int], order: int, priority: int = 0) -> Sequence:
    req = Request(f"r{order}", tokens, SamplingParams(max_tokens=4), priority=priority, order=order)
    return Sequence(req, 0, list(tokens), len(tokens))  # `Scheduler.add` makes it its request's


def step(sched: Scheduler) -> dict[str, int]:
    """Schedule, pretend the model ran, and sample token 7 where a chunk reached the end."""
    batch = sched.schedule()
    no_op_step(sched, batch, 7)
    return {i.seq.request.request_id: i.num_tokens for i in batch.items}


def test_budget_chunks_and_decodes_first() -> None:
    sched = make(budget=10)
    a, b = seq(list(range(1, 6)), 0), seq(list(range(100, 130)), 1)
    sched.add(a)
    sched.add(b)
    assert step(sched) == {"r0": 5, "r1": 5}  # a's whole prompt, then a chunk of b within 10 tokens
    assert step(sched) == {"r0": 1, "r1": 9}  # a decodes first, b gets the rest of the budget
    assert sum(step(sched).values()) <= 10


def test_priority_policy_admits_and_preempts_by_priority() -> None:
    sched = make(policy="priority", num_blocks=6, budget=64)
    low = seq([1] * 10, 0, priority=5)
    sched.add(low)
    step(sched)
    high, higher = seq([2] * 12, 1, priority=0), seq([3] * 12, 2, priority=-1)
    sched.add(high)
    sched.add(higher)
    assert list(step(sched)) == ["r0", "r2"]  # low decodes; `higher` is admitted before `high`
    # the pool is full; `higher` needs a 4th block, so the lowest priority sequence is preempted
    plan = step(sched)
    assert sched.preemptions == 1 and low.status is SequenceStatus.WAITING
    assert "r2" in plan and "r0" not in plan


def test_cache_aware_policy_prefers_the_longest_cached_prefix() -> None:
    sched = make(policy="cache-aware", budget=12)
    warm = seq(list(range(1, 13)), 0)
    sched.add(warm)
    step(sched)
    sched.finish(warm, "stop")
    cold, hot = seq(list(range(50, 62)), 1), seq(list(range(1, 13)) + [99], 2)
    sched.add(cold)
    sched.add(hot)
    assert list(step(sched)) == ["r2", "r1"]  # the later arrival with a cached prefix goes first
    assert hot.request.cached_tokens == 12


def test_shared_prefix_waits_for_the_inflight_prefill() -> None:
    sched = make(budget=16)
    prefix = list(range(1, 33))
    first, second = seq(prefix + [40, 41], 0), seq(prefix + [50, 51], 1)
    sched.add(first)
    sched.add(second)
    assert step(sched) == {"r0": 16}  # the second waits: the first is computing their shared prefix
    assert step(sched) == {"r0": 16}
    plan = step(sched)
    assert second.request.cached_tokens == 32 and plan["r1"] == 2  # then it reuses all 32 tokens


def test_waiting_never_overtakes_when_blocks_run_out_fcfs() -> None:
    sched = make(num_blocks=4, budget=64, cache=False)
    big, small = seq([1] * 20, 0), seq([2] * 3, 1)
    sched.add(big)
    sched.add(small)
    assert step(sched) == {}  # 20 tokens need 5 blocks of 4; FCFS keeps `small` behind `big`
