"""Tests of `radixserve bench step`: the real-model shapes load as specs, the roofline's byte counts
equal an independent count from the config, and an end-to-end run on a tiny random-weight shape
(whose vocabulary exceeds its tokenizer's) writes complete, consistent JSON and leaks no block."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch

from radixserve.bench.step_bench import weight_bytes
from radixserve.bench.step_shapes import SHAPES, write_shape_dir
from radixserve.cli import main
from radixserve.model.embedded import EmbeddedModelMissingError, embedded_model_dir
from radixserve.model.llama import LlamaForCausalLM
from radixserve.model.spec import load_spec

TINY: dict[str, Any] = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", hidden_size=64, intermediate_size=96,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=50000,
    max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0, eos_token_id=2, tie_word_embeddings=True,
)


def expected_weight_bytes(c: dict[str, Any], batch: int, elem: int = 4) -> int:
    """Independent count from the config: every matrix and norm once; an untied embedding's lookup
    reads `batch` rows, the LM head (or the tied embedding in its place) all of them."""
    h, d, inter, vocab = c["hidden_size"], c["head_dim"], c["intermediate_size"], c["vocab_size"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    layer = h * (q + 2 * kv) + q * h + 3 * h * inter + 2 * h
    embedding = vocab * h if c["tie_word_embeddings"] else batch * h + vocab * h
    return elem * (c["num_hidden_layers"] * layer + h + embedding)


def kv_bytes_per_token(c: dict[str, Any], elem: int = 4) -> int:
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * elem


def test_shapes_are_the_real_configs(tmp_path: Path) -> None:
    for name, layers, hidden, inter, head_dim, tied, factor in (("llama-3.2-1b", 16, 2048, 8192, 64, True, 32.0),
                                                                 ("llama-3.1-8b", 32, 4096, 14336, 128, False, 8.0)):
        spec = load_spec(write_shape_dir(SHAPES[name], tmp_path / name, None))
        assert (spec.num_layers, spec.hidden_size, spec.intermediate_size, spec.head_dim) == (layers, hidden, inter, head_dim)
        assert (spec.num_heads, spec.num_kv_heads, spec.vocab_size, spec.tie_word_embeddings) == (32, 8, 128256, tied)
        assert spec.max_position_embeddings == 131072
        assert (spec.rope.rope_type, spec.rope.theta, spec.rope.factor) == ("llama3", 500000.0, factor)
        assert spec.rope.original_max_position_embeddings == 8192
    assert not list(tmp_path.rglob("*.safetensors"))  # no weights written


@pytest.mark.parametrize("tied", [True, False])
def test_weight_bytes_rule(tied: bool, tmp_path: Path) -> None:
    config = {**TINY, "tie_word_embeddings": tied, "vocab_size": 300}
    model = LlamaForCausalLM(load_spec(write_shape_dir(config, tmp_path, None)), torch.float32, "cpu")
    for batch in (1, 7):
        assert weight_bytes(model, batch) == expected_weight_bytes(config, batch)


def _tokenizer_dir() -> Path | None:
    try:
        return embedded_model_dir()
    except EmbeddedModelMissingError:
        return None


def test_step_bench_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tokenizer_dir = _tokenizer_dir()
    model_dir = write_shape_dir(TINY, tmp_path / "tiny", tokenizer_dir)  # vocab 50000 > the tokenizer's 49152
    out = tmp_path / "step.json"
    context, steps, warmup = 40, 3, 2
    assert main(["bench", "step", "--model", str(model_dir), "--load-format", "dummy", "--batch", "1,2",
                 "--context", str(context), "--steps", str(steps), "--warmup", str(warmup), "--device", "cpu",
                 "--bandwidth-mib", "16", "--overlap", "on,off", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| greedy ms/step (median / mean) | top-p ms/step (median / mean) | top-p / greedy |" in table
    assert "| on | on | 2 |" in table and "| off | off | 1 |" in table
    result = json.loads(out.read_text())
    for key in ("device", "device_name", "torch", "triton", "dtype", "bandwidth_bytes_per_s", "model", "rows"):
        assert key in result
    assert result["dtype"] == "float32" and result["load_format"] == "dummy"
    bandwidth = result["bandwidth_bytes_per_s"]
    assert math.isfinite(bandwidth) and bandwidth > 0
    rows = result["rows"]
    assert {(r["graphs"], r["overlap"], r["sampling"], r["batch"]) for r in rows} == {
        (g, v, s, b) for g in ("on", "off") for v in ("on", "off") for s in ("greedy", "top-p") for b in (1, 2)}
    for r in rows:
        for key in ("ms_median", "ms_mean", "tok_s", "roofline_fraction", "weight_bytes", "kv_bytes", "bytes_per_step",
                    "device_ms"):
            assert math.isfinite(r[key]) and r[key] > 0, key
        b = r["batch"]
        assert r["tok_s"] == pytest.approx(b * 1000 / r["ms_median"])
        assert r["weight_bytes"] == expected_weight_bytes(TINY, b)
        assert r["kv_bytes_per_token"] == kv_bytes_per_token(TINY)
        # timed step j reads context + 1 (prefill's token) + warmup + j tokens of each sequence, and one
        # more with overlap: the first token resolves while the step after it is already launched
        ahead = r["overlap"] == "on"
        assert r["kv_bytes"] == pytest.approx(
            b * (context + 1 + ahead + warmup + (steps - 1) / 2) * kv_bytes_per_token(TINY))
        assert 0 <= r["host_unhidden_ms"] < r["ms_median"]  # device_ms is checked finite and > 0 above
        assert r["bytes_per_step"] == pytest.approx(r["weight_bytes"] + r["kv_bytes"])
        assert r["roofline_fraction"] == pytest.approx(r["bytes_per_step"] / bandwidth / (r["ms_median"] / 1000))
        assert r["leaked_blocks"] == 0 and r["live_sequences"] == 0
        assert r["steps"] == steps and r["context"] == context


def test_cli_shape_choices_match_the_shapes() -> None:
    import argparse

    from radixserve.bench.cli import add_bench_arguments

    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    args = parser.parse_args(["step", "--shape", "llama-3.1-8b", "--batch", "1,8", "--sampling", "top-p"])
    assert (args.shape, args.batch, args.sampling, args.graphs) == ("llama-3.1-8b", (1, 8), ("top-p",), ("on", "off"))
    with pytest.raises(SystemExit):
        parser.parse_args(["step", "--shape", "nope"])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    shape = next(a for a in sub.choices["step"]._actions if a.dest == "shape")
    assert set(shape.choices or ()) == {"embedded", *SHAPES}


def test_step_bench_penalties_rows_and_their_ratio(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--penalties off,on`: each row runs without and with every request penalised, and the table
    gives the cost of the second over the first."""
    model_dir = write_shape_dir(TINY, tmp_path / "tiny", _tokenizer_dir())
    out = tmp_path / "step.json"
    assert main(["bench", "step", "--model", str(model_dir), "--load-format", "dummy", "--batch", "2", "--context", "24",
                 "--steps", "2", "--warmup", "1", "--device", "cpu", "--bandwidth-mib", "16", "--graphs", "off",
                 "--sampling", "greedy,top-p", "--penalties", "off,on", "--rounds", "2", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| graphs | overlap | penalties | batch |" in table and "| on / off |" in table
    rows = json.loads(out.read_text())["rows"]
    for r in rows:  # two interleaved rounds of 2 timed steps, pooled
        assert r["rounds"] == 2 and len(r["step_ms"]) == 4 and r["ms_median"] == statistics.median(r["step_ms"])
    assert {(r["sampling"], r["penalties"]) for r in rows} == {(s, p) for s in ("greedy", "top-p") for p in ("off", "on")}
    for r in rows:
        assert math.isfinite(r["ms_median"]) and r["leaked_blocks"] == 0 and r["live_sequences"] == 0
    for sampling in ("greedy", "top-p"):
        off, on = (next(r for r in rows if (r["sampling"], r["penalties"]) == (sampling, p)) for p in ("off", "on"))
        assert f"| off | on | 2 | {sampling} | {off['ms_median']:.2f} / {on['ms_median']:.2f} " \
               f"| {on['ms_median'] / off['ms_median']:.3f}x |" in table


def test_step_bench_speculation_rows_report_tokens_per_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--speculation on,off`: off is the plain decode step (exactly one token per sequence per step);
    on lets the engine draft, and each row says how many tokens a step committed per sequence."""
    model_dir = write_shape_dir(TINY, tmp_path / "tiny", _tokenizer_dir())
    out = tmp_path / "step.json"
    assert main(["bench", "step", "--model", str(model_dir), "--load-format", "dummy", "--batch", "2", "--context", "24",
                 "--steps", "3", "--warmup", "1", "--device", "cpu", "--bandwidth-mib", "16", "--graphs", "off",
                 "--sampling", "greedy", "--speculation", "on,off", "--num-speculative-tokens", "4",
                 "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| graphs | overlap | speculation | batch |" in table and "| tokens / step (greedy / top-p) |" in table
    rows = {r["speculation"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"on", "off"}
    assert rows["off"]["tokens_per_step"] == 1.0 and rows["off"]["engine_tokens_per_draw"] in (None, 1.0)
    assert 1.0 <= rows["on"]["tokens_per_step"] <= 5.0
    for r in rows.values():
        assert r["tok_s"] == pytest.approx(2 * r["tokens_per_step"] * 1000 / r["ms_median"])
        assert r["leaked_blocks"] == 0 and r["live_sequences"] == 0
    assert "| off | on | off | 2 |" in table and "| 1.00 / - |" in table
