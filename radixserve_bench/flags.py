"""The command-line pieces every `radixserve bench` scenario shares: comma lists, `--param`, the output
flags that harness.run_scenario reads, and the usage error they all raise.

Importing this module is cheap (argparse only): the bench's parsers are built from it.
"""

from __future__ import annotations

import argparse


class BenchConfigError(ValueError):
    """Options that cannot make a benchmark; reported as a usage error, not a crash."""


def add_model_arguments(group: argparse._ArgumentGroup, device_help: str = "auto | cpu | cuda") -> None:
    """The model and its numerics: --model, --device, --dtype, --block-size."""
    group.add_argument("--model", default=None, help="HF model directory (default: the embedded SmolLM2-135M-Instruct)")
    group.add_argument("--device", default="auto", help=device_help)
    group.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV block / page (default %(default)s)")


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def parse_params(items: list[str]) -> dict[str, dict[str, str]]:
    """`--param WORKLOAD.FIELD=N` items as workload -> field -> value (checked by the workload later)."""
    out: dict[str, dict[str, str]] = {}
    for item in items:
        key, eq, value = item.partition("=")
        workload, dot, field = key.partition(".")
        if not eq or not dot or not field or not value:
            raise BenchConfigError(f"--param wants WORKLOAD.FIELD=N, got {item!r}")
        out.setdefault(workload, {})[field] = value
    return out


def add_param_argument(g: argparse._ArgumentGroup, example: str) -> None:
    g.add_argument("--param", action="append", default=[], metavar="WORKLOAD.FIELD=N",
                   help=f"override a workload parameter, e.g. {example} (repeatable)")


def add_output_arguments(g: argparse._ArgumentGroup, default_out: str) -> None:
    g.add_argument("--out", default=default_out, help="output directory (default %(default)s)")
    g.add_argument("--publish", default=None, metavar="DIR", help="also copy table, JSON and charts (+ README.md) here")
    g.add_argument("--no-charts", action="store_true", help="skip the PNG charts")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
