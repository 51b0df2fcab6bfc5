"""LFM2's gated short convolution token mixer over the state cache, in torch.

in_proj splits each token into B, C and x; the layer returns out_proj(C * conv(B * x)), where conv is
a causal depthwise convolution of a few taps (model/causal_conv.py) whose window of the last inputs
is the layer's whole per-sequence state, kept in the sequence's state slot.
"""

from __future__ import annotations

import torch
from torch import nn

from radixserve.model.attention import AttentionMetadata
from radixserve.model.causal_conv import CausalConv
from radixserve.model.spec import ShortConvSpec
from radixserve.model.state_cache import StateCache


class ShortConv(nn.Module):
    def __init__(self, spec: ShortConvSpec, state_index: int) -> None:
        super().__init__()
        self.state_index = state_index
        self.in_proj = nn.Linear(spec.channels, 3 * spec.channels, bias=spec.bias)
        self.conv = CausalConv(spec.channels, spec.kernel, spec.bias)
        self.out_proj = nn.Linear(spec.channels, spec.channels, bias=spec.bias)

    def forward(self, x: torch.Tensor, states: StateCache | None, meta: AttentionMetadata) -> torch.Tensor:
        b, c, h = self.in_proj(x).chunk(3, dim=-1)
        fresh = [seq_len == n for n, seq_len in zip(meta.query_lens, meta.seq_lens_host)]
        if states is None:  # a probe forward: each item gets its own zeros
            windows = torch.zeros(meta.num_seqs, self.conv.kernel - 1, self.conv.channels, dtype=x.dtype,
                                  device=x.device)
            slots, fresh = list(range(meta.num_seqs)), [True] * meta.num_seqs
        else:
            windows, slots = states.conv[self.state_index], meta.state_slots
        return self.out_proj(c * self.conv(b * h, windows, slots, fresh, meta))
