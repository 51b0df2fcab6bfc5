"""The Qwen3.5-shaped CPU model: what a forward costs per extra row at one sequence (a recompute after a
rejected draft adds rows), and what copying one state slot costs (a state per draft position writes one
per position). Run as `python docs/bench/hybrid/verify-rows/rows_cost.py` with the checkpoint of
`radixserve bench random-checkpoint --family qwen3.5` converted by `scripts/hybrid_checkpoint.py` at
/tmp/rs-qwen35-cpu (docs/bench/hybrid.md)."""
import statistics
import time

import torch

from radixserve import LLM, SamplingParams

llm = LLM(model="/tmp/rs-qwen35-cpu", num_speculative_tokens=0)
g = torch.Generator().manual_seed(11)
ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
res = {}
for _ in range(3):
    for n in (1, 2, 3, 5, 9):
        base = torch.randint(4, 490, (300,), generator=g).tolist()
        llm.generate([base], ONE)  # cached, its end checkpointed
        tail = torch.randint(4, 490, (n,), generator=g).tolist()
        t0 = time.perf_counter()
        out = llm.generate([base + tail], ONE)[0]
        dt = time.perf_counter() - t0
        assert out.usage.cached_tokens >= 299, out.usage.cached_tokens
        res.setdefault(n + 300 - out.usage.cached_tokens, []).append(dt * 1000)
for rows, ts in sorted(res.items()):
    print(f"rows {rows}: median {statistics.median(ts):.1f} ms  {[round(t,1) for t in ts]}")
states = llm.engine.runner.kv_cache.states
src = torch.empty(states.layout.bytes_per_slot // 4)
dst = torch.empty_like(src)
ts = []
for _ in range(20):
    t0 = time.perf_counter()
    dst.copy_(src)
    ts.append((time.perf_counter() - t0) * 1000)
print(f"slot {states.layout.bytes_per_slot} bytes, copy median {statistics.median(ts):.2f} ms")
