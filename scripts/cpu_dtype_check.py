"""Does the embedded model answer the same in bf16 as in fp32 on CPU? The same chat prompts run
greedy through the engine twice, once per dtype (speculation off, so each run is plain decoding),
and each bf16 answer is compared token by token with the fp32 one: how many answers are identical,
and how many leading tokens agree. A third run in fp32 checks the comparison itself (it must agree
with the first on every token: the engine is deterministic).

    .venv/bin/python scripts/cpu_dtype_check.py --json docs/bench/issue-31/bf16_agreement.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from radixserve import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?", "Explain photosynthesis in two sentences.", "Write a haiku about the sea.",
    "How do I reverse a list in Python?", "Give three tips for better sleep.", "What causes rain?",
    "Summarize the plot of Romeo and Juliet.", "What is 17 times 23?", "Name five fruits that are red.",
    "Why is the sky blue?", "Describe a cat to someone who has never seen one.", "What is a prime number?",
    "Translate 'good morning' into Spanish and German.", "List the planets of the solar system.",
    "How does a refrigerator keep food cold?", "Write a short thank-you note to a teacher.",
    "What is the difference between weather and climate?", "Suggest a name for a bakery.",
    "How many days are in a leap year?", "What does a compiler do?",
]


def answers(dtype: str, max_tokens: int) -> list[list[int]]:
    """Speed is `radixserve bench step --dtype`'s to measure, alone; this only compares tokens."""
    llm = LLM(dtype=dtype, num_speculative_tokens=0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], params)
    return [list(o.outputs[0].token_ids) for o in outs]


def leading_agreement(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
