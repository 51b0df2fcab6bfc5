"""`radixserve bench step`: the decode step through the real engine, against the memory roofline.

One engine per (graphs, overlap) setting (graphs on: `EngineConfig(enforce_eager=False)`, off:
`enforce_eager=True`; overlap on: `EngineConfig(overlap=True)`), reused for every (sampling, batch)
row. A row adds `batch` requests of `context` seeded random token ids (`ignore_eos`), steps until
every sequence has its first token (prefill done, all decoding), runs `warmup` decode steps, then
times `steps` calls of `LLMEngine.step()` (schedule, prepare, forward, sample, postprocess) one by
one with `time.perf_counter`, and aborts the requests; the pool must then hold no block that no
sequence or tree node lists. Both sampling modes of one batch size use the same prompts, so the
second finds them cached; prefill is never timed. Greedy and top-p (temperature 0.7, top-p 0.9) rows
sit side by side with their ratio. `--penalties off,on` runs each row also with every request
penalised (`PENALTIES`: presence, frequency and repetition penalties and a 16-token logit_bias), the
cost of engine/penalties.py. `--speculation off` (the default) runs the engine with
`num_speculative_tokens=0`, so a step is one plain decode per sequence; `on` (or `on,off`) lets it
draft (`--num-speculative-tokens`), and a timed step may then commit several tokens per sequence:
**tokens per step** (generated tokens per sequence per step, 1.0 without speculation) is counted off
the timed steps' outputs, and the engine's own `EngineStats.tokens_per_draw` over the same steps is
kept beside it. On these random-token prompts only prompt lookup can draft (when the greedy output
repeats itself). The Markdown table is step_table.py's. From the engine's `StepClock`, over the steps resolved in the
timed window: device ms (forward + sampling on the device) and unhidden host ms (how long the device
sat idle between two steps: host work not overlapped with device work; on CPU all host work between
forwards). From the engine's `StepPhases` (engine/step_phases.py), for each timed step() call, the host
wall clock spent in: schedule (`Scheduler.schedule`, block copies, the launch's bookkeeping), build
(the runner's batch building: `ModelRunner.prepare` / `PaddedDecoder._fill`), forward (+ sampling),
wait (for the sampled ids) and post (commit, detokenization, stop checks, outputs); the row keeps each
phase's median (`schedule_ms`, `build_ms`, `forward_ms`, `wait_ms`, `post_ms`), `host_ms` (median of
schedule + build + post per step) and the per-step lists (`phase_ms`). With overlap a call's post is
the previous step's.

`--hf-forward on` (the default on CPU; off on CUDA): transformers' own eager decode forward of the
same prompts, `batch` sequences with a DynamicCache holding the context (hf_step.py says exactly what
is timed): each row gets `hf_forward_ms` (median) and `step_over_hf` (ms_median / hf_forward_ms); the
result's `hf_forward` says where its weights came from, or why it was skipped.

Model: `--shape embedded` (SmolLM2-135M with its weights) or a real model's shapes
(`llama-3.2-1b`, `llama-3.1-8b`): a directory under the cache holding its config.json and the embedded
model's tokenizer, run with `load_format="dummy"` (random weights; ids beyond the tokenizer decode
to ""). Roofline: a decode step must read every weight once plus each sequence's K/V, so
bytes = weights + KV and roofline fraction = bytes / bandwidth / median step time, where
weights = every parameter once (a tied embedding counts once: the LM head reads all of it), except
that an untied input embedding counts only the `batch` rows its lookup reads. KV = sum over
sequences of their length that step (every cached token plus the one computed) x 2 x layers x
kv_heads x head_dim x dtype size, averaged over the timed steps. Bandwidth: median of copies of a
large buffer (1 GiB on CUDA, 256 MiB on CPU by default), bytes read + written over time: on CUDA
once, before any engine holds device memory; on CPU also right before each row's timed steps (the
row's `bandwidth_bytes_per_s`), since a shared VM's copy rate moves between 25 and 45 GB/s from one
minute to the next and a step is only comparable with the machine of the same moment; a row pooled
over rounds takes the median of its rounds' floors. Floor: the
time reading those bytes once takes at that bandwidth, floor_ms = 1000 x bytes_per_step / bandwidth
(bytes_per_step = weights + KV as above, bandwidth in bytes/s); each row also has step_over_floor =
ms_median / floor_ms, and roofline_fraction = floor_ms / ms_median, its inverse.
"""

from __future__ import annotations

import gc
import platform
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from radixserve.config import EngineConfig
from radixserve.engine.engine import LLMEngine
from radixserve.engine.step_phases import median_ms, phase_ms
from radixserve.model.device import resolve_device
from radixserve.model.embedded import resolve_model
from radixserve.sampling_params import SamplingParams
from radixserve_bench.hf_step import HFForward, hf_forward
from radixserve_bench.step_floor import floor_ms, measure_bandwidth, sync, weight_bytes
from radixserve_bench.step_shapes import shape_dir

SAMPLING: dict[str, tuple[float, float]] = {"greedy": (0.0, 1.0), "top-p": (0.7, 0.9)}  # (temperature, top_p)
PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1)
BIASED = 16  # logit_bias entries (token ids spread over the vocabulary, +-1 alternately)
GRAPHS = ("on", "off")
OVERLAP = ("on", "off")
SPECULATION = ("on", "off")


@dataclass
class StepBenchOptions:
    shape: str = "embedded"  # embedded | a SHAPES name
    model: str | None = None  # a model directory instead of a shape
    load_format: str | None = None  # None: dummy for shapes, auto otherwise
    batches: tuple[int, ...] | None = None  # None: 1,16,64,128 (CUDA) / 1,4 (CPU)
    context: int = 512
    steps: int | None = None  # None: 32 (CUDA) / 8 (CPU)
    warmup: int = 3
    sampling: tuple[str, ...] = ("greedy", "top-p")
    graphs: tuple[str, ...] = GRAPHS
    overlap: tuple[str, ...] = ("on",)
    penalties: tuple[str, ...] = ("off",)  # on: every request penalised (PENALTIES and a logit_bias)
    # each batch's rows run this many times, interleaved, their timed steps pooled: a drift in the
    # machine's speed (a shared VM) then falls on every row alike instead of on whichever ran last
    rounds: int = 1
    speculation: tuple[str, ...] = ("off",)  # on: the engine drafts (num_speculative_tokens); off: plain decode steps
    num_speculative_tokens: int = 8  # with speculation on
    device: str = "auto"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"  # auto | fp16 | fp8 (docs/kv_fp8.md)
    sliding_window_kv: str = "auto"  # where sliding-window layers keep their K/V (config.SLIDING_WINDOW_KV)
    quantized_activations: str = "int8"  # a GGUF's quantized weights on CPU: int8 | float32 (docs/quantized.md)
    block_size: int = 16
    max_num_seqs: int | None = None  # None: the largest batch
    max_num_batched_tokens: int | None = None  # None: max(8192, largest batch)
    num_blocks: int | None = None  # None: every row's sequences fit, plus slack
    bandwidth_mib: int | None = None  # None: 1024 (CUDA) / 256 (CPU)
    seed: int = 0
    hf_forward: str | None = None  # on | off (transformers' decode forward beside each row); None: on on CPU only


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        name = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.processor() or platform.machine()
    return f"{name} ({torch.get_num_threads()} threads)"


def _version(module: str) -> str | None:
    try:
        return str(__import__(module).__version__)
    except ImportError:  # triton on a machine without it
        return None


def prefill_margin(batch: int, context: int, step_tokens: int) -> int:
    """Tokens a sequence may generate while the rest of its batch is still in prefill (a sequence
    decodes every step once its own prompt is done), with slack."""
    return -(-batch * context // step_tokens) + 8


def run_row(engine: LLMEngine, prompts: list[list[int]], sampling: str, steps: int, warmup: int,
            bandwidth: float | Callable[[], float], penalties: bool = False) -> dict[str, Any]:
    """Time `steps` decode steps of len(prompts) sequences; the requests are aborted afterwards.
    `bandwidth`: bytes/s, or how to measure it right before the timed steps."""
    batch, device = len(prompts), engine.runner.device
    temperature, top_p = SAMPLING[sampling]
    per_step = engine.config.num_speculative_tokens + 1  # the most tokens a step commits per sequence
    margin = prefill_margin(batch, len(prompts[0]), engine.config.max_num_batched_tokens) * per_step
    vocab = engine.spec.vocab_size
    penalised: dict[str, Any] = dict(**PENALTIES, logit_bias={i * vocab // BIASED: (-1.0) ** i for i in range(BIASED)}) \
        if penalties else {}
    params = SamplingParams(max_tokens=(warmup + steps) * per_step + margin, temperature=temperature, top_p=top_p,
                            ignore_eos=True, **penalised)
    ids = [engine.add_request(p, params) for p in prompts]
    seqs = [engine.requests[i].sequences[0] for i in ids]
    prefill_steps = 0
    while any(s.num_generated < 1 for s in seqs):
        if prefill_steps > 2 * len(prompts) * len(prompts[0]) + 100:
            raise RuntimeError("the prompts never finished prefill")
        engine.step()
        prefill_steps += 1
    if len(engine.scheduler.running) != batch or engine.scheduler.waiting:
        raise RuntimeError(f"{len(engine.scheduler.running)} of {batch} sequences running; raise --num-blocks")
    for _ in range(warmup):
        engine.step()
    gc.collect()
    if callable(bandwidth):
        bandwidth = bandwidth()
    times, kv_tokens, committed = [], [], 0
    sync(device)
    clock = engine.clock.history
    clock.clear()
    engine.phases.history.clear()
    before = engine.stats()
    for _ in range(steps):
        kv_tokens.append(sum(len(s.token_ids) for s in seqs))  # each reads its whole length this step
        t0 = time.perf_counter()
        outputs = engine.step()
        times.append(time.perf_counter() - t0)
        got = [len(o.outputs[0].token_ids) for o in outputs]
        committed += sum(got)
        if len(outputs) != batch or any(not 1 <= n <= per_step for n in got) or (per_step == 1 and min(got) != 1):
            seen = [(len(o.outputs[0].token_ids), o.outputs[0].finish_reason, o.error) for o in outputs]
            raise RuntimeError(f"a timed step was not one decode of each of {batch} sequences: {seen[:4]}")
    sync(device)
    after = engine.stats()
    draws = after.committed_draws - before.committed_draws
    spans = list(clock)
    phases = engine.phases.times()  # one per timed step() call, in order
    if len(phases) != steps:
        raise RuntimeError(f"the phase clock saw {len(phases)} step() calls, not the {steps} timed")
    for i in ids:
        engine.abort(i)
    engine.check_integrity()
    layout = engine.runner.kv_layout()
    kv_per_token = layout.bytes_per_token
    weights = weight_bytes(engine.runner.model, batch)
    kv = kv_per_token * statistics.fmean(kv_tokens)
    ms = 1000 * statistics.median(times)
    device_ms = 1000 * statistics.median(t.device_s for t in spans) if spans else float("nan")
    host_ms = 1000 * statistics.median(t.idle_s for t in spans) if spans else float("nan")
    floor = floor_ms(weights + kv, bandwidth)
    per_phase = phase_ms(phases)
    return dict(sampling=sampling, penalties="on" if penalties else "off", batch=batch, device_ms=device_ms,
                tokens_per_step=committed / (batch * steps),
                engine_tokens_per_draw=(after.generation_tokens - before.generation_tokens) / draws if draws else None,
                host_unhidden_ms=host_ms, context=len(prompts[0]), steps=steps, warmup=warmup,
                prefill_steps=prefill_steps, step_ms=[1000 * t for t in times], ms_median=ms,
                ms_mean=1000 * statistics.fmean(times),
                ms_min=1000 * min(times), tok_s=committed / steps * 1000 / ms, weight_bytes=weights, kv_bytes=kv,
                kv_bytes_per_token=kv_per_token, bytes_per_step=weights + kv,
                roofline_fraction=floor / ms, floor_ms=floor, step_over_floor=ms / floor,
                bandwidth_bytes_per_s=bandwidth,
                phase_ms=per_phase, **median_ms(per_phase),
                leaked_blocks=engine.leaked_blocks(), live_sequences=len(engine.live_sequences()))


def pooled(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One row's figures over its rounds: the step times pooled, the per-round medians' median else."""
    times = [t for r in rounds for t in r["step_ms"]]
    ms = statistics.median(times)
    first = rounds[0]
    floor = statistics.median(r["floor_ms"] for r in rounds)
    per_step = statistics.fmean(r["tokens_per_step"] for r in rounds)
    per_phase = {k: [t for r in rounds for t in r["phase_ms"][k]] for k in first["phase_ms"]}
    return {**first, "rounds": len(rounds), "step_ms": times, "ms_median": ms, "ms_mean": statistics.fmean(times),
            "ms_min": min(times), "tok_s": first["batch"] * per_step * 1000 / ms, "tokens_per_step": per_step,
            "floor_ms": floor, "roofline_fraction": floor / ms, "step_over_floor": ms / floor,
            "bandwidth_bytes_per_s": statistics.median(r["bandwidth_bytes_per_s"] for r in rounds),
            "phase_ms": per_phase, **median_ms(per_phase),
            **{k: statistics.median(r[k] for r in rounds) for k in ("device_ms", "host_unhidden_ms")}}


def run_step_bench(o: StepBenchOptions) -> dict[str, Any]:
    if o.model:
        model_dir, load_format = o.model, o.load_format or "auto"
    elif o.shape == "embedded":
        model_dir, load_format = resolve_model(None)[0], o.load_format or "auto"
    else:
        model_dir, load_format = str(shape_dir(o.shape)), o.load_format or "dummy"
    device = resolve_device(o.device)
    cuda = device.type == "cuda"
    batches = o.batches or ((1, 16, 64, 128) if cuda else (1, 4))
    steps = o.steps or (32 if cuda else 8)
    unknown = [s for s in o.sampling if s not in SAMPLING] + [g for g in o.graphs if g not in GRAPHS] \
        + [v for v in o.overlap if v not in OVERLAP] + [v for v in o.penalties if v not in ("on", "off")] \
        + [v for v in o.speculation if v not in SPECULATION]
    unknown += [o.hf_forward] if o.hf_forward not in (None, "on", "off") else []
    if unknown or min(batches) < 1 or o.context < 1 or steps < 1 or o.warmup < 0 or o.rounds < 1:
        raise ValueError(f"bad step-bench options: {unknown or (batches, o.context, steps, o.warmup)}")
    step_tokens = o.max_num_batched_tokens or max(8192, max(batches))
    per_step = o.num_speculative_tokens + 1 if "on" in o.speculation else 1
    max_len = o.context + (o.warmup + steps + prefill_margin(max(batches), o.context, step_tokens)) * per_step
    mib = o.bandwidth_mib or (1024 if cuda else 256)
    hf_on = (o.hf_forward or ("off" if cuda else "on")) == "on"
    bandwidth = measure_bandwidth(device, mib << 20)  # before any engine holds device memory
    rows: list[dict[str, Any]] = []
    all_prompts: dict[int, list[list[int]]] = {}
    result: dict[str, Any] = dict(
        options=asdict(o), shape=o.model or o.shape, model_dir=model_dir, load_format=load_format, device=str(device),
        device_name=_device_name(device), torch=torch.__version__, triton=_version("triton"),
        transformers=_version("transformers"), bandwidth_bytes=mib << 20, bandwidth_bytes_per_s=bandwidth)
    for graphs, overlap, drafting in [(g, v, sp) for g in o.graphs for v in o.overlap for sp in o.speculation]:
        config = EngineConfig(
            model=model_dir, device=o.device, dtype=o.dtype, kv_cache_dtype=o.kv_cache_dtype, block_size=o.block_size,
            quantized_activations=o.quantized_activations, seed=o.seed, sliding_window_kv=o.sliding_window_kv,
            enforce_eager=graphs == "off", overlap=overlap == "on", load_format=load_format,
            num_speculative_tokens=o.num_speculative_tokens if drafting == "on" else 0,
            max_num_seqs=o.max_num_seqs or max(batches),
            max_num_batched_tokens=step_tokens,
            num_blocks=o.num_blocks or max(batches) * (-(-max_len // o.block_size) + 1) + 64)
        engine = LLMEngine(config)
        spec = engine.spec
        result.update(dtype=str(engine.runner.dtype).removeprefix("torch."), kv_cache_dtype=o.kv_cache_dtype,
                      sliding_window_kv=o.sliding_window_kv,
                      attention_backend=engine.runner.backend.name,
                      num_blocks=engine.pool.num_blocks, model=dict(
                          layers=spec.num_layers, hidden=spec.hidden_size, intermediate=spec.intermediate_size,
                          heads=spec.num_heads, kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                          vocab=spec.vocab_size, tied=spec.tie_word_embeddings))
        vocab = min(engine.spec.vocab_size, len(engine.tokenizer) if engine.tokenizer is not None else 1 << 62)
        for batch in batches:
            rng = random.Random(f"{o.seed}-{batch}")  # same prompts for each sampling mode and graphs setting
            prompts = all_prompts[batch] = [[rng.randrange(vocab) for _ in range(o.context)] for _ in range(batch)]
            kinds = [(s, p) for s in o.sampling for p in o.penalties]
            beside = bandwidth if cuda else partial(measure_bandwidth, device, mib << 20)
            rounds = [[run_row(engine, prompts, s, steps, o.warmup, beside, p == "on") for s, p in kinds]
                      for _ in range(o.rounds)]
            rows += [{"graphs": graphs, "overlap": overlap, "speculation": drafting, **pooled([r[k] for r in rounds])}
                     for k in range(len(kinds))]
        del engine
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    # after the engines are gone: transformers then has the device (and its memory) to itself
    hf = hf_forward(model_dir, device, getattr(torch, result["dtype"]), all_prompts, steps, o.warmup) if hf_on \
        else HFForward(skipped="--hf-forward off")
    for r in rows:
        hf_ms = hf.ms(r["batch"])
        r.update(hf_forward_ms=hf_ms, step_over_hf=r["ms_median"] / hf_ms if hf_ms else None)
    result["hf_forward"] = hf.to_json()
    result["rows"] = rows
    return result
