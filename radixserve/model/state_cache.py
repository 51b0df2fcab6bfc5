"""Physical recurrent-state storage of a hybrid model: per recurrent layer, each slot's convolution
window and (Gated DeltaNet layers) delta-rule state.

Layout: per recurrent layer, `conv` [num_slots + 1, conv_kernel - 1, conv_dim] in the model's dtype
(the last inputs of the layer's causal convolution); per Gated DeltaNet layer also `delta`
[num_slots + 1, value_heads, key_head_dim, value_head_dim] in float32 (the delta rule accumulates in
fp32, as the reference does), None for a short convolution. A slot holds one sequence's state
after some prefix of its tokens: a running sequence's working state, or a checkpoint the radix tree
keeps at a node's end. Slots 0..num_slots-1 are the
state pool's (`cache.block_pool.BlockPool` with one-slot "blocks"); the extra last one is scratch
that probe rows write. Which slot belongs to whom is the scheduler's business, not this module's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.model.spec import DeltaNetSpec, RecurrentSpec


@dataclass(frozen=True)
class StateLayout:
    layers: tuple[RecurrentSpec, ...]
    dtype: torch.dtype  # the model's: the convolution windows' dtype

    @property
    def bytes_per_slot(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return sum((d.conv_kernel - 1) * d.conv_dim * elem
                   + (d.num_value_heads * d.key_head_dim * d.value_head_dim * 4 if isinstance(d, DeltaNetSpec) else 0)
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
        self.delta = [torch.zeros(num_slots + 1, d.num_value_heads, d.key_head_dim, d.value_head_dim,
                                  dtype=torch.float32, device=device) if isinstance(d, DeltaNetSpec) else None
                      for d in layout.layers]

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Copy whole states src[i] -> dst[i] in every layer, in order (a later copy may read an
        earlier one's destination)."""
        for s, d in zip(src, dst):
            for conv, delta in zip(self.conv, self.delta):
                conv[d].copy_(conv[s])
                if delta is not None:
                    delta[d].copy_(delta[s])
