"""Thirty layers' attention of 8 decodes over a shared 1,024-token prefix (context 1,100, fp16 K/V,
the embedded model's heads), called straight into radixserve::paged_attention: the median of N passes
(argument, default 41) and a checksum of the last output, which must not change between builds.

    python attention_shared_prefix.py 101
"""
import statistics
import sys
import time

import torch

from radixserve.kernels.cpu_extension import load_extension

load_extension()
torch.set_num_threads(2)
torch.manual_seed(0)
BLOCK, KV_HEADS, DIM, HEADS, ROWS, CONTEXT, SHARED, LAYERS = 16, 3, 64, 9, 8, 1100, 1024, 30
shared_blocks = SHARED // BLOCK
own_blocks = (CONTEXT - SHARED + BLOCK - 1) // BLOCK
blocks = shared_blocks + ROWS * own_blocks
keys = [torch.randn(blocks, BLOCK, KV_HEADS, DIM).half() for _ in range(LAYERS)]
values = [torch.randn(blocks, BLOCK, KV_HEADS, DIM).half() for _ in range(LAYERS)]
table = torch.zeros(ROWS, shared_blocks + own_blocks, dtype=torch.int32)
for row in range(ROWS):
    table[row, :shared_blocks] = torch.arange(shared_blocks)
    table[row, shared_blocks:] = shared_blocks + row * own_blocks + torch.arange(own_blocks)
queries = torch.randn(ROWS, HEADS, DIM)
out = torch.empty_like(queries)


def once() -> None:
    for layer in range(LAYERS):
        torch.ops.radixserve.paged_attention(queries, keys[layer], values[layer], table, [CONTEXT] * ROWS,
                                             [1] * ROWS, 0.125, 1 << 40, out)


once()
passes = int(sys.argv[1]) if len(sys.argv) > 1 else 41
seconds = []
for _ in range(passes):
    start = time.perf_counter()
    once()
    seconds.append(time.perf_counter() - start)
print(f"median {statistics.median(seconds) * 1e3:.2f} ms over {passes}; checksum {out.double().sum().item():.6f}")
