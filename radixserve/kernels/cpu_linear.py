"""CPU matmuls from weights laid out once for a CPU kernel: the projections and the LM head of a model on CPU.

A decode step on CPU reads every weight once per token row; `F.linear` on a plain row-major weight
runs as one-threaded GEMV there (about a third of the machine's copy bandwidth on the 2-core
reference machine). Two layouts run on every thread:
- `BlockedLinear`, the C++ extension's kernel (`csrc/linear.cpp`, built by `cpu_extension`): blocks
  of 16 outputs, streamed in order; it reads the embedded model's weights at 27-32 GB/s where
  oneDNN reads them at 14-25 (docs/cpu.md), and every row's result is the same whatever the row count;
- `PackedLinear`, oneDNN's blocked layout, where the extension cannot be built (or under
  `--enforce-eager`).
`pack_for_cpu` swaps each `nn.Linear` of the model for one of them holding only the reordered weight
(the plain copy is freed), and gives a tied model a packed LM head of its own: the embedding keeps
the plain matrix for its lookups, so a tied model holds its embedding twice (the price of a head
read at full speed).

Invariants: a packed linear computes what the `nn.Linear` it replaced computed, to fp32 rounding
(each sums in its own order; checked on a probe before any swap, and a layout the machine cannot
run leaves the model as it was); its `weight` parameter is the packed tensor, so `parameters()`
still counts every weight byte once.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

PACKED_DTYPES = (torch.float32, torch.bfloat16)
# oneDNN picks its blocked layout for an expected row count; 16 ran fastest on every shape from
# 1 to 512 rows on the reference machine (docs/bench/cpu-step)
_LAYOUT_ROWS = 16
# With that layout one row takes a GEMV path of its own: slower than four rows, and rounding
# differently from every row count >= 2, which all agree bit for bit. Fewer rows are padded to this
# many, so a row's result never depends on how many rows ran with it (a seeded sample or a greedy
# answer is the same alone, batched or verified with drafts) and one row runs at four rows' speed.
MIN_ROWS = 4


class PackedLinear(nn.Module):
    """y = x W^T + b with W in oneDNN's layout; x is [rows, in_features], each row's result the same
    whatever the row count (`MIN_ROWS`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _LAYOUT_ROWS),
                                   requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        # the padded input of a short batch, reused: rows past the real ones keep whatever an earlier
        # call left there (a row's product reads only its own row), so padding is one copy
        self._padded = torch.zeros(MIN_ROWS, self.in_features, dtype=weight.dtype, device=weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if 0 < rows < MIN_ROWS:
            padded = self._padded
            padded[:rows] = x
            return torch.ops.mkldnn._linear_pointwise(padded, self.weight, self.bias, "none", [], "")[:rows]
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


class BlockedLinear(nn.Module):
    """y = x W^T + b through the C++ extension's kernel (`radixserve::linear`), W in blocks of 16
    outputs; x is [rows, in_features], each row's result the same whatever the row count. Needs the
    extension loaded (`cpu_extension.load_extension`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(torch.ops.radixserve.pack_linear(weight.detach()), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.radixserve.linear(x, self.weight, self.bias, self.out_features)


PackedKind = type[PackedLinear] | type[BlockedLinear]


def packing_works(dtype: torch.dtype, kind: PackedKind = PackedLinear) -> bool:
    """Whether this machine packs and runs a `dtype` linear of `kind` (it agrees with `F.linear` on a
    probe): oneDNN's is absent on some builds and CPUs, the kernel without the extension; never assumed."""
    if dtype not in PACKED_DTYPES or (kind is PackedLinear and not torch.backends.mkldnn.is_available()):
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(48, 32, generator=generator).to(dtype)
        x = torch.randn(3, 32, generator=generator).to(dtype)
        got = kind(weight, None)(x).float()
        want = nn.functional.linear(x, weight).float()
    except (RuntimeError, AttributeError) as error:
        log.info("%s cannot pack %s linears here (%s)", kind.__name__, dtype, error)
        return False
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    return bool(torch.allclose(got, want, rtol=tolerance, atol=tolerance))


def pack_for_cpu(model: nn.Module, head_weight: torch.Tensor | None, kind: PackedKind = PackedLinear) -> int:
    """Swap every `nn.Linear` under `model` for a packed linear of `kind`; returns how many.
    `head_weight`, when given (a tied model's embedding), is packed as the `lm_head` the model then uses."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear]
    for parent, name, linear in swaps:
        setattr(parent, name, kind(linear.weight, linear.bias))
    if head_weight is not None:
        model.lm_head = kind(head_weight, None)
    return len(swaps) + (head_weight is not None)
