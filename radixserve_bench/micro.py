"""Micro-benchmarks of the CPU-side machinery, with no model at all.

- scheduler: the real Scheduler, BlockPool and RadixTree driven by a no-op model. Sequences are
  admitted and prefilled until `n` of them decode together, then each measured step is one
  `schedule()` plus the scheduler's post-step calls the engine makes (`launched`, `commit`:
  advance num_computed, cache newly full blocks, commit a token; `scheduler/no_op_model.py`). CPU
  time is the thread's (time.thread_time), so other processes on a shared machine do not count; wall
  time is reported too. Speculation is off (`num_speculative_tokens=0`): the no-op model commits one
  token per draw and verifies no draft, so this is the plain decode step's scheduling cost.
- radix: insert and match throughput of the radix tree on long prompts that share prefixes
  in groups (the shape a chat backend sees), in tokens per second.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from radixserve.cache.block_pool import BlockPool
from radixserve.cache.radix_tree import RadixTree
from radixserve.config import EngineConfig
from radixserve.core import Request, Sequence
from radixserve.sampling_params import SamplingParams
from radixserve.scheduler.no_op_model import no_op_step
from radixserve.scheduler.scheduler import Scheduler


def scheduler_step_cost(num_running: int, steps: int, block_size: int = 16, shared_len: int = 64,
                        unique_len: int = 64, seed: int = 0) -> dict[str, float]:
    max_tokens = steps + 64
    per_seq_blocks = -(-(shared_len + unique_len + max_tokens) // block_size) + 1
    config = EngineConfig(block_size=block_size, max_num_seqs=max(num_running, 1), num_speculative_tokens=0,
                          max_num_batched_tokens=max(512, num_running), num_blocks=num_running * per_seq_blocks + 64)
    pool = BlockPool(config.num_blocks or 1, block_size)
    tree = RadixTree(pool)
    scheduler = Scheduler(config, pool, tree)
    rng = random.Random(seed)
    shared = [rng.randrange(1, 30000) for _ in range(shared_len)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(num_running):
        prompt = shared + [rng.randrange(1, 30000) for _ in range(unique_len)]
        req = Request(f"micro-{i}", prompt, params, order=i)
        seq = Sequence(req, 0, list(prompt), len(prompt))
        scheduler.add(seq)
    for _ in range(10 * num_running + 100):  # admit and prefill everyone
        if not scheduler.waiting and all(not s.is_prefill for s in scheduler.running):
            break
        no_op_step(scheduler, scheduler.schedule(), 7)
    if len(scheduler.running) != num_running or scheduler.waiting:
        raise RuntimeError(f"scheduler micro-benchmark: only {len(scheduler.running)} of {num_running} running")
    cpu, plan, wall = [], [], []
    for _ in range(steps):
        c0, w0 = time.thread_time(), time.perf_counter()
        batch = scheduler.schedule()
        c1 = time.thread_time()
        no_op_step(scheduler, batch, 7)
        cpu.append(time.thread_time() - c0)
        plan.append(c1 - c0)
        wall.append(time.perf_counter() - w0)
        if len(batch.items) != num_running:
            raise RuntimeError(f"a decode step scheduled {len(batch.items)} of {num_running} sequences")
    return {"running": float(num_running), "steps": float(steps),
            "cpu_ms_per_step": 1000 * statistics.median(cpu), "wall_ms_per_step": 1000 * statistics.median(wall),
            "cpu_ms_per_step_p90": 1000 * sorted(cpu)[int(0.9 * (len(cpu) - 1))],
            "schedule_cpu_ms_per_step": 1000 * statistics.median(plan),
            "bookkeeping_cpu_ms_per_step": 1000 * statistics.median(c - p for c, p in zip(cpu, plan))}


def radix_throughput(num_prompts: int, prompt_len: int, groups: int, block_size: int = 16,
                     seed: int = 0) -> dict[str, float]:
    """Prompts come in `groups`, each group sharing its first half; insert all, then match all."""
    rng = random.Random(seed)
    heads = [[rng.randrange(1, 30000) for _ in range(prompt_len // 2)] for _ in range(groups)]
    prompts = [heads[i % groups] + [rng.randrange(1, 30000) for _ in range(prompt_len - prompt_len // 2)]
               for i in range(num_prompts)]
    blocks_per_prompt = -(-prompt_len // block_size)
    pool = BlockPool(num_prompts * blocks_per_prompt, block_size)
    tree = RadixTree(pool)
    tables = [pool.allocate(blocks_per_prompt) for _ in prompts]
    t0 = time.perf_counter()
    for prompt, table in zip(prompts, tables):
        tree.insert(prompt, table)  # type: ignore[arg-type]
    insert_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    matched = sum(tree.match(p, split=False).length for p in prompts)
    match_s = time.perf_counter() - t0
    if matched != num_prompts * prompt_len:
        raise RuntimeError("radix micro-benchmark: a fully inserted prompt did not fully match")
    tokens = num_prompts * prompt_len
    return {"prompts": float(num_prompts), "prompt_len": float(prompt_len), "groups": float(groups),
            "insert_tokens_per_s": tokens / insert_s, "match_tokens_per_s": tokens / match_s,
            "insert_us_per_prompt": 1e6 * insert_s / num_prompts, "match_us_per_prompt": 1e6 * match_s / num_prompts}


def run_micro(smoke: bool = False, block_size: int = 16) -> dict[str, Any]:
    steps = 20 if smoke else 200
    scheduler = {str(n): scheduler_step_cost(n, steps, block_size) for n in (1, 64, 256)}
    radix = radix_throughput(num_prompts=16 if smoke else 256, prompt_len=1024 if smoke else 8192,
                             groups=4 if smoke else 16, block_size=block_size)
    return {"scheduler": scheduler, "radix": radix}
