"""The focused measurements under `radixserve bench` (radixserve_bench/checks/): every check in the table
is a subcommand with its own flags and help, one that lacks a library says which and exits 2, and the
report-only checks reproduce their tables from results files."""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

import pytest

from radixserve_bench import cli as bench_cli
from radixserve_bench.checks import CHECKS, Check, refusal, run_check
from radixserve_bench.checks.greedy_agreement import leading_agreement


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="radixserve bench")
    bench_cli.add_bench_arguments(p)
    return p


def test_every_check_is_a_subcommand_listed_in_the_help() -> None:
    help_text = _parser().format_help()
    for name in CHECKS:
        assert f"    {name}" in help_text, name
    args = _parser().parse_args(["attack", "--rounds", "3", "-h"])
    assert args.bench_command == "attack" and args.passthrough_args == ["--rounds", "3", "-h"]


@pytest.mark.parametrize("check", [c for c in CHECKS.values() if refusal(c) is None], ids=lambda c: c.name)
def test_each_check_parses_its_own_flags(check: Check, capsys: pytest.CaptureFixture[str]) -> None:
    module = importlib.import_module(f"radixserve_bench.checks.{check.module}")
    assert module.__doc__ and callable(module.run)
    with pytest.raises(SystemExit) as exited:
        run_check(check, ["--help"])
    assert exited.value.code == 0
    assert f"usage: radixserve bench {check.name}" in capsys.readouterr().out


def test_a_check_without_its_library_names_it(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    missing = Check("needs-something", "host_tier_fits", "a check needing a library no one installs",
                    elsewhere=("radixserve_no_such_library",))
    monkeypatch.setitem(CHECKS, missing.name, missing)
    assert bench_cli.run_bench(_parser().parse_args(["needs-something"])) == 2
    err = capsys.readouterr().err
    assert "radixserve bench needs-something needs radixserve_no_such_library" in err
    assert "pip install radixserve_no_such_library" in err


def _bench_results(tok_s: dict[tuple[str, str], float]) -> dict[str, object]:
    results: dict[str, dict[str, object]] = {}
    for (workload, system), value in tok_s.items():
        results.setdefault(workload, {})[system] = {"median": {"total_tokens_per_s": value}}
    return {"results": results}


def test_host_tier_fits_renders_the_ratio_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "before-1.json").write_text(json.dumps(_bench_results({("multi-turn", "radixserve"): 1000.0})))
    (tmp_path / "after-1.json").write_text(json.dumps(_bench_results({("multi-turn", "radixserve"): 990.0,
                                                                       ("multi-turn", "radixserve-host"): 1010.0})))
    assert bench_cli.main(["host-tier-fits", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| 1 | multi-turn | 1,000 | 990 | 1,010 | 0.990 | 1.010 | 1.020 |" in out
    assert "Lowest ratio to `before`: 0.990" in out and "radixserve bench host-tier-fits" in out


def test_leading_agreement_counts_the_shared_head() -> None:
    assert leading_agreement([1, 2, 3], [1, 2, 4, 5]) == 2
    assert leading_agreement([7], [8]) == 0 and leading_agreement([1, 2], [1, 2, 3]) == 2


def test_cpu_attention_tables_share_the_prefix_blocks_and_nothing_else() -> None:
    import torch

    from radixserve_bench.checks.cpu_attention import BLOCK, block_table

    for scattered in (False, True):
        table, pool = block_table(3, 5 * BLOCK + 3, 2 * BLOCK + 5, scattered, torch.Generator().manual_seed(0))
        assert table.shape == (3, 6) and table.dtype == torch.int32 and table.is_contiguous()
        assert (table[:, :2] == table[0, :2]).all()  # the shared tokens' whole blocks, in every row
        own = table[:, 2:].flatten().tolist()
        assert len(set(own) | set(table[0, :2].tolist())) == len(own) + 2  # every other block a row's own
        assert int(table.min()) >= 0 and int(table.max()) < pool


@pytest.mark.parametrize(("queries", "cold_mb"), [(1, 0), (1, 1), (3, 0), (20, 0)])
def test_cpu_attention_times_decodes_and_longer_rows_over_a_shared_prefix(queries: int, cold_mb: int) -> None:
    import torch

    from radixserve.kernels.cpu_extension import load_extension
    from radixserve_bench.checks.cpu_attention import measure

    load_extension()
    row = measure(2, 70, 1, torch.Generator().manual_seed(0), shared=40, queries=queries, cold_mb=cold_mb)
    assert (row["batch"], row["context"], row["shared"], row["queries"], row["cold_mb"]) == (2, 70, 32, queries, cold_mb)
    assert row["in_place_ms"] > 0
    # short rows are also run through the gather and SDPA, and their outputs compared inside `measure`
    assert ("gather_sdpa_ms" in row) == (queries <= 16)


def test_cpu_attention_cold_takes_whole_megabytes_from_zero() -> None:
    import argparse

    from radixserve_bench.checks.cpu_attention import megabytes

    assert megabytes("0") == 0 and megabytes("128") == 128
    with pytest.raises(argparse.ArgumentTypeError, match="0 or more"):
        megabytes("-1")


def test_cpu_ggml_layers_times_the_four_projections_in_step_order(capsys: pytest.CaptureFixture[str]) -> None:
    from radixserve.kernels.cpu_extension import load_extension
    from radixserve.kernels.ggml_quants import FORMATS
    from radixserve_bench.checks.cpu_ggml import LAYER_SHAPES, layer_rows
    from radixserve_bench.checks.cpu_linear import SHAPES

    load_extension()
    rows = layer_rows(["Q4_1", "Q8_0"], ["int8"], layers=2, repeats=3)
    assert [(r["weights"], r["activations"], r["layers"]) for r in rows] == [("Q4_1", "int8", 2), ("Q8_0", "int8", 2)]
    for row in rows:
        assert len(row["passes_us"]) == 3 and row["us"] in row["passes_us"]  # the median of three passes
        assert row["GBps"] == pytest.approx(row["bytes"] / row["us"] / 1e3)
    # each format's tiles hold its GGUF blocks of `group` inputs, as the file stores them, plus the header
    weights = sum(out * inp for out, inp in (SHAPES[name] for name in LAYER_SHAPES))
    q4_1, q8_0 = (2 * weights // FORMATS[t].group * FORMATS[t].block_bytes for t in ("Q4_1", "Q8_0"))
    assert rows[0]["bytes"] > q4_1 and rows[1]["bytes"] > q8_0
    assert rows[1]["bytes"] - q8_0 == rows[0]["bytes"] - q4_1  # headers alike
    assert capsys.readouterr().out.count('"shape": "layers"') == 2


def test_cpu_ggml_layers_refuses_a_type_whose_blocks_do_not_divide_the_inputs() -> None:
    import argparse

    from radixserve_bench.checks.cpu_ggml import layer_rows, positive

    with pytest.raises(SystemExit, match="Q4_K's blocks of 256 inputs do not divide"):
        layer_rows(["Q4_K"], ["int8"], layers=1, repeats=1)
    with pytest.raises(argparse.ArgumentTypeError, match="at least 1"):
        positive("0")


@pytest.mark.parametrize("flags", [["--types", "Q4_1,Q9_9"], ["--activations", "int4"]])
def test_cpu_ggml_names_an_unknown_type_or_activation(flags: list[str]) -> None:
    check = CHECKS["cpu-ggml"]
    with pytest.raises(SystemExit, match=f"unknown {flags[1].split(',')[-1]} "):
        run_check(check, flags)
