"""`radixserve bench structured`: runs the structured workload on one engine and builds its results
document (harness.run_scenario writes, prints and publishes it).

Order, and why: compile times first (a cold compile must be the constraint's first in the engine's
compiler, before any request compiles it), then schema validity, tool calls and the step test; last,
on two fresh engines that differ only in `EngineConfig.forced_tokens`, the fixed-keys schema with
forced tokens on and off, and the step test again without forced tokens (one token per row per step
in both modes: what the mask alone costs).

Invariants: every figure comes from this run; `results["results"]` holds the one entry
metrics.check_complete reads (its median lists the headline figures, which must all be finite), so
the exit status says whether every part ran; the targets are evaluated in report.py.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from radixserve.structured import StructuredOutput
from radixserve_bench import results as results_mod
from radixserve_bench.flags import BenchConfigError
from radixserve_bench.structured import SCENARIO
from radixserve_bench.structured.measure import StepLog
from radixserve_bench.structured.schemas import FORCED, STEP, BenchSchema, all_schemas
from radixserve_bench.structured.timing import StepTest, compile_times, forced_steps, step_cost
from radixserve_bench.structured.tool_defs import TOOLS, BenchTool
from radixserve_bench.structured.validity import Sampling, schema_validity, tool_validity

SYSTEM = "radixserve"
# the headline figures: check_complete fails the run when one is missing or not finite
HEADLINE = ("schema_valid_pct", "schema_length", "tool_valid_pct", "compile_cold_p50_ms", "compile_cached_p50_ms",
            "tool_compile_cold_p50_ms", "step_ratio", "step_ratio_no_forced", "forced_steps_ratio")


@dataclass
class StructuredBenchOptions:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    schemas: tuple[str, ...] = ()  # names to run (empty: every schema of the catalog)
    max_schemas: int | None = None  # the first N of them
    tools: int | None = None  # the first N tools (None: all)
    max_tokens: int = 256
    samples: int = 2  # sampled replies per schema / tool and choice, besides the greedy one
    temperature: float = 0.8
    cached_repeats: int = 20  # cached compiles timed per constraint
    step_batch: int = 16
    step_steps: int = 16
    step_warmup: int = 3
    step_rounds: int = 4  # alternating (U C, C U, ...): load drift on a shared machine falls on both modes
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_blocks: int | None = None
    torch_threads: int | None = None


def pick_schemas(o: StructuredBenchOptions) -> list[BenchSchema]:
    catalog = all_schemas()
    if o.schemas:
        known = {s.name: s for s in catalog}
        unknown = [n for n in o.schemas if n not in known]
        if unknown:
            raise BenchConfigError(f"unknown schema(s) {', '.join(unknown)}; see radixserve_bench/structured/catalog_*.py")
        catalog = [known[n] for n in o.schemas]
    return catalog[:o.max_schemas] if o.max_schemas else catalog


def _engine_config(o: StructuredBenchOptions, **over: Any) -> dict[str, Any]:
    """Speculation off: constrained rows never draft, so unconstrained ones must not either for the step
    test to compare one token per row per step in both modes."""
    return dict(device=o.device, dtype=o.dtype, seed=o.seed, block_size=o.block_size, num_blocks=o.num_blocks,
                max_num_seqs=max(o.max_num_seqs, o.step_batch), max_num_batched_tokens=o.max_num_batched_tokens,
                num_speculative_tokens=0, cpu_threads=o.torch_threads, **over)


def tool_constraints(llm: Any, tools: list[BenchTool]) -> dict[str, StructuredOutput]:
    """The constraints a tool request compiles: "required" over every tool, and each tool named."""
    from radixserve.chat.tools import ToolChoice

    offered = [t.openai() for t in tools]
    out: dict[str, StructuredOutput] = {}
    for name, choice in [("required", ToolChoice("required")), *((f"named:{t.name}", ToolChoice("named", t.name))
                                                                  for t in tools)]:
        chat_tools = llm.chat_tools(offered, choice, parallel_tool_calls=False)
        constraint = chat_tools.format.constraint(list(chat_tools.tools), choice, False)
        if constraint is not None:
            out[name] = constraint
    return out


@contextmanager
def _timed(timings: dict[str, float], name: str) -> Iterator[None]:
    started = time.monotonic()
    yield
    timings[name] = time.monotonic() - started


def _main_parts(o: StructuredBenchOptions, schemas: list[BenchSchema], tools: list[BenchTool],
                timings: dict[str, float]) -> tuple[dict[str, Any], Any]:
    """Compile times, validity, tool calls and the step test on one engine; (parts, engine facts)."""
    from radixserve.engine.llm import LLM

    llm = LLM(o.model, **_engine_config(o))
    engine = llm.engine
    log = StepLog()
    engine.add_step_observer(log)
    parts: dict[str, Any] = {}
    sampling = Sampling(o.max_tokens, o.samples, o.temperature, o.seed)
    with _timed(timings, "compile"):
        parts["compile"] = {
            "schemas": compile_times(engine, {s.name: StructuredOutput(json=s.schema) for s in schemas}, o.cached_repeats),
            "tool_parameters": compile_times(engine, {t.name: StructuredOutput(json=t.parameters) for t in tools},
                                             o.cached_repeats),
            "tool_calls": compile_times(engine, tool_constraints(llm, tools), o.cached_repeats)}
    before = engine.stats()
    with _timed(timings, "validity"):
        validity = parts["validity"] = schema_validity(llm, schemas, sampling)
    after = engine.stats()
    validity["forced_tokens"] = after.forced_tokens - before.forced_tokens
    validity["generated_tokens"] = after.generation_tokens - before.generation_tokens
    validity["mask_ms_per_row"] = 1000 * (after.mask_s - before.mask_s) / max(1, after.mask_rows - before.mask_rows)
    with _timed(timings, "tools"):
        parts["tools"] = tool_validity(llm, tools, sampling)
    parts["step_test"] = test = StepTest(llm.formatter.prompt_tokens(STEP.messages()), StructuredOutput(json=STEP.schema),
                                         o.step_batch, o.step_steps, o.step_warmup, o.step_rounds, o.temperature, o.seed)
    with _timed(timings, "step"):
        parts["step"] = step_cost(engine, log, test)
    stats = engine.stats()
    parts["engine_stats"] = {k: getattr(stats, k) for k in (
        "constrained_requests", "grammar_compiles", "grammar_cache_hits", "grammar_compile_failures", "grammar_compile_s",
        "mask_steps", "mask_rows", "mask_s", "forced_tokens", "grammar_dead_ends", "generation_tokens")}
    parts["forced_prompt"] = llm.formatter.prompt_tokens(FORCED.messages())
    return parts, ((engine.model_dir, engine.model_name), engine.spec)


def _forced_part(o: StructuredBenchOptions, prompt: list[int], step: StepTest,
                 timings: dict[str, float]) -> dict[str, Any]:
    """The fixed-keys schema on two fresh engines, forced tokens on and off; then the step test on the
    one without them, where a constrained step decodes exactly one token per row, as an unconstrained
    one does (the mask's cost alone)."""
    from radixserve.engine.llm import LLM

    engines = {}
    for mode, forced in (("on", True), ("off", False)):
        engine = LLM(o.model, **_engine_config(o, forced_tokens=forced)).engine
        log = StepLog()
        engine.add_step_observer(log)
        engines[mode] = (engine, log)
    parts: dict[str, Any] = {}
    with _timed(timings, "forced"):
        parts["forced"] = forced_steps(engines, prompt, StructuredOutput(json=FORCED.schema), o.max_tokens)
    with _timed(timings, "step_no_forced"):
        parts["step_no_forced"] = step_cost(*engines["off"], step)
    return parts


def run_structured(o: StructuredBenchOptions, argv: list[str] | None = None) -> dict[str, Any]:
    import torch

    try:
        import jsonschema  # noqa: F401  (the validator of every reply)
    except ImportError:
        raise BenchConfigError("radixserve bench structured validates replies with jsonschema: pip install jsonschema") from None
    if o.torch_threads:
        torch.set_num_threads(o.torch_threads)
    schemas, tools = pick_schemas(o), TOOLS[:o.tools] if o.tools else list(TOOLS)
    if not schemas or not tools:
        raise BenchConfigError("the structured workload needs at least one schema and one tool")
    started = time.monotonic()
    timings: dict[str, float] = {}
    parts, (model, spec) = _main_parts(o, schemas, tools, timings)
    gc.collect()  # the first engine's memory goes before the two of the forced-token test load
    parts.update(_forced_part(o, parts.pop("forced_prompt"), parts.pop("step_test"), timings))
    results: dict[str, Any] = {"scenario": SCENARIO, "workloads": [SCENARIO], "planned_systems": {SCENARIO: [SYSTEM]},
                               **parts, "part_seconds": timings, "total_seconds": time.monotonic() - started}
    results["results"] = {SCENARIO: {SYSTEM: {"expected_metrics": list(HEADLINE), "median": headline(results)}}}
    results_mod.add_environment(results, o, model, spec, argv)
    results["versions"].update(llguidance=results_mod.version("llguidance"), jsonschema=results_mod.version("jsonschema"))
    from radixserve_bench.structured.report import evaluate_targets

    results["targets"] = evaluate_targets(results)
    return results


def headline(r: dict[str, Any]) -> dict[str, float]:
    compile_ = r["compile"]
    return {"schema_valid_pct": r["validity"]["all"]["valid_pct"], "schema_length": float(r["validity"]["all"]["length"]),
            "tool_valid_pct": r["tools"]["all"]["valid_pct"],
            "compile_cold_p50_ms": compile_["schemas"]["cold"].get("p50_ms", float("nan")),
            "compile_cached_p50_ms": compile_["schemas"]["cached"].get("p50_ms", float("nan")),
            "tool_compile_cold_p50_ms": compile_["tool_calls"]["cold"].get("p50_ms", float("nan")),
            "step_ratio": r["step"]["ratio_step_mean"], "step_ratio_no_forced": r["step_no_forced"]["ratio_step_mean"],
            "forced_steps_ratio": r["forced"]["steps_ratio_off_on"]}
