"""Thirty layers' attention of 8 decodes over a shared 1,024-token prefix (context 1,100, fp16 K/V,
the embedded model's heads), called straight into radixserve::paged_attention: the median of N passes
(argument, default 41) and a checksum of the last output, which must not change between builds.

    python attention_shared_prefix.py 101
"""
import time, statistics, torch, sys
from radixserve.kernels.cpu_extension import load_extension
load_extension(); torch.set_num_threads(2)
torch.manual_seed(0)
bs, kvh, d, heads, rows, ctx, shared = 16, 3, 64, 9, 8, 1100, 1024
nb_shared = shared // bs; per_row = (ctx - shared + bs - 1) // bs
blocks = nb_shared + rows * per_row
layers = 30
ks = [torch.randn(blocks, bs, kvh, d).half() for _ in range(layers)]
vs = [torch.randn(blocks, bs, kvh, d).half() for _ in range(layers)]
table = torch.zeros(rows, nb_shared + per_row, dtype=torch.int32)
for r in range(rows):
    table[r, :nb_shared] = torch.arange(nb_shared)
    table[r, nb_shared:] = nb_shared + r * per_row + torch.arange(per_row)
q = torch.randn(rows, heads, d); out = torch.empty_like(q)
def once():
    for l in range(layers):
        torch.ops.radixserve.paged_attention(q, ks[l], vs[l], table, [ctx]*rows, [1]*rows, 0.125, 1 << 40, out)
once()
n = int(sys.argv[1]) if len(sys.argv) > 1 else 41
ts = []
for _ in range(n):
    t = time.perf_counter(); once(); ts.append(time.perf_counter() - t)
print(f"median {statistics.median(ts)*1e3:.2f} ms over {n}; checksum {out.double().sum().item():.6f}")
