"""Runs a planned benchmark: every repeat runs every workload on every planned system, interleaved so
machine noise spreads over all systems, then folds repeats into medians and derives ratios, targets,
the bounded-pool comparison with the offline optimum, the host tier's figures (returning.py) and
speculative decoding's (speculation.py).

Each run starts its system cold (a fresh engine, a fresh continuous-batching manager: no cache
carried over), warms it up with one short request of tokens no workload contains, then measures.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from radixserve_bench import results as results_mod
from radixserve_bench.belady import simulate_pool, working_set_blocks
from radixserve_bench.driver import RequestRecord, RunTrace, drive, warm_up
from radixserve_bench.flags import BenchConfigError
from radixserve_bench.harness import model_facts, progress_bar
from radixserve_bench.metrics import expected_metrics, fold_repeats, pool_metrics, run_metrics, trace_requests
from radixserve_bench.plan import BenchOptions, Sizing, build_workloads, plan_systems, size_pools
from radixserve_bench.returning import WORKLOAD as RETURNING
from radixserve_bench.returning import host_cache_mb, host_tier_ratios, kv_block_bytes, returning_metrics
from radixserve_bench.speculation import expected_metrics as spec_expected
from radixserve_bench.speculation import spec_ratios, speculation_metrics
from radixserve_bench.systems import (
    AMPLE_HOST,
    BOUNDED,
    BOUNDED_FP8,
    BOUNDED_HOST,
    SYSTEM_DESCRIPTIONS,
    SystemSettings,
    build_system,
)
from radixserve_bench.systems.hf_common import release_hf_models
from radixserve_bench.textsource import byte_encoder
from radixserve_bench.workloads import Workload


def _gguf_quantized(model_dir: str, o: BenchOptions) -> bool:
    """Whether the systems serve a GGUF file with its quantized weights (their K/V then in fp16)."""
    from radixserve.model.device import resolve_device
    from radixserve.model.gguf_checkpoint import serves_quantized

    return Path(model_dir).is_file() and serves_quantized(o.dtype, resolve_device(o.device))


def run_benchmark(o: BenchOptions, argv: list[str] | None = None) -> dict:
    import torch

    model_dir, model_name, spec, tokenizer = model_facts(o.model)
    encode = (lambda text: tokenizer.encode(text, add_special_tokens=False)) if tokenizer is not None \
        else byte_encoder(spec.vocab_size)
    workloads = build_workloads(o, encode, spec.vocab_size, spec.max_position_embeddings, _chat_encoder(tokenizer))
    cuda = torch.cuda.is_available()
    settings = SystemSettings(model_dir, o.device, o.dtype, o.block_size, o.max_num_batched_tokens, o.max_num_seqs,
                              o.seed, o.num_speculative_tokens, o.speculative_max_batch, o.speculative_max_rows,
                              o.prompt_lookup_tokens)
    sizing = {w.name: size_pools(w, o) for w in workloads}
    planned: dict[str, list[str]] = {}
    skipped: list[str] = []
    for w in workloads:
        planned[w.name], why = plan_systems(w, o, cuda, o.device)
        if not planned[w.name]:
            raise BenchConfigError(f"no requested system runs on {w.name}: " + "; ".join(why))
        skipped += why
    warm_prompt = [spec.eos_token_ids[0] if spec.eos_token_ids else 0] * 8
    block_bytes = kv_block_bytes(spec, o.block_size, o.device, o.dtype, gguf_quantized=_gguf_quantized(model_dir, o))
    fp8_block_bytes = kv_block_bytes(spec, o.block_size, o.device, o.dtype, "fp8")
    sizing = {name: dataclasses.replace(s, bounded_fp8_blocks=s.bounded_blocks * block_bytes // fp8_block_bytes)
              for name, s in sizing.items()}

    traces: dict[str, dict[str, list[RunTrace]]] = {w.name: {s: [] for s in planned[w.name]} for w in workloads}
    extras: dict[tuple[str, str, int], dict[str, Any]] = {}
    total = sum(w.num_requests * len(planned[w.name]) for w in workloads) * o.repeats
    bar = progress_bar(total, "bench", o.progress)

    async def run_all() -> None:
        for repeat in range(o.repeats):
            for w in workloads:
                for name in planned[w.name]:
                    bar.set_postfix_str(f"repeat {repeat + 1}/{o.repeats} {w.name} {name}")
                    tiered = name in (BOUNDED_HOST, AMPLE_HOST)
                    host_mb = host_cache_mb(sizing[w.name].host_blocks, block_bytes) if tiered else 0.0
                    trace, extra = await _run_one(name, w, repeat, settings, sizing[w.name], host_mb, warm_prompt, o,
                                                  bar)
                    traces[w.name][name].append(trace)
                    extras[(w.name, name, repeat)] = extra

    started = time.time()
    try:
        asyncio.run(run_all())
    finally:
        bar.close()
        release_hf_models()
    results = _fold(o, workloads, planned, sizing, traces, extras)
    results["skipped"] = skipped
    results["host_tier"] = host_tier_ratios(results)
    results["speculation"] = spec_ratios(results)
    results["wall_time_s"] = time.time() - started
    results_mod.add_environment(results, o, (model_dir, model_name), spec, argv)
    results["ratios"] = results_mod.ratios(results)
    if o.micro:
        from radixserve_bench.micro import run_micro

        results["micro"] = run_micro(smoke=o.smoke, block_size=o.block_size)
    results["targets"] = results_mod.evaluate_targets(results)
    return results


def _chat_encoder(tokenizer: Any) -> Callable[[str], list[int]] | None:
    """One user message as the model's chat prompt (the server's ChatFormatter); None without a tokenizer."""
    if tokenizer is None:
        return None
    from radixserve.chat.template import ChatFormatter

    formatter = ChatFormatter(tokenizer)
    return lambda text: formatter.prompt_tokens([{"role": "user", "content": text}])


async def _run_one(name: str, w: Workload, repeat: int, settings: SystemSettings, sizing: Sizing, host_mb: float,
                   warm_prompt: list[int], o: BenchOptions, bar: tqdm) -> tuple[RunTrace, dict[str, Any]]:
    blocks = sizing.bounded_fp8_blocks if name == BOUNDED_FP8 else \
        sizing.bounded_blocks if name in (BOUNDED, BOUNDED_HOST) else sizing.ample_blocks
    system = build_system(name, settings, blocks, sizing.static_batch_size, host_cache_mb=host_mb)
    await system.start()
    try:
        await warm_up(system, warm_prompt)

        def progressed(_: RequestRecord) -> None:
            bar.update(1)

        trace = await drive(system, w, repeat, o.seed, o.timeout_s, on_record=progressed)
        extra: dict[str, Any] = {"info": system.info().__dict__}
        counters = getattr(system, "engine_counters", None)
        if counters is not None:
            extra["engine"] = counters()
        return trace, extra
    finally:
        await system.stop()


def _fold(o: BenchOptions, workloads: list[Workload], planned: dict[str, list[str]], sizing: dict[str, Sizing],
          traces: dict[str, dict[str, list[RunTrace]]], extras: dict[tuple[str, str, int], dict[str, Any]]) -> dict:
    bs = o.block_size
    out: dict[str, Any] = {"workloads": {}, "systems": {}, "planned_systems": planned, "results": {}}
    for w in workloads:
        out["workloads"][w.name] = {"description": w.describe(), "params": w.params, "load": w.load.__dict__,
                                    "num_requests": w.num_requests, "sizing": sizing[w.name].__dict__}
        per_system: dict[str, Any] = {}
        for name in planned[w.name]:
            runs = []
            for trace in traces[w.name][name]:
                extra = extras[(w.name, name, trace.repeat)]
                pool = extra["info"].get("num_blocks")
                m = run_metrics(trace, bs)
                has_pool = name.startswith("radixserve")
                if has_pool:
                    m |= pool_metrics(trace, bs, pool or 0)
                if name in (BOUNDED, BOUNDED_HOST, BOUNDED_FP8):
                    m |= _bounded_metrics(trace, bs, pool or 0, m["hit_rate"])
                if w.name == RETURNING:
                    m |= returning_metrics(trace)
                m |= speculation_metrics(trace, extra.get("engine", {}))
                runs.append({"repeat": trace.repeat, "metrics": m, **results_mod.run_detail(trace, extra)})
                out["systems"].setdefault(name, {"description": SYSTEM_DESCRIPTIONS[name], **extra["info"]})
            bounded = name in (BOUNDED, BOUNDED_HOST, BOUNDED_FP8)
            expected = expected_metrics(name.startswith("radixserve"), bounded, w.name == RETURNING)
            per_system[name] = fold_repeats(expected + spec_expected(name, w.name), runs)
        out["results"][w.name] = per_system
    return out


def _bounded_metrics(trace: RunTrace, bs: int, pool: int, hit_rate: float) -> dict[str, float]:
    reqs = trace_requests(trace)
    ws = working_set_blocks(reqs, bs)
    belady = simulate_pool(reqs, bs, pool, "belady").hit_rate
    lru = simulate_pool(reqs, bs, pool, "lru").hit_rate
    return {"working_set_blocks": float(ws), "pool_fraction": pool / ws if ws else 0.0, "belady_hit_rate": belady,
            "lru_sim_hit_rate": lru, "hit_rate_vs_belady": hit_rate / belady if belady else 1.0}
