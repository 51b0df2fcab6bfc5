import sys, time, statistics, numpy as np, torch
from radixserve.kernels.cpu_extension import load_extension
from radixserve_bench.checks.cpu_ggml import random_packed
load_extension()
torch.set_num_threads(2)
rng = np.random.default_rng(0)
out, inp = 49152, 576
w = random_packed("Q8_0", out, inp, rng, "int8")
x = torch.randn(1, inp)
junk = torch.empty(32 * 1024 * 1024)  # 128 MB
def once():
    return torch.ops.radixserve.linear(x, w, None, out)
ref = once()
for cold in (False, True):
    ts = []
    for _ in range(31):
        if cold: junk.fill_(1.0)
        t = time.perf_counter(); once(); ts.append(time.perf_counter() - t)
    ms = statistics.median(ts) * 1e3
    print(f"cold={cold} {ms:.3f} ms, {w.numel()/ms/1e6:.1f} GB/s")
print(torch.equal(ref, once()))
