"""The decoder of every supported family over a paged KV cache, in plain torch, built layer by layer
from a `ModelSpec`.

One forward call runs one flattened batch of T new tokens from many sequences; attention, including
writing the new K/V into the cache, is delegated to an AttentionBackend with each layer's window,
sinks and softcap; a window-state layer's (`--sliding-window-kv window`) runs over its state slots
(model/window_kv.py). q/k/v and gate/up projections are each packed into one matmul (the loader fills
them from however the checkpoint stores them, `loader.checkpoint_targets`). Pre-norm layers (Llama's
placement) carry the residual to the next layer's fused add + norm; sandwich (Gemma, GLM-4) and post
(OLMo 2) layers add their residual themselves. A layer may read an earlier layer's K/V instead of
projecting its own (Gemma 4's KV sharing): the source leaves its step's K/V (and, windowed, its windows
as they were before the step) in the step's `meta.plans`, which the reader takes after it. Gemma 4's
per-layer embeddings are computed once per forward beside the embedding and handed to each layer.
Construction allocates weights without initialising them: a model is only meaningful after the loader
has filled every parameter (it checks that it did).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from radixserve.kernels.moe import ExpertActivation
from radixserve.model.attention import AttentionBackend, AttentionMetadata
from radixserve.model.delta_net import GatedDeltaNet
from radixserve.model.kv_cache import KVCache
from radixserve.model.mamba2 import Mamba2Mixer
from radixserve.model.moe import MoE
from radixserve.model.ops import ModelOps, TorchOps, rms_norm, unit_rms_norm
from radixserve.model.rope import RopeParams, RotaryEmbedding
from radixserve.model.short_conv import ShortConv
from radixserve.model.spec import AttentionSpec, LayerSpec, MlpSpec, ModelSpec
from radixserve.model.window_kv import window_attention

TORCH_OPS = TorchOps()


class RMSNorm(nn.Module):
    """Holds a norm's weight and eps; `style` is the checkpoint's rounding (spec.NORM_STYLES). The
    ops apply a Llama-style norm fused with the residual add on the hot path."""

    def __init__(self, dim: int, eps: float, style: str = "llama") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.style = style

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.style == "llama":
            return rms_norm(x, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.style == "gemma":  # the checkpoint stores w - 1
            return (x32 * (1.0 + self.weight.float())).to(x.dtype)
        return (self.weight * x32).to(x.dtype)


def rope_key(spec: ModelSpec, attention: AttentionSpec) -> str:
    """One rotary table per distinct setting and head size, named by its first appearance: layers
    sharing it share its cos/sin per step."""
    distinct: list[tuple[RopeParams | None, int]] = list(dict.fromkeys(
        (a.rope, spec.head_dim_of(a)) for a in spec.attentions if a.rope))
    return f"rope{distinct.index((attention.rope, spec.head_dim_of(attention)))}"


def q_only_key(key: str) -> str:
    """The rotary entry of a layer that rotates only its queries (it reads another layer's keys): torch's
    cos/sin, whatever the ops."""
    return f"{key}/q"


def shared_kv_key(layer: int) -> str:
    """Where layer `layer` leaves its step's keys and values for the layers reading them (`meta.plans`)."""
    return f"kv_of/{layer}"


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_spec: LayerSpec, layer: int) -> None:
        super().__init__()
        a = layer_spec.attention
        assert a is not None
        self.layer = spec.kv_index(layer)  # the KV cache holds paged attention layers only
        # a window-state layer reads and writes its window's K/V in the state cache instead (model/window_kv.py),
        # a window-group layer in the window group's blocks (through `meta.window`)
        self.state_index = spec.state_index(layer) if a.window_state and a.kv_source is None else None
        self.window_index = spec.window_index(layer) if a.window_group else None
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.kv_heads_of(a), spec.head_dim_of(a)
        self.q_size, self.kv_size = spec.num_heads * self.head_dim, spec.kv_size_of(a)
        self.scale, self.window, self.softcap = a.scale, a.window, a.softcap
        self.rope = None if a.rope is None else rope_key(spec, a)
        self.qk_norm = a.qk_norm
        self.output_gate = a.output_gate
        self.key_scale = a.key_scale
        self.value_norm, self.eps = a.value_norm, spec.rms_norm_eps
        # KV sharing (Gemma 4): a source leaves its step's K/V for the later layers reading them
        self.kv_source, self.window_state = a.kv_source, a.window_state
        self.kv_key = shared_kv_key(layer) if any(o.kv_source == layer for o in spec.attentions) else None
        self.q_rows = self.q_size * (2 if a.output_gate else 1)  # a gated q_proj: each head's q, then its gate
        # the packed projection's k and v rows: none for a layer reading another's, k only when v is k's
        self.kv_rows = 0 if a.kv_source is not None else self.kv_size * (1 if a.value_from_key else 2)
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_rows + self.kv_rows, bias=a.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=a.o_bias)
        q_dim, k_dim = (self.q_size, self.kv_size) if a.qk_norm == "whole" else (self.head_dim, self.head_dim)
        norms = a.qk_norm != "none"
        self.q_norm = RMSNorm(q_dim, spec.rms_norm_eps, spec.norm_style) if norms else None
        self.k_norm = RMSNorm(k_dim, spec.rms_norm_eps, spec.norm_style) if norms and self.kv_rows else None
        self.sinks = nn.Parameter(torch.empty(spec.num_heads)) if a.sinks else None

    def forward(self, x: torch.Tensor, ropes: dict[str, tuple[RotaryEmbedding, Any]], kv_cache: KVCache,
                meta: AttentionMetadata, backend: AttentionBackend, ops: ModelOps) -> torch.Tensor:
        if self.kv_source is not None:
            return self._read_shared(x, ropes, kv_cache, meta, backend)
        tokens = x.shape[0]
        projected = self.qkv_proj(x)
        q, k = projected[:, :self.q_rows], projected[:, self.q_rows:self.q_rows + self.kv_size]
        v = k if self.kv_rows == self.kv_size else projected[:, self.q_rows + self.kv_size:]
        gate = None
        if self.output_gate:
            q, gate = q.reshape(tokens, self.num_heads, 2 * self.head_dim).split(self.head_dim, dim=-1)
            q, gate = q.reshape(tokens, self.q_size), gate.reshape(tokens, self.q_size)
        if self.q_norm is not None and self.k_norm is not None and self.qk_norm == "whole":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(tokens, self.num_heads, self.head_dim)
        k = k.reshape(tokens, self.num_kv_heads, self.head_dim)
        if self.key_scale != 1.0:
            k = k * self.key_scale
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        v = unit_rms_norm(v, self.eps) if self.value_norm else v.contiguous()
        if self.q_norm is not None and self.k_norm is not None and self.qk_norm == "per_head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            rotary, prepared = ropes[self.rope]
            if rotary.plain:
                q, k = ops.rotary(q, k, prepared)
            else:
                q, k = rotary.rotate(q, *prepared), rotary.rotate(k, *prepared)
        if self.state_index is not None:
            assert self.window is not None
            windows = None if kv_cache.states is None else kv_cache.states.conv[self.state_index]
            if self.kv_key is not None:  # the readers need the windows as they were before this step's rows (a copy)
                meta.plans[self.kv_key] = (k, v, None if windows is None else windows[meta.state_slots])
            out = window_attention(q, k, v, windows, meta, self.scale, self.window, self.sinks, self.softcap)
        else:
            if self.kv_key is not None:
                meta.plans[self.kv_key] = (k, v, None)
            out = self._paged(q, k, v, kv_cache, meta, backend)
        out = out.reshape(tokens, self.q_size)
        return self.o_proj(out if gate is None else out * torch.sigmoid(gate))

    def _read_shared(self, x: torch.Tensor, ropes: dict[str, tuple[RotaryEmbedding, Any]], kv_cache: KVCache,
                     meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        """Attention of this layer's queries over its source layer's keys and values: the source's
        paged blocks (the step's rows, written again, are the same) or its windows as they were before
        the step."""
        assert self.kv_source is not None
        tokens = x.shape[0]
        q = self.qkv_proj(x).reshape(tokens, self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        if self.rope is not None:
            rotary, prepared = ropes[q_only_key(self.rope)]
            q = rotary.rotate(q, *prepared)
        k, v, windows = meta.plans[shared_kv_key(self.kv_source)]
        if self.window_state:
            assert self.window is not None
            out = window_attention(q, k, v, windows, meta, self.scale, self.window, self.sinks, self.softcap,
                                   slots=list(range(meta.num_seqs)), update=False)
        else:
            out = self._paged(q, k, v, kv_cache, meta, backend)
        return self.o_proj(out.reshape(tokens, self.q_size))

    def _paged(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
               backend: AttentionBackend) -> torch.Tensor:
        """Paged attention over this layer's blocks: the KV cache's, or a window-group layer's in the window group."""
        if self.window_index is None:
            cache, index, view = kv_cache, self.layer, meta
        else:
            assert kv_cache.windows is not None and meta.window is not None, "a window-group layer needs its blocks"
            cache, index, view = kv_cache.windows, self.window_index, meta.window
        return backend.forward(q, k, v, cache.k(index), cache.v(index), view, self.scale,
                               window=self.window, sinks=self.sinks, softcap=self.softcap)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, mlp: MlpSpec) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * mlp.intermediate_size, bias=mlp.bias)
        self.down_proj = nn.Linear(mlp.intermediate_size, spec.hidden_size, bias=mlp.bias)
        self.activation = ExpertActivation(mlp.activation, mlp.swiglu_alpha, mlp.swiglu_limit)
        self.gate_scale, self.down_scale = mlp.gate_scale, mlp.down_scale

    def forward(self, x: torch.Tensor, ops: ModelOps) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.gate_scale != 1.0:
            gate, up = gate_up.chunk(2, dim=-1)
            gate_up = torch.cat((gate * self.gate_scale, up), dim=-1)
        h = ops.silu_and_mul(gate_up) if self.activation.kind == "silu" else self.activation(gate_up)
        out = self.down_proj(h)
        return out if self.down_scale == 1.0 else out * self.down_scale


class UngatedMLP(nn.Module):
    """down(relu(up(x))^2): Nemotron-H's MLP (kernels.moe.UNGATED_ACTIVATIONS)."""

    def __init__(self, spec: ModelSpec, mlp: MlpSpec) -> None:
        super().__init__()
        self.up_proj = nn.Linear(spec.hidden_size, mlp.intermediate_size, bias=mlp.bias)
        self.down_proj = nn.Linear(mlp.intermediate_size, spec.hidden_size, bias=mlp.bias)

    def forward(self, x: torch.Tensor, ops: ModelOps) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(x)).square())


class DecoderLayer(nn.Module):
    """Norms by placement: pre has input_layernorm and post_attention_layernorm (before the MLP);
    sandwich adds post_attention_layernorm after attention and pre/post_feedforward_layernorm around
    the MLP; post has only post_attention_layernorm and post_feedforward_layernorm, on the blocks' outputs.
    A pre-norm layer without a mixer (or an MLP) has neither it nor the norm before it."""

    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__()
        layer_spec = spec.layers[layer]
        self.placement = layer_spec.norms
        self.residual_scale = spec.residual_scale
        dim, eps, style = spec.hidden_size, spec.rms_norm_eps, spec.norm_style
        if self.placement != "post" and layer_spec.has_mixer:
            self.input_layernorm = RMSNorm(dim, eps, style)
        # its mixer, under the checkpoints' names: linear_attn (a DeltaNet), conv (LFM2), mamba, else self_attn;
        # parallel mixers (Falcon-H1) are mamba and self_attn both
        self.recurrent = layer_spec.recurrent is not None
        self.parallel = layer_spec.parallel
        self.mixer_name: str | None = None
        if self.parallel is not None:
            assert layer_spec.mamba is not None
            self.mamba = Mamba2Mixer(spec, layer_spec.mamba, spec.state_index(layer))
            self.self_attn = Attention(spec, layer_spec, layer)
            self.mixer_name = "parallel"
        elif layer_spec.delta_net is not None:
            self.linear_attn = GatedDeltaNet(spec, layer_spec.delta_net, spec.state_index(layer))
            self.mixer_name = "linear_attn"
        elif layer_spec.short_conv is not None:
            self.conv = ShortConv(layer_spec.short_conv, spec.state_index(layer))
            self.mixer_name = "conv"
        elif layer_spec.mamba is not None:
            self.mamba = Mamba2Mixer(spec, layer_spec.mamba, spec.state_index(layer))
            self.mixer_name = "mamba"
        elif layer_spec.attention is not None:
            self.self_attn = Attention(spec, layer_spec, layer)
            self.mixer_name = "self_attn"
        if layer_spec.mlp is not None or self.placement != "pre":
            self.post_attention_layernorm = RMSNorm(dim, eps, style)
        if self.placement == "sandwich":
            self.pre_feedforward_layernorm = RMSNorm(dim, eps, style)
        if self.placement != "pre":
            self.post_feedforward_layernorm = RMSNorm(dim, eps, style)
        self.mlp: nn.Module | None = None if layer_spec.mlp is None else _mlp(spec, layer_spec.mlp)
        self.experts: MoE | None = None
        if layer_spec.experts_beside is not None:  # Gemma 4: each branch normed apart, then summed
            self.experts = MoE(spec, layer_spec.experts_beside)
            self.pre_feedforward_layernorm_2 = RMSNorm(dim, eps, style)
            self.post_feedforward_layernorm_1 = RMSNorm(dim, eps, style)
            self.post_feedforward_layernorm_2 = RMSNorm(dim, eps, style)
        self.per_layer_input = spec.per_layer_input_size > 0
        if self.per_layer_input:  # Gemma 4: the token's per-layer vector gates a residual branch
            assert layer_spec.mlp is not None
            self.per_layer_activation = _ELEMENTWISE[layer_spec.mlp.activation]
            self.per_layer_input_gate = nn.Linear(dim, spec.per_layer_input_size, bias=False)
            self.per_layer_projection = nn.Linear(spec.per_layer_input_size, dim, bias=False)
            self.post_per_layer_input_norm = RMSNorm(dim, eps, style)
        self.layer_scalar = nn.Parameter(torch.empty(1)) if spec.layer_scalars else None
        self.fused_norms = self.placement == "pre" and style == "llama"

    def forward(self, x, residual, ropes, kv_cache, meta, backend, ops,
                per_layer_input: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(x, residual) -> (output, residual): pre-norm layers return the MLP output and the residual
        stream before it (the next layer's norm adds them); the others return the sum and None.
        `per_layer_input` [T, width]: this layer's per-layer embeddings (Gemma 4)."""
        if self.placement == "pre":  # x: the previous block's output, not yet added to the residual stream
            if self.mixer_name is not None:
                h, residual = self._norm(self.input_layernorm, x, residual, ops)
                x = self._scaled(self._mix(h, ropes, kv_cache, meta, backend, ops))
            if self.mlp is not None:
                h, residual = self._norm(self.post_attention_layernorm, x, residual, ops)
                x = self._scaled(self.mlp(h, ops))
            assert residual is not None
            return x, residual
        assert self.mlp is not None
        if residual is not None:  # after a pre-norm layer (a family mixing placements does not exist, but be exact)
            x = x + residual
        if self.placement == "sandwich":
            h = self.post_attention_layernorm(self._mix(self.input_layernorm(x), ropes, kv_cache, meta, backend, ops))
            x = x + self._scaled(h)
            h = self.post_feedforward_layernorm(self._feed_forward(x, ops))
            return self._per_layer_branch(x + self._scaled(h), per_layer_input), None
        h = self.post_attention_layernorm(self._mix(x, ropes, kv_cache, meta, backend, ops))
        x = x + self._scaled(h)
        return x + self._scaled(self.post_feedforward_layernorm(self.mlp(x, ops))), None

    def _feed_forward(self, x: torch.Tensor, ops: ModelOps) -> torch.Tensor:
        """A sandwich layer's feed-forward block before its post norm: the MLP, and the experts beside it."""
        assert self.mlp is not None
        h = self.mlp(self.pre_feedforward_layernorm(x), ops)
        if self.experts is None:
            return h
        routed = self.experts(self.pre_feedforward_layernorm_2(x), ops, route_input=x)
        return self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(routed)

    def _per_layer_branch(self, x: torch.Tensor, per_layer_input: torch.Tensor | None) -> torch.Tensor:
        """Gemma 4's end of a layer: the per-layer input's gated branch added, then the layer's scalar."""
        if self.per_layer_input:
            assert per_layer_input is not None
            gated = self.per_layer_activation(self.per_layer_input_gate(x)) * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return x if self.layer_scalar is None else x * self.layer_scalar

    def _mix(self, h, ropes, kv_cache: KVCache, meta: AttentionMetadata, backend, ops) -> torch.Tensor:
        if self.parallel is not None:
            p = self.parallel
            attended = self.self_attn(h * p.attention_in, ropes, kv_cache, meta, backend, ops) * p.attention_out
            return self.mamba(h, kv_cache.states, meta) * p.mamba_out + attended
        if self.recurrent:
            assert self.mixer_name is not None
            return getattr(self, self.mixer_name)(h, kv_cache.states, meta)
        return self.self_attn(h, ropes, kv_cache, meta, backend, ops)

    def _norm(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None,
              ops: ModelOps) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused_norms:
            return ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        total = x if residual is None else x + residual
        return norm(total), total

    def _scaled(self, h: torch.Tensor) -> torch.Tensor:
        return h if self.residual_scale is None else h * self.residual_scale


# an MLP activation applied alone, where a branch is gated by it (Gemma 4's per-layer inputs)
_ELEMENTWISE = {"silu": nn.functional.silu, "gelu_tanh": lambda x: nn.functional.gelu(x, approximate="tanh")}


def _mlp(spec: ModelSpec, mlp: MlpSpec) -> nn.Module:
    if not mlp.is_moe:
        return MLP(spec, mlp) if mlp.gated else UngatedMLP(spec, mlp)
    shared = _mlp(spec, MlpSpec(mlp.shared_intermediate_size, mlp.activation)) if mlp.shared_intermediate_size else None
    return MoE(spec, mlp, shared)


class DecoderModel(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.norm_style)
        if spec.per_layer_input_size:  # Gemma 4's per-layer embeddings: a table and a projection of the embedding
            width = spec.num_layers * spec.per_layer_input_size
            self.embed_tokens_per_layer = nn.Embedding(spec.per_layer_vocab_size, width)
            self.per_layer_model_projection = nn.Linear(spec.hidden_size, width, bias=False)
            self.per_layer_projection_norm = RMSNorm(spec.per_layer_input_size, spec.rms_norm_eps, spec.norm_style)


class CausalLM(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        device = torch.device(device)
        self.spec = spec
        # Built on the meta device then materialised uninitialised: random init would only be overwritten.
        with torch.device("meta"):
            self.model = DecoderModel(spec)
            tied = spec.tie_word_embeddings
            # a Linear, or after `cpu_linear.pack_for_cpu` a PackedLinear (a tied model's too)
            self.lm_head: nn.Module | None = None if tied else nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.to(dtype)
        for module in self.modules():
            if isinstance(module, MoE):
                module.keep_fp32()
        self.to_empty(device=device)
        self.requires_grad_(False)
        ropes = {rope_key(spec, a): (a.rope, spec.head_dim_of(a)) for a in spec.attentions if a.rope}
        self.rotaries = nn.ModuleDict({key: RotaryEmbedding(head_dim, spec.max_position_embeddings, params, device)
                                       for key, (params, head_dim) in ropes.items()})
        # the rotaries of layers that rotate only their queries (they read another layer's keys)
        self.q_only_ropes = {rope_key(spec, a) for a in spec.attentions if a.rope and a.kv_source is not None}

    @property
    def rotary(self) -> RotaryEmbedding:
        """The one rotary table of a model whose layers share it (the compiled CPU step's)."""
        if len(self.rotaries) != 1:
            raise ValueError(f"the model has {len(self.rotaries)} rotary settings, not one")
        return next(iter(self.rotaries.values()))  # type: ignore[return-value]

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64: absolute position of each token in its sequence
        kv_cache: KVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        ops: ModelOps | None = None,
    ) -> torch.Tensor:  # [T, hidden] final-normed hidden states
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} must be [T]")
        ops = ops or TORCH_OPS
        x = self.embed(input_ids)
        ropes = {}  # shared by every layer of one setting
        for key, rotary in self.rotaries.items():
            assert isinstance(rotary, RotaryEmbedding)
            torch_form = not rotary.plain or isinstance(ops, TorchOps)  # cos/sin as `RotaryEmbedding.rotate` takes them
            prepare = TORCH_OPS.prepare_rotary if torch_form else ops.prepare_rotary
            ropes[key] = (rotary, prepare(rotary, positions, x.dtype))
            if key in self.q_only_ropes:
                ropes[q_only_key(key)] = ropes[key] if torch_form else (
                    rotary, TORCH_OPS.prepare_rotary(rotary, positions, x.dtype))
        per_layer = self.per_layer_inputs(input_ids, x) if self.spec.per_layer_input_size else None
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, ropes, kv_cache, meta, backend, ops,
                                None if per_layer is None else per_layer[:, i])
        norm = self.model.norm
        if residual is not None and self.spec.norm_style == "llama":
            return ops.add_rms_norm(x, residual, norm.weight, norm.eps)[0]
        return norm(x if residual is None else x + residual)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        scale = self.spec.embedding_scale
        if scale is None:
            return x
        if self.spec.embedding_scale_in_dtype:  # Gemma multiplies by sqrt(hidden) rounded to the weights' dtype
            return x * torch.tensor(scale, dtype=torch.float32).to(x.dtype)
        return x * scale

    def per_layer_inputs(self, input_ids: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """[T, layers, width]: Gemma 4's per-layer embeddings of each token, its row of the per-layer
        table (scaled by sqrt(width) in the model dtype) and the normed projection of its embedding
        (scaled by hidden ** -0.5), averaged in norm (their sum over sqrt(2))."""
        spec, model = self.spec, self.model
        shape = (input_ids.shape[0], spec.num_layers, spec.per_layer_input_size)
        table = model.embed_tokens_per_layer(input_ids)
        table = table * torch.tensor(spec.per_layer_input_size ** 0.5, dtype=torch.float32).to(table.dtype)
        projected = model.per_layer_model_projection(embedded) * spec.hidden_size ** -0.5
        projected = model.per_layer_projection_norm(projected.reshape(shape))
        return (projected + table.reshape(shape)) * 2.0 ** -0.5

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 (callers pass only the rows they sample from)."""
        if self.lm_head is None:
            logits = nn.functional.linear(hidden, self.model.embed_tokens.weight)
        else:
            logits = self.lm_head(hidden)
        if self.spec.logit_divisor is not None:
            logits = logits / self.spec.logit_divisor
        if self.spec.logit_scale is not None:
            logits = logits * self.spec.logit_scale
        if self.spec.final_softcap is not None:
            cap = self.spec.final_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
