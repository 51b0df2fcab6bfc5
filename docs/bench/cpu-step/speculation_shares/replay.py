"""Offline replay of `radixserve bench peers`'s shared-prompt workload (32 requests, a ~1k-token system
prompt, rounds of 8, 32 forced tokens each) through LLMEngine on the shipped Q4_1: steps, seconds,
output tok/s and the drafts verified and kept. Usage: python replay.py 1 (speculation on) or 0 (off);
with PYTHONPATH=<a worktree> it replays another commit's scheduler."""
import sys, time, gc
from radixserve.model.embedded import embedded_gguf_path
from radixserve.engine.engine import LLMEngine
from radixserve.config import EngineConfig
from radixserve.sampling_params import SamplingParams
from radixserve_bench.peers.workload import PeersOptions, build_peer_workloads
spec = int(sys.argv[1])
eng = LLMEngine(EngineConfig(model=str(embedded_gguf_path()), num_speculative_tokens=8 if spec else 0, max_num_seqs=8))
tok = eng.tokenizer
o = PeersOptions(workloads=["shared-prompt"])
w = build_peer_workloads(o, lambda s: tok.encode(s, add_special_tokens=False), lambda ids: tok.decode(ids))[0]
order = w.order()
gc.collect(); gc.freeze()
steps = 0; t0 = time.perf_counter()
for r in range(0, len(order), w.concurrency):
    for s, k in order[r:r + w.concurrency]:
        ids = tok.apply_chat_template(s.messages(k, []), add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list): ids = ids["input_ids"]
        eng.add_request(ids, SamplingParams(max_tokens=s.max_tokens, temperature=0, ignore_eos=True))
    while eng.has_unfinished() if hasattr(eng, "has_unfinished") else eng.scheduler.has_work():
        eng.step(); steps += 1
el = time.perf_counter() - t0
st = eng.stats()
print(f"spec={spec} steps={steps} time={el:.2f}s tok/s={len(order)*32/el:.1f}", dict(st.spec_proposed), dict(st.spec_accepted))
