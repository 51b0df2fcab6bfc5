"""Where one cold prefill's CPU time goes, by operator: what decides whether a recurrent layer's own kernel
(a chunked DeltaNet prefill, a C++ Mamba2 scan) would pay (docs/bench/hybrid.md, "Where a prefill's time goes").

    python scripts/prefill_profile.py MODEL_DIR [PROMPT_TOKENS]
"""

from __future__ import annotations

import random
import sys
import time

from torch.profiler import ProfilerActivity, profile

from radixserve import LLM, SamplingParams


def main(model: str, tokens: int = 1024) -> None:
    llm = LLM(model=model)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rng = random.Random(0)
    prompt = [rng.randrange(3, 400) for _ in range(tokens)]
    llm.generate([prompt[:64]], one)  # warm: the first forward builds what later ones reuse
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        llm.generate([prompt], one)
        seconds = time.perf_counter() - start
    total = sum(e.self_cpu_time_total for e in prof.key_averages())
    print(f"{model}: a {tokens}-token prefill took {seconds:.2f} s")
    for event in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]:
        print(f"  {event.key:<36} {event.self_cpu_time_total / 1e3:10.1f} ms  {event.self_cpu_time_total / total:6.1%}")


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]))
