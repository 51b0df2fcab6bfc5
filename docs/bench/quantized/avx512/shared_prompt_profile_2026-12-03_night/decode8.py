"""Eight decodes over a shared cached 1,024-token prefix (the shared-prompt workload's decode steps), the shipped
Q4_1, speculation off: ~40 warm steps, then STEPS timed ones. `python decode8.py [STEPS]`."""
import sys, time, random, statistics, os
from radixserve.config import EngineConfig
from radixserve.engine.engine import LLMEngine
from radixserve.model.embedded import embedded_gguf_path
from radixserve.sampling_params import SamplingParams
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 300
engine = LLMEngine(EngineConfig(model=str(embedded_gguf_path()), max_num_seqs=8, num_speculative_tokens=0))
rng = random.Random(0)
system = [rng.randrange(100, 40000) for _ in range(1024)]
def prompt(): return system + [rng.randrange(100, 40000) for _ in range(38)]
for _ in range(8): engine.add_request(prompt(), SamplingParams(max_tokens=steps + 60, temperature=0, ignore_eos=True))
for _ in range(40): engine.step()
print("ready", os.getpid(), flush=True)
times = []
for _ in range(steps):
    t = time.perf_counter(); engine.step(); times.append((time.perf_counter() - t) * 1000)
print(f"decode 8 at ~{1062 + 40}-{1062 + 40 + steps} tokens: median {statistics.median(times):.1f} ms over {steps} steps")
