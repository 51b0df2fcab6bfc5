"""radixserve::gated_delta_rule alone: one 38-token chunk beside 7 decodes, 16 value heads of 64 x 64."""
import time, statistics
import torch
from radixserve.kernels.cpu_extension import loaded_or_explained
loaded_or_explained()
T, H, K, V = 45, 32, 128, 128
lens = [38] + [1] * 7
q, k = torch.randn(T, H, K), torch.randn(T, H, K)
v = torch.randn(T, H, V); beta = torch.rand(T, H); decay = torch.rand(T, H)
delta = torch.zeros(8, H, K, V)
out = torch.empty(T, H, V)
times = []
for _ in range(300):
    t = time.perf_counter()
    torch.ops.radixserve.gated_delta_rule(q, k, v, beta, decay, delta, list(range(8)), lens, [0] * 8, out)
    times.append((time.perf_counter() - t) * 1e3)
print(f"median {statistics.median(times[40:]):.3f} ms")
