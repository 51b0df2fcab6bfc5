"""Tests of `radixserve bench scale-out` without starting Ray: the chat workloads and their send order,
pool sizing (the reused set overflows one pool of P and fits two), the systems, the HTTP driver and
the statistics wait against a fake server, the figures and the report from a fake result, the
files it publishes, the routing micro-benchmark on a small size, and the command line."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve_bench import cli as bench_cli
from radixserve_bench.belady import TraceRequest, working_set_blocks
from radixserve_bench.flags import BenchConfigError
from radixserve_bench.harness import Scenario, publish, readme, write_outputs
from radixserve_bench.metrics import check_complete
from radixserve_bench.scaleout import SYSTEMS, WORKLOADS
from radixserve_bench.scaleout.chart import CHART, write_charts
from radixserve_bench.scaleout.client import ChatRecord, ChatRun, drive_chat, settled_stats
from radixserve_bench.scaleout.plan import (
    DEFAULT_PARAMS,
    ChatWorkload,
    ScaleOutOptions,
    build_chat_workload,
    chat_trace,
    reused_blocks,
    size_pool,
    system_specs,
)
from radixserve_bench.scaleout.report import evaluate_targets, hit_rate_ratios, render
from radixserve_bench.scaleout.routing_micro import routing_overhead, run_routing_micro
from radixserve_bench.scaleout.runner import RUN_METRICS, run_metrics
from radixserve_bench.textsource import byte_encoder
from radixserve_bench.workloads import MultiTurnParams, SharedPrefixParams

ENCODE = byte_encoder(256)


def DECODE(ids: list[int]) -> str:  # noqa: N802 - the pair of ENCODE
    return bytes(ids).decode("utf-8", errors="replace")


def chatml(messages: list[dict[str, str]]) -> list[int]:
    """A ChatML-shaped renderer over bytes (ids 256+ stand for the template's special tokens)."""
    roles = {"system": 300, "user": 301, "assistant": 302}
    ids: list[int] = []
    for m in messages:
        ids += [256, roles[m["role"]], 10, *ENCODE(m["content"]), 257, 10]
    return ids + [256, 302, 10]


def _workload(name: str, params: Any, concurrency: int = 4) -> ChatWorkload:
    return build_chat_workload(name, params, ENCODE, DECODE, seed=0, concurrency=concurrency)


# -- workloads -------------------------------------------------------------------------------------
def test_shared_prefix_becomes_one_system_prompt_per_group():
    p = SharedPrefixParams(groups=3, prompts_per_group=4, system_len=40, question_len=6, output_len=5)
    w = _workload("shared-prefix", p)
    assert w == _workload("shared-prefix", p) and w.num_requests == 12 and len(w.sessions) == 12
    by_group: dict[int, set[str]] = {}
    for s in w.sessions:
        by_group.setdefault(s.group, set()).add(s.system)
        assert len(s.users) == 1 and s.max_tokens == 5 and len(ENCODE(s.users[0])) == 6
    assert all(len(systems) == 1 for systems in by_group.values())  # a group shares its system prompt
    assert len({next(iter(v)) for v in by_group.values()}) == 3  # groups differ
    assert [s.group for s in w.sessions] != sorted(s.group for s in w.sessions)  # groups interleave


def test_multi_turn_sends_the_whole_history_in_rounds():
    p = MultiTurnParams(conversations=3, turns=3, common_prefix_len=30, conversation_prefix_len=20, user_len=6,
                        output_len=4)
    w = _workload("multi-turn", p, concurrency=2)
    assert w.num_requests == 9 and all(len(s.users) == 3 for s in w.sessions)
    assert len({s.system[:25] for s in w.sessions}) == 1  # the common prefix opens every system message
    assert len({s.system for s in w.sessions}) == 3
    assert [(s.session_id, k) for s, k in w.order()] == [(f"mt-c{c}", k) for k in range(3) for c in range(3)]
    s = w.sessions[0]
    msgs = s.messages(2, ["first reply", "second reply"])
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in msgs[1:]] == [s.users[0], "first reply", s.users[1], "second reply", s.users[2]]
    assert s.messages(0, []) == [{"role": "system", "content": s.system}, {"role": "user", "content": s.users[0]}]
    assert "2 in flight, in rounds" in w.describe()


# -- sizing ----------------------------------------------------------------------------------------
def test_reused_blocks_counts_whole_blocks_a_later_prompt_hits():
    a = tuple(range(1, 41))  # 40 tokens: blocks [0, 16) and [16, 32) full
    trace = [TraceRequest(40, a + (900, 901)),
             TraceRequest(41, a[:35] + (7, 8, 9, 10, 11, 12)),  # shares 35 tokens: 2 whole blocks
             TraceRequest(20, tuple(range(500, 520)))]  # shares nothing
    assert reused_blocks(trace, 16) == 2
    assert reused_blocks(trace[:1], 16) == 0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=2, max_size=70), min_size=1, max_size=12))
def test_reused_blocks_never_exceed_the_working_set(sequences):
    trace = [TraceRequest(max(1, len(s) - 2), tuple(s)) for s in sequences]
    assert 0 <= reused_blocks(trace, 4) <= working_set_blocks(trace, 4)


@pytest.mark.parametrize("name", WORKLOADS)
def test_default_workloads_overflow_one_pool_and_fit_two(name):
    w = _workload(name, DEFAULT_PARAMS[name])
    trace = chat_trace(w, chatml, ENCODE, DECODE)
    assert len(trace) == w.num_requests
    s = size_pool(trace, 16, replicas=2, pool_fraction=0.6)
    assert s.pool_blocks < s.reused_blocks <= s.working_set_blocks  # one pool of P cannot hold what is reused
    assert s.one_replica_blocks >= 1.15 * s.reused_blocks  # two can, with room for the requests in flight
    assert s.pool_blocks >= s.max_request_blocks + 2
    assert size_pool(trace, 16, 2, 0.6, pool_blocks=500).pool_blocks == 500


def test_the_trace_renders_replies_into_later_prompts():
    p = MultiTurnParams(conversations=2, turns=2, common_prefix_len=16, conversation_prefix_len=16, user_len=4,
                        output_len=3)
    trace = chat_trace(_workload("multi-turn", p), chatml, ENCODE, DECODE)
    first, later = trace[0], trace[2]  # conversation 0, turns 0 and 1
    assert later.sequence[:first.prompt_len] == first.sequence[:first.prompt_len]
    reply = first.sequence[first.prompt_len:]
    assert len(reply) == 3 and later.prompt_len > first.prompt_len + len(reply)


def test_systems_share_the_memory():
    s = size_pool([TraceRequest(40, tuple(range(48)))], 16, replicas=3, pool_fraction=0.5)
    specs = {x.name: x for x in system_specs(SYSTEMS, s)}
    assert (specs["cache-aware"].replicas, specs["cache-aware"].router) == (3, "cache-aware")
    assert (specs["power-of-two"].replicas, specs["power-of-two"].router) == (3, "power-of-two")
    assert specs["one-replica"].replicas == 1
    assert specs["one-replica"].blocks_per_replica == 3 * specs["cache-aware"].blocks_per_replica
    assert f"{3 * s.pool_blocks} blocks" in specs["one-replica"].description


@pytest.mark.parametrize("bad", [dict(workloads=("random",)), dict(systems=("vllm",)), dict(replicas=1),
                                 dict(pool_fraction=0.0), dict(cluster=False, micro=False),
                                 dict(params={"random": {"requests": "2"}}), dict(micro_replicas=())])
def test_bad_options_are_config_errors(bad):
    with pytest.raises(BenchConfigError):
        ScaleOutOptions(**bad)


# -- the HTTP driver, against a fake server ---------------------------------------------------------
def _fake_server(seen: list[dict[str, Any]]) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        n = len(body["messages"])
        reply = f"reply to {body['messages'][-1]['content'][:8]!r}"
        return httpx.Response(200, headers={"x-radixserve-replica": f"r{n % 2}"}, json={
            "choices": [{"message": {"role": "assistant", "content": reply}}],
            "usage": {"prompt_tokens": 10 * n, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": n}}})

    return httpx.MockTransport(handle)


def test_drive_chat_sends_each_turn_after_its_history():
    p = MultiTurnParams(conversations=3, turns=3, common_prefix_len=8, conversation_prefix_len=8, user_len=4,
                        output_len=2)
    w = _workload("multi-turn", p, concurrency=2)
    seen: list[dict[str, Any]] = []

    async def go() -> ChatRun:
        async with httpx.AsyncClient(transport=_fake_server(seen), base_url="http://x") as client:
            return await drive_chat(client, w, "m", timeout_s=10)

    run = asyncio.run(go())
    assert len(run.records) == len(seen) == 9 and run.duration_s > 0
    assert all(b["temperature"] == 0 and b["max_tokens"] == 2 and b["model"] == "m" for b in seen)
    for body in seen:  # every assistant message is the reply the fake gave to the user message before it
        msgs = body["messages"]
        for i, m in enumerate(msgs):
            if m["role"] == "assistant":
                assert m["content"] == f"reply to {msgs[i - 1]['content'][:8]!r}"
    last = [r for r in run.records if r.turn == 2]
    assert {r.replica for r in last} == {"r0"} and all(r.prompt_tokens == 60 and r.cached_tokens == 6 for r in last)


def test_drive_chat_reports_http_errors():
    w = _workload("shared-prefix", SharedPrefixParams(groups=1, prompts_per_group=1, system_len=8, question_len=2,
                                                      output_len=1))

    async def go() -> None:
        transport = httpx.MockTransport(lambda r: httpx.Response(503, text="no replica"))
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            await drive_chat(client, w, "m", timeout_s=10)

    with pytest.raises(RuntimeError, match="HTTP 503: no replica"):
        asyncio.run(go())


def test_settled_stats_waits_for_totals_and_replicas_alike():
    reads = iter([(3, [2, 2]), (4, [2, 1]), (4, [2, 2])])  # (totals, per replica): settled on the third

    def handle(request: httpx.Request) -> httpx.Response:
        total, rows = next(reads)
        return httpx.Response(200, json={"requests": total, "replicas": [{"requests": n} for n in rows]})

    async def go(wait_s: float) -> tuple[dict[str, Any], bool]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handle), base_url="http://x") as client:
            return await settled_stats(client, 4, wait_s=wait_s, poll_s=0.0)

    stats, settled = asyncio.run(go(5.0))
    assert settled and stats["replicas"][1]["requests"] == 2
    reads = iter([(1, [1])] * 3)
    assert asyncio.run(go(0.0))[1] is False


# -- figures and report ----------------------------------------------------------------------------
def _stats(prompt: int, cached: int, per_replica: list[int], decisions: dict[str, int]) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "cached_tokens": cached, "requests": sum(per_replica), "evicted_blocks": 3,
            "preemptions": 0, "replicas": [{"replica": f"r{i}", "requests": n} for i, n in enumerate(per_replica)],
            "routing": {"router": "cache-aware", "decisions": decisions}}


def test_run_metrics():
    run = ChatRun("shared-prefix", 2.0, (ChatRecord("a", 0, "r0", 100, 50, 8, 0.0, 1.0),
                                         ChatRecord("b", 0, "r1", 100, 70, 8, 0.1, 1.2)))
    m = run_metrics(run, _stats(200, 100, [3, 1], {"prefix": 3, "miss": 1}))
    assert set(RUN_METRICS) <= set(m)
    assert m["hit_rate"] == 0.5 and m["client_hit_rate"] == 0.6 and m["max_replica_share"] == 0.75
    assert m["total_tokens_per_s"] == 108.0 and m["output_tokens_per_s"] == 8.0 and m["requests_per_s"] == 1.0
    assert (m["decisions_prefix"], m["decisions_miss"], m["decisions_session"]) == (3.0, 1.0, 0.0)


def fake_results(hit: dict[str, float]) -> dict[str, Any]:
    def entry(h: float, per_replica: list[int]) -> dict[str, Any]:
        median = {k: 0.0 if k.startswith("decisions_") else 1.0 for k in RUN_METRICS}
        median |= {"hit_rate": h, "client_hit_rate": h, "decisions_prefix": 24.0, "decisions_miss": 8.0}
        return {"expected_metrics": list(RUN_METRICS), "median": median,
                "repeats": [{"repeat": 0, "metrics": median, "replicas": [{"requests": n} for n in per_replica]}]}

    sizing = {"working_set_blocks": 200, "reused_blocks": 120, "max_request_blocks": 20, "pool_blocks": 72,
              "replicas": 2}
    systems = {"cache-aware": {"replicas": 2, "router": "cache-aware", "blocks_per_replica": 72},
               "power-of-two": {"replicas": 2, "router": "power-of-two", "blocks_per_replica": 72},
               "one-replica": {"replicas": 1, "router": "cache-aware", "blocks_per_replica": 144}}
    results: dict[str, Any] = {
        "date": "today", "command": "radixserve bench scale-out --x", "options": {"block_size": 16, "repeats": 1},
        "machine": {"cpu": "cpu", "cpu_count": 2, "gpu": None}, "versions": {}, "model": {"name": "m"},
        "workloads": {"shared-prefix": {"description": "shared-prefix (shape)", "sizing": sizing}},
        "planned_systems": {"shared-prefix": list(SYSTEMS)}, "systems": {"shared-prefix": systems},
        "results": {"shared-prefix": {"cache-aware": entry(hit["cache-aware"], [17, 15]),
                                      "power-of-two": entry(hit["power-of-two"], [16, 16]),
                                      "one-replica": entry(hit["one-replica"], [32])}},
        "routing_overhead": {"2": {"replicas": 2, "prefixes_per_replica": 1000, "prompt_len": [1000, 2000],
                                   "requests": 10, "median_us": 40.0, "p99_us": 1500.0, "mean_us": 50.0,
                                   "max_us": 2000.0}},
    }
    results["hit_rate_vs_one_replica"] = hit_rate_ratios(results)
    results["targets"] = evaluate_targets(results)
    return results


def test_ratios_targets_and_table_from_a_fake_result():
    r = fake_results({"cache-aware": 0.66, "power-of-two": 0.33, "one-replica": 0.6875})
    assert r["hit_rate_vs_one_replica"] == {"shared-prefix": {"cache-aware": pytest.approx(0.96),
                                                              "power-of-two": pytest.approx(0.48)}}
    by_name = {t["name"]: t for t in r["targets"]}
    hit = by_name["shared-prefix hit rate, cache-aware / one-replica"]
    assert hit["met"] is True and hit["value"] == pytest.approx(0.96)
    routing = by_name["routing overhead p99 (us per request), 2 replicas, 1,000 cached prefixes each"]
    assert routing["met"] is False and routing["value"] == 1500.0
    text = render(r)
    assert "| cache-aware | 2 x 72 | 66.0% | 0.960 |" in text
    assert "| one-replica | 1 x 144 | 68.8% | 1 (reference) |" in text
    assert "| 17 / 15 | prefix 24, miss 8 |" in text and "| 16 / 16 | Ray's choice (not the rule) |" in text
    assert "P = 72 blocks per replica (60% of the reused blocks)" in text
    assert "| 2 | 1,000 | 1,000-2,000 | 10 | 40.0 | 1500.0 |" in text
    assert "power-of-two hit rate / one-replica: shared-prefix: 0.480" in text
    assert "req/s (2 CPU cores)" in text and "`radixserve bench scale-out --x`" in text
    assert check_complete(r) == []
    low = fake_results({"cache-aware": 0.5, "power-of-two": 0.33, "one-replica": 0.6875})
    assert {t["name"]: t for t in low["targets"]}["shared-prefix hit rate, cache-aware / one-replica"]["met"] is False


def test_incomplete_results_are_caught():
    r = fake_results({"cache-aware": 0.66, "power-of-two": 0.33, "one-replica": 0.6875})
    r["results"]["shared-prefix"]["cache-aware"]["median"]["hit_rate"] = math.nan
    del r["results"]["shared-prefix"]["power-of-two"]
    problems = check_complete(r)
    assert any("cache-aware: metric hit_rate" in p for p in problems)
    assert any("power-of-two: not run" in p for p in problems)


SCENARIO = Scenario("radixserve bench scale-out", lambda args, argv: {}, render, write_charts,
                    docs_anchor="radixserve-bench-scale-out")


def test_outputs_and_publish(tmp_path):
    r = fake_results({"cache-aware": 0.66, "power-of-two": 0.33, "one-replica": 0.6875})
    text = render(r)
    charts = write_outputs(r, text, tmp_path / "out", write_charts)
    assert charts == [CHART] and (tmp_path / "out" / CHART).stat().st_size > 1000
    assert json.loads((tmp_path / "out" / "results.json").read_text())["targets"] == r["targets"]
    publish(tmp_path / "out", tmp_path / "pub", charts, readme(SCENARIO, text, charts, tmp_path / "pub", r["command"]))
    published = (tmp_path / "pub" / "README.md").read_text()
    assert "```sh\nradixserve bench scale-out --x\n```" in published and f"]({CHART})" in published
    assert "`radixserve bench scale-out --publish`" in published
    assert text in published and sorted(p.name for p in (tmp_path / "pub").iterdir()) == sorted(
        ["README.md", "results.json", "table.md", CHART])
    assert write_outputs({"results": {}}, "x", tmp_path / "micro-only", write_charts) == []


# -- routing micro-benchmark -----------------------------------------------------------------------
def test_routing_overhead_on_a_small_size():
    r = routing_overhead(3, prefixes=30, requests=200, prompt_len=(60, 120), shared_len=20, group_size=5)
    assert r["replicas"] == 3 and r["prefixes_per_replica"] == 30 and r["requests"] == 200
    assert 0 < r["median_us"] <= r["p99_us"] <= r["max_us"]
    d = r["decisions"]
    # prompts extending a cached one are hits; a shared head under half the prompt is a miss (min_prefix_fraction)
    assert sum(d.values()) == 200 and d["prefix"] >= 60 and d["miss"] >= 60 and d["session"] == 0
    with pytest.raises(ValueError):
        routing_overhead(2, prefixes=10, prompt_len=(50, 40))
    smoke = run_routing_micro((2, 4), smoke=True)
    assert sorted(smoke) == ["2", "4"] and all(v["prefixes_per_replica"] == 40 for v in smoke.values())


# -- command line ----------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    bench_cli.add_bench_arguments(p)
    return p


def test_cli_options_and_errors(capsys):
    from radixserve_bench.scaleout.cli import options_from_args

    args = _parser().parse_args(["scale-out", "--workload", "multi-turn", "--systems", "cache-aware,one-replica",
                                 "--replicas", "3", "--routing-replicas", "2,4", "--no-cluster",
                                 "--param", "multi-turn.turns=2"])
    assert args.bench_command == "scale-out"
    o = options_from_args(args)
    assert o.workloads == ("multi-turn",) and o.systems == ("cache-aware", "one-replica") and o.replicas == 3
    assert o.micro_replicas == (2, 4) and not o.cluster and o.torch_threads == 1 and o.concurrency == 4
    assert o.params == {"multi-turn": {"turns": "2"}}
    for bad in (["--workload", "random"], ["--replicas", "1"], ["--no-cluster", "--no-micro"],
                ["--param", "multi-turn.turns"]):
        assert bench_cli.run_bench(_parser().parse_args(["scale-out", *bad])) == 2
        assert "radixserve bench scale-out:" in capsys.readouterr().err


def test_cli_no_cluster_runs_the_micro_benchmark_alone(tmp_path, capsys):
    args = _parser().parse_args(["scale-out", "--no-cluster", "--smoke", "--routing-replicas", "2",
                                 "--out", str(tmp_path / "out"), "--publish", str(tmp_path / "pub")])
    assert bench_cli.run_bench(args) == 0
    out = capsys.readouterr().out
    assert "Routing micro-benchmark only" in out and "| 2 | 40 | 100-200 | 100 |" in out
    saved = json.loads((tmp_path / "pub" / "results.json").read_text())
    assert saved["results"] == {} and saved["complete"] is True and saved["routing_overhead"]["2"]["requests"] == 100


def test_published_readme_links_the_docs_when_under_docs(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "bench.md").write_text("# bench\n")
    for name in ("results.json", "table.md"):
        (tmp_path / name).write_text("{}")
    dst = tmp_path / "docs" / "bench" / "scale-out"
    publish(tmp_path, dst, [], readme(SCENARIO, "table\n", [], dst, None))
    published = (dst / "README.md").read_text()
    assert "[docs/bench.md](../../bench.md#radixserve-bench-scale-out)" in published and "Reproduce" not in published
