"""One 38-token prompt after a cached 1,024-token prefix (the shared-prompt workload's prefill), the shipped Q4_1,
speculation off: four timed steps, then one under torch.profiler, its ops by self time.
`python profile_prompt.py [N]` runs N such prompts in one step (default 1)."""
import sys, time, random, statistics, torch
from radixserve.config import EngineConfig
from radixserve.engine.engine import LLMEngine
from radixserve.model.embedded import embedded_gguf_path
from radixserve.sampling_params import SamplingParams
n = int(sys.argv[1]) if len(sys.argv) > 1 else 1
engine = LLMEngine(EngineConfig(model=str(embedded_gguf_path()), max_num_seqs=8, num_speculative_tokens=0))
rng = random.Random(0)
system = [rng.randrange(100, 40000) for _ in range(1024)]
def prompt(): return system + [rng.randrange(100, 40000) for _ in range(38)]
engine.add_request(prompt(), SamplingParams(max_tokens=1, temperature=0))
while engine.has_unfinished(): engine.step()
times = []
for rep in range(4):
    for _ in range(n): engine.add_request(prompt(), SamplingParams(max_tokens=1, temperature=0))
    t = time.perf_counter(); engine.step(); times.append((time.perf_counter()-t)*1000)
    while engine.has_unfinished(): engine.step()
print("step ms", [round(x,1) for x in times])
for _ in range(n): engine.add_request(prompt(), SamplingParams(max_tokens=1, temperature=0))
with torch.profiler.profile() as p:
    engine.step()
print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
