"""The scheduler and the radix tree publish their own figures (scheduler/snapshot.py,
cache/tree_stats.py) and EngineStats is built from those: each snapshot holds exactly what its
component holds (counted independently here, mid-run, with sequences running and waiting and part
of the cache written back to the host tier), and stays as taken when the component moves on."""

from __future__ import annotations

import pytest
from test_engine import make_llm, random_prompts

from radixserve import SamplingParams
from radixserve.cache.tree_stats import HostOnly, TreeStats, tree_stats
from radixserve.engine.engine import LLMEngine
from radixserve.engine.stats import EngineStats
from radixserve.scheduler.snapshot import BlockCounts, snapshot

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    """Mid-run: the first prompts pushed out to the host tier, then four long requests admitted
    into a 12-block pool (not all fit at once) and stepped a few times."""
    llm = make_llm("llama", num_blocks=12, host_cache_mb=64.0, new_token_ratio=0.0)
    llm.generate(random_prompts([70, 90], seed=21), GREEDY)
    for prompt in random_prompts([110, 110], seed=22):
        llm.generate([prompt], GREEDY)
    engine = llm.engine
    for prompt in random_prompts([60, 60, 60, 60], seed=23):
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    for _ in range(3):
        engine.step()
    return engine


def test_scheduler_snapshot_is_what_the_scheduler_holds(engine: LLMEngine) -> None:
    sched, pool = engine.scheduler, engine.pool
    snap = snapshot(sched, count_blocks=True)
    assert (snap.num_running, snap.num_waiting) == (len(sched.running), len(sched.waiting))
    assert snap.num_running > 0 and snap.num_waiting > 0
    assert (snap.preemptions, snap.swaps_out, snap.swaps_in) == (sched.preemptions, sched.swaps_out, sched.swaps_in)
    assert dict(snap.preemptions_by_cause) == dict(sched.preemptions_by_cause)
    assert dict(snap.admission_blocked) == dict(sched.admission_blocked) and snap.admission_blocked
    assert (snap.new_token_ratio, snap.growth_reserve_blocks) == (sched.growth.ratio, sched.growth.reserved_blocks)
    used = {b for s in sched.live_sequences() for b in s.block_table}
    assert snap.blocks_total == pool.num_blocks
    assert snap.blocks == BlockCounts(pool.num_free, len(used), pool.num_blocks - pool.num_free - len(used))
    assert len(used) > 0
    assert snapshot(sched).blocks is None  # not counted unless asked


def test_scheduler_snapshot_stays_as_taken(engine: LLMEngine) -> None:
    sched = engine.scheduler
    snap = snapshot(sched)
    before = dict(snap.admission_blocked)
    sched.admission_blocked["a cause of this test"] += 1
    try:
        assert dict(snap.admission_blocked) == before
        with pytest.raises(TypeError):
            snap.admission_blocked["blocks"] = 0  # type: ignore[index]
    finally:
        del sched.admission_blocked["a cause of this test"]


def test_tree_stats_are_what_the_tree_holds(engine: LLMEngine) -> None:
    tree, host = engine.tree, engine.host_pool
    assert tree is not None and host is not None
    nodes = tree.nodes()
    host_only = [n for n in nodes if not n.blocks]
    assert tree_stats(tree, count_host=True) == TreeStats(
        nodes=len(nodes), tokens=sum(len(n.tokens) for n in nodes), evictions=tree.evictions,
        evicted_blocks=tree.evicted_blocks, written_back_blocks=tree.written_back_blocks,
        loaded_blocks=tree.loaded_blocks, host_dropped_blocks=tree.host_dropped_blocks,
        host_blocks_total=host.num_blocks, host_blocks_free=host.num_free,
        host_only=HostOnly(len(host_only), sum(len(n.tokens) for n in host_only)))
    assert host_only and tree.written_back_blocks > 0 and tree.evictions > 0
    assert tree_stats(tree).host_only is None  # not counted unless asked
    assert tree_stats(None) == TreeStats()  # the prefix cache off


def test_engine_stats_are_built_from_the_snapshots(engine: LLMEngine) -> None:
    st = EngineStats.collect(engine)
    snap, tree = snapshot(engine.scheduler, count_blocks=True), tree_stats(engine.tree, count_host=True)
    assert snap.blocks is not None and tree.host_only is not None
    assert (st.blocks_free, st.blocks_used, st.blocks_cached) == (snap.blocks.free, snap.blocks.used, snap.blocks.cached)
    assert (st.num_running, st.num_waiting, st.preemptions) == (snap.num_running, snap.num_waiting, snap.preemptions)
    assert st.admission_blocked == dict(snap.admission_blocked)
    assert st.preemptions_by_cause == dict(snap.preemptions_by_cause)
    assert (st.tree_nodes, st.tree_tokens, st.evictions) == (tree.nodes, tree.tokens, tree.evictions)
    assert (st.host_nodes, st.host_tokens) == (tree.host_only.nodes, tree.host_only.tokens)
    assert (st.host_blocks_total, st.written_back_blocks) == (tree.host_blocks_total, tree.written_back_blocks)
    assert st.prompt_tokens == engine.stats_totals.prompt_tokens > 0
