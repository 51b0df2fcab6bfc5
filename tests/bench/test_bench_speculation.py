"""Tests of the speculation side of `radixserve bench`: the regenerate and edit workloads build
deterministically, a regenerate really re-asks its prompt, an edit's prediction is its original text,
the systems planned per workload, the figures (tokens per step, acceptance, on / off and peer ratios,
targets) from hand-built runs, the peer's step clock, and one tiny-model run with speculation on and
off and transformers prompt lookup side by side."""

from __future__ import annotations

import ast
import asyncio
import json
import random
from pathlib import Path

import pytest
import torch
from test_bench import FakeSystem  # noqa: E402

from radixserve_bench.driver import RequestRecord, RunTrace, drive
from radixserve_bench.metrics import check_complete, run_metrics
from radixserve_bench.plan import BenchOptions, plan_systems
from radixserve_bench.results import evaluate_targets
from radixserve_bench.spec_workloads import EDIT_KINDS, code_snippet, edit_tasks
from radixserve_bench.speculation import spec_ratios, speculation_metrics, target_values
from radixserve_bench.systems import NOSPEC, PROMPT_LOOKUP, REFERENCE
from radixserve_bench.systems.hf_generate import _StepClock
from radixserve_bench.textsource import byte_encoder
from radixserve_bench.workloads import (
    DEFAULT_PARAMS,
    SMOKE_PARAMS,
    SPEC_WORKLOADS,
    EditParams,
    EditPredictionParams,
    Load,
    RegenerateParams,
    RegenerateSampledParams,
    build_workload,
    with_overrides,
)

ENCODE = byte_encoder(512)


def _chat(text: str) -> list[int]:  # a stand-in chat template: a fixed header around the byte encoding
    return [1, 2, 3] + ENCODE(text) + [4, 5]


def _build(name: str, params: object, seed: int = 0, concurrency: int = 1):
    return build_workload(name, params, Load("closed", concurrency), ENCODE, seed, _chat)


# -- workloads -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", SPEC_WORKLOADS)
def test_spec_workloads_build_deterministically(name: str) -> None:
    params = SMOKE_PARAMS[name]
    w = _build(name, params)
    assert w == _build(name, params) and w != _build(name, params, seed=1)
    assert w.load.concurrency == 1 and w.num_requests >= 2
    for s in w.sessions:
        for t in s.turns:
            assert t.new_tokens[:3] == (1, 2, 3) and t.new_tokens[-2:] == (4, 5)  # sent as chat prompts
    assert isinstance(DEFAULT_PARAMS[name], type(params))


def test_regenerate_reasks_the_identical_prompt() -> None:
    p = RegenerateParams(sessions=3, asks=3, prompt_len=30, output_len=4)
    w = _build("regenerate", p)
    assert w.num_requests == 9 and len({s.turns[0].new_tokens for s in w.sessions}) == 3
    system = FakeSystem()
    trace = asyncio.run(drive(system, w, repeat=0, seed=0, timeout_s=30))
    for s in w.sessions:
        asked = [system.prompts[f"{s.session_id}-t{k}-r0"] for k in range(3)]
        assert asked[0] == asked[1] == asked[2] == list(s.turns[0].new_tokens)  # no history, the same prompt
        assert all(t.sampling.greedy and not t.history for t in s.turns)
        recs = sorted((r for r in trace.records if r.session_id == s.session_id), key=lambda r: r.turn)
        assert all(b.send_time >= a.finish_time for a, b in zip(recs, recs[1:]))
    sampled = _build("regenerate-sampled", RegenerateSampledParams(sessions=2, prompt_len=30, output_len=4))
    assert [s.turns[0].new_tokens for s in sampled.sessions] == [s.turns[0].new_tokens for s in w.sessions[:2]]
    seeds = [t.sampling.seed for s in sampled.sessions for t in s.turns]
    assert all(t.sampling.temperature == 0.7 for s in sampled.sessions for t in s.turns)
    assert None not in seeds and len(set(seeds)) == len(seeds)  # every ask samples anew
    assert with_overrides(p, {"temperature": "0.5"}).temperature == 0.5  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=">= 0"):
        with_overrides(p, {"temperature": "-1"})


def test_edit_prediction_is_the_original_text() -> None:
    p = EditParams(requests=6, text_len=40, output_extra=5)
    plain, predicted = _build("edit", p), _build("edit-prediction", EditPredictionParams(**p.__dict__))
    tasks = edit_tasks(6, 0, 40, lambda t: len(ENCODE(t)))
    assert [t.kind for t in tasks] == list(EDIT_KINDS) * 2
    for task, a, b in zip(tasks, plain.sessions, predicted.sessions):
        (ta,), (tb,) = a.turns, b.turns
        assert ta.new_tokens == tb.new_tokens == tuple(_chat(task.instruction))  # the same prompts
        assert ta.sampling.prediction is None and tb.sampling.prediction == tuple(ENCODE(task.original))
        assert task.original in task.instruction  # the text as the prompt shows it, typos included
        assert ta.output_len == len(ENCODE(task.original)) + 5 and len(ENCODE(task.original)) >= 40
    for task in tasks:
        if task.kind == "rename":
            ast.parse(task.original)  # generated code is valid Python
            assert "Rename the variable" in task.instruction
    code, names = code_snippet(random.Random(3), 600, len)  # several functions, each with its own name
    assert len(code) >= 600 and len(names) >= 6 and code.count("\ndef ") >= 1
    assert len({line.split("(")[0] for line in code.splitlines() if line.startswith("def ")}) == code.count("def ")
    ast.parse(code)


def test_systems_planned_for_the_spec_workloads() -> None:
    o = BenchOptions()
    plans = {name: plan_systems(_build(name, SMOKE_PARAMS[name]), o, cuda=False, device="cpu")[0]
             for name in SPEC_WORKLOADS}
    assert plans == {"regenerate": [REFERENCE, NOSPEC, PROMPT_LOOKUP], "regenerate-sampled": [REFERENCE, NOSPEC],
                     "edit": [REFERENCE, NOSPEC, PROMPT_LOOKUP], "edit-prediction": [REFERENCE, NOSPEC]}
    rnd = build_workload("random", SMOKE_PARAMS["random"], Load("closed", 4), ENCODE, 0)
    assert plan_systems(rnd, o, cuda=False, device="cpu")[0] == [REFERENCE, "radixserve-nocache", "hf-generate",
                                                                  "hf-generate-batch", NOSPEC]
    named = BenchOptions(systems=(REFERENCE, PROMPT_LOOKUP, "hf-generate"))
    run, skipped = plan_systems(_build("regenerate-sampled", SMOKE_PARAMS["regenerate-sampled"]), named, False, "cpu")
    assert run == [REFERENCE] and all("greedy requests only" in s for s in skipped) and len(skipped) == 2


# -- figures -------------------------------------------------------------------------------------
def _rec(i: int, turn: int, times: list[float], steps: int | None = None) -> RequestRecord:
    return RequestRecord(f"r{i}-{turn}", f"s{i}", i, turn, 10, len(times), 0.0, times[-1], times, 0, None,
                         [0] * (10 + len(times)), steps=steps)


def test_decode_speed_tokens_per_step_and_acceptance() -> None:
    # two tokens arrive with the first (one step), then 4 more over 2 s: 4 tokens after the first arrival
    recs = [_rec(0, 0, [1.0, 1.0, 2.0, 2.0, 3.0, 3.0], steps=3), _rec(0, 1, [1.0, 1.5, 2.0], steps=3)]
    trace = RunTrace("x", "regenerate", 0, 0.0, 4.0, recs, [])
    m = run_metrics(trace, 16)
    assert m["decode_tok_s_mean"] == pytest.approx((4 / 2 + 2 / 1) / 2) and m["decode_tok_s_turn2"] == 2.0
    assert recs[0].decode_tokens_per_s == 2.0 and _rec(1, 0, [1.0, 1.0]).decode_tokens_per_s is None
    assert speculation_metrics(trace, {}) == {"tokens_per_step": 9 / 6}  # a peer: tokens / its steps
    engine = {"generation_tokens": 90.0, "committed_draws": 30.0, "spec_proposed_tree": 40.0,
              "spec_accepted_tree": 36.0, "spec_proposed_lookup": 10.0, "spec_accepted_lookup": 4.0}
    s = speculation_metrics(trace, engine)
    assert s["tokens_per_step"] == 3.0 and s["spec_proposed"] == 50 and s["spec_accepted"] == 40
    assert s["acceptance_rate"] == 0.8 and s["spec_proposed_prediction"] == 0.0
    off = speculation_metrics(trace, {"generation_tokens": 9.0, "committed_draws": 9.0})
    assert off["tokens_per_step"] == 1.0 and off["acceptance_rate"] == 0.0


def _results(clients: int, medians: dict[tuple[str, str], dict[str, float]]) -> dict:
    results: dict = {"workloads": {}, "planned_systems": {}, "results": {}}
    for (w, s), m in medians.items():
        results["workloads"][w] = {"description": w, "load": {"mode": "closed", "concurrency": clients}}
        results["planned_systems"].setdefault(w, []).append(s)
        results["results"].setdefault(w, {})[s] = {"median": m, "expected_metrics": list(m), "repeats": []}
    results["speculation"] = spec_ratios(results)
    return results


def test_ratios_and_targets_at_batch_1_and_16() -> None:
    one = _results(1, {
        ("regenerate", REFERENCE): {"decode_tok_s_mean": 60.0, "decode_tok_s_turn2": 100.0},
        ("regenerate", NOSPEC): {"decode_tok_s_mean": 20.0, "decode_tok_s_turn2": 20.0},
        ("edit", REFERENCE): {"decode_tok_s_mean": 40.0}, ("edit", NOSPEC): {"decode_tok_s_mean": 20.0},
        ("edit", PROMPT_LOOKUP): {"decode_tok_s_mean": 32.0},
        ("edit-prediction", REFERENCE): {"decode_tok_s_mean": 60.0},
        ("edit-prediction", NOSPEC): {"decode_tok_s_mean": 20.0},
        ("random", REFERENCE): {"decode_tok_s_mean": 19.0}, ("random", NOSPEC): {"decode_tok_s_mean": 20.0},
    })
    r = one["speculation"]
    assert r["regenerate"]["decode_metric"] == "decode_tok_s_turn2" and r["regenerate"]["on_off"][REFERENCE]["ratio"] == 5.0
    assert r["edit"]["vs_peer"]["ratio"] == 1.25 and r["edit-prediction"]["vs_peer"]["peer"] == 32.0
    targets = {name: (goal, value) for name, _, goal, value in target_values(one)}
    assert targets["regenerate second ask's decode tok/s per request, speculation on / off (1 client)"] == (3.0, 5.0)
    assert targets["edit decode tok/s per request, speculation on / off (1 client)"] == (1.8, 2.0)
    assert targets["edit-prediction decode tok/s per request, speculation on / off (1 client)"] == (2.5, 3.0)
    assert targets["random decode tok/s per request, speculation on / off (1 client)"] == (0.97, 0.95)
    assert targets["edit decode tok/s per request, radixserve / transformers prompt lookup (1 client)"] == (1.5, 1.25)
    by_name = {t["name"]: t for t in evaluate_targets(one)}
    assert by_name["random decode tok/s per request, speculation on / off (1 client)"]["met"] is False
    sixteen = _results(16, {("edit", REFERENCE): {"decode_tok_s_mean": 30.0}, ("edit", NOSPEC): {"decode_tok_s_mean": 20.0}})
    assert [(n, g, v) for n, _, g, v in target_values(sixteen)] == [
        ("edit decode tok/s per request, speculation on / off (16 clients)", 1.3, 1.5)]


def test_step_clock_counts_every_token_of_an_assisted_step() -> None:
    clock = _StepClock()
    clock.put(torch.zeros(1, 12))  # the prompt
    clock.put(torch.zeros(1))  # a plain step, batch 1
    clock.put(torch.zeros(1, 4))  # an assisted step that committed 4 tokens
    clock.put(torch.zeros(3))  # a plain step of a static batch of 3: one token per row
    assert clock.steps == 3 and len(clock.times) == 1 + 4 + 1
    assert clock.times[1] == clock.times[4]


# -- end to end ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llama() -> str:
    from tiny_models import tiny_model_dir

    return str(tiny_model_dir("llama"))


def test_spec_bench_end_to_end(tiny_llama: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from radixserve.cli import main

    rc = main(["bench", "--smoke", "--model", tiny_llama, "--repeats", "1", "--workload",
               "random,regenerate,regenerate-sampled,edit,edit-prediction", "--concurrency", "1",
               "--systems", f"{REFERENCE},{NOSPEC},{PROMPT_LOOKUP}", "--out", str(tmp_path), "--no-micro",
               "--no-charts", "--no-progress"])
    assert rc == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["complete"] and check_complete(results) == []
    per = results["results"]
    assert set(per["edit"]) == set(per["regenerate"]) == set(per["random"]) == {REFERENCE, NOSPEC, PROMPT_LOOKUP}
    assert set(per["regenerate-sampled"]) == {REFERENCE, NOSPEC}  # the peer is greedy only
    assert any("greedy requests only" in s for s in results["skipped"])
    for systems in per.values():
        for name, entry in systems.items():
            m = entry["median"]
            assert m["decode_tok_s_mean"] > 0 and m["tokens_per_step"] >= 1.0
            if name.startswith("radixserve"):
                assert {"spec_proposed", "acceptance_rate", "spec_accepted_tree", "spec_proposed_prediction"} <= set(m)
                assert entry["repeats"][0]["engine"]["leaked_blocks"] == 0
            if name == NOSPEC:
                assert m["tokens_per_step"] == 1.0 and m["spec_proposed"] == 0
    regen = per["regenerate"][REFERENCE]["median"]
    assert regen["hit_rate"] > 0.4 and "decode_tok_s_turn2" in regen  # the second ask hits its whole prompt
    assert results["systems"][NOSPEC]["settings"]["num_speculative_tokens"] == 0
    assert results["systems"][PROMPT_LOOKUP]["settings"]["prompt_lookup_num_tokens"] == 10
    assert set(results["speculation"]) == {"random", "regenerate", "regenerate-sampled", "edit", "edit-prediction"}
    assert "vs_peer" in results["speculation"]["edit"]
    names = {t["name"] for t in results["targets"]}
    assert "edit decode tok/s per request, radixserve / transformers prompt lookup (1 client)" in names
    printed = capsys.readouterr().out
    assert "| system | decode tok/s per request, mean / p50 | second ask, mean | tokens / step |" in printed
    assert f"- {REFERENCE} / {PROMPT_LOOKUP} (decode_tok_s_mean; the peer on edit's prompts)" in printed
