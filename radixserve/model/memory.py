"""How many KV blocks a CUDA device holds: the rule behind `--gpu-memory-utilization`.

The engine may use `utilization` of the device's total memory for everything it owns. What is in use
when the pool is sized (the CUDA context, the weights, other processes) is read from the driver;
the activations of the largest step and the memory the decode CUDA graphs will keep are measured by
running them (`peak_bytes`) before the pool exists. The pool gets what remains, in whole blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceBudget:
    total_bytes: int
    in_use_bytes: int  # context, weights and anything else already on the device
    activation_bytes: int  # peak of the largest eager step
    graph_bytes: int  # what the captured decode graphs are expected to keep
    utilization: float

    @property
    def kv_bytes(self) -> int:
        return int(self.total_bytes * self.utilization) - self.in_use_bytes - self.activation_bytes - self.graph_bytes

    def kv_blocks(self, bytes_per_block: int) -> int:
        blocks = self.kv_bytes // bytes_per_block
        if blocks < 1:
            gib = 2**30
            raise ValueError(
                f"no memory left for the KV cache: {self.utilization:.2f} of {self.total_bytes / gib:.1f} GiB is "
                f"{self.total_bytes * self.utilization / gib:.1f} GiB, and weights/context use "
                f"{self.in_use_bytes / gib:.1f} GiB, activations {self.activation_bytes / gib:.2f} GiB, CUDA graphs "
                f"{self.graph_bytes / gib:.2f} GiB; raise --gpu-memory-utilization, lower --max-num-batched-tokens "
                "or --max-num-seqs, or set --kv-cache-memory-mb"
            )
        return blocks


def peak_bytes(run: Callable[[], object], device: torch.device) -> int:
    """Device memory `run` allocates at its peak beyond what was allocated before it."""
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    torch.cuda.synchronize(device)
    return max(0, torch.cuda.max_memory_allocated(device) - base)


def in_use_bytes(device: torch.device) -> tuple[int, int]:
    """(total, in use) as the driver sees them, after returning the allocator's cached blocks."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return total, total - free
