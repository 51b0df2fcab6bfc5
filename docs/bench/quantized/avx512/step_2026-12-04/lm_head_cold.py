"""One Q8_0 matmul of the embedded model's LM-head shape (49,152 x 576, random quants) at one row, int8
activations, 2 threads: the median of 31 calls with the weight in cache, then of 31 each after 128 MB
written (the weight read from memory, as inside a step), and whether the two passes gave the same bits.

    python lm_head_cold.py > lm_head_cold.txt
"""
import statistics
import time

import numpy as np
import torch

from radixserve.kernels.cpu_extension import load_extension
from radixserve_bench.checks.cpu_ggml import random_packed

load_extension()
torch.set_num_threads(2)
OUT, IN = 49152, 576
weight = random_packed("Q8_0", OUT, IN, np.random.default_rng(0), "int8")
x = torch.randn(1, IN)
eviction = torch.empty(32 * 1024 * 1024)  # 128 MB of fp32


def once() -> torch.Tensor:
    return torch.ops.radixserve.linear(x, weight, None, OUT)


first = once()
for cold in (False, True):
    seconds = []
    for _ in range(31):
        if cold:
            eviction.fill_(1.0)
        start = time.perf_counter()
        once()
        seconds.append(time.perf_counter() - start)
    ms = statistics.median(seconds) * 1e3
    print(f"cold={cold} {ms:.3f} ms, {weight.numel() / ms / 1e6:.1f} GB/s")
print(torch.equal(first, once()))
