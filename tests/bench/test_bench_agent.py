"""Tests of `radixserve bench agent`: fitting tasks into the context, the Responses history modes, and the
whole command (--smoke: 2 tasks x 3 round trips on each API, cache on and off, then 4 loops at once) on a
tiny random-weight chat model, whose results must be the servers' usage: cached tokens after turn 1 with
the cache on, none with it off, and every derived figure the arithmetic of the turns beside it."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
from tiny_models import tiny_chat_model_dir

from radixserve.cli import main
from radixserve_bench.agents.client import APIS, ClientPlan, LoopTask, Reply, ResponsesLoop
from radixserve_bench.agents.workload import SAFETY, AgentParams, fit_task

LONG_CONTEXT = 4096  # the tiny model's 1,024 positions cannot hold a system prompt with tools in its tokenizer


@pytest.fixture(scope="module")
def tiny_long_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny chat model with room for the workload's system prompt and tools (random weights: any
    context length is as good as another)."""
    out = tmp_path_factory.mktemp("agents") / "tiny-chat-long"
    shutil.copytree(tiny_chat_model_dir("llama"), out)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = LONG_CONTEXT
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_fitting_cuts_round_trips_then_scales_outputs() -> None:
    p = AgentParams(tasks=1, round_trips=(10, 10), output_tokens=(32, 100), answer_max_tokens=16)
    shape = fit_task([100] * 10, base=500, overhead=50, context=1200, p=p)
    # 620 tokens of room: 10 round trips leave 120 for outputs (< 10 x 32), ..., 7 leave 270 (>= 7 x 32);
    # each output keeps its 32 and 46 of the 7 x 68 above it are shared out
    assert (shape.drawn_round_trips, shape.round_trips) == (10, 7)
    assert shape.scale == pytest.approx(46 / (7 * 68))
    assert shape.output_tokens == (38,) * 7
    assert shape.max_prompt_tokens == 500 + 7 * 50 + 7 * 38
    assert shape.max_prompt_tokens + p.answer_max_tokens + SAFETY <= 1200
    # round trips are cut first, down to the range's low end, while the drawn outputs do not fit
    cut = fit_task([300] * 5, base=500, overhead=50, context=2000, p=dataclasses.replace(p, round_trips=(2, 5)))
    assert (cut.round_trips, cut.scale, cut.output_tokens) == (4, 1.0, (300,) * 4)
    roomy = fit_task([100] * 3, base=500, overhead=50, context=4096, p=p)
    assert (roomy.round_trips, roomy.scale, roomy.output_tokens) == (3, 1.0, (100, 100, 100))
    with pytest.raises(ValueError, match="cannot hold one round trip"):
        fit_task([100], base=1150, overhead=50, context=1200, p=p)


@pytest.mark.parametrize("mode", ["chain", "replay"])
def test_responses_history_modes(mode: str) -> None:
    tools = [{"name": "read_file", "description": "Read a file.", "parameters": {"type": "object", "properties": {}}}]
    plan = ClientPlan("http://x", "m", "system", tools, [], responses_mode=mode)
    loop = ResponsesLoop(plan, LoopTask("t", "responses", "the task", ["out 1", "out 2"]))
    first = loop.body(1, False)
    assert first["input"] == [{"role": "user", "content": "the task"}] and "previous_response_id" not in first
    assert first["instructions"] == "system" and first["tool_choice"] == "required"
    loop.absorb(Reply(call_id="call_1", call_name="read_file", arguments="{}", response_id="resp_1"), "out 1")
    second = loop.body(2, False)
    result = {"type": "function_call_output", "call_id": "call_1", "output": "out 1"}
    if mode == "chain":
        assert second["previous_response_id"] == "resp_1" and second["input"] == [result] and second["store"]
    else:
        assert "previous_response_id" not in second and not second["store"]
        assert second["input"] == [{"role": "user", "content": "the task"},
                                   {"type": "function_call", "call_id": "call_1", "name": "read_file", "arguments": "{}"},
                                   result]
    assert second["instructions"] == "system" and second["tools"] == first["tools"]  # sent again every turn
    assert loop.body(3, True)["tool_choice"] == "auto" and loop.body(3, True)["max_output_tokens"] == 16


def _turn_arithmetic(run: dict[str, Any], outputs: dict[str, list[int]]) -> None:
    """Each turn's derived figures are the arithmetic of its usage and the turn before."""
    by_task: dict[str, list[dict[str, Any]]] = {}
    for row in run["turns"]:
        by_task.setdefault(row["task_id"], []).append(row)
    for task, rows in by_task.items():
        assert [r["turn"] for r in rows] == [1, 2, 3, 4]
        assert [r["kind"] for r in rows] == ["call", "call", "call", "answer"]
        for prev, row in zip(rows, rows[1:]):
            assert row["computed_tokens"] == row["prompt_tokens"] - row["cached_tokens"]
            assert row["new_tokens"] == row["prompt_tokens"] - prev["prompt_tokens"] - prev["completion_tokens"]
            assert row["beyond_new"] == row["computed_tokens"] - row["new_tokens"]
            # the turn adds its tool output (re-tokenized in context) and the result's framing
            assert row["new_tokens"] >= outputs[task][row["turn"] - 2] - 2
    s = run["summary"]
    later = [r for r in run["turns"] if r["turn"] >= 2]
    assert s["later_cached_fraction"] == pytest.approx(sum(r["cached_tokens"] for r in later)
                                                       / sum(r["prompt_tokens"] for r in later))
    assert s["computed_tokens"] == sum(r["computed_tokens"] for r in run["turns"])


def test_agent_bench_smoke(tiny_long_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    rc = main(["bench", "agent", "--smoke", "--model", str(tiny_long_model), "--out", str(out)])
    assert rc == 0
    r = json.loads((out / "results.json").read_text())
    assert r["complete"] and (out / "table.md").is_file() and (out / "agents.png").is_file()
    w = r["workload"]
    assert w["context"] == LONG_CONTEXT and len(w["tools"]) == 3 and w["responses_mode"] == "chain"
    assert [t["round_trips"] for t in w["tasks"]] == [3, 3]
    outputs = {t["task_id"]: t["output_tokens"] for t in w["tasks"]}
    assert all(16 <= n <= 48 for n in sum(outputs.values(), []))
    assert set(r["runs"]) == set(APIS)
    for api in APIS:
        on, off = r["runs"][api]["on"], r["runs"][api]["off"]
        for run in (on, off):
            assert run["errors"] == [] and run["requests"] == 8 and run["summary"]["turns"] == 8
            _turn_arithmetic(run, outputs)
            # a forced call always streams its name; a final answer cut while it looked like a call's start may not
            assert all(row["ttft_ms"] > 0 for row in run["turns"] if row["kind"] == "call")
            assert all(row["e2e_ms"] >= row["ttft_ms"] for row in run["turns"] if row["ttft_ms"] is not None)
            assert run["summary"]["server_ttft_ms_mean"] > 0  # the server's histogram counted the run
        assert on["responses_mode"] == ("chain" if api == "responses" else None)
        # what the cache held when the run was over, and the memory holding it (no state: not a hybrid)
        held = on["cache_held"]
        assert held["tree_tokens"] > 0 and held["state_bytes"] == 0 and held["checkpoints"] == 0
        assert held["tokens_per_gb"] == pytest.approx(held["tree_tokens"] / (held["kv_bytes"] / 1e9))
        # the cache's figures are the server's usage: every later turn hits the conversation so far ...
        for row in on["turns"]:
            if row["turn"] >= 2:
                assert row["cached_tokens"] > 0 and row["cached_tokens"] / row["prompt_tokens"] > 0.5, (api, row)
        # ... and with the cache off the server reports nothing cached and computes every prompt token
        assert all(row["cached_tokens"] == 0 for row in off["turns"])
        assert off["summary"]["computed_tokens"] == off["summary"]["prompt_tokens"]
        # the same workload both ways: the same prompts, turn by turn, up to the replies the model chose
        assert {row["task_id"]: row["prompt_tokens"] for row in on["turns"] if row["turn"] == 1} == \
               {row["task_id"]: row["prompt_tokens"] for row in off["turns"] if row["turn"] == 1}
        c = r["comparison"][api]
        assert c["ttft_later_ratio"] == pytest.approx(on["summary"]["ttft_ms_later_mean"]
                                                      / off["summary"]["ttft_ms_later_mean"])
        assert c["off_cached_tokens"] == 0
        assert r["results"]["agents"]["radixserve"]["median"][f"{api}.later_cached_fraction"] == \
               on["summary"]["later_cached_fraction"]
    s = r["scheduler"]
    assert s["loops"] == 4 and s["errors"] == [] and s["requests"] == 4 * 4 and s["steps"] > 0
    assert s["running_max"] <= 4 and math.isfinite(s["schedule_ms_p50"]) and math.isfinite(s["scheduler_cpu_ms_p50"])
    assert len(s["samples"]) == s["steps"] and all(cpu > 0 for cpu, _, _ in s["samples"])
    assert s["mask_ms_mean"] > 0  # every forced call is constrained
    assert r["results"]["agents"]["radixserve"]["median"]["scheduler.scheduler_cpu_ms_p50"] == s["scheduler_cpu_ms_p50"]
    if s["paired"]:  # the phase clock's steps are the observer's
        assert s["phase_steps"] == s["steps"] and all(wall is not None and wall >= 0 for _, _, wall in s["samples"])
    names = [t["name"] for t in r["targets"]]
    assert sum(n.endswith("cache on / off") for n in names) == 3 and any(n.startswith("scheduler") for n in names)
    table = (out / "table.md").read_text()
    assert "## Cache on against cache off" in table and "## The scheduler with 4 agent loops in flight" in table
