"""Tests of `radixserve bench step`: the real-model shapes load as specs, the roofline's byte counts
equal an independent count from the config, an end-to-end run on a tiny random-weight shape
(whose vocabulary exceeds its tokenizer's) writes complete, consistent JSON and leaks no block, and
each row's memory floor, host phases (engine/step_phases.py) and transformers' forward (hf_step.py)
agree with the raw figures they come from."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch

from radixserve.cli import main
from radixserve.engine.step_phases import FORWARD, SCHEDULE, WAIT, StepPhases
from radixserve.kernels.cpu_linear import packing_works
from radixserve.model.batch_inputs import BuildTime
from radixserve.model.decoder import CausalLM
from radixserve.model.embedded import EmbeddedModelMissingError, embedded_model_dir
from radixserve.model.spec import load_spec
from radixserve_bench.step_bench import weight_bytes
from radixserve_bench.step_shapes import SHAPES, write_shape_dir

TINY: dict[str, Any] = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", hidden_size=64, intermediate_size=96,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=50000,
    max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0, eos_token_id=2, tie_word_embeddings=True,
)


def expected_weight_bytes(c: dict[str, Any], batch: int, elem: int = 4, packed_head: bool = False) -> int:
    """Independent count from the config: every matrix and norm once; an untied embedding's lookup
    reads `batch` rows, the LM head (or the tied embedding in its place) all of them. On CPU a tied
    model's head is packed apart from its embedding (`packed_head`, model/cpu_linear.py): it reads
    as an untied one."""
    h, d, inter, vocab = c["hidden_size"], c["head_dim"], c["intermediate_size"], c["vocab_size"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    layer = h * (q + 2 * kv) + q * h + 3 * h * inter + 2 * h
    embedding = vocab * h if c["tie_word_embeddings"] and not packed_head else batch * h + vocab * h
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
    model = CausalLM(load_spec(write_shape_dir(config, tmp_path, None)), torch.float32, "cpu")
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
                 "--bandwidth-mib", "16", "--overlap", "on,off", "--hf-forward", "off", "--json", str(out)]) == 0
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
        assert r["weight_bytes"] == expected_weight_bytes(TINY, b, packed_head=packing_works(torch.float32))
        assert r["kv_bytes_per_token"] == kv_bytes_per_token(TINY)
        # timed step j reads context + 1 (prefill's token) + warmup + j tokens of each sequence, and one
        # more with overlap: the first token resolves while the step after it is already launched
        ahead = r["overlap"] == "on"
        assert r["kv_bytes"] == pytest.approx(
            b * (context + 1 + ahead + warmup + (steps - 1) / 2) * kv_bytes_per_token(TINY))
        # device_ms is checked finite and > 0 above; the unhidden host time is a median of other spans
        # than the steps', so comparing the two medians is a wall-clock bound a busy machine fails
        assert math.isfinite(r["host_unhidden_ms"]) and r["host_unhidden_ms"] >= 0
        assert r["bytes_per_step"] == pytest.approx(r["weight_bytes"] + r["kv_bytes"])
        assert r["roofline_fraction"] == pytest.approx(
            r["bytes_per_step"] / r["bandwidth_bytes_per_s"] / (r["ms_median"] / 1000))
        assert r["leaked_blocks"] == 0 and r["live_sequences"] == 0
        assert r["steps"] == steps and r["context"] == context


def test_cli_shape_choices_match_the_shapes() -> None:
    import argparse

    from radixserve_bench.cli import add_bench_arguments

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
                 "--sampling", "greedy,top-p", "--penalties", "off,on", "--rounds", "2", "--hf-forward", "off",
                 "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| graphs | overlap | penalties | batch |" in table and "| on / off |" in table
    assert "- transformers forward: not run (--hf-forward off)" in table
    result = json.loads(out.read_text())
    assert result["hf_forward"]["skipped"] == "--hf-forward off" and result["hf_forward"]["step_ms"] == {}
    rows = result["rows"]
    for r in rows:  # pooled over the rounds: each phase's per-step list too, and its median
        assert r["hf_forward_ms"] is None and r["step_over_hf"] is None
        assert all(len(v) == 4 for v in r["phase_ms"].values()) and r["host_ms"] == statistics.median(r["phase_ms"]["host"])
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
    result = json.loads(out.read_text())
    rows = {r["speculation"]: r for r in result["rows"]}
    assert set(rows) == {"on", "off"}
    # transformers' forward (on by default on CPU) of a directory without weights: built from its config
    assert result["hf_forward"]["source"] == "random-init" and len(result["hf_forward"]["step_ms"]["2"]) == 3
    assert all(r["hf_forward_ms"] > 0 and r["step_over_hf"] == pytest.approx(r["ms_median"] / r["hf_forward_ms"])
               for r in rows.values())
    assert rows["off"]["tokens_per_step"] == 1.0 and rows["off"]["engine_tokens_per_draw"] in (None, 1.0)
    assert 1.0 <= rows["on"]["tokens_per_step"] <= 5.0
    for r in rows.values():
        assert r["tok_s"] == pytest.approx(2 * r["tokens_per_step"] * 1000 / r["ms_median"])
        assert r["leaked_blocks"] == 0 and r["live_sequences"] == 0
    assert "| off | on | off | 2 |" in table and "| 1.00 / - |" in table


def test_step_bench_floor_host_phases_and_transformers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A real (tiny) checkpoint, both decode paths (graphs on: the padded decoder; off: the eager
    path): each row's floor is its bytes over the bandwidth, its host phases add up to (almost) the
    whole timed step with batch building timed on either path, and transformers' forward of the same
    checkpoint is timed for each batch size, its ratio to the step in the row and the table."""
    from tiny_models import tiny_model_dir

    out, steps = tmp_path / "step.json", 3
    assert main(["bench", "step", "--model", str(tiny_model_dir("llama")), "--batch", "1,2", "--context", "24",
                 "--steps", str(steps), "--warmup", "1", "--device", "cpu", "--bandwidth-mib", "16",
                 "--overlap", "off", "--json", str(out)]) == 0  # --hf-forward: on by default on CPU
    table = capsys.readouterr().out
    assert "| top-p / greedy | floor ms | step / floor (greedy / top-p) |" in table
    assert "GB/s (copy, before the engines; again before each row, " in table
    assert "| host ms (greedy / top-p) | host ms, greedy (schedule / build / post) | transformers forward ms " \
           "| step / transformers (greedy / top-p) |" in table
    result = json.loads(out.read_text())
    hf = result["hf_forward"]
    assert result["bandwidth_bytes_per_s"] > 0  # the sample before the engines
    assert hf["source"] == "checkpoint" and hf["skipped"] is None
    assert {(r["graphs"], r["batch"]) for r in result["rows"]} == {(g, b) for g in ("on", "off") for b in (1, 2)}
    for r in result["rows"]:
        ms = r["ms_median"]
        # on CPU the copy rate is measured again right before each row: its floor is that moment's
        assert r["bandwidth_bytes_per_s"] > 0
        assert r["floor_ms"] > 0 and r["floor_ms"] == pytest.approx(r["bytes_per_step"] / r["bandwidth_bytes_per_s"] * 1000)
        assert r["step_over_floor"] == pytest.approx(ms / r["floor_ms"])
        assert r["roofline_fraction"] == pytest.approx(r["floor_ms"] / ms)
        phases = r["phase_ms"]
        assert all(len(v) == steps for v in phases.values())
        for i, step_ms in enumerate(r["step_ms"]):
            assert min(phases[k][i] for k in ("schedule", "build", "forward", "post")) > 0 and phases["wait"][i] >= 0
            assert phases["host"][i] == pytest.approx(phases["schedule"][i] + phases["build"][i] + phases["post"][i])
            total = phases["host"][i] + phases["forward"][i] + phases["wait"][i]
            # the phases tile the step() call: only the bench's own call overhead lies outside them
            assert total <= step_ms and step_ms - total < max(0.1 * step_ms, 1.0)
        for k in ("schedule", "build", "forward", "wait", "post", "host"):
            assert r[f"{k}_ms"] == statistics.median(phases[k])
        assert r["schedule_ms"] + r["build_ms"] + r["post_ms"] > 0 and r["host_ms"] <= ms
        hf_steps = hf["step_ms"][str(r["batch"])]
        assert len(hf_steps) == steps and min(hf_steps) > 0
        assert r["hf_forward_ms"] == statistics.median(hf_steps) == hf["ms_median"][str(r["batch"])]
        assert r["step_over_hf"] == pytest.approx(ms / r["hf_forward_ms"])
        if r["sampling"] == "greedy":
            assert f"| {r['floor_ms']:.2f} | {r['step_over_floor']:.2f}x / " in table
            assert f"| {r['schedule_ms']:.3f} / {r['build_ms']:.3f} / {r['post_ms']:.3f} " \
                   f"| {r['hf_forward_ms']:.2f} | {r['step_over_hf']:.2f}x / " in table


class FakeClock:
    """A clock that moves only when told: the phase clock's laps become exact, whatever the machine's load.
    Steps are powers of two, so every sum and difference below is exact in binary floating point."""

    def __init__(self) -> None:
        self.now = 1.0

    def __call__(self) -> float:
        return self.now


def test_step_phases_charge_each_lap_and_time_batch_building() -> None:
    """Laps charge the time since the previous mark to their phase; what the runner counted as batch
    building during a forward lap moves from forward to build (never more than the lap itself)."""
    built, clock = BuildTime(), FakeClock()
    phases = StepPhases(built, clock=clock)
    clock.now += 8.0  # between construction and begin: charged to nothing
    phases.begin()
    clock.now += 0.25
    phases.lap(SCHEDULE)
    clock.now += 0.75
    built.seconds += 0.5  # the runner says 0.5 s of those 0.75 built the batch
    phases.lap(FORWARD)
    clock.now += 0.125
    phases.lap(WAIT)
    clock.now += 0.0625
    phases.end()

    # a second step: the runner's count outgrows the forward lap (it counted some building before it)
    phases.begin()
    phases.lap(SCHEDULE)
    clock.now += 0.25
    built.seconds += 0.5
    phases.lap(FORWARD)
    phases.lap(WAIT)
    phases.end()

    first, second = phases.times()
    assert (first.schedule_s, first.build_s, first.forward_s, first.wait_s, first.post_s) == (0.25, 0.5, 0.25, 0.125, 0.0625)
    assert first.host_s == 0.25 + 0.5 + 0.0625 and first.total_s == 1.1875
    assert (second.schedule_s, second.build_s, second.forward_s, second.wait_s, second.post_s) == (0.0, 0.25, 0.0, 0.0, 0.0)
    assert second.total_s == 0.25


def test_hf_forward_skips_a_model_transformers_cannot_build(tmp_path: Path) -> None:
    from radixserve_bench.hf_step import hf_forward

    model_dir = write_shape_dir({**TINY, "model_type": "no-such-architecture"}, tmp_path / "odd", None)
    result = hf_forward(str(model_dir), torch.device("cpu"), torch.float32, {1: [[1, 2, 3]]}, steps=2, warmup=0)
    assert result.source is None and result.skipped is not None and "transformers could not build" in result.skipped
    assert result.ms(1) is None and result.to_json()["ms_median"] == {}

