"""The causal depthwise convolution of the recurrent layers (Gated DeltaNet, LFM2's short
convolution), continuing each sequence from its state slot.

Each item of a step convolves its new inputs after its slot's window of the previous kernel - 1
inputs (zeros for an item at position 0) and leaves the window holding its last kernel - 1 inputs,
so a slot always holds the window after the sequence's computed tokens. In torch, steps of one-token
items run as one batched product over the slots and prefill chunks run per item; with the Triton
kernels (`RecurrentImplementation` "triton": CUDA, or the interpreter under the Triton attention backend) every
item of a step is one launch (kernels/recurrent.py).

This module also owns what the recurrent layers share: which code runs them (`RecurrentImplementation`,
set by the runner), the batched decode's slot index (`decode_slots`) and the Triton kernels' per-step item
table (`step_items`, made once per step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.model.attention import AttentionMetadata

if TYPE_CHECKING:
    from radixserve.kernels.recurrent import StepItems

# which code runs a recurrent layer: plain torch, the C++ extension's scans on CPU (the convolution
# stays torch there), or the Triton kernels
RecurrentImplementation = Literal["torch", "cpp", "triton"]

# where a step's `StepItems` sit in its metadata's plans (the padded decode path puts its static ones there)
RECURRENT_ITEMS = "recurrent_items"


def decode_slots(slots: list[int], fresh: list[bool], dtype: torch.dtype,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For a step of one-token items: the slots to gather and scatter [B] and, per item, 1 to keep the
    slot's state or 0 to start from zeros (an item at position 0) [B], as the recurrent layers use them."""
    index = torch.tensor(slots, dtype=torch.long).to(device, non_blocking=True)
    keep = torch.tensor([not f for f in fresh], dtype=dtype).to(device, non_blocking=True)
    return index, keep


def step_items(meta: AttentionMetadata, slots: list[int], fresh: list[bool], device: torch.device) -> StepItems:
    """The Triton kernels' item table for this step, made by the first recurrent layer and kept on the
    step's metadata: every layer of a forward has the same items, slots and fresh flags."""
    from radixserve.kernels.recurrent import StepItems

    items = meta.plans.get(RECURRENT_ITEMS)
    if items is None:
        items = meta.plans[RECURRENT_ITEMS] = StepItems.make(meta.query_lens, slots, fresh, device)
    return items


class CausalConv(nn.Module):
    """Holds the weight [channels, 1, kernel] (and bias) as checkpoints store them."""

    def __init__(self, channels: int, kernel: int, bias: bool = False) -> None:
        super().__init__()
        self.channels, self.kernel = channels, kernel
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))
        self.bias = nn.Parameter(torch.empty(channels)) if bias else None
        self.implementation: RecurrentImplementation = "torch"  # the runner sets it

    def forward(self, inputs: torch.Tensor, windows: torch.Tensor, slots: list[int], fresh: list[bool],
                meta: AttentionMetadata) -> torch.Tensor:
        """inputs [T, C] -> outputs [T, C]; `windows` [slots, kernel - 1, C] is read and updated at `slots`."""
        if self.implementation == "triton":
            from radixserve.kernels.recurrent import causal_conv

            return causal_conv(inputs.contiguous(), windows, self.weight.reshape(self.channels, self.kernel),
                               self.bias, step_items(meta, slots, fresh, inputs.device))
        bias = None if self.bias is None else self.bias.to(inputs.dtype)
        if meta.all_decode:  # one token per item: all items at once
            index, keep = decode_slots(slots, fresh, windows.dtype, inputs.device)
            window = torch.cat([windows[index] * keep[:, None, None], inputs[:, None, :]], dim=1)  # [B, K, C]
            windows[index] = window[:, 1:]
            out = (window * self.weight[:, 0, :].to(window.dtype).t()[None]).sum(dim=1)
            return out if bias is None else out + bias
        outs, first = [], 0
        for n, slot, zero in zip(meta.query_lens, slots, fresh):
            window = torch.cat([torch.zeros_like(windows[slot]) if zero else windows[slot], inputs[first:first + n]])
            outs.append(F.conv1d(window.t()[None], self.weight.to(window.dtype), bias, groups=self.channels)[0].t())
            windows[slot] = window[-(self.kernel - 1):]
            first += n
        return torch.cat(outs)
