"""Cache namespaces and pinned prefixes on the real engine (tiny random-weight Llama): a request only
hits what its own namespace cached, and draft tokens never come from another namespace's tree; a
pinned prefix survives eviction storms many times the pool, unpinning makes it evictable again, the
budget refuses what would pass it, and nothing leaks. The tree's picture is bounded, connected and
shows only the namespaces asked for. Integrity is checked after every step.
"""

from __future__ import annotations

import asyncio
import random

import pytest
from test_liveness import make_engine, pin_prefix, run_until_done
from tiny_models import TINY_VOCAB

from radixserve import SamplingParams
from radixserve.cache.tree_view import tree_view
from radixserve.config import EngineConfig
from radixserve.engine.async_engine import AsyncEngine
from radixserve.engine.engine import LLMEngine
from radixserve.engine.pins import PinError, pin_budget_blocks


def greedy(namespace: str = "", max_tokens: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, cache_namespace=namespace)


def run_one(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> int:
    """The request's cached prompt tokens."""
    rid = engine.add_request(prompt, params)
    return run_until_done(engine, 200)[rid].usage.cached_tokens


def words(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, TINY_VOCAB) for _ in range(n)]


def test_a_namespace_hits_only_what_it_cached() -> None:
    engine = make_engine(block_size=4, num_blocks=64)
    prompt = words(random.Random(1), 40)
    assert run_one(engine, prompt, greedy("tenant-a")) == 0
    assert run_one(engine, prompt, greedy("tenant-b")) == 0  # the same tokens, another namespace: a miss
    assert run_one(engine, prompt, greedy("")) == 0  # the shared namespace is one more
    assert run_one(engine, prompt, greedy("tenant-a")) == 39  # its own: everything but the last token
    assert run_one(engine, prompt, greedy("tenant-b")) == 39
    assert set(engine.tree.roots) == {"", "tenant-a", "tenant-b"}  # type: ignore[union-attr]
    engine.tree.clear()  # type: ignore[union-attr]
    assert set(engine.tree.roots) == {""}, "an emptied namespace's root is kept"  # type: ignore[union-attr]
    assert engine.leaked_blocks() == 0


def test_drafts_come_only_from_the_own_namespace() -> None:
    """A tree draft is the cached continuation: from another tenant's tree it would leak its text
    through the speed of decoding."""
    engine = make_engine(block_size=4, num_blocks=128, num_speculative_tokens=8)
    prompt = words(random.Random(2), 12)
    rid = engine.add_request(prompt, greedy("tenant-a", max_tokens=24))
    run_until_done(engine, 200)
    for namespace, expect_tree_drafts in (("tenant-b", False), ("tenant-a", True)):
        rid = engine.add_request(prompt, greedy(namespace, max_tokens=24))
        drafts = run_until_done(engine, 200)[rid].usage.speculation
        assert bool(drafts and drafts.by_source.get("tree", [0, 0])[0]) == expect_tree_drafts, drafts


def test_a_pinned_prefix_survives_a_burst_ten_times_the_pool_and_unpinning_frees_it() -> None:
    engine = make_engine(block_size=4, num_blocks=64, max_model_len=128)
    rng = random.Random(3)
    system = words(rng, 30)
    pin_prefix(engine, system, "tenant-a")
    (pin,) = engine.pins.entries()
    assert pin.tokens == 30 and pin.blocks == 8 and pin.namespace == "tenant-a"
    burst = 0
    while burst < 10 * 64 * 4:  # ten pools of other traffic, in both namespaces
        prompt = words(rng, 60)
        run_one(engine, prompt, greedy(rng.choice(["tenant-a", "tenant-b"])))
        burst += len(prompt)
    assert engine.tree.evictions > 0  # type: ignore[union-attr]
    assert run_one(engine, system + words(rng, 10), greedy("tenant-a")) == 30  # the whole pin hit
    assert run_one(engine, system + words(rng, 10), greedy("tenant-b")) == 0  # not another tenant's
    assert engine.pins.entries()[0].hits == 1
    stats = engine.stats()  # counted apart: the pinned part of the hits, and the requests that had one
    assert (stats.pins, stats.pinned_blocks, stats.pinned_cached_tokens, stats.pin_hit_requests) == (1, 8, 30, 1)
    engine.pins.unpin(pin.id)
    assert engine.pins.entries() == [] and engine.pins.used_blocks() == 0
    for _ in range(20):  # ... and another burst evicts it like any LRU entry
        run_one(engine, words(rng, 60), greedy("tenant-b"))
    assert engine.tree.match(system, split=False, namespace="tenant-a").length < 30  # type: ignore[union-attr]
    assert engine.leaked_blocks() == 0 and engine.stats().blocks_used == 0


def test_the_budget_refuses_a_pin_that_would_pass_it() -> None:
    engine = make_engine(block_size=4, num_blocks=64, max_model_len=128, pin_budget=0.25)
    assert engine.pins.budget_blocks == 16
    rng = random.Random(4)
    pin_prefix(engine, words(rng, 40), "")  # 10 blocks
    with pytest.raises(PinError, match="only 6 of the pin budget's 16 are left"):
        engine.pins.check_size(40)
    too_many = words(rng, 24)  # exactly the 6 blocks left
    pin_prefix(engine, too_many, "")
    assert engine.pins.used_blocks() == 16
    with pytest.raises(PinError, match="pin budget"):
        engine.pins.check_size(1)
    engine.check_integrity()


def test_pin_budget_leaves_room_for_the_longest_sequence() -> None:
    assert pin_budget_blocks(0.25, 64, 128, 4) == 16
    assert pin_budget_blocks(0.9, 64, 128, 4) == 64 - 32 - 1  # the longest sequence plus a copied block
    assert pin_budget_blocks(0.5, 8, 32, 4) == 0  # a pool of one longest sequence: no pins
    engine = make_engine(block_size=4, num_blocks=8)  # the context fills the pool
    with pytest.raises(PinError, match="pinning is off"):
        engine.pins.check_size(4)


def test_async_pin_unpin_and_the_tree_view() -> None:
    async def scenario() -> None:
        from tiny_models import tiny_model_dir

        engine = AsyncEngine(EngineConfig(model=str(tiny_model_dir("llama")), block_size=4, num_blocks=64,
                                          max_model_len=128))
        try:
            rng = random.Random(5)
            system = words(rng, 20)
            info = await engine.pin(system, "tenant-a", "support bot")
            assert (info.tokens, info.label, info.namespace) == (20, "support bot", "tenant-a")
            assert [p.id for p in engine.pins()] == [info.id] and engine.pin_budget().used_blocks == 5
            async for out in engine.generate(system + words(rng, 5), greedy("tenant-a")):
                last = out
            assert last.usage.cached_tokens == 20
            async for _out in engine.generate(words(rng, 9), greedy("tenant-b")):
                pass
            view = await engine.cache_tree(limit=50)
            assert set(view.namespaces) == {"tenant-a", "tenant-b"}
            pinned = [n for n in view.nodes if n.pinned]
            assert pinned and all(n.namespace == "tenant-a" for n in pinned) and pinned[0].hits >= 1
            only_b = await engine.cache_tree(limit=50, include=lambda ns: ns == "tenant-b")
            assert {n.namespace for n in only_b.nodes} == {"tenant-b"} and set(only_b.namespaces) == {"tenant-b"}
            assert (await engine.unpin(info.id)) is not None and await engine.unpin(info.id) is None
            with pytest.raises(PinError, match="pin budget"):
                await engine.pin(words(rng, 120), "tenant-a")
            engine.check_integrity()
        finally:
            await engine.shutdown()

    asyncio.run(scenario())


def test_tree_view_is_bounded_connected_and_largest_first() -> None:
    engine = make_engine(block_size=4, num_blocks=256)
    rng = random.Random(6)
    trunk = words(rng, 24)
    for i in range(12):  # a trunk with 12 branches of growing length, and unrelated prompts
        run_one(engine, trunk + words(rng, 4 + 2 * i), greedy())
        run_one(engine, words(rng, 8), greedy())
    full = tree_view(engine.tree, 1000)
    assert len(full.nodes) == engine.tree.num_nodes == full.total_nodes  # type: ignore[union-attr]
    assert full.total_tokens == engine.tree.num_tokens  # type: ignore[union-attr]
    view = tree_view(engine.tree, 5)
    ids = {n.id for n in view.nodes}
    assert len(view.nodes) == 5 and all(n.parent is None or n.parent in ids for n in view.nodes)
    assert view.nodes[0].subtree_tokens == max(n.subtree_tokens for n in full.nodes)  # the trunk comes first
    for n in view.nodes:
        shown = sum(c.subtree_tokens for c in view.nodes if c.parent == n.id)
        assert n.hidden_tokens == n.subtree_tokens - n.tokens - shown >= 0
    assert tree_view(engine.tree, 5, include=lambda ns: ns == "nobody").nodes == []


@pytest.mark.parametrize("namespaces, wait", [(("a", "a"), True), (("a", "b"), False)])
def test_a_prompt_waits_only_for_a_prefill_of_its_own_namespace(namespaces: tuple[str, str], wait: bool) -> None:
    """A prompt waits for a running prefill that will cache its prefix, but only one of its own
    namespace: another's would never give it a hit, and waiting would time that prefill."""
    engine = make_engine(block_size=4, num_blocks=64, max_num_batched_tokens=128)  # room for both at once
    prompt = words(random.Random(7), 60)
    first, second = (engine.add_request(prompt, greedy(ns, max_tokens=4)) for ns in namespaces)
    engine.step()
    computed = {s.request.request_id: s.num_computed for s in engine.live_sequences()}
    assert computed[first] > 0 and (computed[second] == 0) == wait, computed
    finals = run_until_done(engine, 100)
    assert (finals[second].usage.cached_tokens > 0) == wait


def test_the_pin_figures_reach_the_stats_body_and_metrics() -> None:
    from radixserve.engine.stats import EngineStats
    from radixserve.server.cache_stats import cache_stats_json
    from radixserve.server.metrics import _EngineCollector

    engine = make_engine(block_size=4, num_blocks=64, max_model_len=128)
    system = words(random.Random(8), 20)
    pin_prefix(engine, system, "")
    run_one(engine, system + [5, 6], greedy())
    st: EngineStats = engine.stats()
    pins = cache_stats_json(st, 4, 0, [])["pins"]
    assert pins == {"count": 1, "blocks": 5, "budget_blocks": 16, "cached_tokens": 20, "hit_requests": 1}
    scraped = {m.name: m.samples[0].value for m in _EngineCollector(lambda: st).collect() if m.samples}
    assert scraped["radixserve_pins"] == 1 and scraped["radixserve_pinned_blocks"] == 5
    assert scraped["radixserve_prompt_tokens_cached_pinned"] == 20 and scraped["radixserve_pin_hit_requests"] == 1


def test_a_context_nobody_asked_for_leaves_the_pin_budget_free() -> None:
    from radixserve.engine.sizing import engine_sizes

    class Runner:  # what engine_sizes reads of a model runner on CPU
        class spec:  # noqa: N801
            max_position_embeddings = 4096
        device = type("Device", (), {"type": "cpu"})()

        @staticmethod
        def kv_layout() -> object:
            return type("Layout", (), {"bytes_per_block": 1 << 20, "blocks_for_budget": staticmethod(lambda mb: 100)})()

        @staticmethod
        def state_layout() -> None:  # no recurrent layers
            return None

        @staticmethod
        def window_layout() -> None:  # no sliding-window layers
            return None

    def sizes(**kw: object) -> tuple[int, int]:
        s = engine_sizes(EngineConfig(model="unused", block_size=16, **kw), Runner())  # type: ignore[arg-type]
        return s.num_blocks, s.max_seq_len

    assert sizes() == (100, (100 - 25 - 1) * 16)  # the default budget, and a block to copy, stay free
    assert sizes(pin_budget=0.0) == (100, 1600)  # no pins: the whole pool, as before
    assert sizes(max_model_len=4096) == (100, 1600)  # a context asked for is the operator's call
    assert sizes(num_blocks=50) == (50, 800)
