"""Does the embedded model answer the same served as shipped (its Q4_1 GGUF in the C++ kernels) as
from its fp32 conversion (`--dtype float32`)? The twenty chat prompts run greedy through the engine
both ways (speculation off) and the answers are compared token by token. The kernels decode the
file's blocks to exactly the weights the conversion holds and multiply them in the fp32 kernel's
order, so every answer should be identical; this check says whether the served model is.

    radixserve bench gguf-agreement --json docs/bench/quantized/gguf_agreement.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from radixserve_bench.checks.cpu_dtype import answers
from radixserve_bench.checks.greedy_agreement import QUESTIONS, leading_agreement


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None)


def run(args: argparse.Namespace) -> int:
    shipped = answers(None, args.max_tokens)
    converted = answers("float32", args.max_tokens)
    leading = [leading_agreement(a, b) for a, b in zip(shipped, converted)]
    result: dict[str, Any] = dict(
        prompts=len(QUESTIONS), max_tokens=args.max_tokens,
        identical_answers=sum(a == b for a, b in zip(shipped, converted)),
        mean_leading_tokens_agreeing=statistics.fmean(leading),
        tokens_compared=sum(min(len(a), len(b)) for a, b in zip(shipped, converted)),
        leading_tokens_agreeing=leading, date=time.strftime("%Y-%m-%d"))
    print(json.dumps({k: v for k, v in result.items() if k != "leading_tokens_agreeing"}, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["identical_answers"] == len(QUESTIONS) else 1
