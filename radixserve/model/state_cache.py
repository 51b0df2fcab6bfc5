"""Physical recurrent-state storage of a hybrid model: per recurrent layer, each slot's convolution
window and (Gated DeltaNet and Mamba2 layers) matrix state.

Layout: per recurrent layer, `conv` [num_slots + 1, conv_kernel - 1, conv_dim] in the model's dtype
(the last inputs of the layer's causal convolution); per layer with a matrix state also `ssm`
[num_slots + 1, *spec.state_shape] in float32 (a DeltaNet's [value_heads, key_head_dim,
value_head_dim], a Mamba2's [heads, head_dim, state_size]; the recurrences accumulate in fp32, as
the references do), None for a short convolution. A slot holds one sequence's state
after some prefix of its tokens: a running sequence's working state, or a checkpoint the radix tree
keeps at a node's end. Slots 0..num_slots-1 are the
state pool's (`cache.block_pool.BlockPool` with one-slot "blocks"); the extra last one is scratch
that probe rows write. Which slot belongs to whom is the scheduler's business, not this module's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from radixserve.model.spec import RecurrentSpec


@dataclass(frozen=True)
class StateLayout:
    layers: tuple[RecurrentSpec, ...]
    dtype: torch.dtype  # the model's: the convolution windows' dtype

    @property
    def bytes_per_slot(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return sum((d.conv_kernel - 1) * d.conv_dim * elem + (math.prod(d.state_shape) * 4 if d.state_shape else 0)
                   for d in self.layers)

    def slots_for_budget(self, memory_mb: float) -> int:
        return int(memory_mb * 1024 * 1024) // self.bytes_per_slot


class StateCache:
    def __init__(self, layout: StateLayout, num_slots: int, device: torch.device) -> None:
        self.layout = layout
        self.num_slots = num_slots
        self.scratch_slot = num_slots
        self.conv = [torch.zeros(num_slots + 1, d.conv_kernel - 1, d.conv_dim, dtype=layout.dtype, device=device)
                     for d in layout.layers]
        self.ssm = [None if d.state_shape is None else
                    torch.zeros(num_slots + 1, *d.state_shape, dtype=torch.float32, device=device)
                    for d in layout.layers]

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Copy whole states src[i] -> dst[i] in every layer, in order (a later copy may read an
        earlier one's destination)."""
        for s, d in zip(src, dst):
            for conv, ssm in zip(self.conv, self.ssm):
                conv[d].copy_(conv[s])
                if ssm is not None:
                    ssm[d].copy_(ssm[s])
