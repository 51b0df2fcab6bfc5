"""Does the embedded model answer the same in bf16 as in fp32 on CPU? The same chat prompts run
greedy through the engine twice, once per dtype (speculation off, so each run is plain decoding),
and each bf16 answer is compared token by token with the fp32 one: how many answers are identical,
and how many leading tokens agree. A third run in fp32 checks the comparison itself (it must agree
with the first on every token: the engine is deterministic).

    radixserve bench cpu-dtype --json docs/bench/cpu-step/bf16_agreement.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from radixserve.engine import LLM
from radixserve.sampling_params import SamplingParams
from radixserve_bench.checks.greedy_agreement import QUESTIONS, leading_agreement


def answers(dtype: str, max_tokens: int) -> list[list[int]]:
    """Speed is `radixserve bench step --dtype`'s to measure, alone; this only compares tokens."""
    llm = LLM(dtype=dtype, num_speculative_tokens=0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], params)
    return [list(o.outputs[0].token_ids) for o in outs]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None)


def run(args: argparse.Namespace) -> int:
    fp32 = answers("float32", args.max_tokens)
    again = answers("float32", args.max_tokens)
    bf16 = answers("bfloat16", args.max_tokens)
    if again != fp32:
        raise SystemExit("two fp32 runs disagree: the comparison would mean nothing")
    leading = [leading_agreement(a, b) for a, b in zip(fp32, bf16)]
    shorter = [min(len(a), len(b)) for a, b in zip(fp32, bf16)]
    result: dict[str, Any] = dict(
        prompts=len(QUESTIONS), max_tokens=args.max_tokens,
        identical_answers=sum(a == b for a, b in zip(fp32, bf16)),
        mean_leading_tokens_agreeing=statistics.fmean(leading),
        mean_tokens_per_answer_fp32=statistics.fmean(len(a) for a in fp32),
        first_token_agrees=sum(n > 0 for n in leading),
        fraction_of_tokens_before_first_divergence=sum(leading) / sum(shorter),
        leading_tokens_agreeing=leading, date=time.strftime("%Y-%m-%d"))
    print(json.dumps({k: v for k, v in result.items() if k != "leading_tokens_agreeing"}, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0
