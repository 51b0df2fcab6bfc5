"""A mixture-of-experts MLP: a router picks each token's top-k experts and their weights; the experts'
arithmetic is `kernels.moe.routed_experts`.

Routing follows the family (`MlpSpec.routing`):
- softmax over every expert then the top k (Qwen3-MoE, Mixtral; rescaled to sum to 1 where
  `normalize_topk`);
- the top-k logits then a softmax over them (gpt-oss, whose router has a bias);
- sigmoid scores, the top k chosen by score plus a learned per-expert bias and weighted by the score
  alone, optionally normalised, then scaled (LFM2-MoE); optionally chosen only from the groups of
  experts whose two best scores sum highest (Nemotron-H, as DeepSeek-V3);
- Gemma 4: the router's input normed and scaled by a learned vector, softmax then the top k
  rescaled to sum to 1, each times a learned per-expert scale.
A shared expert (a dense MLP every token runs) is added to the routed experts' sum: scaled by sigmoid
of its own one-output gate (Qwen3-Next, Qwen3.5-MoE) or as it is (Granite 4, Nemotron-H). Experts
may be gated (SwiGLU and kin) or not (Nemotron-H's squared ReLU), and may run in a narrower latent
space between two projections (Nemotron-H's `moe_latent_size`). Expert weights are stacked as
`ExpertWeights` lays them out, whatever the checkpoint's layout (the loader converts). Invariant: a
token's routing and result depend on that token alone.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from radixserve.kernels.moe import ExpertActivation, ExpertWeights, GgmlExperts, PackedExperts, prepare, routed_experts
from radixserve.kernels.mxfp4_format import Mxfp4Experts
from radixserve.model.ops import unit_rms_norm
from radixserve.model.spec import MlpSpec, ModelSpec


class Fp32Router(nn.Linear):
    """A router whose weight and logits are fp32 in a model of any dtype (`MlpSpec.router_fp32`); a
    subclass of Linear, so that the CPU packing (which swaps plain Linears) leaves it as it is."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())


class MoE(nn.Module):
    def __init__(self, spec: ModelSpec, mlp: MlpSpec, shared_expert: nn.Module | None = None) -> None:
        """`shared_expert`: the dense MLP of `mlp.shared_intermediate_size` the decoder built for it."""
        super().__init__()
        if (shared_expert is None) != (mlp.shared_intermediate_size == 0):
            raise ValueError("a shared expert is given exactly when the spec names one")
        self.shared_expert = shared_expert
        self.shared_expert_gate = (nn.Linear(spec.hidden_size, 1, bias=False)
                                   if shared_expert is not None and mlp.shared_gate else None)
        hidden, inter, experts = spec.hidden_size, mlp.intermediate_size, mlp.num_experts
        self.top_k, self.routing, self.normalize_topk = mlp.top_k, mlp.routing, mlp.normalize_topk
        self.normalize_epsilon = mlp.normalize_epsilon
        self.expert_groups, self.expert_groups_kept = mlp.expert_groups, mlp.expert_groups_kept
        self.router = (Fp32Router if mlp.router_fp32 else nn.Linear)(hidden, experts, bias=mlp.router_bias)
        self.router_scale = nn.Parameter(torch.empty(hidden)) if mlp.router_norm else None
        self.per_expert_scale = nn.Parameter(torch.empty(experts)) if mlp.per_expert_scale else None
        self.eps = spec.rms_norm_eps
        self.expert_bias = nn.Parameter(torch.empty(experts)) if mlp.expert_bias else None
        self.routed_scaling = mlp.routed_scaling
        # the experts' input and output width: the latent space between the two projections, if any
        width = mlp.latent_size or hidden
        self.fc1_latent_proj = nn.Linear(hidden, width, bias=False) if mlp.latent_size else None
        self.fc2_latent_proj = nn.Linear(width, hidden, bias=False) if mlp.latent_size else None
        self.activation = ExpertActivation(mlp.activation, mlp.swiglu_alpha, mlp.swiglu_limit)
        rows = 2 * inter if self.activation.gated else inter
        self.gate_up = nn.Parameter(torch.empty(experts, rows, width))
        self.down = nn.Parameter(torch.empty(experts, width, inter))
        self.gate_up_bias = nn.Parameter(torch.empty(experts, rows)) if mlp.bias else None
        self.down_bias = nn.Parameter(torch.empty(experts, width)) if mlp.bias else None
        # `pack` makes it once the weights are loaded; the loader sets MXFP4 experts the GPU runs as they are,
        # and a GGUF's quantized experts the CPU runs as they are
        self.packed: ExpertWeights | PackedExperts | Mxfp4Experts | GgmlExperts | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_ids [T, k] int64, topk_weights [T, k] float32) of each token."""
        if self.router_scale is not None:
            x = unit_rms_norm(x, self.eps) * self.router_scale * x.shape[-1] ** -0.5
        logits = self.router(x)
        if self.routing == "topk_softmax":
            top, ids = torch.topk(logits, self.top_k, dim=-1)
            return ids, torch.softmax(top.float(), dim=-1)
        if self.routing == "sigmoid_topk":
            scores = torch.sigmoid(logits.float())
            choice = scores if self.expert_bias is None else scores + self.expert_bias.float()
            if self.expert_groups > 1:
                choice = self._in_kept_groups(choice)
            ids = torch.topk(choice, self.top_k, dim=-1).indices
            weights = scores.gather(1, ids)
            if self.normalize_topk:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + self.normalize_epsilon)
            return ids, weights * self.routed_scaling
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.per_expert_scale is not None:
            weights = weights * self.per_expert_scale[ids]
        return ids, weights

    def _in_kept_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """`choice` [T, E] with every expert outside a token's kept groups at -inf: a group's score is
        the sum of its two best choosing scores."""
        grouped = choice.view(choice.shape[0], self.expert_groups, -1)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        kept = torch.topk(group_scores, self.expert_groups_kept, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        return grouped.masked_fill(~keep[:, :, None], float("-inf")).view_as(choice)

    def keep_fp32(self) -> None:
        """Its routing parameters back in fp32 after the model was cast to its dtype: the expert bias (only
        ever added in fp32) and an fp32 router's weight. Changes the parameters' dtype, before loading."""
        if isinstance(self.router, Fp32Router):
            self.router.float()
        if self.expert_bias is not None:
            self.expert_bias.data = self.expert_bias.data.float()

    def experts(self) -> ExpertWeights:
        return ExpertWeights(self.gate_up, self.down, self.gate_up_bias, self.down_bias)

    def pack(self, use_cpu_kernel: bool) -> None:
        """The experts in the layout `routed_experts` runs fastest on this device (on CPU the C++
        kernel's tiles, which read only routed experts and keep a token's result independent of its
        batch), made once after loading. Where that is a copy the stacked parameters are dropped: the
        packed tensors hold the weights from then on. MXFP4 and GGUF experts are already in their kernels'
        layout."""
        if isinstance(self.packed, (Mxfp4Experts, GgmlExperts)):
            return
        self.packed = prepare(self.experts(), self.gate_up.device, use_cpu_kernel=use_cpu_kernel,
                              gated=self.activation.gated)
        if isinstance(self.packed, PackedExperts):
            self.register_parameter("gate_up", None)
            self.register_parameter("down", None)
            self.gate_up_bias = self.down_bias = None

    def forward(self, x: torch.Tensor, ops: Any = None, route_input: torch.Tensor | None = None) -> torch.Tensor:
        """The experts' sum for x; routed by x itself, or by `route_input` (Gemma 4 routes the residual
        stream while its experts read it normed)."""
        ids, weights = self.route(x if route_input is None else route_input)
        if isinstance(self.packed, Mxfp4Experts):
            from radixserve.kernels.fused_moe_mxfp4 import fused_experts_mxfp4  # imports triton: CUDA only

            return fused_experts_mxfp4(x, ids, weights, self.packed, self.activation)
        latent = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)
        out = routed_experts(latent, ids, weights, self.packed or self.experts(), self.activation)
        if self.fc2_latent_proj is not None:
            out = self.fc2_latent_proj(out)
        if self.shared_expert is not None:
            shared = self.shared_expert(x, ops)
            out = out + (shared if self.shared_expert_gate is None else torch.sigmoid(self.shared_expert_gate(x)) * shared)
        return out
