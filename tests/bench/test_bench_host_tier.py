"""Tests of the returning-chats benchmark workload (the host-memory KV tier): its shape, the rounds
load that makes histories idle, pool and host-tier sizing, the systems planned for it, its metrics
and computed ratios, and one end-to-end run on the tiny random model with the tier on and off."""

from __future__ import annotations

import asyncio
import json

import pytest
from test_bench import FakeSystem  # noqa: E402

from radixserve_bench.belady import simulate_pool
from radixserve_bench.driver import RequestRecord, RunTrace, drive
from radixserve_bench.metrics import RETURNING_METRICS, check_complete, expected_metrics
from radixserve_bench.plan import BenchOptions, make_load, placeholder_trace, plan_systems, size_pools
from radixserve_bench.report import render
from radixserve_bench.results import evaluate_targets
from radixserve_bench.returning import host_cache_mb, host_tier_ratios, kv_block_bytes, returning_metrics
from radixserve_bench.systems import BOUNDED, BOUNDED_HOST, REFERENCE, default_systems
from radixserve_bench.textsource import byte_encoder
from radixserve_bench.workloads import (
    DEFAULT_PARAMS,
    Load,
    ReturningChatsParams,
    Workload,
    build_workload,
    default_load,
    send_order,
)

ENCODE = byte_encoder(512)
RC = "returning-chats"


def _workload(p: ReturningChatsParams, load: Load | None = None) -> Workload:
    return build_workload(RC, p, load or default_load(RC, p), ENCODE, seed=0)


# -- shape -----------------------------------------------------------------------------------------
def test_returning_chats_shape():
    p = ReturningChatsParams(conversations=5, turns=4, system_len=20, history_len=50, user_len=6, output_len=3)
    w = _workload(p)
    assert w == _workload(p) and w.num_requests == 20 and len(w.sessions) == 5
    assert w.load == Load("rounds", concurrency=1) and "round-robin" in w.describe()
    firsts = [s.turns[0].new_tokens for s in w.sessions]
    assert all(len(f) == 20 + 50 + 6 for f in firsts)
    assert len({f[:20] for f in firsts}) == 1  # one system prompt, shared
    assert len({f[20:70] for f in firsts}) == 5  # each conversation its own history
    assert all(len(t.new_tokens) == 6 and t.output_len == 3 for s in w.sessions for t in s.turns[1:])


def test_rounds_send_order_leaves_each_conversation_idle_while_the_others_talk():
    p = ReturningChatsParams(conversations=4, turns=3, system_len=8, history_len=16, user_len=4, output_len=2)
    w = _workload(p)
    order = [(s.session_id, k) for s, k in send_order(w)]
    assert order == [(f"rc-c{c}", k) for k in range(3) for c in range(4)]
    for i, (sid, k) in enumerate(order):
        if k:
            between = order[order.index((sid, k - 1)) + 1:i]
            assert sorted(other for other, _ in between) == sorted(f"rc-c{c}" for c in range(4) if f"rc-c{c}" != sid)
    closed = build_workload(RC, p, Load("closed", 1), ENCODE, seed=0)
    assert [(s.session_id, k) for s, k in send_order(closed)][:3] == [("rc-c0", 0), ("rc-c0", 1), ("rc-c0", 2)]
    with pytest.raises(ValueError, match="concurrency"):
        Load("rounds", 0)


def test_default_working_set_is_four_pools_and_histories_leave_the_pool():
    w = _workload(DEFAULT_PARAMS[RC])  # type: ignore[arg-type]
    s = size_pools(w, BenchOptions(workloads=(RC,)))
    assert 3.8 <= s.working_set_blocks / s.bounded_blocks <= 4.2
    assert s.bounded_blocks >= s.max_request_blocks + 2  # any one request fits the bounded pool
    assert s.host_blocks == s.ample_blocks >= s.working_set_blocks  # the whole history fits the host tier
    trace = placeholder_trace(w)
    assert [r.prompt_len for r in trace[:8]] == [128 + 896 + 32] * 8  # in send order: every first turn first
    unbounded = simulate_pool(trace, 16, 10**6, "lru").hit_rate
    bounded = simulate_pool(trace, 16, s.bounded_blocks, "lru").hit_rate
    # with LRU in a quarter pool only the shared system prompt survives a round: returns recompute
    system_share = 128 * w.num_requests / sum(r.prompt_len for r in trace)
    assert unbounded > 0.6 and bounded <= system_share + 0.01


def test_load_overrides_keep_rounds():
    p = DEFAULT_PARAMS[RC]
    assert make_load(RC, p, BenchOptions(concurrency=2)) == Load("rounds", concurrency=2)
    assert make_load(RC, p, BenchOptions(load="closed")) == Load("closed", concurrency=1)
    assert make_load("multi-turn", DEFAULT_PARAMS["multi-turn"], BenchOptions(load="rounds")).mode == "rounds"


# -- driver ----------------------------------------------------------------------------------------
def test_rounds_driver_sends_round_robin_and_keeps_histories():
    p = ReturningChatsParams(conversations=4, turns=3, system_len=8, history_len=16, user_len=4, output_len=2)
    w = _workload(p)
    system = FakeSystem()
    trace = asyncio.run(drive(system, w, repeat=0, seed=0, timeout_s=30))
    assert [(r.session_id, r.turn) for r in trace.records] == [(s.session_id, k) for s, k in send_order(w)]
    assert system.max_in_flight == 1
    for s in w.sessions:
        recs = [r for r in trace.records if r.session_id == s.session_id]
        for prev, cur in zip(recs, recs[1:]):
            assert system.prompts[cur.request_id] == prev.sequence + list(s.turns[cur.turn].new_tokens)


def test_rounds_driver_with_several_clients_waits_for_the_previous_turn():
    p = ReturningChatsParams(conversations=3, turns=4, system_len=8, history_len=8, user_len=4, output_len=3)
    w = _workload(p, Load("rounds", concurrency=5))  # more clients than conversations
    system = FakeSystem()
    trace = asyncio.run(drive(system, w, repeat=0, seed=0, timeout_s=30))
    assert len(trace.records) == 12 and system.max_in_flight == 3
    for s in w.sessions:
        recs = sorted((r for r in trace.records if r.session_id == s.session_id), key=lambda r: r.turn)
        for prev, cur in zip(recs, recs[1:]):
            assert cur.send_time >= prev.finish_time
            assert system.prompts[cur.request_id] == prev.sequence + list(s.turns[cur.turn].new_tokens)


# -- systems, sizing, metrics, ratios ---------------------------------------------------------------
def test_systems_planned_for_returning_chats():
    w = _workload(ReturningChatsParams(conversations=2, turns=2, system_len=8, history_len=8, user_len=4,
                                       output_len=2))
    assert BOUNDED_HOST in default_systems(cuda=False)
    run, skipped = plan_systems(w, BenchOptions(), cuda=False, device="cpu")
    assert run == [REFERENCE, BOUNDED, BOUNDED_HOST] and skipped == []
    run, skipped = plan_systems(w, BenchOptions(systems=("radixserve", "hf-generate")), cuda=False, device="cpu")
    assert run == [REFERENCE] and "hf-generate" in skipped[0]
    other = build_workload("random", DEFAULT_PARAMS["random"], Load("closed", 4), ENCODE, 0)
    run, skipped = plan_systems(other, BenchOptions(systems=(REFERENCE, BOUNDED_HOST)), cuda=False, device="cpu")
    assert run == [REFERENCE] and "host tier runs on the returning-chats workload" in skipped[0]


def test_host_cache_mb_holds_exactly_the_blocks():
    spec = type("Spec", (), {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64})()
    per_block = kv_block_bytes(spec, 16, "cpu", "auto")
    assert per_block == 2 * 30 * 16 * 3 * 64 * 4  # fp32 on CPU, K and V
    assert kv_block_bytes(spec, 16, "cpu", "bfloat16") == per_block // 2
    for blocks in (1, 62, 625, 10_007):
        assert int(host_cache_mb(blocks, per_block) * 2**20) // per_block == blocks


def _rec(session: int, turn: int, prompt: int, cached: int, host: int, ttft: float) -> RequestRecord:
    send = 10.0 * (3 * turn + session)
    return RequestRecord(f"s{session}-t{turn}", f"s{session}", session, turn, prompt, 2, send, send + ttft + 1,
                         [send + ttft, send + ttft + 1], cached, send, [0] * (prompt + 2), host)


def test_returning_metrics_on_a_hand_built_trace():
    recs = [_rec(0, 0, 100, 10, 0, 2.0), _rec(1, 0, 100, 10, 0, 4.0),
            _rec(0, 1, 120, 100, 90, 0.5), _rec(1, 1, 120, 110, 80, 0.25), _rec(0, 2, 140, 130, 130, 0.75)]
    m = returning_metrics(RunTrace("x", RC, 0, 0.0, 100.0, recs, []))
    assert set(m) == set(RETURNING_METRICS) and set(RETURNING_METRICS) <= set(expected_metrics(True, True, True))
    assert m["first_turn_ttft_ms_mean"] == pytest.approx(3000.0)
    assert m["returning_ttft_ms_mean"] == pytest.approx(500.0) and m["returning_ttft_ms_p50"] == pytest.approx(500.0)
    assert m["returning_hit_rate"] == pytest.approx(340 / 380)
    assert m["host_cached_tokens"] == 300 and m["host_hit_share"] == pytest.approx(300 / 360)
    with pytest.raises(ValueError, match="returning turns"):
        returning_metrics(RunTrace("x", RC, 0, 0.0, 1.0, recs[:2], []))


def _results(medians: dict[str, dict[str, float]]) -> dict:
    per_system = {name: {"median": m, "expected_metrics": list(m), "repeats": []} for name, m in medians.items()}
    return {"workloads": {RC: {"description": RC}}, "planned_systems": {RC: list(medians)}, "results": {RC: per_system},
            "systems": {BOUNDED_HOST: {"settings": {"host_cache_mb": 439.5}}}}


def test_ratios_and_targets_are_computed_from_the_medians():
    base = {"hit_rate_vs_optimal": 1.0, "requests_per_s": 1.0, "output_tokens_per_s": 1.0, "total_tokens_per_s": 1.0,
            **{f"{k}_p{q}": 1.0 for k in ("ttft_ms", "itl_ms", "e2e_ms") for q in (50, 90, 99)},
            "first_turn_ttft_ms_mean": 3500.0, "returning_ttft_ms_p50": 1.0, "returning_hit_rate": 0.9,
            "host_cached_tokens": 0.0, "host_hit_share": 0.0, "pool_blocks": 134.0}
    results = _results({REFERENCE: base | {"hit_rate": 0.70, "returning_ttft_ms_mean": 150.0, "pool_blocks": 625.0},
                        BOUNDED: base | {"hit_rate": 0.10, "returning_ttft_ms_mean": 3800.0},
                        BOUNDED_HOST: base | {"hit_rate": 0.68, "returning_ttft_ms_mean": 190.0,
                                              "host_hit_share": 0.8}})
    results["host_tier"] = host_tier_ratios(results)
    r = results["host_tier"][RC]
    assert r["hit_rate_host_vs_ample"] == pytest.approx(0.68 / 0.70)
    assert r["returning_ttft_host_vs_recompute"] == pytest.approx(190 / 3800)
    by_name = {t["name"]: t for t in evaluate_targets(results)}
    hit = by_name["returning-chats hit rate, host tier / ample pool"]
    ttft = by_name["returning-chats returning-turn mean TTFT, host tier / recompute"]
    assert hit["met"] and hit["value"] == pytest.approx(0.68 / 0.70) and hit["threshold"] == 0.95
    assert ttft["met"] and ttft["value"] == pytest.approx(0.05) and ttft["threshold"] == 0.25
    results["targets"] = evaluate_targets(results)
    text = render(results)
    assert f"68.0% / 70.0% = {0.68 / 0.70:.3f} (goal >= 0.95)" in text
    assert "190 ms / 3,800 ms = 0.050 (goal <= 0.25)" in text
    assert f"| {BOUNDED_HOST} | 134 | 439.5 | 68.0% | 80.0% |" in text
    del results["results"][RC][BOUNDED]
    assert "returning_ttft_host_vs_recompute" not in host_tier_ratios(results)[RC]
    results["host_tier"] = host_tier_ratios(results)
    assert "not measured (both systems must run)" in render(results)


# -- end to end ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llama() -> str:
    from tiny_models import tiny_model_dir

    return str(tiny_model_dir("llama"))


def test_returning_chats_end_to_end(tiny_llama, tmp_path, capsys):
    from radixserve.cli import main

    params = dict(conversations=6, turns=3, system_len=32, history_len=160, user_len=16, output_len=4)
    rc = main(["bench", "--model", tiny_llama, "--workload", RC, "--repeats", "1", "--out", str(tmp_path),
               "--no-micro", "--no-progress", *(x for k, v in params.items() for x in ("--param", f"{RC}.{k}={v}"))])
    assert rc == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["complete"] and check_complete(results) == []
    per_system = results["results"][RC]
    assert list(per_system) == [REFERENCE, BOUNDED, BOUNDED_HOST]
    sizing = results["workloads"][RC]["sizing"]
    med = {name: entry["median"] for name, entry in per_system.items()}
    assert med[BOUNDED]["pool_blocks"] == med[BOUNDED_HOST]["pool_blocks"] == sizing["bounded_blocks"]
    assert 0.2 <= med[BOUNDED]["pool_fraction"] <= 0.3
    for name, entry in per_system.items():
        engine = entry["repeats"][0]["engine"]
        assert engine["leaked_blocks"] == 0
        assert name != BOUNDED_HOST or engine["host_blocks_total"] == sizing["host_blocks"]
    # without the tier a returning conversation's history is gone; with it, it comes back from host memory
    assert med[REFERENCE]["returning_hit_rate"] > 0.85 and med[BOUNDED]["returning_hit_rate"] < 0.3
    assert med[REFERENCE]["host_cached_tokens"] == med[BOUNDED]["host_cached_tokens"] == 0
    assert med[BOUNDED_HOST]["host_cached_tokens"] > 0 and med[BOUNDED_HOST]["host_hit_share"] > 0.5
    ratios = results["host_tier"][RC]
    assert ratios["hit_rate_host_vs_ample"] == pytest.approx(med[BOUNDED_HOST]["hit_rate"] / med[REFERENCE]["hit_rate"])
    assert ratios["hit_rate_host_vs_ample"] >= 0.95
    assert ratios["returning_ttft_host_vs_recompute"] == pytest.approx(
        med[BOUNDED_HOST]["returning_ttft_ms_mean"] / med[BOUNDED]["returning_ttft_ms_mean"])
    printed = capsys.readouterr().out
    assert "Ratios, computed from the medians above" in printed and "returning-turn mean TTFT" in printed
    assert (tmp_path / "host_tier.png").stat().st_size > 0
