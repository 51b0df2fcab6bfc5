"""llguidance against xgrammar on the structured bench's schemas, with the embedded model's tokenizer:
how many schemas each compiles, how long a compile takes, and how long one token mask takes (over a
seeded random walk of allowed tokens). The measurement behind the engine's choice of llguidance
(docs/structured_output.md). Needs `pip install xgrammar` (not a radixserve dependency).

    radixserve bench grammar-backends > docs/bench/structured-output/grammar_backends.md
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from importlib.metadata import version
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from radixserve.model.embedded import resolve_model
from radixserve.model.loader import load_tokenizer
from radixserve.structured import JSON_OPTIONS
from radixserve_bench.structured.schemas import all_schemas

WALK = 48  # tokens per random walk: the masks measured per schema


def allowed(bitmask: torch.Tensor, vocab: int) -> list[int]:
    bits = ((bitmask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab]
    return bits.nonzero().flatten().tolist()


def walk_llguidance(matcher: Any, vocab: int, rng: random.Random) -> list[float]:
    bitmask, times = llguidance.torch.allocate_token_bitmask(1, vocab), []
    for _ in range(WALK):
        if matcher.is_stopped():
            break
        started = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        times.append(time.perf_counter() - started)
        options = allowed(bitmask, vocab)
        if not options or not matcher.consume_token(rng.choice(options)):
            break
    return times


def walk_xgrammar(matcher: Any, vocab: int, rng: random.Random) -> list[float]:
    import xgrammar  # here, not at the top: the module's flags are read where xgrammar is absent
    bitmask, times = xgrammar.allocate_token_bitmask(1, vocab), []
    for _ in range(WALK):
        if matcher.is_terminated():
            break
        started = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        times.append(time.perf_counter() - started)
        options = allowed(bitmask, vocab)
        if not options or not matcher.accept_token(rng.choice(options)):
            break
    return times


def compile_xgrammar(compiler: Any, schema: dict[str, Any]) -> tuple[Any, str]:
    """xgrammar's compiled schema and what it wrote to stderr meanwhile (it logs the schema features it
    ignores there, from C++: the file descriptor is redirected, not sys.stderr)."""
    with tempfile.TemporaryFile() as captured:
        saved = os.dup(2)
        os.dup2(captured.fileno(), 2)
        try:
            compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        captured.seek(0)
        return compiled, captured.read().decode(errors="replace")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options: the schemas, the tokenizer and the walks are fixed."""


def run(args: argparse.Namespace) -> int:
    import xgrammar  # here, not at the top: the module's flags are read where xgrammar is absent
    tokenizer = load_tokenizer(resolve_model(None)[0])
    if tokenizer is None:
        raise SystemExit("radixserve bench grammar-backends: the embedded model has no tokenizer files")
    vocab = len(tokenizer)
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    xgr_compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab),
                                            cache_enabled=False)
    results: dict[str, dict[str, list[float]]] = {"llguidance": {"compile": [], "mask": []},
                                                  "xgrammar": {"compile": [], "mask": []}}
    failed: dict[str, list[str]] = {"llguidance": [], "xgrammar": []}
    ignored: list[str] = []  # schemas whose constraints xgrammar compiled only in part
    schemas = all_schemas()
    for bench in schemas:
        for backend in results:
            rng = random.Random(bench.name)
            started = time.perf_counter()
            try:
                if backend == "llguidance":
                    grammar = llguidance.LLMatcher.grammar_from_json_schema(bench.schema, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
                    matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
                    if matcher.is_error():
                        raise ValueError(matcher.get_error())
                else:
                    compiled, log = compile_xgrammar(xgr_compiler, bench.schema)
                    if "ignoring" in log or "not supported" in log:
                        ignored.append(bench.name)
                    matcher = xgrammar.GrammarMatcher(compiled)
            except Exception as e:  # a schema this backend cannot compile: counted, with its reason
                failed[backend].append(f"{bench.name}: {str(e).splitlines()[0][:100]}")
                continue
            results[backend]["compile"].append(time.perf_counter() - started)
            walk = walk_llguidance if backend == "llguidance" else walk_xgrammar
            results[backend]["mask"] += walk(matcher, vocab, rng)
    print(f"# Grammar backends on the structured bench's {len(schemas)} schemas\n")
    print(f"Tokenizer: the embedded SmolLM2 ({vocab} tokens); llguidance {version('llguidance')}"
          f" vs xgrammar {version('xgrammar')}; compile caches off; masks over seeded random walks of up to {WALK}"
          " allowed tokens per schema. Command: `radixserve bench grammar-backends`.\n")
    print("| backend | schemas compiled | compile p50 (ms) | compile p95 (ms) | compile max (ms) | mask mean (µs) "
          "| mask p95 (µs) |")
    print("|---|---|---|---|---|---|---|")
    for backend, got in results.items():
        compile_ms = sorted(t * 1e3 for t in got["compile"])
        mask_us = sorted(t * 1e6 for t in got["mask"])

        def pct(xs: list[float], q: float) -> float:
            return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")
        print(f"| {backend} | {len(compile_ms)}/{len(schemas)} | {pct(compile_ms, 0.5):.2f} | {pct(compile_ms, 0.95):.2f} "
              f"| {max(compile_ms, default=float('nan')):.2f} | {statistics.fmean(mask_us) if mask_us else float('nan'):.1f} "
              f"| {pct(mask_us, 0.95):.1f} |")
    print(f"\nxgrammar compiled {len(ignored)} of the {len(schemas)} schemas only in part (it logged that it ignores "
          "a keyword, e.g. minLength/maxLength next to a pattern): its output for them may not validate.")
    for backend, reasons in failed.items():
        if reasons:
            print(f"\n{backend} could not compile:\n")
            for reason in reasons:
                print(f"- {reason}")
    return 0
