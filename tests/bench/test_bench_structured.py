"""Tests of `radixserve bench structured`: the catalog (>= 50 valid schemas covering JSONSchemaBench's
kinds and the features they use, >= 10 tools, all compiled by the engine's compiler), the verdict on
a reply, and the whole command on a tiny random-weight model, whose results must be computed from
the run (counts add up, ratios are the quotients of the figures beside them, engine counters agree)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator
from tiny_models import tiny_chat_model_dir

from radixserve.cli import main
from radixserve.structured import StructuredOutput
from radixserve_bench.structured.measure import Reply, judge, tally, validator_for
from radixserve_bench.structured.schemas import FAMILIES, FEATURES, FORCED, STEP, all_schemas, features
from radixserve_bench.structured.tool_defs import TOOLS


def test_catalog_size_kinds_and_features() -> None:
    schemas = all_schemas()
    assert len(schemas) >= 50
    assert len({s.name for s in schemas}) == len(schemas)
    for s in [*schemas, STEP]:
        Draft202012Validator.check_schema(s.schema)
        assert s.family in FAMILIES and s.task
    assert {s.family for s in schemas} == set(FAMILIES)
    seen: dict[str, int] = {}
    for s in schemas:
        for f in features(s.schema):
            seen[f] = seen.get(f, 0) + 1
    assert set(FEATURES) <= set(seen), set(FEATURES) - set(seen)
    for f in ("enum", "pattern", "numeric-bounds", "nested-object", "array-of-objects", "optional-property",
              "closed-object", "anyOf", "ref"):
        assert seen[f] >= 3 or f == "ref" and seen[f] + seen["recursive-ref"] >= 3, (f, seen[f])
    assert FORCED in schemas and len(FORCED.schema["required"]) == 6
    assert all("enum" in p or p.get("type") == "boolean" for p in FORCED.schema["properties"].values())
    assert STEP.schema["properties"]["items"]["minItems"] >= 200  # no step-test row can finish


def test_tools() -> None:
    assert len(TOOLS) >= 10 and len({t.name for t in TOOLS}) == len(TOOLS)
    for t in TOOLS:
        Draft202012Validator.check_schema(t.parameters)
        assert t.parameters["type"] == "object" and t.question
        assert t.openai()["function"]["name"] == t.name


def test_features_are_read_off_the_schema() -> None:
    assert features({"type": "object", "properties": {"a": {"enum": [1]}}, "required": []}) == {"enum", "optional-property"}
    recursive = {"$defs": {"n": {"type": "object", "properties": {"k": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"}
    assert "recursive-ref" in features(recursive)
    assert {"nullable", "anyOf", "string-length"} <= features({"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 3}]})
    assert {"nested-object", "closed-object", "integer", "numeric-bounds"} <= features(
        {"type": "object", "properties": {"o": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0}},
                                                "additionalProperties": False}}})


def test_every_schema_and_tool_compiles() -> None:
    """The engine's own compiler, on the tiny chat tokenizer: no schema of the catalog is refused."""
    from transformers import AutoTokenizer

    from radixserve.engine.grammar import GrammarCompiler

    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model_dir("llama"))
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    try:
        for schema in [*(s.schema for s in all_schemas()), STEP.schema, *(t.parameters for t in TOOLS)]:
            compiler.compile(StructuredOutput(json=schema))
        assert compiler.stats.failures == 0
    finally:
        compiler.close()


def test_judge() -> None:
    v = validator_for({"type": "object", "properties": {"ip": {"type": "string", "format": "ipv4"}}, "required": ["ip"]})
    assert judge(Reply("k", '{"ip": "10.0.0.1"}', 5, "stop"), v).verdict == "valid"
    assert judge(Reply("k", '{"ip": "300.0.0.1"}', 5, "stop"), v).verdict == "invalid"  # formats are checked
    assert judge(Reply("k", '{"ip": 1}', 5, "stop"), v).why.startswith("ip:")
    assert judge(Reply("k", '{"ip": "1', 5, "stop"), v).why.startswith("not JSON")
    assert judge(Reply("k", '{"ip": "1', 256, "length"), v).verdict == "length"
    assert judge(Reply("k", "", 3, "error", "dead end"), v).verdict == "error"
    t = tally([judge(Reply("k", '{"ip": "1.2.3.4"}', 1, "stop"), v), judge(Reply("k", "{", 9, "length"), v)])
    assert (t["replies"], t["valid"], t["length"], t["valid_pct"], t["valid_pct_of_finished"]) == (2, 1, 1, 50.0, 100.0)


def _check_tally(t: dict[str, Any]) -> None:
    assert t["valid"] + t["invalid"] + t["length"] + t["error"] == t["replies"]
    assert math.isclose(t["valid_pct"], 100 * t["valid"] / t["replies"])


def test_structured_bench_on_a_tiny_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    names = ["sentiment", "dependency", "forced-fixed-keys"]
    out = tmp_path / "out"
    code = main(["bench", "structured", "--model", str(tiny_chat_model_dir("llama")), "--device", "cpu",
                 "--schemas", ",".join(names), "--tools", "2", "--samples", "1", "--max-tokens", "200",
                 "--cached-repeats", "3", "--step-batch", "4", "--step-steps", "3", "--step-warmup", "1",
                 "--step-rounds", "2", "--out", str(out), "--no-charts", "--no-progress"])
    assert code in (0, 1)  # 1 only when a headline figure is not finite
    r = json.loads((out / "results.json").read_text())
    assert r["complete"] == (code == 0)
    table = capsys.readouterr().out
    assert "### Targets" in table and "### Validity" in table and "### Grammar compile" in table
    assert (out / "table.md").read_text() in table

    v = r["validity"]
    assert v["schemas"] == 3 and v["modes"] == ["greedy", "sampled-1"]
    assert v["all"]["replies"] == 6 and v["greedy"]["replies"] == 3 and v["sampled"]["replies"] == 3
    for t in (v["all"], v["greedy"], v["sampled"], r["tools"]["all"]):
        _check_tally(t)
    assert set(v["per_schema"]) == set(names)
    assert sum(1 for x in v["failures"] if x["verdict"] == "length") == v["all"]["length"]
    assert v["all"]["invalid"] == 0 and v["all"]["error"] == 0  # the constraint holds even on random weights

    tools = r["tools"]
    assert tools["tools"] == 2 and tools["all"]["replies"] == 2 * 2 * 2  # 2 tools x (required, named) x 2 modes
    assert tools["all"]["invalid"] == 0 and tools["all"]["error"] == 0

    c = r["compile"]
    assert c["schemas"]["constraints"] == 3 and c["schemas"]["compiled"] == 3 and not c["schemas"]["failed"]
    assert c["schemas"]["cached_lookups"] == 9 and set(c["schemas"]["per_constraint"]) == set(names)
    assert c["tool_calls"]["constraints"] == 3  # required + each of 2 named
    assert c["schemas"]["cached"]["p50_ms"] < c["schemas"]["cold"]["p50_ms"]

    for key in ("step", "step_no_forced"):
        s = r[key]
        for mode in ("unconstrained", "constrained"):
            assert s[mode]["steps"] == 2 * 3 and s[mode]["full_batch_steps"] == 2 * 3
            assert math.isclose(s[mode]["tokens_per_step"], s[mode]["tokens"] / s[mode]["steps"])
        assert s["unconstrained"]["tokens"] == 2 * 3 * 4 and s["unconstrained"]["mask_ms_per_step"] == 0
        assert s["constrained"]["mask_ms_per_step"] > 0
        assert math.isclose(s["ratio_step_mean"], s["constrained"]["step_ms_mean"] / s["unconstrained"]["step_ms_mean"])
    assert r["step_no_forced"]["constrained"]["tokens"] == 2 * 3 * 4  # one token per row per step without forcing
    assert r["step_no_forced"]["constrained"]["forced_tokens"] == 0

    f = r["forced"]
    assert f["off"]["forced_tokens"] == 0 and f["on"]["forced_tokens"] > 0
    assert f["off"]["steps"] >= f["off"]["tokens"]  # without forcing, one token per step (plus prefill)
    assert math.isclose(f["steps_ratio_off_on"], f["off"]["steps"] / f["on"]["steps"])
    assert f["same_text"] and f["on"]["finish_reason"] == "stop"
    json.loads(f["on"]["text"])

    stats = r["engine_stats"]
    assert stats["constrained_requests"] == 6 + 8 + 2 * 4  # validity, tools, the step test's constrained rows
    assert stats["grammar_dead_ends"] == 0
    assert [t["name"] for t in r["targets"]][0].startswith("schema replies valid")
    assert len(r["targets"]) == 6 and r["results"]["structured"]["radixserve"]["median"]["schema_valid_pct"] == v["all"][
        "valid_pct"]


@pytest.mark.slow
def test_structured_bench_embedded_model(tmp_path: Path) -> None:
    """A few schemas on the embedded SmolLM2: every finished reply parses and validates."""
    out = tmp_path / "out"
    main(["bench", "structured", "--schemas", "sentiment,forced-fixed-keys,k8s-service,glaive-stock-price", "--tools", "3",
          "--samples", "1", "--step-batch", "4", "--step-steps", "4", "--step-rounds", "2", "--out", str(out), "--no-charts"])
    r = json.loads((out / "results.json").read_text())
    assert r["validity"]["all"]["invalid"] == 0 and r["validity"]["all"]["error"] == 0
    assert r["tools"]["all"]["invalid"] == 0 and r["tools"]["all"]["error"] == 0
    assert r["forced"]["steps_ratio_off_on"] >= 1.3
