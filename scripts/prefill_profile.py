"""Where one cold prefill's CPU time goes, by operator: what decides whether a recurrent layer's own kernel
(a chunked DeltaNet prefill, a C++ Mamba2 scan) would pay (docs/bench/hybrid.md, "Where a prefill's time goes").
`--ab N`: instead, N cold prefills with the recurrent layers' C++ kernels and N with their torch paths,
alternating, and the median of each.

    python scripts/prefill_profile.py MODEL_DIR [--tokens 1024] [--ab 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from torch.profiler import ProfilerActivity, profile

from radixserve import LLM, SamplingParams
from radixserve.model.delta_net import GatedDeltaNet
from radixserve.model.mamba2 import Mamba2Mixer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--ab", type=int, default=0)
    a = p.parse_args()
    llm = LLM(model=a.model, enable_prefix_cache=False)  # every prefill cold
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rng = random.Random(0)
    prompt = [rng.randrange(3, 400) for _ in range(a.tokens)]
    llm.generate([prompt[:64]], one)  # warm: the first forward builds what later ones reuse

    def prefill() -> float:
        start = time.perf_counter()
        llm.generate([prompt], one)
        return time.perf_counter() - start

    if a.ab:
        layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, (GatedDeltaNet, Mamba2Mixer))]
        kernel = bool(layers) and layers[0].cpu_kernel
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(a.ab):
            for use in (True, False):
                for layer in layers:
                    layer.cpu_kernel = use and kernel
                times[use].append(prefill())
        print(f"{a.model}: a {a.tokens}-token prefill, median of {a.ab}: {statistics.median(times[True]):.2f} s with "
              f"the recurrent layers' C++ kernels, {statistics.median(times[False]):.2f} s with their torch paths")
        return
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        seconds = prefill()
    total = sum(e.self_cpu_time_total for e in prof.key_averages())
    print(f"{a.model}: a {a.tokens}-token prefill took {seconds:.2f} s")
    for event in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]:
        print(f"  {event.key:<36} {event.self_cpu_time_total / 1e3:10.1f} ms  {event.self_cpu_time_total / total:6.1%}")


if __name__ == "__main__":
    main()
