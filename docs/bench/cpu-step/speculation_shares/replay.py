"""Offline replay of `radixserve bench peers`'s shared-prompt workload (32 requests, a ~1k-token system
prompt, rounds of 8, 32 forced tokens each) through LLMEngine on the shipped Q4_1: steps, seconds,
output tok/s and the drafts verified and kept.

    python replay.py 1   # speculation on (8 draft tokens)
    python replay.py 0   # speculation off
    PYTHONPATH=<a worktree> python replay.py 1   # another commit's scheduler

(Tidied after the runs in replay.txt; the same calls.)
"""

import gc
import sys
import time

from radixserve.config import EngineConfig
from radixserve.engine.engine import LLMEngine
from radixserve.model.embedded import embedded_gguf_path
from radixserve.sampling_params import SamplingParams
from radixserve_bench.peers.workload import PeersOptions, build_peer_workloads

speculation = sys.argv[1] == "1"
engine = LLMEngine(EngineConfig(model=str(embedded_gguf_path()), max_num_seqs=8,
                                num_speculative_tokens=8 if speculation else 0))
tokenizer = engine.tokenizer
workload = build_peer_workloads(PeersOptions(workloads=["shared-prompt"]),
                                lambda text: tokenizer.encode(text, add_special_tokens=False),
                                tokenizer.decode)[0]
order = workload.order()
gc.collect()
gc.freeze()
steps, output_tokens, started = 0, 0, time.perf_counter()
for first in range(0, len(order), workload.concurrency):  # a round: its requests together, then the next
    for session, turn in order[first:first + workload.concurrency]:
        ids = tokenizer.apply_chat_template(session.messages(turn, []), add_generation_prompt=True, tokenize=True)
        ids = ids if isinstance(ids, list) else ids["input_ids"]
        engine.add_request(ids, SamplingParams(max_tokens=session.max_tokens, temperature=0, ignore_eos=True))
        output_tokens += session.max_tokens
    while engine.has_unfinished():
        engine.step()
        steps += 1
elapsed = time.perf_counter() - started
stats = engine.stats()
print(f"spec={int(speculation)} steps={steps} time={elapsed:.2f}s tok/s={output_tokens / elapsed:.1f}",
      dict(stats.spec_proposed), dict(stats.spec_accepted))
