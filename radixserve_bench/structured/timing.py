"""The structured workload's timings: grammar compiles (cold and cached), the constrained decode step
beside the unconstrained one at one batch size, and the steps forced tokens save.

Invariants:
- a cold compile is the first of its constraint in the engine's compiler (checked: the compiler's
  `compiles` counter grows by one; a constraint found already cached is reported, not timed as cold);
  the llguidance tokenizer is built before the first timed compile and timed on its own;
- the step test's two modes run the same prompts (so the same lengths), sampled with the same seeds,
  `ignore_eos` and a max_tokens no row reaches in the window, so both time the same number of steps
  of the same batch; the modes alternate over rounds (U C, then C U, ...) so drift in a shared
  machine's load falls on both; prefill and warm-up steps are never timed;
- forced tokens are compared on two engines that differ only in `EngineConfig.forced_tokens`, one
  greedy request alone on each, so every step counted is that request's.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

from radixserve.engine.engine import LLMEngine
from radixserve.errors import ConstraintError
from radixserve.sampling_params import SamplingParams
from radixserve.structured import StructuredOutput
from radixserve_bench.structured.measure import Job, StepLog, run_jobs, spread_ms


def compile_times(engine: LLMEngine, constraints: dict[str, StructuredOutput], cached_repeats: int) -> dict[str, Any]:
    """Cold and cached compile times of `constraints` (name -> constraint) in `engine`'s compiler."""
    grammars = engine.grammars
    started = time.perf_counter()
    _ = grammars.ll_tokenizer  # built once per engine; not part of any constraint's compile
    tokenizer_s = time.perf_counter() - started
    cold: dict[str, dict[str, float]] = {}
    failed: dict[str, str] = {}
    already: list[str] = []
    for name, constraint in constraints.items():
        before = grammars.stats.compiles
        started = time.perf_counter()
        try:
            compiled = grammars.compile(constraint)
        except ConstraintError as e:
            failed[name] = str(e)
            continue
        wall = time.perf_counter() - started
        if grammars.stats.compiles != before + 1:
            already.append(name)
            continue
        cold[name] = {"wall_ms": 1000 * wall, "compile_ms": 1000 * compiled.compile_s}
    cached: list[float] = []
    for name, constraint in constraints.items():
        if name in failed:
            continue
        for _ in range(cached_repeats):
            started = time.perf_counter()
            grammars.compile(constraint)
            cached.append(time.perf_counter() - started)
    walls = [c["wall_ms"] / 1000 for c in cold.values()]
    return {"constraints": len(constraints), "compiled": len(cold), "failed": failed, "already_cached": already,
            "tokenizer_ms": 1000 * tokenizer_s, "cold": spread_ms(walls) if walls else {},
            "cold_in_worker": spread_ms([c["compile_ms"] / 1000 for c in cold.values()]) if cold else {},
            "cached": spread_ms(cached) if cached else {}, "cached_lookups": len(cached), "per_constraint": cold}


@dataclass
class StepTest:
    prompt: list[int]
    structured: StructuredOutput
    batch: int = 16
    steps: int = 16  # timed decode steps per round and mode
    warmup: int = 3
    rounds: int = 2
    temperature: float = 0.8
    seed: int = 0


def _timed_round(engine: LLMEngine, log: StepLog, t: StepTest, constrained: bool, seed: int) -> dict[str, Any]:
    """One mode's batch: prefill, warm-up, then `t.steps` timed steps; the requests are aborted after."""
    budget = 8 * (t.warmup + t.steps) + 64  # forced tokens may append several tokens a step: never reached
    ids = [engine.add_request(t.prompt, SamplingParams(
        max_tokens=budget, temperature=t.temperature, seed=seed + row, ignore_eos=True,
        structured=t.structured if constrained else None)) for row in range(t.batch)]
    seqs = [engine.requests[i].sequences[0] for i in ids]
    guard = 0
    while any(s.num_generated < 1 for s in seqs):
        engine.step()
        guard += 1
        if guard > 10 * t.batch + 100:
            raise RuntimeError("the step test's prompts never finished prefill")
    for _ in range(t.warmup):
        engine.step()
    mask_s, mask_steps = engine.constraints.stats.mask_s, engine.constraints.stats.mask_steps
    forced = engine.constraints.stats.forced_tokens
    log.start()
    walls, tokens = [], 0
    for _ in range(t.steps):
        started = time.perf_counter()
        outputs = engine.step()
        walls.append(time.perf_counter() - started)
        tokens += sum(len(c.token_ids) for o in outputs for c in o.outputs)
        if any(o.finished for o in outputs):
            raise RuntimeError("a row of the step test finished inside the timed window")
    infos = log.stop()
    for i in ids:
        engine.abort(i)
    engine.check_integrity()
    if engine.leaked_blocks():
        raise RuntimeError(f"the step test leaked {engine.leaked_blocks()} KV blocks")
    full = [x for x in infos if x.num_seqs == t.batch]
    return {"step_s": [x.duration_s for x in infos], "wall_s": walls, "tokens": tokens, "full_batch_steps": len(full),
            "mask_s": engine.constraints.stats.mask_s - mask_s, "mask_steps": engine.constraints.stats.mask_steps - mask_steps,
            "forced_tokens": engine.constraints.stats.forced_tokens - forced}


def step_cost(engine: LLMEngine, log: StepLog, t: StepTest) -> dict[str, Any]:
    """The constrained decode step beside the unconstrained one (StepInfo.duration_s, mean over rounds);
    `log` is attached to `engine`."""
    rounds: dict[str, list[dict[str, Any]]] = {"unconstrained": [], "constrained": []}
    for r in range(t.rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        for constrained in order:
            rounds["constrained" if constrained else "unconstrained"].append(
                _timed_round(engine, log, t, constrained, t.seed + 1000 * r))
    out: dict[str, Any] = {"batch": t.batch, "timed_steps_per_round": t.steps, "warmup": t.warmup, "rounds": t.rounds,
                           "prompt_tokens": len(t.prompt), "temperature": t.temperature}
    for mode, runs in rounds.items():
        steps = [s for run in runs for s in run["step_s"]]
        tokens = sum(run["tokens"] for run in runs)
        out[mode] = {"steps": len(steps), "step_ms_mean": 1000 * statistics.fmean(steps),
                     "step_ms_median": 1000 * statistics.median(steps),
                     "wall_ms_mean": 1000 * statistics.fmean([w for run in runs for w in run["wall_s"]]),
                     "tokens": tokens, "tokens_per_step": tokens / len(steps),
                     "ms_per_token": 1000 * sum(steps) / tokens if tokens else float("nan"),
                     "full_batch_steps": sum(run["full_batch_steps"] for run in runs),
                     "mask_ms_per_step": 1000 * sum(run["mask_s"] for run in runs) / len(steps),
                     "forced_tokens": sum(run["forced_tokens"] for run in runs),
                     "round_step_ms_mean": [1000 * statistics.fmean(run["step_s"]) for run in runs]}
    u, c = out["unconstrained"], out["constrained"]
    out["ratio_step_mean"] = c["step_ms_mean"] / u["step_ms_mean"]
    out["ratio_step_median"] = c["step_ms_median"] / u["step_ms_median"]
    out["ratio_ms_per_token"] = c["ms_per_token"] / u["ms_per_token"]
    return out


def forced_steps(engines: dict[str, tuple[LLMEngine, StepLog]], prompt: list[int], structured: StructuredOutput,
                 max_tokens: int) -> dict[str, Any]:
    """One greedy constrained request alone on each engine ("on": forced tokens appended, "off": not):
    the steps it took, its tokens and text."""
    out: dict[str, Any] = {}
    for mode, (engine, log) in engines.items():
        forced = engine.constraints.stats.forced_tokens
        log.start()
        (reply,) = run_jobs(engine, [Job(mode, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                      structured=structured))])
        infos = log.stop()
        out[mode] = {"steps": len(infos), "tokens": reply.tokens, "finish_reason": reply.finish_reason,
                     "forced_tokens": engine.constraints.stats.forced_tokens - forced, "text": reply.text,
                     "prompt_tokens": len(prompt)}
    on, off = out["on"], out["off"]
    out["same_text"] = on["text"] == off["text"]
    out["steps_ratio_off_on"] = off["steps"] / on["steps"] if on["steps"] else float("nan")
    return out
