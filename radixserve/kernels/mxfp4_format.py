"""MXFP4 expert weights (gpt-oss's checkpoints) and their torch reference: what `fused_moe_mxfp4` reads.

The OCP microscaling FP4 layout: a weight [rows, K] is stored as `blocks` [rows, K/32, 16] uint8, two
e2m1 values a byte, the low nibble first (k even, then k odd), and `scales` [rows, K/32] uint8, each an
e8m0 power of two 2^(s - 127) for its 32 values. e2m1 is sign, 2 exponent bits (bias 1), 1 mantissa
bit: the 16 codes are FP4_E2M1. Plain torch: importable where Triton is not.

`Mxfp4Experts` holds a MoE layer's experts as `kernels.moe.ExpertWeights` orders them (gate rows then up
rows, out x in) but in this format; biases stay in the model dtype. Invariant: K of both projections
(hidden and intermediate sizes) is a multiple of 32, so no block straddles two rows' inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.kernels.moe import ExpertWeights

FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32
E8M0_BIAS = 127


def check_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, name: str) -> None:
    if (blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() < 2
            or blocks.shape[-1] * 2 != BLOCK or scales.shape != blocks.shape[:-1]):
        raise ValueError(f"{name}: blocks {blocks.dtype} {tuple(blocks.shape)} and scales {scales.dtype} "
                         f"{tuple(scales.shape)} are not MXFP4 (uint8 [..., K/{BLOCK}, {BLOCK // 2}] and "
                         f"[..., K/{BLOCK}])")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [..., K/32, 16], scales [..., K/32] -> float32 [..., K] (exact)."""
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32, device=blocks.device)
    values = torch.stack((lut[(blocks & 0xF).long()], lut[(blocks >> 4).long()]), dim=-1).flatten(-2)
    return torch.ldexp(values, scales.long()[..., None] - E8M0_BIAS).flatten(-2)


@dataclass
class Mxfp4Experts:
    gate_up_blocks: torch.Tensor  # [E, 2I, H/32, 16]: gate rows, then up rows
    gate_up_scales: torch.Tensor  # [E, 2I, H/32]
    down_blocks: torch.Tensor  # [E, H, I/32, 16]
    down_scales: torch.Tensor  # [E, H, I/32]
    gate_up_bias: torch.Tensor | None = None  # [E, 2I] in the model dtype
    down_bias: torch.Tensor | None = None  # [E, H]

    def __post_init__(self) -> None:
        check_mxfp4(self.gate_up_blocks, self.gate_up_scales, "MXFP4 gate_up")
        check_mxfp4(self.down_blocks, self.down_scales, "MXFP4 down")
        experts, two_inter, groups = self.gate_up_scales.shape
        if self.down_scales.shape != (experts, groups * BLOCK, two_inter // 2 // BLOCK) or two_inter % (2 * BLOCK):
            raise ValueError(f"MXFP4 down scales {tuple(self.down_scales.shape)} do not fit gate_up scales "
                             f"{tuple(self.gate_up_scales.shape)} (intermediate size a multiple of {BLOCK})")

    @property
    def num_experts(self) -> int:
        return int(self.gate_up_blocks.shape[0])

    @property
    def hidden(self) -> int:
        return int(self.gate_up_scales.shape[2]) * BLOCK

    @property
    def intermediate(self) -> int:
        return int(self.gate_up_blocks.shape[1]) // 2

    def dequantized(self, dtype: torch.dtype) -> ExpertWeights:
        """The same experts as plain stacks in `dtype` (the reference; what a CPU load keeps)."""
        return ExpertWeights(dequantize_mxfp4(self.gate_up_blocks, self.gate_up_scales).to(dtype),
                             dequantize_mxfp4(self.down_blocks, self.down_scales).to(dtype),
                             self.gate_up_bias, self.down_bias)
