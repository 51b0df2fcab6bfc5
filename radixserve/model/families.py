"""The registry of model families: which HF `architectures` we run and how each one's config
becomes a per-layer `ModelSpec`.

One `Family` per architecture name: the config reader shared by all (`describe`) asks the family
for its quirks (norm placement, q/k norms, biases, MLP kind, which layers slide, embedding and
logit scaling, checkpoint layout). Invariant: a config value we do not implement is refused here,
at start, with one line naming the field and what is supported; nothing reaches the model half
understood.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from radixserve.model.rope import RopeParams
from radixserve.model.spec import (
    AttentionSpec,
    CheckpointLayout,
    DeltaNetSpec,
    LayerSpec,
    Mamba2Spec,
    MlpSpec,
    ModelSpec,
    ParallelMixers,
    ShortConvSpec,
    int_list,
)

_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


@dataclass(frozen=True)
class Family:
    """A family's quirks; `describe` reads everything else from the config the same way for all."""

    model_type: str
    norms: str = "pre"
    norm_style: str = "llama"
    qk_norm: str = "none"
    qkv_bias: bool | None = None  # None: the config's attention_bias
    o_bias: bool | None = None  # None: the config's attention_bias
    sinks: bool = False
    window_everywhere: bool = False  # a config sliding_window applies to every layer (no layer_types)
    interleaved_rope: bool = False
    output_gate: bool = False  # q_proj yields a gate per head (Qwen3.5)
    linear_attention: bool = False  # layer_types may name Gated DeltaNet layers (Qwen3.5)
    fused_delta_projections: bool = False  # the DeltaNet's q/k/v/z and b/a projections fused per key head (Qwen3-Next)
    short_conv: bool = False  # layer_types may name gated short convolution layers, "conv" (LFM2)
    # Nemotron-H: each layer is one block, a Mamba2 layer ("linear_attention"), attention without
    # position embeddings ("full_attention") or an MLP ("mlp"), per `layers_block_type`
    single_block_layers: bool = False
    mamba: Callable[[Any], Mamba2Spec] | None = None  # "linear_attention" layers are Mamba2 layers, read by it
    # Falcon-H1: every layer is "hybrid", attention and a Mamba2 layer side by side; this makes such a
    # layer of the config's attention and MLP
    hybrid_layer: Callable[[Any, AttentionSpec, MlpSpec], LayerSpec] | None = None
    rope: Callable[[Any], bool] = lambda config: True  # False: no position embedding in any layer (NoPE)
    intermediate_size: Callable[[Any], int] = lambda config: int(config.intermediate_size)
    embedding_scale: Callable[[Any], float | None] = lambda config: None
    moe: Callable[[Any, int], MlpSpec | None] = lambda config, layer: None
    checkpoint: CheckpointLayout = field(default_factory=CheckpointLayout)
    extra: Callable[[Any, dict[str, Any]], None] = lambda config, fields: None  # the family's own ModelSpec fields
    # what multiplies q.k where it is not head_dim ** -0.5 or named by the config (Gemma 4: 1, its q and k are normed)
    attention_scale: float | None = None
    # the family's changes to layer i as the shared reader built it (Gemma 4's per-layer head shapes, KV sharing)
    adjust_layer: Callable[[Any, int, LayerSpec], LayerSpec] = lambda config, i, layer: layer
    multimodal: bool = False  # a checkpoint of several modalities: its text config and text model are what we run


def _gemma_scale(config: Any) -> float:
    return float(config.hidden_size) ** 0.5


def _gemma_extra(config: Any, fields: dict[str, Any], causal_settings: tuple[Any, ...] = (None, False)) -> None:
    fields["embedding_scale_in_dtype"] = True
    fields["final_softcap"] = getattr(config, "final_logit_softcapping", None)
    setting = getattr(config, "use_bidirectional_attention", None)
    if setting not in causal_settings:
        raise ValueError(f"use_bidirectional_attention {setting!r} is not supported (text generation is causal); "
                         f"supported: {', '.join(repr(s) for s in causal_settings if s is not False)}")


def _gemma4_extra(config: Any, fields: dict[str, Any]) -> None:
    # "vision": image tokens see each other both ways; text, all we take, stays causal
    _gemma_extra(config, fields, causal_settings=(None, False, "vision"))
    fields["layer_scalars"] = True
    width = int(getattr(config, "hidden_size_per_layer_input", 0) or 0)
    if width:
        fields["per_layer_input_size"] = width
        fields["per_layer_vocab_size"] = int(config.vocab_size_per_layer_input)


def _gemma4_layer(config: Any, i: int, layer: LayerSpec) -> LayerSpec:
    """A Gemma 4 layer: its own head shape where the config's per-layer settings give one (the global
    layers' wider heads, and with `attention_k_eq_v` their own kv heads and values taken from the keys'
    projection), values normed, the K/V of the last earlier layer of its kind in the last
    `num_kv_shared_layers` (whose MLPs are twice as wide with `use_double_wide_mlp`), and routed experts
    beside the MLP with `enable_moe_block`."""
    assert layer.attention is not None and layer.mlp is not None
    own = config.per_layer_config[i]
    head_dim, kv_heads = int(own.head_dim), int(own.num_key_value_heads)
    full = config.layer_types[i] == "full_attention"
    attention = replace(layer.attention, head_dim=None if head_dim == int(config.head_dim) else head_dim,
                        num_kv_heads=None if kv_heads == int(config.num_key_value_heads) else kv_heads,
                        value_from_key=bool(config.attention_k_eq_v) and full, value_norm=True)
    mlp = layer.mlp
    if config.kv_sharing_modes[i] == "reuse":
        kinds = config.layer_types
        first_shared = int(config.num_hidden_layers) - int(config.num_kv_shared_layers)
        source = max(j for j in range(first_shared) if kinds[j] == kinds[i])
        attention = replace(attention, kv_source=source, value_from_key=False, value_norm=False)
        if config.use_double_wide_mlp:
            mlp = replace(mlp, intermediate_size=2 * mlp.intermediate_size)
    experts = None
    if config.enable_moe_block:
        experts = MlpSpec(int(config.moe_intermediate_size), _activation(config), num_experts=int(config.num_experts),
                          top_k=int(config.top_k_experts), normalize_topk=True, router_norm=True,
                          per_expert_scale=True)
    return replace(layer, attention=attention, mlp=mlp, experts_beside=experts)


def _granite_extra(config: Any, fields: dict[str, Any]) -> None:
    fields["residual_scale"] = float(config.residual_multiplier)
    fields["logit_divisor"] = float(config.logits_scaling)


def _qwen3_moe(config: Any, layer: int) -> MlpSpec | None:
    sparse_step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    if layer in (getattr(config, "mlp_only_layers", None) or ()) or (layer + 1) % sparse_step:
        return None
    return MlpSpec(int(config.moe_intermediate_size), _activation(config), num_experts=int(config.num_experts),
                   top_k=int(config.num_experts_per_tok), normalize_topk=bool(getattr(config, "norm_topk_prob", False)))


def _qwen3_next_moe(config: Any, layer: int) -> MlpSpec | None:
    """Qwen3-Next and Qwen3.5-MoE: Qwen3-MoE's routing with a gated shared expert beside the routed ones."""
    spec = _qwen3_moe(config, layer) if int(getattr(config, "num_experts", 0) or 0) else None
    if spec is None:
        return None
    return replace(spec, normalize_topk=bool(getattr(config, "norm_topk_prob", True)),
                   shared_intermediate_size=int(config.shared_expert_intermediate_size))


def _lfm2_intermediate(config: Any) -> int:
    """LFM2's MLP width: 2/3 of the configured one, times a multiplier, rounded up to a multiple."""
    size = int(config.intermediate_size)
    if getattr(config, "block_auto_adjust_ff_dim", False):
        size = int(2 * size / 3)
        if config.block_ffn_dim_multiplier is not None:
            size = int(config.block_ffn_dim_multiplier * size)
            size = config.block_multiple_of * ((size + config.block_multiple_of - 1) // config.block_multiple_of)
    return size


def _lfm2_moe(config: Any, layer: int) -> MlpSpec | None:
    """LFM2-MoE: dense MLPs in the first `num_dense_layers`, then sigmoid-routed experts."""
    if layer < int(config.num_dense_layers):
        return None
    return MlpSpec(int(config.moe_intermediate_size), "silu", num_experts=int(config.num_experts),
                   top_k=int(config.num_experts_per_tok), routing="sigmoid_topk",
                   normalize_topk=bool(config.norm_topk_prob), expert_bias=bool(config.use_expert_bias),
                   routed_scaling=float(config.routed_scaling_factor))


_LFM2_NAMES = (("self_attn.o_proj", "self_attn.out_proj"), ("self_attn.q_norm", "self_attn.q_layernorm"),
               ("self_attn.k_norm", "self_attn.k_layernorm"), ("mlp.gate_proj", "feed_forward.w1"),
               ("mlp.up_proj", "feed_forward.w3"), ("mlp.down_proj", "feed_forward.w2"),
               ("input_layernorm", "operator_norm"), ("post_attention_layernorm", "ffn_norm"),
               ("model.norm", "model.embedding_norm"))


def _granite_hybrid_moe(config: Any, layer: int) -> MlpSpec | None:
    """Granite 4's MoE models: the top-k router logits softmaxed, SwiGLU experts, and the shared MLP
    added as it is. The dense models (no experts) run the shared MLP as the layer's MLP."""
    experts = int(getattr(config, "num_local_experts", 0) or 0)
    if not experts:
        return None
    return MlpSpec(int(config.intermediate_size), _activation(config), num_experts=experts,
                   top_k=int(config.num_experts_per_tok), routing="topk_softmax",
                   shared_intermediate_size=int(config.shared_intermediate_size), shared_gate=False)


def _nemotron_mamba(config: Any) -> Mamba2Spec:
    if getattr(config, "mamba_hidden_act", "silu") != "silu":
        raise ValueError(f"mamba_hidden_act {config.mamba_hidden_act!r} is not supported; supported: silu")
    return Mamba2Spec(int(config.mamba_num_heads), int(config.mamba_head_dim), int(config.ssm_state_size),
                      int(config.n_groups), int(config.conv_kernel), bool(config.use_conv_bias),
                      bool(getattr(config, "use_bias", False)), _time_step_limit(config))


def _granite_mamba(config: Any) -> Mamba2Spec:
    if getattr(config, "hidden_act", "silu") != "silu":  # Granite 4's Mamba2 convolution is its hidden_act
        raise ValueError(f"hidden_act {config.hidden_act!r} in a Mamba2 layer; supported: silu")
    return Mamba2Spec(int(config.mamba_n_heads), int(config.mamba_d_head), int(config.mamba_d_state),
                      int(config.mamba_n_groups), int(config.mamba_d_conv), bool(config.mamba_conv_bias),
                      bool(config.mamba_proj_bias), _time_step_limit(config))


def _time_step_limit(config: Any) -> tuple[float, float]:
    low, high = (float(v) for v in getattr(config, "time_step_limit", None) or (0.0, float("inf")))
    return low, high


# the dense models' layer MLP and the MoE models' shared expert are both the checkpoint's shared_mlp
_GRANITE_HYBRID_NAMES = (("mlp.gate_up_proj", "shared_mlp.input_linear"), ("mlp.down_proj", "shared_mlp.output_linear"),
                         ("mlp.shared_expert.gate_up_proj", "shared_mlp.input_linear"),
                         ("mlp.shared_expert.down_proj", "shared_mlp.output_linear"))
_NEMOTRON_H_NAMES = (("model.embed_tokens", "backbone.embeddings"), ("model.norm", "backbone.norm_f"),
                     ("model.layers", "backbone.layers"), ("input_layernorm", "norm"),
                     ("post_attention_layernorm", "norm"), ("self_attn", "mixer"), ("mamba", "mixer"),
                     ("mlp", "mixer"), ("shared_expert", "shared_experts"))


def _mixtral_moe(config: Any, layer: int) -> MlpSpec:
    return MlpSpec(int(config.intermediate_size), _activation(config), num_experts=int(config.num_local_experts),
                   top_k=int(config.num_experts_per_tok), normalize_topk=True)


def _gpt_oss_moe(config: Any, layer: int) -> MlpSpec:
    return MlpSpec(int(config.intermediate_size), "clamped_swiglu", bias=True,
                   num_experts=int(config.num_local_experts), top_k=int(config.num_experts_per_tok),
                   routing="topk_softmax", router_bias=True, swiglu_alpha=float(getattr(config, "swiglu_alpha", 1.702)),
                   swiglu_limit=float(config.swiglu_limit))


def _falcon_h1_layer(config: Any, attention: AttentionSpec, mlp: MlpSpec) -> LayerSpec:
    """A Falcon-H1 layer: attention and Mamba2 read the same normed input, each scaled by its muP
    multipliers, and their outputs are summed; then the MLP, its gate and output scaled too."""
    if bool(config.mamba_proj_bias) != bool(config.projectors_bias):
        raise ValueError(f"mamba_proj_bias {config.mamba_proj_bias} with projectors_bias {config.projectors_bias} "
                         "is not supported; supported: both the same")
    if config.hidden_act != "silu":  # the Mamba2 convolution's activation as well as the MLP's
        raise ValueError(f"hidden_act {config.hidden_act!r} is not supported in falcon_h1; supported: silu")
    output = ("gate" if not config.mamba_rms_norm
              else "norm_then_gate" if config.mamba_norm_before_gate else "gate_then_norm")
    mamba = Mamba2Spec(int(config.mamba_n_heads), int(config.mamba_d_head), int(config.mamba_d_state),
                       int(config.mamba_n_groups), int(config.mamba_d_conv), bool(config.mamba_conv_bias),
                       bool(config.mamba_proj_bias), _time_step_limit(config), output=output,
                       input_scale=float(config.ssm_in_multiplier),
                       projection_scales=tuple(float(v) for v in config.ssm_multipliers))  # type: ignore[arg-type]
    gate_scale, down_scale = (float(v) for v in config.mlp_multipliers)
    return LayerSpec(replace(attention, key_scale=float(config.key_multiplier)),
                     replace(mlp, gate_scale=gate_scale, down_scale=down_scale), mamba=mamba,
                     parallel=ParallelMixers(float(config.attention_in_multiplier),
                                             float(config.attention_out_multiplier), float(config.ssm_out_multiplier)))


def _falcon_h1_extra(config: Any, fields: dict[str, Any]) -> None:
    fields["logit_scale"] = float(config.lm_head_multiplier)


_FALCON_H1_NAMES = (("mlp", "feed_forward"), ("post_attention_layernorm", "pre_ff_layernorm"),
                    ("model.norm", "model.final_layernorm"))

_GEMMA = dict(norms="sandwich", norm_style="gemma", embedding_scale=_gemma_scale, extra=_gemma_extra)
_GLM_NORMS = (("post_attention_layernorm", "post_self_attn_layernorm"),
              ("pre_feedforward_layernorm", "post_attention_layernorm"),
              ("post_feedforward_layernorm", "post_mlp_layernorm"))

FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family("llama"),
    "MistralForCausalLM": Family("mistral", qkv_bias=False, o_bias=False, window_everywhere=True),
    "Qwen2ForCausalLM": Family("qwen2", qkv_bias=True, o_bias=False),  # Qwen2 hard-wires q/k/v biases
    "Qwen3ForCausalLM": Family("qwen3", qk_norm="per_head"),
    "SmolLM3ForCausalLM": Family("smollm3"),
    "GraniteForCausalLM": Family("granite", embedding_scale=lambda c: float(c.embedding_multiplier),
                                 extra=_granite_extra),
    "Phi3ForCausalLM": Family("phi3", qkv_bias=False, o_bias=False, window_everywhere=True,
                              checkpoint=CheckpointLayout(fused_qkv=True, fused_gate_up=True)),
    "Olmo2ForCausalLM": Family("olmo2", norms="post", norm_style="fp32_weight", qk_norm="whole"),
    "Olmo3ForCausalLM": Family("olmo3", norms="post", norm_style="fp32_weight", qk_norm="whole"),
    "GlmForCausalLM": Family("glm", o_bias=False, interleaved_rope=True,
                             checkpoint=CheckpointLayout(fused_gate_up=True)),
    "Glm4ForCausalLM": Family("glm4", norms="sandwich", o_bias=False, interleaved_rope=True,
                              checkpoint=CheckpointLayout(fused_gate_up=True, norm_names=_GLM_NORMS)),
    "Gemma2ForCausalLM": Family("gemma2", **_GEMMA),  # type: ignore[arg-type]
    "Gemma3ForCausalLM": Family("gemma3_text", qk_norm="per_head", **_GEMMA),  # type: ignore[arg-type]
    "Gemma4ForCausalLM": Family("gemma4_text", norms="sandwich", norm_style="fp32_weight", qk_norm="per_head",
                                embedding_scale=_gemma_scale, extra=_gemma4_extra, attention_scale=1.0,
                                adjust_layer=_gemma4_layer),
    "Qwen3MoeForCausalLM": Family("qwen3_moe", qk_norm="per_head", moe=_qwen3_moe),
    "MixtralForCausalLM": Family("mixtral", qkv_bias=False, o_bias=False, window_everywhere=True, moe=_mixtral_moe,
                                 checkpoint=CheckpointLayout(mlp_name="block_sparse_moe", experts="w1w3w2")),
    "Qwen3_5ForCausalLM": Family("qwen3_5_text", norm_style="gemma", qk_norm="per_head", output_gate=True,
                                 linear_attention=True),
    "Qwen3_5MoeForCausalLM": Family("qwen3_5_moe_text", norm_style="gemma", qk_norm="per_head", output_gate=True,
                                    linear_attention=True, moe=_qwen3_next_moe),
    "Qwen3NextForCausalLM": Family("qwen3_next", norm_style="gemma", qk_norm="per_head", output_gate=True,
                                   linear_attention=True, moe=_qwen3_next_moe, fused_delta_projections=True),
    "Lfm2ForCausalLM": Family("lfm2", qk_norm="per_head", short_conv=True, intermediate_size=_lfm2_intermediate,
                              checkpoint=CheckpointLayout(renames=_LFM2_NAMES)),
    "Lfm2MoeForCausalLM": Family("lfm2_moe", qk_norm="per_head", short_conv=True, moe=_lfm2_moe,
                                 checkpoint=CheckpointLayout(renames=_LFM2_NAMES, mlp_name="feed_forward",
                                                             experts="w1w3w2")),
    "NemotronHForCausalLM": Family("nemotron_h", norm_style="fp32_weight", qkv_bias=False, o_bias=False,
                                   single_block_layers=True, mamba=_nemotron_mamba, rope=lambda config: False,
                                   checkpoint=CheckpointLayout(renames=_NEMOTRON_H_NAMES,
                                                               expert_bias_name="gate.e_score_correction_bias")),
    "GraniteMoeHybridForCausalLM": Family(
        "granitemoehybrid", embedding_scale=lambda c: float(c.embedding_multiplier), extra=_granite_extra,
        mamba=_granite_mamba, moe=_granite_hybrid_moe, intermediate_size=lambda c: int(c.shared_intermediate_size),
        rope=lambda c: getattr(c, "position_embedding_type", None) == "rope",
        checkpoint=CheckpointLayout(fused_gate_up=True, renames=_GRANITE_HYBRID_NAMES, mlp_name="block_sparse_moe",
                                    router_name="router.layer", experts="input_output_linear")),
    "FalconH1ForCausalLM": Family("falcon_h1", hybrid_layer=_falcon_h1_layer, extra=_falcon_h1_extra,
                                  embedding_scale=lambda c: float(c.embedding_multiplier),
                                  checkpoint=CheckpointLayout(renames=_FALCON_H1_NAMES)),
    "GptOssForCausalLM": Family("gpt_oss", sinks=True, moe=_gpt_oss_moe,
                                checkpoint=CheckpointLayout(router_name="router", experts="stacked_interleaved")),
}
# Multimodal checkpoints (as Gemma 3 and 4 are published): their text model served as text, the other
# towers left unread. The text model's tensors sit under language_model.model (Gemma 3, as transformers
# saves it too) or model.language_model (Gemma 4).
_OTHER_MODALITIES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.embed_vision.",
                     "model.audio_tower.", "model.embed_audio.")


def _text_model_of_multimodal(text: Family, model_type: str, text_path: str) -> Family:
    checkpoint = replace(text.checkpoint, renames=(*text.checkpoint.renames, ("model", text_path)),
                         skipped_prefixes=_OTHER_MODALITIES)
    return replace(text, model_type=model_type, checkpoint=checkpoint, multimodal=True)


FAMILIES["Gemma3ForConditionalGeneration"] = _text_model_of_multimodal(FAMILIES["Gemma3ForCausalLM"], "gemma3",
                                                                       "language_model.model")
FAMILIES["Gemma4ForConditionalGeneration"] = _text_model_of_multimodal(FAMILIES["Gemma4ForCausalLM"], "gemma4",
                                                                       "model.language_model")
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
# Configs written without `architectures` (e.g. converted from GGUF) still name their model_type.
_ARCHITECTURE_OF_MODEL_TYPE = {family.model_type: name for name, family in FAMILIES.items()}


def supported_architecture(architectures: Any, model_type: Any = None) -> str:
    """The first supported name in a config's `architectures`, else a ValueError naming ours."""
    for name in architectures or ():
        if name in FAMILIES:
            return name
    if not architectures and model_type in _ARCHITECTURE_OF_MODEL_TYPE:
        return _ARCHITECTURE_OF_MODEL_TYPE[model_type]
    named = repr(architectures) if architectures else f"model_type {model_type!r}" if model_type else "(none named)"
    raise ValueError(f"unsupported model architecture {named}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def describe(config: Any, extra_eos_token_ids: tuple[int, ...] = ()) -> ModelSpec:
    """The ModelSpec of a transformers config of a supported architecture."""
    arch = supported_architecture(getattr(config, "architectures", None), getattr(config, "model_type", None))
    family = FAMILIES[arch]
    if family.multimodal:
        config = config.get_text_config()
    if getattr(config, "per_layer_config", None) is not None:
        # transformers guards settings that vary by layer (Gemma 4's head shapes) and warns on reading
        # them globally; the global value is the model's default, and the family reads each layer's own
        # (`adjust_layer`)
        config.allow_global_per_layer_attribute_access = True
        logging.getLogger("transformers.integrations.heterogeneity.configuration_utils").setLevel(logging.ERROR)
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    bias = bool(getattr(config, "attention_bias", False))
    layer_types = _layer_types(config, family)
    no_rope = int_list(getattr(config, "no_rope_layers", None))  # SmolLM3: 1 = rotary, 0 = none
    context = int(config.max_position_embeddings)
    layers = []
    for i, kind in enumerate(layer_types):
        if family.single_block_layers:
            layers.append(_single_block_layer(config, kind, head_dim, bias, family))
            continue
        mlp = family.moe(config, i) or MlpSpec(family.intermediate_size(config), _activation(config),
                                               bias=bool(getattr(config, "mlp_bias", False)))
        if kind == "linear_attention" and family.mamba is not None:
            layers.append(LayerSpec(None, mlp, family.norms, mamba=family.mamba(config)))
            continue
        if kind == "linear_attention":
            layers.append(LayerSpec(None, mlp, family.norms, delta_net=_delta_net(config, family)))
            continue
        if kind == "hybrid":
            assert family.hybrid_layer is not None
            rope = _rope(config, "full_attention", head_dim, family) if family.rope(config) else None
            layers.append(family.hybrid_layer(config, _attention(config, "full_attention", rope, head_dim, bias, family),
                                              mlp))
            continue
        if kind == "conv":
            short = ShortConvSpec(int(config.hidden_size), int(config.conv_L_cache), bool(config.conv_bias))
            layers.append(LayerSpec(None, mlp, family.norms, short_conv=short))
            continue
        rope = None if (no_rope and not no_rope[i]) or not family.rope(config) else _rope(config, kind, head_dim, family)
        if rope is not None and rope.rope_type == "longrope":
            # transformers switches longrope's frequencies with the batch's length, which cached keys
            # cannot follow; below the pretraining context its short frequencies are exact
            context = min(context, rope.original_max_position_embeddings)
        layers.append(family.adjust_layer(
            config, i, LayerSpec(_attention(config, kind, rope, head_dim, bias, family), mlp, family.norms)))
    eos = int_list(getattr(config, "eos_token_id", None)) + list(extra_eos_token_ids)
    fields: dict[str, Any] = {}
    family.extra(config, fields)
    return ModelSpec(
        architecture=arch,
        hidden_size=int(config.hidden_size),
        num_heads=heads,
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=head_dim,
        vocab_size=int(config.vocab_size),
        rms_norm_eps=float(getattr(config, "rms_norm_eps", None) or getattr(config, "norm_eps", None)
                           or getattr(config, "layer_norm_epsilon", None) or 1e-6),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        max_position_embeddings=context,
        eos_token_ids=tuple(dict.fromkeys(eos)),
        layers=tuple(layers),
        bos_token_id=getattr(config, "bos_token_id", None),
        norm_style=family.norm_style,
        embedding_scale=family.embedding_scale(config),
        checkpoint=family.checkpoint,
        **fields,
    )


def _attention(config: Any, kind: str, rope: RopeParams | None, head_dim: int, bias: bool,
               family: Family) -> AttentionSpec:
    return AttentionSpec(
        rope=rope,
        scale=_attention_scale(config, head_dim) if family.attention_scale is None else family.attention_scale,
        window=int(config.sliding_window) if kind == "sliding_attention" else None,
        qk_norm=family.qk_norm,
        qkv_bias=bias if family.qkv_bias is None else family.qkv_bias,
        o_bias=bias if family.o_bias is None else family.o_bias,
        sinks=family.sinks,
        softcap=getattr(config, "attn_logit_softcapping", None),
        output_gate=family.output_gate,
    )


def _single_block_layer(config: Any, kind: str, head_dim: int, bias: bool, family: Family) -> LayerSpec:
    """A Nemotron-H layer: one block after one norm."""
    if kind == "linear_attention":
        assert family.mamba is not None
        return LayerSpec(None, None, family.norms, mamba=family.mamba(config))
    if kind == "full_attention":  # no position embedding: the Mamba2 layers order the tokens
        return LayerSpec(_attention(config, kind, None, head_dim, bias, family), None, family.norms)
    act = getattr(config, "mlp_hidden_act", "relu2")
    if act != "relu2":
        raise ValueError(f"mlp_hidden_act {act!r} is not supported; supported: relu2")
    bias = bool(getattr(config, "mlp_bias", False))
    if kind == "moe":
        return LayerSpec(None, _nemotron_moe(config, bias), family.norms)
    return LayerSpec(None, MlpSpec(int(config.intermediate_size), "relu2", bias=bias), family.norms)


def _nemotron_moe(config: Any, bias: bool) -> MlpSpec:
    """Nemotron 3: squared-ReLU experts chosen by sigmoid score plus a correction bias within the best
    groups, an ungated shared expert added as it is, optionally a latent space around the experts."""
    if bias:  # transformers' experts have no biases where its other projections would
        raise ValueError("mlp_bias in a Nemotron-H MoE layer is not supported")
    return MlpSpec(int(config.moe_intermediate_size), "relu2", num_experts=int(config.n_routed_experts),
                   top_k=int(config.num_experts_per_tok), routing="sigmoid_topk",
                   normalize_topk=bool(config.norm_topk_prob), expert_bias=True, normalize_epsilon=1e-20, router_fp32=True,
                   routed_scaling=float(config.routed_scaling_factor), expert_groups=int(config.n_group or 1),
                   expert_groups_kept=int(config.topk_group or 1), latent_size=int(config.moe_latent_size or 0),
                   shared_intermediate_size=int(config.moe_shared_expert_intermediate_size), shared_gate=False)


def _layer_types(config: Any, family: Family) -> list[str]:
    count = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    types = list(getattr(config, "layer_types", None) or ())
    if not types:
        sliding = bool(window) and family.window_everywhere
        types = ["sliding_attention" if sliding else "full_attention"] * count
    if len(types) != count:
        raise ValueError(f"layer_types names {len(types)} layers, num_hidden_layers is {count}")
    supported = (("full_attention", "sliding_attention")
                 + (("linear_attention",) if family.linear_attention or family.mamba else ())
                 + (("conv",) if family.short_conv else ())
                 + (("hybrid",) if family.hybrid_layer else ()))
    if family.single_block_layers:
        supported = ("linear_attention", "full_attention", "mlp", "moe")
    for kind in types:
        if kind not in supported:
            raise ValueError(f"layer_types {kind!r} is not supported in {family.model_type}; "
                             f"supported: {', '.join(supported)}")
    if "sliding_attention" in types and not window:
        raise ValueError("layer_types names sliding_attention layers but sliding_window is not set")
    return types


def _delta_net(config: Any, family: Family) -> DeltaNetSpec:
    if getattr(config, "hidden_act", "silu") != "silu":  # the DeltaNet's convolution and gate are SiLU
        raise ValueError(f"hidden_act {config.hidden_act!r} in a Gated DeltaNet layer; supported: silu")
    return DeltaNetSpec(int(config.linear_num_key_heads), int(config.linear_num_value_heads),
                        int(config.linear_key_head_dim), int(config.linear_value_head_dim),
                        int(config.linear_conv_kernel_dim), family.fused_delta_projections)


def _activation(config: Any) -> str:
    name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    if name not in _ACTIVATIONS:
        raise ValueError(f"hidden_act {name!r} is not supported; supported: {', '.join(sorted(_ACTIVATIONS))}")
    return _ACTIVATIONS[name]


def _attention_scale(config: Any, head_dim: int) -> float:
    if getattr(config, "attention_multiplier", None) is not None:  # Granite
        return float(config.attention_multiplier)
    if getattr(config, "query_pre_attn_scalar", None) is not None:  # Gemma
        return float(config.query_pre_attn_scalar) ** -0.5
    return head_dim**-0.5


def _rope(config: Any, layer_type: str, head_dim: int, family: Family) -> RopeParams:
    """A layer's rotary settings from transformers 5 `rope_parameters` (per layer type where nested)
    or the older `rope_theta` / `rope_scaling`."""
    params = getattr(config, "rope_parameters", None)
    nested = isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values())
    if nested:
        assert isinstance(params, dict)
        if layer_type not in params:
            raise ValueError(f"rope_parameters has no entry for {layer_type!r} layers")
        raw = dict(params[layer_type])
    elif isinstance(params, dict) and params:
        raw = dict(params)
    else:
        raw = dict(getattr(config, "rope_scaling", None) or {})
        raw.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope_type = raw.get("rope_type") or raw.get("type") or "default"
    partial = float(raw.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", 1.0) or 1.0)
    # proportional rope rotates whole heads, its frequencies past the partial factor's share zero
    rotary_dim = head_dim if rope_type == "proportional" else int(head_dim * partial)
    shape = dict(rotary_dim=None if rotary_dim == head_dim else rotary_dim, interleaved=family.interleaved_rope)
    theta = float(raw.get("rope_theta", 10000.0))
    try:
        if rope_type == "default":
            return RopeParams(theta=theta, **shape)  # type: ignore[arg-type]
        if rope_type == "linear":
            return RopeParams(theta=theta, rope_type="linear", factor=float(raw["factor"]), **shape)  # type: ignore[arg-type]
        if rope_type == "llama3":
            return RopeParams(
                theta=theta, rope_type="llama3", factor=float(raw["factor"]),
                low_freq_factor=float(raw["low_freq_factor"]), high_freq_factor=float(raw["high_freq_factor"]),
                original_max_position_embeddings=int(
                    raw.get("original_max_position_embeddings") or config.max_position_embeddings),
                **shape,  # type: ignore[arg-type]
            )
    except KeyError as missing:
        raise ValueError(f"{rope_type} rope settings lack {missing}") from None
    if rope_type in ("yarn", "longrope", "proportional"):
        return _precomputed_rope(config, rope_type, layer_type if nested else None, raw, theta, shape)
    return RopeParams(rope_type=rope_type)  # raises: names the supported rope types


def _precomputed_rope(config: Any, rope_type: str, layer_type: str | None, raw: dict[str, Any], theta: float,
                      shape: dict[str, Any]) -> RopeParams:
    """yarn / longrope / proportional frequencies exactly as transformers computes them for this config."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", layer_type=layer_type)
    original = raw.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)
    return replace(RopeParams(theta=theta, rope_type=rope_type, frequencies=tuple(inv_freq.float().tolist()),
                              attention_scaling=float(scaling), **shape),
                   original_max_position_embeddings=int(original or config.max_position_embeddings))


def rope_params_from_config(config: Any, layer_type: str = "full_attention") -> RopeParams:
    """The rotary settings of a layer of `layer_type` in a plain (rotate-half) family's config."""
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    return _rope(config, layer_type, head_dim, FAMILIES["LlamaForCausalLM"])
