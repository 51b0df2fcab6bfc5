"""Routed experts of a mixture-of-experts layer: each token through its top-k experts, weighted and summed.

The router (which experts, with what weights) is the model's; this module owns only the experts'
arithmetic, given `topk_ids` [T, k] and `topk_weights` [T, k]. Expert weights are stacked in one
layout whatever the checkpoint's (`ExpertWeights`): gate rows then up rows, out x in, as nn.Linear;
an ungated expert (Nemotron-H's squared ReLU, `UNGATED_ACTIVATIONS`) has up rows only.

`prepare` lays them out once at load for the device's path, which `routed_experts` then takes:
- CPU with the C++ extension loaded: `PackedExperts`, run by `radixserve::moe_experts` (csrc/moe.cpp);
- CUDA: `ExpertWeights` on the device, run by the Triton kernels (`fused_moe.fused_experts`);
- elsewhere (CPU without the extension, fp16 on CPU): `ExpertWeights`, run by the plain-torch
  `routed_experts_reference`;
- a GGUF file's quantized experts (the loader makes them, CPU with the extension): `GgmlExperts`, one
  `radixserve::linear` per routed expert and projection over the file's blocks.

Invariants: only the experts some token routes to are read; a token's result is the sum over its k
experts in k order. On the C++ and Triton paths it never depends on which other tokens share the step,
bit for bit (batch invariance); the reference's matmuls (oneDNN/MKL) may round a row differently with
another row count, so it guarantees that only up to the last bits. Numerics: the C++ path keeps every
intermediate in fp32 and rounds once to x's dtype; the Triton path, like the reference, rounds the
projections and the activation to x's dtype, and sums the weighted expert outputs in fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

ACTIVATIONS = ("silu", "gelu_tanh", "clamped_swiglu")  # gated: act(gate) * up
UNGATED_ACTIVATIONS = ("relu2",)  # one projection: relu(up)^2
EXPERT_ACTIVATIONS = ACTIVATIONS + UNGATED_ACTIVATIONS
ACTIVATION_CODES = {kind: code for code, kind in enumerate(EXPERT_ACTIVATIONS)}  # moe.cpp's `Activation`
PACKED_DTYPES = (torch.float32, torch.bfloat16)  # the C++ kernel's weight dtypes
TILE = 16  # the C++ kernel's lanes: a gate/up tile is 16 gate then 16 up outputs, a down tile 32 outputs


@dataclass(frozen=True)
class ExpertActivation:
    """How an expert's first projection becomes the down projection's input. Gated, of its gate and up
    halves: silu: silu(g) * u (SwiGLU); gelu_tanh: GeGLU; clamped_swiglu (gpt-oss): g clamped above at
    `limit`, u to [-limit, limit], g * sigmoid(alpha g) * (u + 1). Ungated, of the whole projection:
    relu2: relu(u)^2 (Nemotron-H)."""

    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self) -> None:
        if self.kind not in EXPERT_ACTIVATIONS:
            raise ValueError(f"unknown expert activation {self.kind!r}; supported: {', '.join(EXPERT_ACTIVATIONS)}")

    @property
    def gated(self) -> bool:
        """Whether the first projection holds gate rows then up rows (else up rows only)."""
        return self.kind in ACTIVATIONS

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.kind == "relu2":
            return torch.relu(gate_up).square()
        gate, up = gate_up.chunk(2, dim=-1)
        if self.kind == "silu":
            return torch.nn.functional.silu(gate) * up
        if self.kind == "gelu_tanh":
            return torch.nn.functional.gelu(gate, approximate="tanh") * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return gate * torch.sigmoid(gate * self.alpha) * (up + 1)


@dataclass
class ExpertWeights:
    gate_up: torch.Tensor  # [E, 2I, H]: gate rows, then up rows; ungated experts [E, I, H], up rows only
    down: torch.Tensor  # [E, H, I]
    gate_up_bias: torch.Tensor | None = None  # [E, 2I]
    down_bias: torch.Tensor | None = None  # [E, H]

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> ExpertWeights:
        """Every stack (and bias) through `fn`."""
        return ExpertWeights(fn(self.gate_up), fn(self.down),
                             None if self.gate_up_bias is None else fn(self.gate_up_bias),
                             None if self.down_bias is None else fn(self.down_bias))


def routed_experts_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                             weights: ExpertWeights, activation: ExpertActivation) -> torch.Tensor:
    """[T, H]: Σ_k topk_weights[t, k] · expert_{topk_ids[t, k]}(x[t]), in plain torch, reading only
    the routed experts; each expert runs once over the tokens routed to it. The C++ and Triton
    paths are tested against it."""

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.linear(rows, weights.gate_up[e],
                                       None if weights.gate_up_bias is None else weights.gate_up_bias[e])
        return torch.nn.functional.linear(activation(h), weights.down[e],
                                          None if weights.down_bias is None else weights.down_bias[e])

    return per_expert(x, topk_ids, topk_weights, weights.num_experts, expert)


def per_expert(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
               expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Σ_k topk_weights[t, k] · expert(topk_ids[t, k], x[t]), each expert called once on the rows routed to
    it, the weighted outputs summed in k order."""
    tokens, k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    outputs = x.new_empty((tokens * k, x.shape[1]))
    start = 0
    for e, count in enumerate(counts):
        if not count:
            continue
        pairs = order[start:start + count]
        start += count
        outputs.index_copy_(0, pairs, expert(e, x.index_select(0, pairs // k)).to(x.dtype))
    weighted = outputs.view(tokens, k, -1) * topk_weights.to(x.dtype)[:, :, None]
    out = weighted[:, 0]
    for j in range(1, k):  # in k order: a token's sum never depends on its neighbours
        out = out + weighted[:, j]
    return out


@dataclass
class GgmlExperts:
    """Experts kept in a GGUF file's blocks (`ggml_quants.pack_ggml`), one packed gate/up (gate rows then
    up rows; up alone for ungated experts) and one packed down weight per expert, with their biases where
    they have them (gpt-oss), run by the C++ kernel's `radixserve::linear` per routed expert. Each row's
    result does not depend on the others."""

    gate_up: list[torch.Tensor]
    down: list[torch.Tensor]
    gate_up_rows: int
    width: int  # the experts' input and output width
    gate_up_bias: torch.Tensor | None = None  # [E, gate_up_rows] fp32 (gpt-oss)
    down_bias: torch.Tensor | None = None  # [E, width] fp32

    @property
    def num_experts(self) -> int:
        return len(self.gate_up)


def ggml_routed_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: GgmlExperts,
                        activation: ExpertActivation) -> torch.Tensor:
    """`routed_experts` of GGUF-block experts, in fp32."""
    linear = torch.ops.radixserve.linear

    gate_up_bias, down_bias = experts.gate_up_bias, experts.down_bias

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        h = linear(rows, experts.gate_up[e], None if gate_up_bias is None else gate_up_bias[e], experts.gate_up_rows)
        return linear(activation(h).contiguous(), experts.down[e], None if down_bias is None else down_bias[e],
                      experts.width)

    return per_expert(x.float().contiguous(), topk_ids, topk_weights, experts.num_experts, expert)


@dataclass
class PackedExperts:
    """Expert weights in the C++ kernel's layout (`csrc/moe.cpp`), made once at load by `prepare`:
    gate_up [E, Ip/16, H, 32] (per input column, 16 gate then the matching 16 up outputs; ungated,
    [E, Ip/32, H, 32], 32 up outputs), down [E, Hp/32, Ip, 32], in the checkpoint's dtype (fp32 or
    bf16); biases fp32 in the same tiles. Ip and Hp are I rounded up to 16 (ungated: 32) and H to
    32; the padding is zeros."""

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    hidden: int
    intermediate: int

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _tiles(rows: torch.Tensor) -> torch.Tensor:
    """[E, tiles, 32, in] (a tile's 32 output rows) -> [E, tiles, in, 32], contiguous."""
    return rows.transpose(2, 3).contiguous()


def pack_experts(weights: ExpertWeights, gated: bool = True) -> PackedExperts:
    """`weights` in the C++ kernel's layout (a copy: the caller keeps only this). Gated: tiles of 16
    gate rows then the matching 16 up rows; ungated: tiles of 32 up rows, as the down projection's."""
    experts, rows, hidden = weights.gate_up.shape
    inter, tile = (rows // 2, TILE) if gated else (rows, 2 * TILE)
    padded_inter, padded_hidden = _round_up(inter, tile), _round_up(hidden, 2 * TILE)
    halves = 2 if gated else 1  # [E, halves, Ip, H]: (gate, up) or (up,), zero-padded to Ip rows each
    first = weights.gate_up.new_zeros(experts, halves, padded_inter, hidden)
    first[:, :, :inter] = weights.gate_up.detach().view(experts, halves, inter, hidden)
    gate_up = first.view(experts, halves, padded_inter // tile, tile, hidden).transpose(1, 2)
    down = weights.down.new_zeros(experts, padded_hidden, padded_inter)
    down[:, :hidden, :inter] = weights.down.detach()
    gate_up_bias = down_bias = None
    if weights.gate_up_bias is not None:
        bias = torch.zeros(experts, halves, padded_inter, dtype=torch.float32)
        bias[:, :, :inter] = weights.gate_up_bias.detach().float().view(experts, halves, inter)
        gate_up_bias = bias.view(experts, halves, padded_inter // tile, tile).transpose(1, 2).reshape(
            experts, padded_inter // tile, 2 * TILE).contiguous()
    if weights.down_bias is not None:
        down_bias = torch.zeros(experts, padded_hidden, dtype=torch.float32)
        down_bias[:, :hidden] = weights.down_bias.detach().float()
    return PackedExperts(
        gate_up=_tiles(gate_up.reshape(experts, padded_inter // tile, 2 * TILE, hidden)),
        down=_tiles(down.view(experts, padded_hidden // (2 * TILE), 2 * TILE, padded_inter)),
        gate_up_bias=gate_up_bias, down_bias=down_bias, hidden=hidden, intermediate=inter)


def cpu_kernel_available() -> bool:
    """Whether the C++ extension with `radixserve::moe_experts` is loaded in this process
    (`cpu_extension.loaded_or_explained()` loads it)."""
    return hasattr(torch.ops.radixserve, "moe_experts")


def prepare(weights: ExpertWeights, device: torch.device | str, *, use_cpu_kernel: bool = True,
            gated: bool = True) -> ExpertWeights | PackedExperts:
    """`weights` as `routed_experts` runs them fastest on `device`, made once at load (a copy where the
    layout changes: the caller keeps only the result). CPU: `PackedExperts` where the C++ extension
    is loaded, the weights are fp32 or bf16 and `use_cpu_kernel` (False under --enforce-eager), else
    the plain stacks; other devices: the plain stacks, contiguous, on the device."""
    device = torch.device(device)
    if (device.type == "cpu" and use_cpu_kernel and weights.gate_up.dtype in PACKED_DTYPES
            and cpu_kernel_available()):
        return pack_experts(weights.map(lambda t: t.detach()), gated)
    return weights.map(lambda t: t.detach().to(device).contiguous())


def routed_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   weights: ExpertWeights | PackedExperts | GgmlExperts, activation: ExpertActivation) -> torch.Tensor:
    """The experts' output [T, H] in x's dtype on this device's fastest path: `PackedExperts` (CPU)
    through the C++ kernel, `ExpertWeights` on CUDA through the Triton kernels, otherwise the
    reference. x [T, H] fp32 or bf16, topk_ids [T, k] int64, topk_weights [T, k] fp32."""
    if isinstance(weights, GgmlExperts):
        return ggml_routed_experts(x, topk_ids, topk_weights, weights, activation).to(x.dtype)
    if isinstance(weights, PackedExperts):
        return torch.ops.radixserve.moe_experts(
            x, topk_ids, topk_weights, weights.gate_up, weights.gate_up_bias, weights.down, weights.down_bias,
            ACTIVATION_CODES[activation.kind], activation.alpha, activation.limit)
    if x.is_cuda:
        from radixserve.kernels.fused_moe import fused_experts  # imports triton: CUDA only

        return fused_experts(x, topk_ids, topk_weights, weights, activation)
    return routed_experts_reference(x, topk_ids, topk_weights, weights, activation)
