"""Prefill steps of 1, 2, 4 and 8 prompts of UNIQUE new tokens after a cached SYSTEM-token prefix, the shipped
Q4_1, speculation off. `PYTHONPATH=<tree> python prompts.py SYSTEM UNIQUE`."""
import sys, time, random, statistics
from radixserve.config import EngineConfig
from radixserve.engine.engine import LLMEngine
from radixserve.model.embedded import embedded_gguf_path
from radixserve.sampling_params import SamplingParams
engine = LLMEngine(EngineConfig(model=str(embedded_gguf_path()), max_num_seqs=8, num_speculative_tokens=0))
rng = random.Random(0)
system = [rng.randrange(100, 40000) for _ in range(int(sys.argv[1]))]
unique = int(sys.argv[2])
def prompt(): return system + [rng.randrange(100, 40000) for _ in range(unique)]
engine.add_request(prompt(), SamplingParams(max_tokens=1, temperature=0))
while engine.has_unfinished(): engine.step()
res = {}
for rep in range(4):
    for n in (1, 2, 4, 8):
        for _ in range(n): engine.add_request(prompt(), SamplingParams(max_tokens=1, temperature=0))
        t = time.perf_counter(); engine.step(); res.setdefault(n, []).append((time.perf_counter() - t) * 1000)
        while engine.has_unfinished(): engine.step()
for n, v in res.items():
    m = statistics.median(v); print(f"{n} prompts of {unique} after {len(system)}: {m:6.1f} ms, {m/n:5.1f} per prompt, {m/n/unique:5.2f} per row")
