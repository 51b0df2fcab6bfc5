"""Does the embedded model answer the same served as shipped (its Q4_1 GGUF in the C++ kernels) as
from its fp32 conversion (`--dtype float32`)? The twenty chat prompts run greedy through the engine
three ways (speculation off): as shipped with int8 activations and K/V in fp16 (the defaults,
llama.cpp's way), as shipped with fp32 activations and K/V (`--quantized-activations float32
--kv-cache-dtype model`) and converted.

- fp32 activations must answer exactly what the conversion answers: the kernels decode the file's
  blocks to the weights the conversion holds and multiply them in the fp32 kernel's order (the exit
  code says whether every answer is identical);
- int8 activations compute another model (each linear's inputs rounded to 8 bits per block of 32):
  how many answers are identical, how many leading tokens agree, and, teacher-forced, at how many
  positions of its own answers the conversion's argmax is the token it chose.

    radixserve bench gguf-agreement --json docs/bench/quantized/gguf_agreement.json
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


def _llm(**config: Any) -> LLM:
    return LLM(num_speculative_tokens=0, **config)


def _answers(llm: LLM, max_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """Each prompt's tokens and greedy answer."""
    outs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS],
                    SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return [list(o.prompt_token_ids) for o in outs], [list(o.outputs[0].token_ids) for o in outs]


def teacher_forced(llm: LLM, prompts: list[list[int]], answers: list[list[int]]) -> tuple[int, int]:
    """At how many of the answers' positions `llm`'s most likely token is the answer's, of how many."""
    forced: list[str | list[int]] = [p + a for p, a in zip(prompts, answers)]
    outs = llm.generate(forced,
                        SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))
    agree = total = 0
    for prompt, answer, out in zip(prompts, answers, outs):
        scored = out.prompt_logprobs or []
        for i, token in enumerate(answer):
            entry = scored[len(prompt) + i]
            agree += entry is not None and bool(entry.top) and entry.top[0][0] == token
            total += 1
    return agree, total


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None)


def run(args: argparse.Namespace) -> int:
    prompts, int8 = _answers(_llm(), args.max_tokens)
    _, float_activations = _answers(_llm(quantized_activations="float32", kv_cache_dtype="model"), args.max_tokens)
    converted_llm = _llm(dtype="float32")
    _, converted = _answers(converted_llm, args.max_tokens)
    agree, total = teacher_forced(converted_llm, prompts, int8)
    leading = [leading_agreement(a, b) for a, b in zip(int8, converted)]
    result: dict[str, Any] = dict(
        prompts=len(QUESTIONS), max_tokens=args.max_tokens,
        float32_activations_identical_answers=sum(a == b for a, b in zip(float_activations, converted)),
        int8_identical_answers=sum(a == b for a, b in zip(int8, converted)),
        int8_mean_leading_tokens_agreeing=statistics.fmean(leading),
        int8_teacher_forced_agreement=agree / total, int8_tokens_teacher_forced=total,
        int8_leading_tokens_agreeing=leading, date=time.strftime("%Y-%m-%d"))
    print(json.dumps({k: v for k, v in result.items() if k != "int8_leading_tokens_agreeing"}, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["float32_activations_identical_answers"] == len(QUESTIONS) else 1
