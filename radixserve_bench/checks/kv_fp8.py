"""Does the embedded model answer the same with an FP8 KV cache (`--kv-cache-dtype fp8`), or an fp16 one
(`--kv-cache-dtype fp16`)? For each model dtype (fp32, bf16; auto: the shipped GGUF), the chat prompts
of `radixserve bench cpu-dtype` run greedy on the CPU with the cache in the model's dtype (the
reference) and in the narrower one, speculation off:

- free-running: identical answers, answers whose first 16 tokens are identical, and the share of
  tokens before an answer's first divergence;
- per token (teacher-forced): each reference answer is fed back as the prompt to fresh engines
  (prefix cache off) that report their most likely token at every position (`prompt_logprobs`); the
  share of the answer's positions where the narrower cache's engine's choice is the reference engine's.

    radixserve bench kv-fp8 --json docs/bench/kv-fp8/kv_fp8_agreement.json
    radixserve bench kv-fp8 --kv-cache-dtype fp16 --dtypes auto,float32 --json docs/bench/quantized/kv_fp16_agreement.json
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

HEAD = 16  # the "first 16 tokens identical"


def answers(dtype: str, kv: str, max_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, greedy answer ids) per question."""
    llm = LLM(dtype=dtype, kv_cache_dtype=kv, num_speculative_tokens=0)
    outs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], SamplingParams(temperature=0.0,
                                                                                         max_tokens=max_tokens))
    return [list(o.prompt_token_ids) for o in outs], [list(o.outputs[0].token_ids) for o in outs]


def choices(dtype: str, kv: str, texts: list[list[int]], starts: list[int]) -> list[list[int]]:
    """The engine's most likely next token at each position from `starts[i]` on, given texts[i]'s
    tokens before it."""
    llm = LLM(dtype=dtype, kv_cache_dtype=kv, num_speculative_tokens=0, enable_prefix_cache=False)
    prompts: list[str | list[int]] = list(texts)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))
    picked = []
    for out, start in zip(outs, starts):
        assert out.prompt_logprobs is not None
        picked.append([lp.top[0][0] for lp in out.prompt_logprobs[start:] if lp is not None])
    return picked


def compare(dtype: str, max_tokens: int, kv: str = "fp8") -> dict[str, Any]:
    prompts, ref = answers(dtype, "model", max_tokens)
    _, fp8 = answers(dtype, kv, max_tokens)
    if answers(dtype, "model", max_tokens)[1] != ref:
        raise SystemExit(f"two {dtype} runs disagree: the comparison would mean nothing")
    leading = [leading_agreement(a, b) for a, b in zip(ref, fp8)]
    texts = [p + a for p, a in zip(prompts, ref)]
    starts = [len(p) for p in prompts]  # position len(p) holds the answer's first token
    ref_picks, fp8_picks = choices(dtype, "model", texts, starts), choices(dtype, kv, texts, starts)
    same = sum(a == b for r, f in zip(ref_picks, fp8_picks) for a, b in zip(r, f))
    positions = sum(min(len(r), len(f)) for r, f in zip(ref_picks, fp8_picks))
    return dict(
        kv_cache_dtype=kv, prompts=len(QUESTIONS), max_tokens=max_tokens,
        identical_answers=sum(a == b for a, b in zip(ref, fp8)),
        first_16_identical=sum(a[:HEAD] == b[:HEAD] for a, b in zip(ref, fp8)),
        fraction_of_tokens_before_first_divergence=sum(leading) / sum(min(len(a), len(b)) for a, b in zip(ref, fp8)),
        teacher_forced_positions=positions, teacher_forced_agreement=same / positions,
        mean_tokens_per_answer=statistics.fmean(len(a) for a in ref), leading_tokens_agreeing=leading)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtypes", default="float32,bfloat16", help="model dtypes, comma-separated (auto: the "
                        "embedded model as shipped, its GGUF)")
    parser.add_argument("--kv-cache-dtype", default="fp8", choices=("fp8", "fp16"), help="the narrower cache")
    parser.add_argument("--json", type=Path, default=None)


def run(args: argparse.Namespace) -> int:
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d")}
    for dtype in args.dtypes.split(","):
        result[dtype] = compare(dtype, args.max_tokens, args.kv_cache_dtype)
        print(dtype, json.dumps({k: v for k, v in result[dtype].items() if k != "leading_tokens_agreeing"}, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0
