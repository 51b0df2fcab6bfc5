"""What an entirely wrong prediction costs: the same greedy edit requests with no prediction and with
a prediction of unrelated text of similar length, interleaved over rounds on one engine with the
prefix cache off (so the tree drafts for neither), decode seconds per request compared.

    radixserve bench spec-wrong-prediction --rounds 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from radixserve.engine import LLM
from radixserve.sampling_params import SamplingParams

CODE = ("def total_price(items, tax):\n    subtotal = 0\n    for item in items:\n        subtotal += item.price * "
        "item.count\n    return subtotal * (1 + tax)\n")
UNRELATED = ("The committee met on Tuesday to review the harbour survey. Tide tables were compared with the "
             "records of the previous winter, and the members agreed to repaint the northern beacon before "
             "the spring storms arrive.")


def decode_s(llm: LLM, prediction: str | None, max_tokens: int) -> tuple[float, int]:
    messages = [{"role": "user", "content": "Rename `subtotal` to `amount` and return the whole function:\n```python\n"
                 + CODE + "```"}]
    start = time.perf_counter()
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=max_tokens, prediction=prediction))[0]
    assert out.timing.first_token is not None
    return time.perf_counter() - start - (out.timing.first_token - out.timing.arrival), out.usage.completion_tokens


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--json", default=None)


def run(a: argparse.Namespace) -> int:
    llm = LLM(enable_prefix_cache=False)
    decode_s(llm, None, 8)  # warm-up
    runs: dict[str, list[float]] = {"none": [], "wrong": []}
    tokens = {}
    for _ in range(a.rounds):
        for name, prediction in (("none", None), ("wrong", UNRELATED)):
            seconds, tokens[name] = decode_s(llm, prediction, a.max_tokens)
            runs[name].append(seconds)
    none, wrong = statistics.median(runs["none"]), statistics.median(runs["wrong"])
    assert tokens["none"] == tokens["wrong"], "a prediction must not change the reply"
    print(f"decode s (median of {a.rounds}): no prediction {none:.3f}, wrong prediction {wrong:.3f}, "
          f"ratio {wrong / none:.3f}x ({tokens['none']} tokens each)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"runs": runs, "tokens": tokens, "ratio": wrong / none}, f, indent=1)
    return 0
