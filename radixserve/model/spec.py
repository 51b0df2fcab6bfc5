"""ModelSpec: what a supported decoder is, layer by layer, derived once from a HF config and then read-only.

A model is an embedding, `layers` (each a token mixer, an `MlpSpec` and where its norms sit) and a
final norm and head. A layer's mixer is softmax attention over the paged KV cache (`AttentionSpec`)
or a recurrent layer whose per-sequence state has a fixed size: a Gated DeltaNet (`DeltaNetSpec`,
linear attention), a gated short convolution (`ShortConvSpec`, LFM2) or a Mamba2 selective state
space layer (`Mamba2Spec`, Nemotron-H, Granite 4), or attention and a Mamba2 layer side by side
(`ParallelMixers`, Falcon-H1). A pre-norm layer may hold only one of the two blocks (Nemotron-H's
layers are each a mixer or an MLP). A sliding-window attention layer may keep its
window's K/V as a fixed-size state too (`with_window_states`, `WindowKVSpec`), or paged in a window
group of its own, which is no state (`with_window_group`). A model with any such
stateful layer is a hybrid (`is_hybrid`), whose prefix cache restores states only where it
checkpointed them (docs/hybrid_cache.md). Which
architectures we run and how each family's config maps onto these descriptions is `families.py`;
how its checkpoint names map onto our parameters is `CheckpointLayout`.

Invariants: at least one layer is attention; num_heads is a multiple of every layer's kv heads;
the layers the paged KV cache holds share one head shape (`paged_kv_shape`), those of the window group
another (`window_group_shape`), while a window-state
layer may have its own (Gemma 4's sliding and global layers differ); a layer reading another's K/V
(`AttentionSpec.kv_source`) reads an earlier one of its own window and shape; `max_position_embeddings` is the usable context: the
config's, except where a rope scheme is only exact below its pretraining context (longrope), where
it is capped to that. A sliding window does not cap it: the backends attend to the window at every
position.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from radixserve.kernels.moe import EXPERT_ACTIVATIONS, UNGATED_ACTIVATIONS
from radixserve.model.rope import RopeParams

QK_NORMS = ("none", "per_head", "whole")  # whole: one norm over all heads' q (OLMo 2), not per head
NORM_PLACEMENTS = ("pre", "sandwich", "post")
NORM_STYLES = ("llama", "gemma", "fp32_weight")
# how a Mamba2 layer's output y meets its gate z before out_proj: RMS-normed per group after the gate
# (Nemotron-H, Granite 4), before it, or gated only (no norm)
MAMBA_OUTPUTS = ("gate_then_norm", "norm_then_gate", "gate")
ROUTINGS = ("softmax_topk", "topk_softmax", "sigmoid_topk")


@dataclass(frozen=True)
class AttentionSpec:
    rope: RopeParams | None  # None: no position embedding in this layer (NoPE)
    scale: float  # multiplies q·k
    window: int | None = None  # sliding window: a query at p sees keys p - window < j <= p
    qk_norm: str = "none"
    qkv_bias: bool = False
    o_bias: bool = False
    sinks: bool = False  # a learned logit per head joins the softmax (gpt-oss)
    softcap: float | None = None  # scores become softcap * tanh(scores / softcap) (Gemma 2)
    output_gate: bool = False  # q_proj also yields a per-head gate: out * sigmoid(gate) before o_proj (Qwen3.5)
    key_scale: float = 1.0  # keys are multiplied by it before the rotary (Falcon-H1's key_multiplier)
    # this layer's head shape where it differs from the model's (Gemma 4's global layers); None: the model's
    head_dim: int | None = None
    num_kv_heads: int | None = None
    value_from_key: bool = False  # no v_proj: the values are k_proj's output, normed apart from the keys (Gemma 4)
    value_norm: bool = False  # values RMS-normed per head without a weight (Gemma 4)
    # the earlier layer whose keys and values this one reads instead of projecting its own (Gemma 4's KV
    # sharing): it holds no K/V or window state of its own
    kv_source: int | None = None
    # a window layer whose K/V of the last window - 1 tokens is a per-sequence state (`WindowKVSpec`),
    # not paged blocks: set by `ModelSpec.with_window_states`, never by a config
    window_state: bool = False
    # a window layer whose K/V is paged in the window group, a pool of its own beside the KV cache's
    # (cache/window_blocks.py), which attention reads in place: set by `ModelSpec.with_window_group`
    window_group: bool = False

    def __post_init__(self) -> None:
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm {self.qk_norm!r}; supported: {', '.join(QK_NORMS)}")
        if self.window is not None and self.window < 1:
            raise ValueError(f"sliding window must be >= 1, got {self.window}")
        if (self.window_state or self.window_group) and self.window is None:
            raise ValueError("only a sliding-window layer keeps its K/V as a state or in the window group")
        if self.window_state and self.window_group:
            raise ValueError("a sliding-window layer keeps its K/V as a state or in the window group, not both")
        if self.kv_source is not None and (self.value_from_key or self.qkv_bias):
            raise ValueError("a layer reading another's K/V projects no keys or values of its own")


@dataclass(frozen=True)
class MlpSpec:
    intermediate_size: int
    activation: str = "silu"  # kernels.moe.EXPERT_ACTIVATIONS: silu (SwiGLU), gelu_tanh (GeGLU), clamped_swiglu, relu2
    bias: bool = False
    num_experts: int = 0  # 0: a dense MLP
    top_k: int = 0
    # softmax over all experts then top-k; top-k logits then softmax; or sigmoid scores, the top k by
    # score plus `expert_bias` (LFM2-MoE)
    routing: str = "softmax_topk"
    normalize_topk: bool = False  # softmax_topk, sigmoid_topk: rescale the k weights to sum to 1
    router_bias: bool = False
    expert_bias: bool = False  # sigmoid_topk: a learned per-expert bias on the scores that choose, not on the weights
    routed_scaling: float = 1.0  # sigmoid_topk: the k weights are multiplied by it
    normalize_epsilon: float = 1e-6  # sigmoid_topk with normalize_topk: added to the k weights' sum (LFM2-MoE's)
    # sigmoid_topk: the experts are split into `expert_groups` equal groups and a token's k are chosen from
    # the `expert_groups_kept` groups whose two best choosing scores sum highest (Nemotron-H, DeepSeek-V3)
    expert_groups: int = 1
    expert_groups_kept: int = 1
    latent_size: int = 0  # > 0: the routed experts run in a space of this width between two projections (Nemotron-H)
    swiglu_alpha: float = 1.702  # clamped_swiglu only
    swiglu_limit: float = 7.0
    shared_intermediate_size: int = 0  # > 0: a shared expert beside the routed ones, of this MLP's activation
    shared_gate: bool = True  # the shared expert's output is scaled by sigmoid(gate(x)) (Qwen3-Next); else added as is
    gate_scale: float = 1.0  # a dense gated MLP's gate half is multiplied by it before the activation (Falcon-H1)
    down_scale: float = 1.0  # a dense MLP's output is multiplied by it (Falcon-H1)
    # Gemma 4's router: its input RMS-normed without a weight, times a learned vector and hidden ** -0.5;
    # each chosen expert's weight times a learned per-expert scale
    router_norm: bool = False
    per_expert_scale: bool = False
    # the router's weight and logits in fp32 whatever the model's dtype (Nemotron-H: transformers keeps
    # its gate weight in fp32 and routes in fp32)
    router_fp32: bool = False

    def __post_init__(self) -> None:
        if self.activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"MLP activation {self.activation!r}; supported: {', '.join(EXPERT_ACTIVATIONS)}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"router {self.routing!r}; supported: {', '.join(ROUTINGS)}")
        if self.num_experts and not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be in [1, num_experts {self.num_experts}]")
        if (self.gate_scale != 1.0 or self.down_scale != 1.0) and (self.is_moe or not self.gated):
            raise ValueError("gate_scale and down_scale apply to a dense gated MLP only")
        if self.expert_groups > 1:
            per_group = self.num_experts // self.expert_groups
            if self.routing != "sigmoid_topk" or self.num_experts % self.expert_groups or per_group < 2:
                raise ValueError(f"{self.expert_groups} expert groups need sigmoid_topk routing and num_experts "
                                 f"{self.num_experts} split into groups of at least 2")
            if not 1 <= self.expert_groups_kept <= self.expert_groups or self.top_k > self.expert_groups_kept * per_group:
                raise ValueError(f"topk_group {self.expert_groups_kept} must be in [1, {self.expert_groups}] and hold "
                                 f"top_k {self.top_k} experts ({per_group} a group)")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def gated(self) -> bool:
        """gate_proj and up_proj halves combined by the activation (all but `UNGATED_ACTIVATIONS`)."""
        return self.activation not in UNGATED_ACTIVATIONS


@dataclass(frozen=True)
class DeltaNetSpec:
    """A Gated DeltaNet layer (Qwen3.5, Qwen3-Next): a causal depthwise convolution over the q/k/v
    projections, then the gated delta rule over a [value_heads, key_head_dim, value_head_dim] state."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    # Qwen3-Next's checkpoints: q, k, v, z in one projection and b, a in another, grouped per key head
    fused_projections: bool = False

    def __post_init__(self) -> None:
        if min(self.num_key_heads, self.key_head_dim, self.value_head_dim, self.conv_kernel) < 1 \
                or self.num_value_heads % self.num_key_heads:
            raise ValueError(f"linear attention heads {self.num_value_heads} value / {self.num_key_heads} key: "
                             "value heads must be a positive multiple of key heads")

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    @property
    def state_shape(self) -> tuple[int, ...]:
        """The fp32 delta-rule state per sequence."""
        return (self.num_value_heads, self.key_head_dim, self.value_head_dim)


@dataclass(frozen=True)
class ShortConvSpec:
    """LFM2's gated short convolution: in_proj to B, C and x; C * conv(B * x); out_proj. Its state is
    the convolution's last `kernel - 1` inputs."""

    channels: int  # the hidden size
    kernel: int
    bias: bool = False

    @property
    def conv_kernel(self) -> int:
        return self.kernel

    @property
    def conv_dim(self) -> int:
        return self.channels

    @property
    def state_shape(self) -> None:
        """No state beyond the convolution window."""
        return None


@dataclass(frozen=True)
class Mamba2Spec:
    """A Mamba2 layer (Nemotron-H): in_proj to a gate z, the convolution's x, B, C and a time step
    per head; a causal depthwise convolution (SiLU) over x, B and C; the selective scan
    S <- exp(dt A) S + dt x B^T, y = S C + D x per head over a [heads, head_dim, state_size] state, B
    and C shared by the heads of each of `groups`; y * SiLU(z) normed per group (`output`), then
    out_proj. Falcon-H1 scales the input by `input_scale` and in_proj's z, x, B, C and dt sections by
    `projection_scales`."""

    num_heads: int
    head_dim: int
    state_size: int
    groups: int
    conv_kernel: int
    conv_bias: bool = True
    proj_bias: bool = False  # in_proj and out_proj
    time_step_limit: tuple[float, float] = (0.0, float("inf"))  # dt is clamped into it after the softplus
    output: str = "gate_then_norm"  # MAMBA_OUTPUTS
    input_scale: float = 1.0
    projection_scales: tuple[float, float, float, float, float] = (1.0, 1.0, 1.0, 1.0, 1.0)  # z, x, B, C, dt

    def __post_init__(self) -> None:
        if min(self.num_heads, self.head_dim, self.state_size, self.groups, self.conv_kernel) < 1 \
                or self.num_heads % self.groups:
            raise ValueError(f"mamba heads {self.num_heads} must be a positive multiple of its groups {self.groups}")
        if self.output not in MAMBA_OUTPUTS:
            raise ValueError(f"Mamba2 output {self.output!r}; supported: {', '.join(MAMBA_OUTPUTS)}")
        if len(self.projection_scales) != 5:
            raise ValueError(f"projection_scales names {len(self.projection_scales)} sections of in_proj; it has 5")

    @property
    def inner_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: x, then each group's B, then each group's C."""
        return self.inner_dim + 2 * self.groups * self.state_size

    @property
    def state_shape(self) -> tuple[int, ...]:
        """The fp32 SSM state per sequence."""
        return (self.num_heads, self.head_dim, self.state_size)


@dataclass(frozen=True)
class WindowKVSpec:
    """A sliding-window attention layer's keys and values kept as a state: the K and V rows (each
    token's kv heads flattened, K then V) of the last `window - 1` tokens, which is all a query after
    them reads besides its own. Stored like a convolution window (model/window_kv.py)."""

    window: int
    kv_size: int  # num_kv_heads * head_dim

    @property
    def conv_kernel(self) -> int:
        return self.window

    @property
    def conv_dim(self) -> int:
        return 2 * self.kv_size

    @property
    def state_shape(self) -> None:
        """No state beyond the window's rows."""
        return None


# a layer whose per-sequence state has a fixed size
RecurrentSpec = DeltaNetSpec | ShortConvSpec | Mamba2Spec | WindowKVSpec


@dataclass(frozen=True)
class ParallelMixers:
    """Attention and a Mamba2 layer reading the same normed input, their outputs summed (Falcon-H1):
    attention_out * attention(h * attention_in) + mamba_out * mamba(h)."""

    attention_in: float = 1.0
    attention_out: float = 1.0
    mamba_out: float = 1.0


@dataclass(frozen=True)
class LayerSpec:
    attention: AttentionSpec | None  # None: the layer's mixer is recurrent, or it has none
    mlp: MlpSpec | None  # None: a mixer-only layer (Nemotron-H)
    norms: str = "pre"  # pre: Llama; sandwich: pre and post norms around each block (Gemma, GLM-4); post: OLMo 2
    delta_net: DeltaNetSpec | None = None
    short_conv: ShortConvSpec | None = None
    mamba: Mamba2Spec | None = None
    parallel: ParallelMixers | None = None  # set: `attention` and `mamba` side by side (Falcon-H1)
    # routed experts beside the dense MLP, each branch normed on its own and summed (Gemma 4's MoE models)
    experts_beside: MlpSpec | None = None

    def __post_init__(self) -> None:
        if self.norms not in NORM_PLACEMENTS:
            raise ValueError(f"norm placement {self.norms!r}; supported: {', '.join(NORM_PLACEMENTS)}")
        mixers = sum(m is not None for m in (self.attention, self.delta_net, self.short_conv, self.mamba))
        if self.parallel is not None:
            if self.attention is None or self.mamba is None or mixers != 2 or self.attention.window is not None \
                    or self.norms != "pre":
                raise ValueError("parallel mixers are full attention beside a Mamba2 layer, pre-norm")
        elif mixers > 1:
            raise ValueError("a layer mixes tokens by at most one of attention, a DeltaNet, a short convolution "
                             "and a Mamba2 layer")
        if mixers + (self.mlp is not None) < 2 and self.norms != "pre":
            raise ValueError(f"a layer without a mixer or an MLP needs pre norms, not {self.norms!r}")
        if mixers == 0 and self.mlp is None:
            raise ValueError("a layer needs a mixer or an MLP")
        if self.experts_beside is not None and (not self.experts_beside.is_moe or self.mlp is None
                                                or self.mlp.is_moe or self.norms != "sandwich"):
            raise ValueError("experts beside an MLP are an MoE beside a dense MLP, in a sandwich-norm layer")

    @property
    def recurrent(self) -> RecurrentSpec | None:
        return self.delta_net or self.short_conv or self.mamba

    @property
    def window_state(self) -> bool:
        """Its attention keeps the window's K/V as a state (`WindowKVSpec`), not in the paged cache."""
        return self.attention is not None and self.attention.window_state

    @property
    def has_mixer(self) -> bool:
        return self.attention is not None or self.recurrent is not None

    @property
    def llama_shaped(self) -> bool:
        """Pre-norm, SwiGLU, rotate-half rope over whole heads, no sinks/softcap, K/V in the paged cache: the
        compiled CPU step's layer."""
        a, m = self.attention, self.mlp
        return (a is not None and m is not None and self.norms == "pre" and not m.is_moe and m.activation == "silu"
                and self.recurrent is None and a.key_scale == 1.0 and m.gate_scale == m.down_scale == 1.0
                and _paged(a) and a.head_dim is None and a.num_kv_heads is None
                and not a.value_from_key and not a.value_norm and self.experts_beside is None
                and a.qk_norm == "none" and a.rope is not None and a.rope.rotary_dim is None
                and not a.rope.interleaved and not a.sinks and a.softcap is None and not a.output_gate)


@dataclass(frozen=True)
class CheckpointLayout:
    """How a family's checkpoint names and stores what our modules hold."""

    fused_qkv: bool = False  # one self_attn.qkv_proj (Phi-3)
    fused_gate_up: bool = False  # one mlp.gate_up_proj (Phi-3, GLM)
    mlp_name: str = "mlp"  # Mixtral: block_sparse_moe
    router_name: str = "gate"  # gpt-oss: router; Granite 4: router.layer
    expert_bias_name: str = "expert_bias"  # Nemotron-H: gate.e_score_correction_bias
    # per_expert (gate/up/down_proj), w1w3w2 (Mixtral), stacked_interleaved (gpt-oss), input_output_linear (Granite 4)
    experts: str = "per_expert"
    norm_names: tuple[tuple[str, str], ...] = ()  # (ours, the checkpoint's) where they differ
    # (ours, the checkpoint's) module paths, applied last to every name: a family naming its modules
    # its own way (LFM2: self_attn.out_proj, feed_forward.w1, operator_norm, model.embedding_norm)
    renames: tuple[tuple[str, str], ...] = ()
    # tensors of the checkpoint that are not the text model's, left unread (a multimodal checkpoint's
    # vision and audio towers)
    skipped_prefixes: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int  # usable context length, see the module docstring
    eos_token_ids: tuple[int, ...]
    layers: tuple[LayerSpec, ...]
    bos_token_id: int | None = None
    norm_style: str = "llama"  # llama: w * x.to(dtype); gemma: x * (1 + w) in fp32; fp32_weight: (w * x) in fp32
    embedding_scale: float | None = None  # embeddings are multiplied by it (Gemma: sqrt(hidden); Granite)
    embedding_scale_in_dtype: bool = False  # Gemma rounds the scale to the model dtype first
    residual_scale: float | None = None  # each block's output is multiplied by it before the add (Granite)
    logit_divisor: float | None = None  # logits are divided by it (Granite's logits_scaling)
    logit_scale: float | None = None  # logits are multiplied by it (Falcon-H1's lm_head_multiplier)
    final_softcap: float | None = None  # logits become c * tanh(logits / c) (Gemma 2)
    # Gemma 4's per-layer embeddings: each token's vector of this width for every layer, from a table of
    # `per_layer_vocab_size` and a projection of its embedding, gates a residual branch after each layer
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    layer_scalars: bool = False  # each layer's output is multiplied by a learned scalar (Gemma 4)
    checkpoint: CheckpointLayout = field(default_factory=CheckpointLayout)

    def __post_init__(self) -> None:
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if not self.attentions:
            raise ValueError("a model needs at least one attention layer")
        if not any(layer.mlp is not None for layer in self.layers):
            raise ValueError("a model needs at least one MLP")
        if min(self.hidden_size, self.num_layers, self.head_dim, self.vocab_size, self.max_position_embeddings) < 1:
            raise ValueError("model dimensions must be positive")
        if self.norm_style not in NORM_STYLES:
            raise ValueError(f"norm style {self.norm_style!r}; supported: {', '.join(NORM_STYLES)}")
        if (self.per_layer_input_size or self.layer_scalars) and any(
                layer.norms != "sandwich" or layer.mlp is None or layer.mlp.activation not in ("silu", "gelu_tanh")
                for layer in self.layers):
            raise ValueError("per-layer inputs and layer scalars end sandwich-norm layers with a SiLU or GELU MLP")
        for i, layer in enumerate(self.layers):
            a = layer.attention
            if a is None:
                continue
            if self.num_heads % self.kv_heads_of(a):
                raise ValueError(f"layer {i}: num_heads {self.num_heads} is not a multiple of its "
                                 f"{self.kv_heads_of(a)} kv heads")
            if a.kv_source is not None:
                source = self.layers[a.kv_source].attention if 0 <= a.kv_source < i else None
                if source is None or source.kv_source is not None or source.window != a.window \
                        or (self.kv_heads_of(source), self.head_dim_of(source)) != (self.kv_heads_of(a), self.head_dim_of(a)):
                    raise ValueError(f"layer {i} reads the K/V of layer {a.kv_source}, which is not an earlier "
                                     "attention layer of its own window and head shape that projects its own")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def intermediate_size(self) -> int:
        """The first MLP's width (an expert's, in an MoE layer)."""
        return next(layer.mlp.intermediate_size for layer in self.layers if layer.mlp is not None)

    @property
    def rope(self) -> RopeParams | None:
        """The first rotary layer's settings (per-layer ones: `layers[i].attention.rope`)."""
        return next((a.rope for a in self.attentions if a.rope), None)

    @property
    def attentions(self) -> list[AttentionSpec]:
        """Every attention layer's spec, in order."""
        return [layer.attention for layer in self.layers if layer.attention is not None]

    def head_dim_of(self, attention: AttentionSpec) -> int:
        return attention.head_dim or self.head_dim

    def kv_heads_of(self, attention: AttentionSpec) -> int:
        return attention.num_kv_heads or self.num_kv_heads

    def kv_size_of(self, attention: AttentionSpec) -> int:
        return self.kv_heads_of(attention) * self.head_dim_of(attention)

    @property
    def paged_attentions(self) -> list[AttentionSpec]:
        """The attention layers the paged KV cache holds, in order: all but those keeping a window state,
        those in the window group and those reading another layer's K/V."""
        return [a for a in self.attentions if _paged(a)]

    @property
    def window_group_attentions(self) -> list[AttentionSpec]:
        """The attention layers whose K/V the window group holds, in order (none reads another's)."""
        return [a for a in self.attentions if a.window_group and a.kv_source is None]

    @property
    def window_group_shape(self) -> tuple[int, int]:
        """(kv heads, head_dim) of every layer the window group holds: one tensor holds them all."""
        shapes = {(self.kv_heads_of(a), self.head_dim_of(a)) for a in self.window_group_attentions}
        if len(shapes) != 1:
            raise ValueError(f"the window group holds layers of head shapes {sorted(shapes)}: one pool holds one shape")
        return shapes.pop()

    def window_index(self, layer: int) -> int:
        """Where window-group layer `layer`'s K/V sit in the window group; a layer reading another's, the other's."""
        a = self.layers[layer].attention
        assert a is not None and a.window_group
        if a.kv_source is not None:
            return self.window_index(a.kv_source)
        return sum(1 for earlier in self.layers[:layer] if earlier.attention is not None
                   and earlier.attention.window_group and earlier.attention.kv_source is None)

    @property
    def paged_kv_shape(self) -> tuple[int, int]:
        """(kv heads, head_dim) of every layer the paged KV cache holds: one tensor holds them all."""
        shapes = {(self.kv_heads_of(a), self.head_dim_of(a)) for a in self.paged_attentions}
        if len(shapes) > 1:
            raise ValueError(f"the paged KV cache holds layers of head shapes {sorted(shapes)} (kv heads, head_dim); "
                             "one pool holds one shape: keep the sliding-window layers' K/V as states "
                             "(--sliding-window-kv window)")
        return shapes.pop() if shapes else (self.num_kv_heads, self.head_dim)

    @property
    def mixed_head_shapes(self) -> bool:
        """Its layers projecting K/V differ in head shape, so only some can be paged (Gemma 4's global
        layers are wider than its sliding ones): the sliding ones must keep window states or be in the
        window group."""
        return len({(self.kv_heads_of(a), self.head_dim_of(a)) for a in self.attentions if a.kv_source is None}) > 1

    def kv_index(self, layer: int) -> int:
        """Where attention layer `layer`'s K/V sit in the KV cache (which holds paged attention layers
        only); a layer reading another's K/V, the other's."""
        a = self.layers[layer].attention
        if a is not None and a.kv_source is not None:
            return self.kv_index(a.kv_source)
        return sum(1 for earlier in self.layers[:layer] if earlier.attention is not None and _paged(earlier.attention))

    def state_index(self, layer: int) -> int:
        """Where layer `layer`'s states sit in the state cache (which holds recurrent and window-state layers only)."""
        return len(self._stateful(self.layers[:layer]))

    @property
    def recurrents(self) -> list[RecurrentSpec]:
        """The specs of the layers the state cache holds, in order: recurrent layers and window-state attention."""
        return self._stateful(self.layers)

    def _stateful(self, layers: tuple[LayerSpec, ...]) -> list[RecurrentSpec]:
        specs: list[RecurrentSpec] = []
        for layer in layers:
            if layer.recurrent is not None:
                specs.append(layer.recurrent)
            elif layer.attention is not None and layer.attention.window_state and layer.attention.kv_source is None:
                assert layer.attention.window is not None
                specs.append(WindowKVSpec(layer.attention.window, self.kv_size_of(layer.attention)))
        return specs

    def with_window_states(self) -> ModelSpec:
        """This model with every sliding-window attention layer keeping its window's K/V as a state
        (`--sliding-window-kv window`, docs/hybrid_cache.md). Itself if it has no such layer, or no
        other: a model windowed everywhere (Mistral v0.1, Phi-3 mini) keeps paged blocks, which the radix
        tree needs at least one layer of."""
        return self._with_windows(state=True)

    def with_window_group(self) -> ModelSpec:
        """This model with every sliding-window attention layer's K/V paged in the window group
        (`--sliding-window-kv window-blocks`, docs/hybrid_cache.md). Itself where `with_window_states` is."""
        return self._with_windows(state=False)

    def with_sliding_window_kv(self, layout: str) -> ModelSpec:
        """`layout`, a resolved `--sliding-window-kv` (all, window or window-blocks): this model with its
        sliding-window layers' K/V kept that way."""
        if layout == "all":
            return self
        if layout == "window":
            return self.with_window_states()
        if layout == "window-blocks":
            return self.with_window_group()
        raise ValueError(f"sliding-window K/V kept as {layout!r}: expected all, window or window-blocks")

    def _with_windows(self, state: bool) -> ModelSpec:
        """Every sliding-window layer's K/V as a window state (`state`) or in the window group."""
        windows = [a.window is not None for a in self.attentions]
        if all(windows) or not any(windows):
            return self
        layers = tuple(layer if layer.attention is None or layer.attention.window is None
                       else replace(layer, attention=replace(layer.attention, window_state=state, window_group=not state))
                       for layer in self.layers)
        return replace(self, layers=layers)

    @property
    def delta_nets(self) -> list[DeltaNetSpec]:
        return [r for r in self.recurrents if isinstance(r, DeltaNetSpec)]

    @property
    def is_hybrid(self) -> bool:
        """Some layer keeps a fixed-size state (recurrent, or a sliding window's K/V): a cached prefix
        resumes only at a state checkpoint."""
        return bool(self.recurrents)

    @property
    def llama_shaped(self) -> bool:
        return (all(layer.llama_shaped for layer in self.layers) and self.norm_style == "llama"
                and self.embedding_scale is None and self.residual_scale is None
                and not self.per_layer_input_size and not self.layer_scalars)

    @classmethod
    def from_hf_config(cls, config: Any, extra_eos_token_ids: tuple[int, ...] = ()) -> ModelSpec:
        """Build from a transformers PretrainedConfig (or anything with the same attributes)."""
        from radixserve.model.families import describe

        return describe(config, extra_eos_token_ids)


def _paged(attention: AttentionSpec) -> bool:
    return not attention.window_state and not attention.window_group and attention.kv_source is None


def load_spec(path: str | Path) -> ModelSpec:
    """Read a HF model directory's config.json (+ generation_config.json), or a GGUF file's metadata,
    without touching the network."""
    from radixserve.model.families import supported_architecture
    from radixserve.model.gguf_checkpoint import is_gguf_path, load_gguf_spec

    if is_gguf_path(path):
        return load_gguf_spec(path)
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"model directory {str(root)!r} does not exist or is not a directory")
    config_file = root / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{str(root)!r} has no config.json; expected a Hugging Face model directory")
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read {config_file}: {err}") from None
    # Checked on the raw JSON first so an architecture transformers does not know still gets our message.
    if not isinstance(raw, dict):
        raise ValueError(f"{config_file} does not hold a JSON object")
    supported_architecture(raw.get("architectures"), raw.get("model_type"))

    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(root, local_files_only=True)
    return ModelSpec.from_hf_config(config, tuple(_generation_eos(root)))


def _generation_eos(root: Path) -> list[int]:
    gen_file = root / "generation_config.json"
    if not gen_file.is_file():
        return []
    try:
        return int_list(json.loads(gen_file.read_text()).get("eos_token_id"))
    except (OSError, ValueError, AttributeError) as err:
        raise ValueError(f"cannot read {gen_file}: {err}") from None


def int_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]
