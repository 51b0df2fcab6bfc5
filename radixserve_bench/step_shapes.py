"""Real model shapes without their weights.

`SHAPES`: what `radixserve bench step` runs (step_bench.py): the real config.json of Llama 3.2 1B and
Llama 3.1 8B, written into a directory under the cache with the embedded model's tokenizer, for the
engine to load with `load_format="dummy"`.

`FAMILY_SHAPES`: one published checkpoint per model family `radixserve bench random-checkpoint --family`
writes (checks/random_checkpoint.py): the fields of its config.json that set its shapes and quirks
(layer sizes, heads, head_dim, experts, windows, rope settings, vocabulary, special token ids, the
family's scalings and softcaps); the rest are the family's config class's defaults. Per-layer patterns
a config class derives from the layer count (Gemma's and gpt-oss's alternating windows, OLMo 3's 3:1,
SmolLM3's rope-less fourth layers) are left to it: the checkpoints' config.json files spell out the same.
Invariant: every architecture of radixserve/model/families.py has one (tests/bench/test_random_family_serve.py).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixserve.model.embedded import EmbeddedModelMissingError, resolve_model
from radixserve.paths import cache_root

_LLAMA3 = dict(architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False, mlp_bias=False,
               hidden_act="silu", num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
               max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, bos_token_id=128000,
               eos_token_id=128001, torch_dtype="bfloat16")
_ROPE = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
SHAPES: dict[str, dict[str, Any]] = {  # meta-llama/Llama-3.2-1B and Llama-3.1-8B config.json (what we read)
    "llama-3.2-1b": {**_LLAMA3, "num_hidden_layers": 16, "hidden_size": 2048, "intermediate_size": 8192,
                     "head_dim": 64, "tie_word_embeddings": True, "rope_scaling": {**_ROPE, "factor": 32.0}},
    "llama-3.1-8b": {**_LLAMA3, "num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336,
                     "head_dim": 128, "tie_word_embeddings": False, "rope_scaling": {**_ROPE, "factor": 8.0}},
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "chat_template.jinja")


def write_shape_dir(config: dict[str, Any], out: Path, tokenizer_dir: Path | None) -> Path:
    """A model directory with `config` and `tokenizer_dir`'s tokenizer files; no weights."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".config.json.{os.getpid()}"
    tmp.write_text(json.dumps(config, indent=1) + "\n")
    os.replace(tmp, out / "config.json")
    for name in TOKENIZER_FILES:
        if tokenizer_dir is not None and (tokenizer_dir / name).is_file():
            shutil.copyfile(tokenizer_dir / name, out / name)
    return out


def shape_dir(name: str) -> Path:
    """The cached directory of shape `name`, with the embedded model's tokenizer when it is installed."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; choose embedded or one of {', '.join(SHAPES)}")
    try:
        tokenizer_dir: Path | None = Path(resolve_model(None)[0])
    except EmbeddedModelMissingError:
        tokenizer_dir = None  # the engine then takes token ids and detokenizes nothing
    return write_shape_dir(SHAPES[name], cache_root() / "shapes" / name, tokenizer_dir)


@dataclass(frozen=True)
class FamilyShape:
    """A family's published checkpoint: `config` goes to `AutoConfig.for_model(model_type, **config)`."""

    model_type: str
    source: str  # the Hugging Face repository whose config.json this is
    config: dict[str, Any]


FAMILY_SHAPES: dict[str, FamilyShape] = {
    "llama": FamilyShape("llama", "meta-llama/Llama-3.1-8B", {
        k: v for k, v in SHAPES["llama-3.1-8b"].items() if k not in ("model_type", "torch_dtype")}),
    "qwen2": FamilyShape("qwen2", "Qwen/Qwen2.5-7B-Instruct", dict(
        architectures=["Qwen2ForCausalLM"], hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False, bos_token_id=151643,
        eos_token_id=151645)),
    "qwen3": FamilyShape("qwen3", "Qwen/Qwen3-8B", dict(
        architectures=["Qwen3ForCausalLM"], hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
        bos_token_id=151643, eos_token_id=151645)),
    # transformers' Qwen3_5TextConfig defaults (its Qwen3.5-9B-style example): 3 DeltaNet layers to 1 full
    "qwen3.5": FamilyShape("qwen3_5_text", "Qwen/Qwen3.5-9B", dict(
        architectures=["Qwen3_5ForCausalLM"], hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
        num_attention_heads=16, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        vocab_size=248320, max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    # transformers' Qwen3NextConfig defaults, its Qwen3-Next-80B-A3B example: 3 DeltaNet layers to 1 full, 512 experts
    "qwen3-next": FamilyShape("qwen3_next", "Qwen/Qwen3-Next-80B-A3B-Instruct", dict(
        architectures=["Qwen3NextForCausalLM"], hidden_size=2048, intermediate_size=5632, num_hidden_layers=48,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        norm_topk_prob=True, vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6,
        tie_word_embeddings=False)),
    # transformers' Qwen3_5MoeTextConfig defaults (its Qwen3.5-35B-A3B-style example)
    "qwen3.5-moe": FamilyShape("qwen3_5_moe_text", "Qwen/Qwen3.5-35B-A3B", dict(
        architectures=["Qwen3_5MoeForCausalLM"], hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
        num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=256,
        num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512, vocab_size=248320,
        max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    "lfm2": FamilyShape("lfm2", "LiquidAI/LFM2-1.2B", dict(
        architectures=["Lfm2ForCausalLM"], hidden_size=2048, intermediate_size=12288, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=65536, max_position_embeddings=128000,
        norm_eps=1e-5, conv_L_cache=3, conv_bias=False, block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.0,
        block_multiple_of=256, tie_word_embeddings=True, bos_token_id=1, eos_token_id=7, pad_token_id=0,
        layer_types=["conv", "conv", "full_attention", "conv", "conv", "full_attention", "conv", "conv",
                     "full_attention", "conv", "full_attention", "conv", "full_attention", "conv", "full_attention",
                     "conv"])),
    # transformers' Lfm2MoeConfig defaults (its LFM2-8B-A1B example: 32 experts, the first 2 layers
    # dense), which name no layer types, at 24 layers: 6 attention layers among 18 convolutions
    "lfm2-moe": FamilyShape("lfm2_moe", "LiquidAI/LFM2-8B-A1B", dict(
        architectures=["Lfm2MoeForCausalLM"], tie_word_embeddings=True, bos_token_id=1, eos_token_id=7,
        pad_token_id=0, num_hidden_layers=24,
        layer_types=["full_attention" if i in (2, 6, 10, 14, 18, 21) else "conv" for i in range(24)])),
    # Nemotron Nano 2's 12B base model (a base model: no chat template of its own, ChatML here)
    "nemotron-h": FamilyShape("nemotron_h", "nvidia/NVIDIA-Nemotron-Nano-12B-v2-Base", dict(
        architectures=["NemotronHForCausalLM"], hidden_size=5120, intermediate_size=20480, num_attention_heads=40,
        num_key_value_heads=8, head_dim=128, mamba_num_heads=128, mamba_head_dim=80, ssm_state_size=128,
        n_groups=8, conv_kernel=4, vocab_size=131072, max_position_embeddings=131072, layer_norm_epsilon=1e-5,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        layer_types=[{"M": "linear_attention", "-": "mlp", "*": "full_attention"}[c]
                     for c in "M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M-"])),
    # transformers' GraniteMoeHybridConfig defaults made dense (Granite 4.0-H micro has no experts) with
    # Granite 4.0-H's one attention layer in ten, and its NoPE
    "granite-4": FamilyShape("granitemoehybrid", "ibm-granite/granite-4.0-h-micro", dict(
        architectures=["GraniteMoeHybridForCausalLM"], num_local_experts=0, num_hidden_layers=40,
        position_embedding_type="nope", layer_types=(["linear_attention"] * 9 + ["full_attention"]) * 4,
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0)),
    # Nemotron 3 Nano (30B, 3.5B active): Mamba2 and MoE layers alternating, 6 attention layers; 128
    # squared-ReLU experts (top 6, scaled by 2.5) beside a shared one, as Megatron-Bridge's provider gives it
    "nemotron-3": FamilyShape("nemotron_h", "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", dict(
        architectures=["NemotronHForCausalLM"], hidden_size=2688, num_attention_heads=32, num_key_value_heads=2,
        head_dim=128, mamba_num_heads=64, mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4,
        n_routed_experts=128, num_experts_per_tok=6, moe_intermediate_size=1856,
        moe_shared_expert_intermediate_size=3712, routed_scaling_factor=2.5, n_group=1, topk_group=1,
        norm_topk_prob=True, vocab_size=131072, max_position_embeddings=262144, layer_norm_epsilon=1e-5,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        layer_types=[{"M": "linear_attention", "E": "moe", "*": "full_attention"}[c]
                     for c in "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"])),
    # Granite 4.0-H tiny (7B, 1B active): 64 SwiGLU experts (top 6) beside the shared MLP, 4 attention
    # layers among 36 Mamba2 ones, NoPE; its multipliers are left at transformers' defaults
    "granite-4-moe": FamilyShape("granitemoehybrid", "ibm-granite/granite-4.0-h-tiny", dict(
        architectures=["GraniteMoeHybridForCausalLM"], hidden_size=1536, num_hidden_layers=40, num_attention_heads=12,
        num_key_value_heads=4, intermediate_size=512, shared_intermediate_size=1024, num_local_experts=64,
        num_experts_per_tok=6, mamba_n_heads=48, mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1,
        mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256, vocab_size=100352, max_position_embeddings=131072,
        position_embedding_type="nope", tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        layer_types=(["linear_attention"] * 5 + ["full_attention"] + (["linear_attention"] * 9 + ["full_attention"]) * 3
                     + ["linear_attention"] * 4))),
    # Falcon-H1 0.5B: attention and Mamba2 side by side in each of 36 layers, with its muP multipliers
    # (a chat template of its own is not reproduced: ChatML here)
    "falcon-h1": FamilyShape("falcon_h1", "tiiuae/Falcon-H1-0.5B-Instruct", dict(
        architectures=["FalconH1ForCausalLM"], hidden_size=1024, intermediate_size=2048, num_hidden_layers=36,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, mamba_d_ssm=1536, mamba_n_heads=24,
        mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=128,
        mamba_conv_bias=True, mamba_proj_bias=False, projectors_bias=False, mamba_rms_norm=False,
        mamba_norm_before_gate=False, attention_in_multiplier=1.0, attention_out_multiplier=0.9375,
        embedding_multiplier=5.656854249492381, key_multiplier=0.39062499999999994, lm_head_multiplier=0.0390625,
        mlp_multipliers=[0.8838834764831844, 0.5859375], ssm_in_multiplier=1.25,
        ssm_multipliers=[0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738],
        ssm_out_multiplier=0.23570226039551587, rope_theta=100000000000.0, max_position_embeddings=16384,
        rms_norm_eps=1e-5, vocab_size=32784, tie_word_embeddings=False)),
    "mistral": FamilyShape("mistral", "mistralai/Mistral-7B-Instruct-v0.3", dict(
        architectures=["MistralForCausalLM"], hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=32768,
        max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1000000.0, sliding_window=None,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)),
    "gemma2": FamilyShape("gemma2", "google/gemma-2-9b-it", dict(
        architectures=["Gemma2ForCausalLM"], hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
        num_attention_heads=16, num_key_value_heads=8, head_dim=256, vocab_size=256000,
        max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0, sliding_window=4096,
        query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        hidden_activation="gelu_pytorch_tanh", bos_token_id=2, eos_token_id=[1, 107], pad_token_id=0)),
    "gemma3": FamilyShape("gemma3_text", "google/gemma-3-1b-it", dict(
        architectures=["Gemma3ForCausalLM"], hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
        max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
        rope_scaling=None, sliding_window=512, sliding_window_pattern=6, query_pre_attn_scalar=256,
        attn_logit_softcapping=None, final_logit_softcapping=None, hidden_activation="gelu_pytorch_tanh",
        bos_token_id=2, eos_token_id=[1, 106], pad_token_id=0)),
    # Gemma 4 E2B: 4 sliding layers of 256-wide heads to one global of 512 (a quarter of it rotated), the
    # last 20 layers reading the K/V of the last earlier layer of their kind with twice-wide MLPs, and
    # per-layer embeddings of 256 per layer (a chat template of its own is not reproduced: Gemma 3's here)
    "gemma-4": FamilyShape("gemma4_text", "google/gemma-4-E2B-it", dict(
        architectures=["Gemma4ForCausalLM"], hidden_size=1536, intermediate_size=6144, num_hidden_layers=35,
        num_attention_heads=8, num_key_value_heads=1, head_dim=256, global_head_dim=512, vocab_size=262144,
        vocab_size_per_layer_input=262144, hidden_size_per_layer_input=256, num_kv_shared_layers=20,
        use_double_wide_mlp=True, attention_k_eq_v=False, enable_moe_block=False, max_position_embeddings=131072,
        rms_norm_eps=1e-6, sliding_window=512, final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh",
        layer_types=["full_attention" if i % 5 == 4 else "sliding_attention" for i in range(35)],
        rope_parameters={"full_attention": dict(rope_type="proportional", partial_rotary_factor=0.25,
                                                rope_theta=1000000.0),
                         "sliding_attention": dict(rope_type="default", rope_theta=10000.0)},
        tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0)),
    "gpt-oss": FamilyShape("gpt_oss", "openai/gpt-oss-20b", dict(
        architectures=["GptOssForCausalLM"], hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
        vocab_size=201088, max_position_embeddings=131072, rms_norm_eps=1e-5, sliding_window=128,
        attention_bias=True, swiglu_limit=7.0, rope_theta=150000.0,
        rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                          original_max_position_embeddings=4096, truncate=False),
        tie_word_embeddings=False, eos_token_id=200002, pad_token_id=199999)),
    "qwen3-moe": FamilyShape("qwen3_moe", "Qwen/Qwen3-30B-A3B", dict(
        architectures=["Qwen3MoeForCausalLM"], hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
        bos_token_id=151643, eos_token_id=151645)),
    "mixtral": FamilyShape("mixtral", "mistralai/Mixtral-8x7B-Instruct-v0.1", dict(
        architectures=["MixtralForCausalLM"], hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
        vocab_size=32000, max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1000000.0,
        sliding_window=None, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)),
    "phi3": FamilyShape("phi3", "microsoft/Phi-3-mini-4k-instruct", dict(
        architectures=["Phi3ForCausalLM"], hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, vocab_size=32064, max_position_embeddings=4096,
        original_max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
        sliding_window=2047, tie_word_embeddings=False, bos_token_id=1, eos_token_id=32000, pad_token_id=32000)),
    "olmo2": FamilyShape("olmo2", "allenai/OLMo-2-1124-7B-Instruct", dict(
        architectures=["Olmo2ForCausalLM"], hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, vocab_size=100352, max_position_embeddings=4096,
        rms_norm_eps=1e-6, rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=100257,
        eos_token_id=100257, pad_token_id=100277)),
    "olmo3": FamilyShape("olmo3", "allenai/Olmo-3-7B-Instruct", dict(
        architectures=["Olmo3ForCausalLM"], hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, vocab_size=100278, max_position_embeddings=65536,
        rms_norm_eps=1e-6, sliding_window=4096, rope_theta=500000.0,
        rope_scaling=dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=8192, beta_fast=32.0,
                          beta_slow=1.0, attention_factor=1.2079441541679836),
        tie_word_embeddings=False, eos_token_id=100257, pad_token_id=100277)),
    "smollm3": FamilyShape("smollm3", "HuggingFaceTB/SmolLM3-3B", dict(
        architectures=["SmolLM3ForCausalLM"], hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
        num_attention_heads=16, num_key_value_heads=4, vocab_size=128256, max_position_embeddings=65536,
        rms_norm_eps=1e-6, rope_theta=5000000.0, no_rope_layer_interval=4, use_sliding_window=False,
        tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128012, pad_token_id=128004)),
    "glm4": FamilyShape("glm4", "THUDM/GLM-4-9B-0414", dict(
        architectures=["Glm4ForCausalLM"], hidden_size=4096, intermediate_size=13696, num_hidden_layers=40,
        num_attention_heads=32, num_key_value_heads=2, head_dim=128, vocab_size=151552,
        max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=10000.0, partial_rotary_factor=0.5,
        attention_bias=True, tie_word_embeddings=False, eos_token_id=[151329, 151336, 151338],
        pad_token_id=151329)),
    "glm": FamilyShape("glm", "THUDM/glm-4-9b-chat-hf", dict(
        architectures=["GlmForCausalLM"], hidden_size=4096, intermediate_size=13696, num_hidden_layers=40,
        num_attention_heads=32, num_key_value_heads=2, head_dim=128, vocab_size=151552,
        max_position_embeddings=131072, rms_norm_eps=1.5625e-07, rope_theta=10000.0, partial_rotary_factor=0.5,
        attention_bias=True, tie_word_embeddings=False, eos_token_id=[151329, 151336, 151338],
        pad_token_id=151329)),
    "granite": FamilyShape("granite", "ibm-granite/granite-3.3-8b-instruct", dict(
        architectures=["GraniteForCausalLM"], hidden_size=4096, intermediate_size=12800, num_hidden_layers=40,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=49159, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_theta=10000000.0, embedding_multiplier=12.0, attention_multiplier=0.0078125,
        residual_multiplier=0.22, logits_scaling=16.0, tie_word_embeddings=True, bos_token_id=0,
        eos_token_id=0, pad_token_id=0)),
}
