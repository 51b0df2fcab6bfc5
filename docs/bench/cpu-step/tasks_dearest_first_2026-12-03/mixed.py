"""Step times on the shipped Q4_1 (speculation off): seven decodes over a cached 1,024-token prefix, then one
38-token prompt beside them, then eight such prompts in one step. `PYTHONPATH=<tree> python mixed.py 0`."""
import sys, time, random, statistics
from radixserve.config import EngineConfig
from radixserve.engine.engine import LLMEngine
from radixserve.model.embedded import embedded_gguf_path
from radixserve.sampling_params import SamplingParams
spec = int(sys.argv[1]) if len(sys.argv) > 1 else 0
engine = LLMEngine(EngineConfig(model=str(embedded_gguf_path()), max_num_seqs=8, num_speculative_tokens=spec))
rng = random.Random(0)
system = [rng.randrange(100, 40000) for _ in range(1024)]
def prompt(): return system + [rng.randrange(100, 40000) for _ in range(38)]
def timed_step():
    t = time.perf_counter(); engine.step(); return (time.perf_counter() - t) * 1000
engine.add_request(prompt(), SamplingParams(max_tokens=1, temperature=0))
while engine.has_unfinished(): engine.step()
mixed, decode7, batch8, decode8 = [], [], [], []
for rep in range(6):
    ids = [engine.add_request(prompt(), SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)) for _ in range(7)]
    engine.step()  # the seven prompts
    for _ in range(3): decode7.append(timed_step())
    ids.append(engine.add_request(prompt(), SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)))
    mixed.append(timed_step())   # one prompt beside seven decodes
    for _ in range(3): decode8.append(timed_step())
    for i in ids: engine.abort(i)
    while engine.has_unfinished(): engine.step()
    for _ in range(8): engine.add_request(prompt(), SamplingParams(max_tokens=1, temperature=0))
    batch8.append(timed_step())  # eight prompts together
    while engine.has_unfinished(): engine.step()
for name, v in [("decode 7", decode7), ("decode 8", decode8), ("1 prompt + 7 decodes", mixed), ("8 prompts", batch8)]:
    print(f"{name:22s} median {statistics.median(v):7.1f} ms  all {[round(x) for x in v]}")
