"""The model's elementwise hot-path operations: in plain torch, in the CPU extension's loops, or as fused
Triton kernels.

Three operations run between the matmuls of every layer: residual add + RMSNorm, rotary embedding
of q and k, and SiLU-and-mul of the packed gate/up projection. `TorchOps` is the reference: the exact
rounding steps of the HF models. `TritonOps` launches one fused kernel per operation (from the
top-level `kernels` package) with the same rounding steps, which cuts a decode step's launches
several-fold; it agrees with TorchOps bit for bit in fp32 and to rounding in bf16. `CpuKernelOps`
runs the norm and SiLU-and-mul in the CPU extension's loops (the same rounding steps, the norm's sum
in its own fixed order: to rounding of TorchOps), which the compiled CPU step calls too.

Contract: `add_rms_norm(x, residual, ...)` returns (normed, new_residual) with new_residual = x +
residual (x when residual is None); `rotary(q, k, rope)` may rotate q and k in place and returns
them; `prepare_rotary` runs once per forward and its result is shared by every layer.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from radixserve.model.rope import RotaryEmbedding, apply_rotary


class ModelOps(Protocol):
    name: str

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def prepare_rotary(self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype) -> Any: ...

    def rotary(self, q: torch.Tensor, k: torch.Tensor, prepared: Any) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in float32 whatever the model dtype, as the checkpoints were trained to expect.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def unit_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x RMS-normed over its last dimension without a weight, in fp32, as transformers' Gemma 4 norms
    it (`pow(-0.5)`, not `rsqrt`): its value and router norms."""
    x32 = x.float()
    return (x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + eps, -0.5)).to(x.dtype)


class TorchOps:
    name = "torch"

    def add_rms_norm(self, x, residual, weight, eps):
        new_residual = x if residual is None else x + residual
        return rms_norm(new_residual, weight, eps), new_residual

    def prepare_rotary(self, rotary, positions, dtype):
        return rotary.cos_sin(positions, dtype)

    def rotary(self, q, k, prepared):
        cos, sin = prepared
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def silu_and_mul(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up


class CpuKernelOps(TorchOps):
    """TorchOps with the norm and SiLU-and-mul of the C++ extension (`csrc/elementwise.cpp`), which
    the compiled CPU step calls too: where the extension runs the projections, both paths then round
    alike without the step paying ATen's per-call setup for each. Other dtypes, devices or shapes
    (a norm weight of another dtype) take TorchOps' torch form."""

    name = "cpp"

    def add_rms_norm(self, x, residual, weight, eps):
        if x.device.type != "cpu" or weight.dtype != x.dtype or weight.shape != x.shape[-1:] or \
                (residual is not None and (residual.dtype != x.dtype or residual.shape != x.shape)):
            return super().add_rms_norm(x, residual, weight, eps)
        return torch.ops.radixserve.add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, gate_up):
        if gate_up.device.type != "cpu":
            return super().silu_and_mul(gate_up)
        return torch.ops.radixserve.silu_and_mul(gate_up)


class TritonOps:
    name = "triton"

    def __init__(self) -> None:
        from radixserve.kernels import add_rms_norm, rotary_qk_, silu_and_mul  # fails at engine start, not mid-step

        self._add_rms_norm, self._rotary, self._silu_and_mul = add_rms_norm, rotary_qk_, silu_and_mul

    def add_rms_norm(self, x, residual, weight, eps):
        return self._add_rms_norm(x, residual, weight, eps)

    def prepare_rotary(self, rotary, positions, dtype):
        return positions, rotary.get_buffer("cos_table"), rotary.get_buffer("sin_table")

    def rotary(self, q, k, prepared):
        positions, cos_table, sin_table = prepared
        self._rotary(q, k, positions, cos_table, sin_table)
        return q, k

    def silu_and_mul(self, gate_up):
        return self._silu_and_mul(gate_up)


def make_ops(backend_name: str, cpu_kernels: bool = False) -> ModelOps:
    """Fused kernels go with the Triton attention backend; the torch backend keeps the torch oracle,
    except where the C++ extension runs the CPU's projections (`cpu_kernels`): its elementwise ops."""
    if backend_name == "triton":
        return TritonOps()
    return CpuKernelOps() if cpu_kernels else TorchOps()
