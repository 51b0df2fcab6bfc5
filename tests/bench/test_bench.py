"""Tests of `radixserve bench`: workloads, driver, cache simulations, metrics, targets, CLI wiring,
and one end-to-end smoke run on the tiny random model (the harness works and its JSON is complete;
ratios are not checked)."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import statistics
import sys
import time
import types

import pytest

from radixserve_bench import cli as bench_cli
from radixserve_bench.belady import TraceRequest, optimal_hits, simulate_pool, working_set_blocks
from radixserve_bench.driver import RequestRecord, RunTimeout, RunTrace, drive
from radixserve_bench.metrics import CORE_METRICS, check_complete, percentile, pool_metrics, run_metrics
from radixserve_bench.micro import radix_throughput, scheduler_step_cost
from radixserve_bench.plan import BenchOptions, placeholder_trace, size_pools
from radixserve_bench.results import evaluate_targets
from radixserve_bench.systems.base import GREEDY, Completion, Sampling, System, SystemInfo
from radixserve_bench.textsource import TokenStream, byte_encoder
from radixserve_bench.workloads import (
    Load,
    MultiTurnParams,
    RandomParams,
    SharedPrefixParams,
    build_workload,
    with_overrides,
)

ENCODE = byte_encoder(512)


# -- workloads -----------------------------------------------------------------------------------
def test_token_stream_is_real_text_and_deterministic():
    a, b, c = TokenStream(ENCODE, 1), TokenStream(ENCODE, 1), TokenStream(ENCODE, 2)
    first = a.take(300)
    assert first == b.take(300)
    assert first != c.take(300)
    assert a.take(50) != first[:50]  # the stream moves on
    text = bytes(first).decode("utf-8", errors="replace")  # byte encoding of real English text
    assert sum(ch.isalpha() for ch in text) > 150
    with pytest.raises(ValueError):
        a.take(-1)


def test_shared_prefix_shape():
    p = SharedPrefixParams(groups=3, prompts_per_group=4, system_len=40, question_len=7, output_len=5)
    w = build_workload("shared-prefix", p, Load("closed", 12), ENCODE, seed=3)
    assert w == build_workload("shared-prefix", p, Load("closed", 12), ENCODE, seed=3)
    assert len(w.sessions) == 12 and w.num_requests == 12
    by_group: dict[int, list[tuple[int, ...]]] = {}
    for s in w.sessions:
        (turn,) = s.turns
        assert len(turn.new_tokens) == 47 and turn.output_len == 5
        by_group.setdefault(s.group, []).append(turn.new_tokens)
    systems = {g: {p[:40] for p in prompts} for g, prompts in by_group.items()}
    assert all(len(v) == 1 for v in systems.values())  # one system prompt per group
    assert len({next(iter(v)) for v in systems.values()}) == 3  # and distinct across groups
    assert [s.group for s in w.sessions] != sorted(s.group for s in w.sessions)  # groups interleave


def test_multi_turn_shape():
    p = MultiTurnParams(conversations=3, turns=4, common_prefix_len=30, conversation_prefix_len=5, user_len=6,
                        output_len=3)
    w = build_workload("multi-turn", p, Load("closed", 3), ENCODE, seed=0)
    assert w.num_requests == 12
    firsts = [s.turns[0].new_tokens for s in w.sessions]
    assert len({f[:30] for f in firsts}) == 1 and len({f[30:35] for f in firsts}) == 3
    assert all(len(f) == 41 for f in firsts)
    assert all(len(t.new_tokens) == 6 and t.output_len == 3 for s in w.sessions for t in s.turns[1:])


def test_random_shape_and_overrides():
    p = with_overrides(RandomParams(), {"requests": "5", "prompt_len": "20"})
    w = build_workload("random", p, Load("closed", 2), ENCODE, seed=0)
    lens = [len(s.turns[0].new_tokens) for s in w.sessions]
    assert len(lens) == 5 and all(10 <= n <= 30 for n in lens)
    with pytest.raises(ValueError, match="unknown parameter"):
        with_overrides(RandomParams(), {"nope": "1"})
    with pytest.raises(ValueError, match="integer"):
        with_overrides(RandomParams(), {"requests": "x"})
    with pytest.raises(ValueError, match=">= 1"):
        with_overrides(RandomParams(), {"requests": "0"})


def test_load_validation_and_poisson_arrivals():
    with pytest.raises(ValueError):
        Load("closed", 0)
    with pytest.raises(ValueError):
        Load("open", rate=0)
    with pytest.raises(ValueError):
        Load("sideways", 1)
    load = Load("open", rate=4.0)
    offsets = load.arrival_offsets(2000, seed=1)
    assert offsets == load.arrival_offsets(2000, seed=1) and offsets[0] == 0.0
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert all(g >= 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.1)


def test_pool_sizing():
    p = SharedPrefixParams(groups=2, prompts_per_group=3, system_len=64, question_len=16, output_len=16)
    w = build_workload("shared-prefix", p, Load("closed", 6), ENCODE, seed=0)
    trace = placeholder_trace(w)
    assert [r.prompt_len for r in trace] == [80] * 6 and all(len(r.sequence) == 96 for r in trace)
    s = size_pools(w, BenchOptions(block_size=16))
    # 2 system prompts of 4 blocks, then per request 1 question block + 1 reply block (the last, partial)
    assert s.working_set_blocks == 2 * 4 + 6 * 2
    assert s.max_request_blocks == 6
    assert s.ample_blocks >= s.working_set_blocks + 6 * s.max_request_blocks
    assert s.bounded_blocks == max(math.ceil(0.25 * s.working_set_blocks), s.max_request_blocks + 2)


# -- cache simulations ------------------------------------------------------------------------------
def _random_trace(rng: random.Random, n: int) -> list[TraceRequest]:
    base = [rng.randrange(4) for _ in range(48)]
    trace: list[TraceRequest] = []
    for _ in range(n):
        if trace and rng.random() < 0.3:
            prompt = list(trace[rng.randrange(len(trace))].sequence) + [rng.randrange(4) for _ in range(3)]
        else:
            prompt = base[:rng.randrange(48)] + [rng.randrange(4) for _ in range(rng.randint(1, 20))]
        trace.append(TraceRequest(len(prompt), tuple(prompt + [rng.randrange(4) for _ in range(rng.randint(1, 5))])))
    return trace


def _brute_optimal(trace: list[TraceRequest]) -> list[int]:
    out = []
    for i, r in enumerate(trace):
        prompt = r.sequence[:r.prompt_len]
        best = 0
        for earlier in trace[:i]:
            cached = earlier.sequence[:-1]
            n = 0
            while n < min(len(cached), len(prompt)) and cached[n] == prompt[n]:
                n += 1
            best = max(best, n)
        out.append(max(0, min(best, r.prompt_len - 1)))
    return out


def test_optimal_hits_matches_brute_force():
    rng = random.Random(7)
    for _ in range(150):
        trace = _random_trace(rng, rng.randint(1, 14))
        assert optimal_hits(trace, block_size=4) == _brute_optimal(trace)


def test_pool_simulation_orders_policies_and_capacities():
    rng = random.Random(11)
    for _ in range(100):
        trace = _random_trace(rng, rng.randint(2, 14))
        ws = working_set_blocks(trace, 4)
        unbounded = simulate_pool(trace, 4, 10**6, "belady")
        assert unbounded.hit_tokens == simulate_pool(trace, 4, 10**6, "lru").hit_tokens
        # with room for everything, Belady hits every shareable full block
        expected = sum(min(h // 4 * 4, r.prompt_len - 1) for h, r in zip(optimal_hits(trace, 4), trace))
        assert unbounded.hit_tokens >= expected
        cap = max(8, ws // 3)
        belady, lru = simulate_pool(trace, 4, cap, "belady"), simulate_pool(trace, 4, cap, "lru")
        assert lru.hit_tokens <= belady.hit_tokens <= unbounded.hit_tokens


def test_belady_keeps_the_prefix_used_next():
    a, b, c = (tuple(range(k, k + 8)) for k in (100, 200, 300))  # prefixes of two 4-token blocks

    def req(prefix: tuple[int, ...], tail: int) -> TraceRequest:
        return TraceRequest(12, prefix + (tail,) * 4 + (9,))

    trace = [req(a, 1), req(b, 2), req(c, 3), req(a, 4)]
    # room for 7 blocks: when c arrives, Belady drops b's blocks (never reused) and keeps a's, while
    # LRU drops a's leaf, then a's second block, so the last request only hits a's first block
    belady, lru = simulate_pool(trace, 4, 7, "belady"), simulate_pool(trace, 4, 7, "lru")
    assert belady.hit_tokens == 8 and lru.hit_tokens == 4
    assert belady.prompt_tokens == 48 and belady.hit_rate == 8 / 48
    with pytest.raises(ValueError):
        simulate_pool(trace, 4, 0)
    with pytest.raises(ValueError):
        simulate_pool(trace, 4, 5, "fifo")


# -- driver with a fake system ----------------------------------------------------------------------
class FakeSystem(System):
    """Echo-ish system: each output token is the prompt length plus its index; tracks concurrency."""

    name = "fake"

    def __init__(self, delay: float = 0.002, wrong_len: bool = False) -> None:
        self.delay, self.wrong_len = delay, wrong_len
        self.in_flight = self.max_in_flight = 0
        self.prompts: dict[str, list[int]] = {}

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def info(self) -> SystemInfo:
        return SystemInfo(self.name, "fake")

    async def generate(self, prompt: list[int], output_len: int, request_id: str,
                       sampling: Sampling = GREEDY) -> Completion:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.prompts[request_id] = list(prompt)
        tokens, times = [], []
        for i in range(output_len + int(self.wrong_len)):
            await asyncio.sleep(self.delay)
            tokens.append(len(prompt) + i)
            times.append(time.monotonic())
        self.in_flight -= 1
        return Completion(tokens, times, cached_tokens=len(prompt) // 2)


def test_closed_loop_multi_turn_history_and_concurrency():
    p = MultiTurnParams(conversations=5, turns=3, common_prefix_len=8, conversation_prefix_len=2, user_len=3,
                        output_len=2)
    w = build_workload("multi-turn", p, Load("closed", 2), ENCODE, seed=0)
    system = FakeSystem()
    trace = asyncio.run(drive(system, w, repeat=0, seed=0, timeout_s=30))
    assert len(trace.records) == 15 and system.max_in_flight == 2
    for s in w.sessions:
        recs = sorted((r for r in trace.records if r.session_id == s.session_id), key=lambda r: r.turn)
        for prev, cur in itertools.pairwise(recs):
            assert cur.send_time >= prev.finish_time
            assert system.prompts[cur.request_id] == prev.sequence + list(s.turns[cur.turn].new_tokens)
        assert recs[-1].prompt_len == 13 + 2 * 5


def test_open_loop_follows_arrivals():
    w = build_workload("random", RandomParams(requests=6, prompt_len=10, output_len=2), Load("open", rate=50.0),
                       ENCODE, seed=0)
    trace = asyncio.run(drive(FakeSystem(), w, repeat=0, seed=5, timeout_s=30))
    offsets = sorted(w.load.arrival_offsets(6, 5))
    sends = sorted(r.send_time - trace.start for r in trace.records)
    assert all(s >= o - 1e-3 for s, o in zip(sends, offsets))
    assert all(s - o < 0.5 for s, o in zip(sends, offsets))


def test_driver_refuses_wrong_lengths_and_times_out():
    w = build_workload("random", RandomParams(requests=2, prompt_len=10, output_len=3), Load("closed", 2), ENCODE, 0)
    with pytest.raises(RuntimeError, match="wanted exactly 3"):
        asyncio.run(drive(FakeSystem(wrong_len=True), w, 0, 0, timeout_s=30))
    with pytest.raises(RunTimeout):
        asyncio.run(drive(FakeSystem(delay=1.0), w, 0, 0, timeout_s=0.2))


# -- metrics and targets ----------------------------------------------------------------------------
def _record(i: int, prompt: list[int], out: list[int], send: float, times: list[float], cached: int,
            scheduled: float | None = None) -> RequestRecord:
    return RequestRecord(f"r{i}", f"s{i}", 0, 0, len(prompt), len(out), send, times[-1], times, cached, scheduled,
                         prompt + out)


def test_run_metrics_on_a_hand_built_trace():
    shared = list(range(1, 21))
    r0 = _record(0, shared + [50], [60, 61], send=0.0, times=[1.0, 1.5], cached=0)
    r1 = _record(1, shared + [70], [80, 81], send=0.5, times=[1.0, 2.0], cached=16)
    trace = RunTrace("x", "w", 0, start=0.0, end=2.0, records=[r0, r1], pool_samples=[])
    m = run_metrics(trace, block_size=16)
    assert set(CORE_METRICS) <= set(m)
    assert m["requests_per_s"] == 1.0 and m["output_tokens_per_s"] == 2.0 and m["total_tokens_per_s"] == 23.0
    assert m["hit_rate"] == 16 / 42 and m["optimal_hit_rate"] == 20 / 42 and m["hit_rate_vs_optimal"] == 0.8
    assert m["ttft_ms_mean"] == pytest.approx(750.0) and m["ttft_ms_p50"] == pytest.approx(750.0)
    assert m["itl_ms_p50"] == pytest.approx(750.0) and m["e2e_ms_p99"] == pytest.approx(1500.0)
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 99) == 5


def test_pool_metrics_static_reservation():
    from radixserve_bench.systems.base import PoolSample

    recs = [_record(0, [1] * 30, [2] * 2, 0.0, [1.0, 1.4], 0, scheduled=0.0),  # 32 tokens -> 2 blocks
            _record(1, [1] * 40, [2] * 2, 0.0, [3.0, 4.0], 0, scheduled=1.5),  # 42 -> 3 blocks, after r0 ends
            _record(2, [1] * 10, [2] * 7, 0.0, [1.0, 3.5], 0, scheduled=0.5)]  # 17 -> 2 blocks, overlaps both
    samples = [PoolSample(0.1, 3, 0, 50), PoolSample(1.6, 4, 1, 50)]
    trace = RunTrace("x", "w", 0, 0.0, 4.0, recs, samples)
    m = pool_metrics(trace, 16, 50)
    assert m["static_reservation_blocks"] == 5 and m["peak_blocks_used"] == 4 and m["peak_vs_static"] == 0.8


def _fake_results(values: dict[tuple[str, str], dict[str, float]]) -> dict:
    results: dict = {"workloads": {}, "planned_systems": {}, "results": {}}
    for (w, s), m in values.items():
        results["workloads"][w] = {}
        results["planned_systems"].setdefault(w, []).append(s)
        results["results"].setdefault(w, {})[s] = {"median": m, "expected_metrics": list(m), "repeats": []}
    return results


def test_check_complete_flags_missing_and_non_finite():
    good = _fake_results({("random", "a"): {"x": 1.0}})
    assert check_complete(good) == []
    bad = _fake_results({("random", "a"): {"x": float("nan")}})
    bad["results"]["random"]["a"]["expected_metrics"].append("y")
    bad["planned_systems"]["random"].append("b")
    problems = check_complete(bad)
    assert any("x is nan" in p for p in problems) and any("y is None" in p for p in problems)
    assert any("b: not run" in p for p in problems)


def test_targets_report_met_missed_and_margin():
    results = _fake_results({
        ("shared-prefix", "radixserve"): {"output_tokens_per_s": 30.0, "hit_rate_vs_optimal": 0.995},
        ("shared-prefix", "hf-generate-batch"): {"output_tokens_per_s": 10.0},
        ("shared-prefix", "hf-generate"): {"output_tokens_per_s": 10.0},
        ("multi-turn", "radixserve"): {"ttft_ms_mean": 100.0, "ttft_ms_turn1": 100.0, "ttft_ms_turn10": 200.0,
                                       "hit_rate_vs_optimal": 1.0},
        ("multi-turn", "hf-generate-batch"): {"ttft_ms_mean": 400.0},
    })
    results["micro"] = {"scheduler": {"256": {"cpu_ms_per_step": 0.5}}}
    by_name = {t["name"]: t for t in evaluate_targets(results)}
    sp = by_name["shared-prefix output tok/s, radixserve / hf-generate-batch"]
    assert sp["value"] == 3.0 and sp["met"] and sp["margin"] == pytest.approx(0.5)
    static = by_name["shared-prefix output tok/s, radixserve / hf-generate"]
    assert static["met"] is False and static["margin"] == pytest.approx(-0.4)
    ttft = by_name["multi-turn mean TTFT, radixserve / hf-generate-batch"]
    assert ttft["value"] == 0.25 and ttft["met"] and ttft["margin"] == pytest.approx(1.0)
    late = by_name["multi-turn TTFT turn 10 / turn 1 (radixserve)"]
    assert late["value"] == 2.0 and late["met"] is False
    assert by_name["random output tok/s, cache on / cache off"]["met"] is None
    assert by_name["scheduler CPU ms per step, 256 running sequences"]["met"]


# -- micro-benchmarks ------------------------------------------------------------------------------
def test_micro_benchmarks_run_on_the_real_scheduler_and_tree():
    s = scheduler_step_cost(8, steps=5)
    assert s["running"] == 8 and s["cpu_ms_per_step"] > 0 and math.isfinite(s["wall_ms_per_step"])
    assert s["schedule_cpu_ms_per_step"] <= s["cpu_ms_per_step"]
    r = radix_throughput(num_prompts=8, prompt_len=256, groups=2)
    assert r["insert_tokens_per_s"] > 0 and r["match_tokens_per_s"] > 0


# -- command line ----------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    bench_cli.add_bench_arguments(p)
    return p


def test_cli_parsing_and_bad_options(capsys):
    p = _parser()
    args = p.parse_args(["--smoke", "--workload", "random,multi-turn", "--systems", "radixserve,hf-generate",
                         "--param", "random.requests=3"])
    o = bench_cli.options_from_args(args)
    assert o.workloads == ("random", "multi-turn") and o.systems == ("radixserve", "hf-generate")
    assert o.params == {"random": {"requests": "3"}} and o.smoke
    assert p.parse_args(["run", "--repeats", "2"]).repeats == 2
    assert p.parse_args(["micro", "--smoke"]).bench_command == "micro"
    assert p.parse_args(["kernels", "--dtype", "x", "-h"]).passthrough_args == ["--dtype", "x", "-h"]
    for bad in (["--workload", "nope"], ["--systems", "vllm"], ["--repeats", "0"], ["--param", "random.requests"],
                ["--pool-fraction", "0"]):
        assert bench_cli.run_bench(p.parse_args(bad)) == 2
        assert "radixserve bench:" in capsys.readouterr().err


def test_kernels_subcommand_is_passed_through(monkeypatch):
    seen = {}
    fake = types.ModuleType("radixserve_bench.kernel_bench")
    fake.add_arguments = lambda parser: parser.add_argument("--iters", type=int, default=1)  # type: ignore[attr-defined]
    fake.main = lambda args: seen.setdefault("iters", args.iters) and 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "radixserve_bench.kernel_bench", fake)
    import radixserve_bench as bench_pkg

    monkeypatch.setattr(bench_pkg, "kernel_bench", fake, raising=False)
    assert bench_cli.run_bench(_parser().parse_args(["kernels", "--iters", "7"])) == 0
    assert seen == {"iters": 7}


# -- transformers versions -------------------------------------------------------------------------
def test_cb_config_kwargs_follow_the_installed_transformers():
    """transformers <= 5.17 names the tokens per block `block_size`, later versions `page_size` (keeping
    `block_size` as a deprecated alias): the peer's settings are renamed to what the class accepts."""
    import dataclasses

    from radixserve_bench.systems.hf_cb import HFContinuousBatchSystem, cb_config_kwargs, config_fields

    @dataclasses.dataclass
    class Config517:  # the fields of transformers 5.17's ContinuousBatchingConfig that matter here
        block_size: int = 256
        num_blocks: int | None = None
        max_batch_tokens: int | None = None
        max_requests_per_batch: int | None = None
        allow_block_sharing: bool = True

    @dataclasses.dataclass
    class Config523(Config517):  # 5.23: page_size, with block_size a deprecated alias
        page_size: int = 256
        block_size: int | None = None  # type: ignore[assignment]

    class PlainConfig:  # not a dataclass: read from the signature
        def __init__(self, page_size: int = 256, num_blocks: int | None = None, *, allow_block_sharing: bool = True,
                     **ignored: object) -> None:
            pass

    system = HFContinuousBatchSystem("cb", "m", "cpu", "float32", block_size=16, num_blocks=40, max_batch_tokens=64,
                                     max_requests_per_batch=8)
    settings = system._settings()
    old = Config517(**cb_config_kwargs(settings, config_fields(Config517)))
    assert (old.block_size, old.num_blocks, old.max_batch_tokens, old.max_requests_per_batch) == (16, 40, 64, 8)
    new = cb_config_kwargs(settings, config_fields(Config523))
    assert new["page_size"] == 16 and "block_size" not in new
    assert config_fields(PlainConfig) == {"page_size", "num_blocks", "allow_block_sharing"}
    with pytest.raises(RuntimeError, match="max_batch_tokens"):
        cb_config_kwargs(settings, config_fields(PlainConfig))
    # and the installed version builds, with the page size where it belongs
    generation, cb = system._configs()
    assert getattr(cb, "page_size", None) == 16 or cb.block_size == 16
    assert (cb.num_blocks, cb.max_batch_tokens, cb.max_requests_per_batch) == (40, 64, 8)


# -- end to end ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llama() -> str:
    from tiny_models import tiny_model_dir

    return str(tiny_model_dir("llama"))


def test_smoke_run_end_to_end(tiny_llama, tmp_path, capsys):
    from radixserve.cli import main

    out, docs = tmp_path / "out", tmp_path / "docs"
    started = time.monotonic()
    rc = main(["bench", "--smoke", "--model", tiny_llama, "--repeats", "1", "--out", str(out), "--publish", str(docs),
               "--no-progress"])
    assert rc == 0
    assert time.monotonic() - started < 120
    results = json.loads((out / "results.json").read_text())
    assert results["complete"] and check_complete(results) == []
    for workload in ("shared-prefix", "multi-turn", "random"):
        assert set(results["results"][workload]) == {"radixserve", "radixserve-nocache", "hf-generate",
                                                     "hf-generate-batch"} | ({"radixserve-nospec"} if workload == "random"
                                                                             else set())
    for workload in ("regenerate", "edit"):  # speculation on and off, and transformers prompt lookup
        assert set(results["results"][workload]) == {"radixserve", "radixserve-nospec", "hf-prompt-lookup"}
    assert set(results["results"]["bounded-pool"]) == {"radixserve", "radixserve-pool25"}
    assert set(results["results"]["returning-chats"]) == {"radixserve", "radixserve-pool25", "radixserve-pool25-host"}
    bounded = results["results"]["bounded-pool"]["radixserve-pool25"]["median"]
    assert 0 < bounded["pool_blocks"] < bounded["working_set_blocks"] and 0 <= bounded["belady_hit_rate"] <= 1
    for per_system in results["results"].values():
        for entry in per_system.values():
            assert entry["repeats"][0]["engine"].get("leaked_blocks", 0) == 0
    assert results["results"]["shared-prefix"]["radixserve"]["median"]["hit_rate"] > 0
    assert results["results"]["shared-prefix"]["radixserve-nocache"]["median"]["hit_rate"] == 0
    assert results["versions"]["torch"] and results["machine"]["cpu_count"] and results["date"]
    assert {t["name"] for t in results["targets"]} and "micro" in results
    printed = capsys.readouterr().out
    assert "## Targets" in printed and "radixserve relative to each peer" in printed
    for name in ("table.md", "results.json", "throughput.png", "ttft.png", "hit_rate.png", "blocks.png",
                 "ttft_by_turn.png", "host_tier.png", "README.md"):
        assert (docs / name).stat().st_size > 0
    assert "![throughput](throughput.png)" in (docs / "README.md").read_text()


def test_open_loop_smoke_run(tiny_llama, tmp_path):
    from radixserve.cli import main

    rc = main(["bench", "run", "--smoke", "--model", tiny_llama, "--repeats", "2", "--workload", "shared-prefix",
               "--systems", "radixserve,hf-generate-batch", "--load", "open", "--request-rate", "40",
               "--out", str(tmp_path), "--no-micro", "--no-charts", "--no-progress"])
    assert rc == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["workloads"]["shared-prefix"]["load"]["mode"] == "open"
    assert check_complete(results) == [] and len(results["results"]["shared-prefix"]["radixserve"]["repeats"]) == 2


def test_workload_without_an_applicable_system_is_a_usage_error(tiny_llama, tmp_path, capsys):
    from radixserve.cli import main

    rc = main(["bench", "--smoke", "--model", tiny_llama, "--workload", "bounded-pool", "--systems", "hf-generate",
               "--out", str(tmp_path), "--no-progress"])
    assert rc == 2
    assert "no requested system runs on bounded-pool" in capsys.readouterr().err
    rc = main(["bench", "--model", str(tmp_path / "missing"), "--out", str(tmp_path), "--no-progress"])
    assert rc == 2 and "does not exist" in capsys.readouterr().err
