"""Tiny random-weight HF checkpoints of each supported architecture, and their transformers oracles.

Each checkpoint is built once per process into a temp directory (removed at exit) with
transformers itself, so our loader reads exactly what `save_pretrained` writes. Weights are drawn
with a large initializer range, and biases and norm weights are perturbed away from their 0/1
defaults, so every code path matters and greedy top-1 choices are not near ties.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

TINY_VOCAB = 512
TINY_CONTEXT = 1024
MISTRAL_WINDOW = 24  # far below the context and the longer test prompts: every path attends across the window

_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    vocab_size=TINY_VOCAB,
    max_position_embeddings=TINY_CONTEXT,
    rms_norm_eps=1e-5,
    initializer_range=0.2,
    bos_token_id=1,
)

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(
        architectures=["LlamaForCausalLM"],
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_bias=True,  # Llama's flag puts biases on q/k/v and o_proj
        eos_token_id=[2, 3],
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=10000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=256,
        ),
    ),
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"],
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        eos_token_id=2,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
    ),
    "qwen3": dict(
        architectures=["Qwen3ForCausalLM"],
        num_attention_heads=8,  # head_dim 16 set apart from hidden/heads, GQA 4:1
        num_key_value_heads=2,
        head_dim=16,
        eos_token_id=2,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
    ),
    "mistral": dict(
        architectures=["MistralForCausalLM"],
        num_attention_heads=4,
        num_key_value_heads=1,
        sliding_window=MISTRAL_WINDOW,
        eos_token_id=2,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
    ),
}
TINY_WINDOW = 8  # the newer families' sliding window: every test prompt crosses it

# The families beyond Llama's shape: each config exercises what sets the family apart.
FAMILY_CONFIGS: dict[str, dict[str, Any]] = {
    "gemma2": dict(
        architectures=["Gemma2ForCausalLM"], num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        layer_types=["sliding_attention", "full_attention"], sliding_window=TINY_WINDOW, query_pre_attn_scalar=24,
        attn_logit_softcapping=5.0, final_logit_softcapping=40.0, eos_token_id=2, tie_word_embeddings=True,
    ),
    "gemma3": dict(
        architectures=["Gemma3ForCausalLM"], num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        sliding_window=TINY_WINDOW, query_pre_attn_scalar=24, eos_token_id=2, tie_word_embeddings=True,
        rope_parameters={"full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1000000.0),
                         "sliding_attention": dict(rope_type="default", rope_theta=10000.0)},
    ),
    "gpt_oss": dict(
        architectures=["GptOssForCausalLM"], num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"], sliding_window=TINY_WINDOW, eos_token_id=2,
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
                             original_max_position_embeddings=64, truncate=False),
    ),
    "qwen3_moe": dict(
        architectures=["Qwen3MoeForCausalLM"], num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1],
        eos_token_id=2,
    ),
    "mixtral": dict(
        architectures=["MixtralForCausalLM"], num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=TINY_WINDOW * 2, eos_token_id=2,
    ),
    "phi3": dict(
        architectures=["Phi3ForCausalLM"], num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5), eos_token_id=2,
    ),
    "olmo2": dict(architectures=["Olmo2ForCausalLM"], num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
                  eos_token_id=2),
    "olmo3": dict(architectures=["Olmo3ForCausalLM"], num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
                  layer_types=["sliding_attention", "full_attention"], sliding_window=TINY_WINDOW, eos_token_id=2),
    "smollm3": dict(architectures=["SmolLM3ForCausalLM"], num_attention_heads=4, num_key_value_heads=2,
                    no_rope_layers=[1, 0], pad_token_id=0, eos_token_id=2),
    "glm4": dict(architectures=["Glm4ForCausalLM"], num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 attention_bias=True, pad_token_id=0, eos_token_id=2),
    "glm": dict(architectures=["GlmForCausalLM"], num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                attention_bias=True, pad_token_id=0, eos_token_id=2),
    "granite": dict(architectures=["GraniteForCausalLM"], num_attention_heads=4, num_key_value_heads=2,
                    embedding_multiplier=6.0, attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=2.0,
                    pad_token_id=0, eos_token_id=2),
}
TINY_CONFIGS.update(FAMILY_CONFIGS)

# Hybrids: recurrent layers beside attention, whose cached prefixes resume only at state checkpoints.
HYBRID_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3_5": dict(
        architectures=["Qwen3_5ForCausalLM"], num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=12, linear_conv_kernel_dim=4, eos_token_id=2,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    ),
}
_TINY_DELTA = dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
                   linear_conv_kernel_dim=4, eos_token_id=2,
                   layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"])
HYBRID_CONFIGS["qwen3_5_moe"] = dict(architectures=["Qwen3_5MoeForCausalLM"], num_experts=4, num_experts_per_tok=2,
                                     moe_intermediate_size=32, shared_expert_intermediate_size=48, **_TINY_DELTA)
HYBRID_CONFIGS["qwen3_next"] = dict(architectures=["Qwen3NextForCausalLM"], num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=True,
                                    mlp_only_layers=[1], **_TINY_DELTA)
HYBRID_CONFIGS["lfm2"] = dict(
    architectures=["Lfm2ForCausalLM"], num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    conv_L_cache=3, conv_bias=True, block_auto_adjust_ff_dim=True, block_multiple_of=32, norm_eps=1e-5,
    eos_token_id=2, layer_types=["conv", "conv", "full_attention", "conv"])
# Nemotron-H: Mamba2, MLP-only and attention-only layers; HF's prefill scan runs chunks of 8
HYBRID_CONFIGS["nemotron_h"] = dict(
    architectures=["NemotronHForCausalLM"], num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=8,
    layer_norm_epsilon=1e-5, eos_token_id=2,
    layers_block_type=["linear_attention", "mlp", "full_attention", "mlp", "linear_attention", "mlp"])
# Granite 4 (dense): Mamba2 and attention layers, each with the shared SwiGLU MLP, Granite's multipliers, NoPE
HYBRID_CONFIGS["granitemoehybrid"] = dict(
    architectures=["GraniteMoeHybridForCausalLM"], num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    num_local_experts=0, shared_intermediate_size=96, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
    mamba_n_groups=2, mamba_d_conv=4, mamba_chunk_size=8, mamba_expand=2, embedding_multiplier=2.0,
    residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0, position_embedding_type="nope",
    eos_token_id=2, layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"])
# LFM2-MoE: LFM2's layers with a dense MLP first, then experts chosen by sigmoid score plus a bias
HYBRID_CONFIGS["lfm2_moe"] = dict(
    architectures=["Lfm2MoeForCausalLM"], num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    conv_L_cache=3, conv_bias=True, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_dense_layers=1,
    routed_scaling_factor=1.5, norm_eps=1e-5, eos_token_id=2, layer_types=["conv", "conv", "full_attention", "conv"])
# Nemotron 3 (Nemotron-H MoE): squared-ReLU experts in a latent space, chosen within the best of 2 groups
HYBRID_CONFIGS["nemotron_h_moe"] = dict(
    HYBRID_CONFIGS["nemotron_h"], n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=48, n_group=2, topk_group=1, routed_scaling_factor=2.5, moe_latent_size=24,
    layers_block_type=["linear_attention", "moe", "full_attention", "moe", "linear_attention", "mlp"])
# Granite 4's MoE models: routed SwiGLU experts beside the shared MLP
HYBRID_CONFIGS["granitemoehybrid_moe"] = dict(
    HYBRID_CONFIGS["granitemoehybrid"], num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)
# Falcon-H1: attention and Mamba2 side by side in every layer, muP multipliers away from 1 everywhere;
# gated Mamba2 output without a norm (as Falcon-H1 0.5B)
_FALCON_H1 = dict(
    architectures=["FalconH1ForCausalLM"], num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, mamba_d_ssm=64, mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=8,
    embedding_multiplier=1.5, lm_head_multiplier=0.7, key_multiplier=0.8, attention_in_multiplier=1.2,
    attention_out_multiplier=0.9, ssm_in_multiplier=1.1, ssm_out_multiplier=0.8,
    ssm_multipliers=[0.9, 1.1, 0.8, 1.2, 0.7], mlp_multipliers=[0.8, 1.25], rms_norm_eps=1e-5, eos_token_id=2)
HYBRID_CONFIGS["falcon_h1"] = dict(_FALCON_H1, mamba_rms_norm=False)
# Gemma 4: sliding and global layers where the global ones have wider heads and fewer kv heads, their
# values taken from the keys' projection; the last three layers read the K/V of the last earlier layer of
# their kind (two the same sliding one's), with twice-wide MLPs; per-layer embeddings; as the E2B/E4B models
HYBRID_CONFIGS["gemma4"] = dict(
    architectures=["Gemma4ForCausalLM"], num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
    layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                 "sliding_attention", "full_attention"], sliding_window=TINY_WINDOW, num_kv_shared_layers=3,
    use_double_wide_mlp=True,
    hidden_size_per_layer_input=8, vocab_size_per_layer_input=TINY_VOCAB, final_logit_softcapping=30.0,
    eos_token_id=2, tie_word_embeddings=True)
# Gemma 4's MoE model (26B-A4B): routed experts beside every layer's MLP, no per-layer embeddings
HYBRID_CONFIGS["gemma4_moe"] = dict(
    architectures=["Gemma4ForCausalLM"], num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"], sliding_window=TINY_WINDOW,
    hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
    final_logit_softcapping=30.0, eos_token_id=2, tie_word_embeddings=True, use_bidirectional_attention="vision")
TINY_CONFIGS.update(HYBRID_CONFIGS)
# Falcon-H1's other Mamba2 outputs, checked at the model level: normed after the gate (its 7B-class
# models, as Nemotron-H's) and before it
TINY_CONFIGS["falcon_h1_norm"] = dict(_FALCON_H1, mamba_rms_norm=True, mamba_norm_before_gate=False)
TINY_CONFIGS["falcon_h1_norm_first"] = dict(_FALCON_H1, mamba_rms_norm=True, mamba_norm_before_gate=True)

_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral", "gemma2": "gemma2",
                "gemma3": "gemma3_text", "gpt_oss": "gpt_oss", "qwen3_moe": "qwen3_moe", "mixtral": "mixtral",
                "phi3": "phi3", "olmo2": "olmo2", "olmo3": "olmo3", "smollm3": "smollm3", "glm4": "glm4", "glm": "glm",
                "granite": "granite", "qwen3_5": "qwen3_5_text",
                "qwen3_5_moe": "qwen3_5_moe_text", "qwen3_next": "qwen3_next", "lfm2": "lfm2",
                "nemotron_h": "nemotron_h", "granitemoehybrid": "granitemoehybrid",
                "lfm2_moe": "lfm2_moe", "nemotron_h_moe": "nemotron_h", "granitemoehybrid_moe": "granitemoehybrid",
                "falcon_h1": "falcon_h1", "falcon_h1_norm": "falcon_h1", "falcon_h1_norm_first": "falcon_h1",
                "gemma4": "gemma4_text", "gemma4_moe": "gemma4_text"}


@functools.cache
def _workdir() -> Path:
    path = Path(tempfile.mkdtemp(prefix="radixserve-tiny-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@functools.cache
def tiny_model_dir(arch: str) -> Path:
    """Directory with config.json + model.safetensors of a tiny random `arch` model (built once)."""
    if arch not in TINY_CONFIGS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose one of {', '.join(TINY_CONFIGS)}")
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(_MODEL_TYPES[arch], **{**_COMMON, **TINY_CONFIGS[arch]})
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith(("expert_bias", "e_score_correction_bias")):  # saved buffers: away from zero, so that they matter
                buffer.normal_(0.0, 0.2)
            elif name.endswith("layer_scalar"):  # Gemma 4's, away from one
                buffer.uniform_(0.5, 1.5)
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.2)
            elif "norm" in name or name.endswith(("router.scale", "per_expert_scale")):
                param.uniform_(0.5, 1.5)
            elif "embed_tokens" in name or "lm_head" in name:
                # logits spread ~4x wider: greedy choices far from ties (Gemma already scales its
                # embeddings by sqrt(hidden), and wider still would leave sampling one choice)
                param.mul_(0.5 if arch.startswith("gemma") else 4.0)
    out = _workdir() / arch
    model.save_pretrained(out)
    return out


# the towers beside the text model in a tiny multimodal checkpoint, as small as transformers allows
_TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=2, head_dim=16)
_TINY_AUDIO = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, subsampling_conv_channels=[8, 4],
                   output_proj_dims=32)
_MULTIMODAL = {"gemma3": ("gemma3", dict(vision_config=dict(_TINY_VISION, image_size=32, patch_size=16,
                                                                 model_type="siglip_vision_model"),
                                         mm_tokens_per_image=4)),
               "gemma4": ("gemma4", dict(vision_config=_TINY_VISION, audio_config=_TINY_AUDIO))}


@functools.cache
def tiny_multimodal_dir(arch: str) -> Path:
    """A tiny multimodal checkpoint (Gemma 3 or 4 `...ForConditionalGeneration`) whose text model is
    `tiny_model_dir(arch)`'s: the same weights under model.language_model, with vision (and audio) towers beside."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForImageTextToText

    model_type, towers = _MULTIMODAL[arch]
    text = tiny_model_dir(arch)
    text_config = AutoConfig.from_pretrained(text).to_dict()
    config = AutoConfig.for_model(model_type, text_config=text_config, **towers)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    own = {f"model.language_model.{name.removeprefix('model.')}": tensor
           for name, tensor in load_file(text / "model.safetensors").items() if name != "lm_head.weight"}
    missing, _ = model.load_state_dict(own, strict=False)
    assert not [name for name in missing if "language_model" in name], "the text model's weights are all given"
    out = _workdir() / f"{arch}_multimodal"
    model.save_pretrained(out)
    return out


@functools.cache
def hf_model(path: Path) -> Any:
    """The transformers model of a checkpoint directory, fp32, eval mode: the oracle our model must match."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    return model.eval()


# A ChatML template, as SmolLM2 and Qwen use (the tiny chat checkpoints' own)
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# what the tiny tokenizer's merges are learned from: the text structured output and tool calls produce
_TINY_CORPUS = [
    '{"name": "Ada", "age": 36, "tags": ["math", "code"], "ok": true, "score": 1.5}',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
    "The quick brown fox jumps over the lazy dog. Hello, how are you today? I am fine, thank you.",
    '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]',
]


def tiny_chat_model_dir(arch: str = "llama") -> Path:
    """The tiny `arch` checkpoint with a byte-level BPE tokenizer (special tokens at the ids the tiny
    configs name: 1 BOS, 2 and 3 EOS) and a ChatML template: what text, chat and grammar paths need.
    Built once per arch, whether the arch is named or left to the default."""
    return _tiny_chat_model_dir(arch)


@functools.cache
def _tiny_chat_model_dir(arch: str) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "<|im_end|>", "</s>", "<|im_start|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB - 12, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_TINY_CORPUS * 4, trainer)
    out = _workdir() / f"{arch}-chat"
    shutil.copytree(tiny_model_dir(arch), out)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>", pad_token="<pad>",
                                   chat_template=TINY_CHAT_TEMPLATE)
    fast.save_pretrained(out)
    return out


# Chat templates of thinking models, written for the tests after the shapes of Qwen3's and gpt-oss's (not
# copies): what the reasoning parsers, template variables and tool formats must cope with.
_QWEN3_SYSTEM = (
    "{%- if tools -%}{{ '<|im_start|>system\\n' }}{%- if messages[0].role == 'system' -%}"
    "{{ messages[0].content + '\\n\\n' }}{%- endif -%}"
    "{{ '# Tools\\n\\nYou may call functions. Their signatures are in <tools></tools>:\\n<tools>' }}"
    "{%- for t in tools -%}{{ '\\n' + (t | tojson) }}{%- endfor -%}"
    "{{ '\\n</tools>\\n\\nFor each call write <tool_call>\\n{\"name\": <name>, \"arguments\": <args>}\\n</tool_call>"
    "<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' -%}{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif -%}"
)
# {keep}: which assistant turns show their reasoning; {opening}: what the generation prompt adds
_QWEN3_BODY = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' and loop.first -%}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- set r = m.reasoning_content if m.reasoning_content is defined and m.reasoning_content else '' -%}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- if {keep} -%}{{ '<think>\\n' + r.strip('\\n') + '\\n</think>\\n\\n' }}{%- endif -%}"
    "{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] -%}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' + c.function.name + '\", \"arguments\": ' + (c.function.arguments | tojson)"
    " + '}\\n</tool_call>' }}{%- endfor -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' -%}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else -%}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{opening}{%- endif -%}"
)
_QWEN3_KEEPS = {
    # as Qwen3: only the turns after the last user message keep their <think> (the last one always)
    "qwen3": "loop.index0 > ns.last_user and (loop.last or r)",
    # as templates that keep every turn's reasoning when the client sends it back (Qwen3.5's, GLM's)
    "qwen3_keep": "r or (loop.index0 > ns.last_user and loop.last)",
    # the generation prompt opens the thinking (Qwen3-Thinking, Qwen3.5): replies start inside it
    "qwen3_opened": "loop.index0 > ns.last_user and (loop.last or r)",
}
_QWEN3_OPENINGS = {
    "qwen3": "{%- if enable_thinking is defined and not enable_thinking -%}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}",
    "qwen3_keep": "{%- if enable_thinking is defined and not enable_thinking -%}{{ '<think>\\n\\n</think>\\n\\n' }}"
                  "{%- endif -%}",
    "qwen3_opened": "{%- if enable_thinking is defined and not enable_thinking -%}{{ '<think>\\n\\n</think>\\n\\n' }}"
                    "{%- else -%}{{ '<think>\\n' }}{%- endif -%}",
}
# harmony: a system message with the reasoning effort, a developer message with the instructions and tools,
# replies in the final channel, calls as commentary messages to functions.NAME, results from them
HARMONY_TEMPLATE = (
    "{{ '<|start|>system<|message|>You are a tiny test model.\\nReasoning: ' + (reasoning_effort | default('medium'))"
    " + '\\n# Valid channels: analysis, commentary, final.<|end|>' }}"
    "{%- set first = messages[0].content if messages and messages[0].role == 'system' else '' -%}"
    "{%- if first or tools -%}{{ '<|start|>developer<|message|>' }}"
    "{%- if first -%}{{ '# Instructions\\n' + first + '\\n' }}{%- endif -%}"
    "{%- if tools -%}{{ '# Tools\\nnamespace functions {\\n' }}{%- for t in tools -%}"
    "{{ '// ' + t.function.description + '\\ntype ' + t.function.name + ' = (_: ' + (t.function.parameters | tojson)"
    " + ') => any;\\n' }}{%- endfor -%}{{ '}' }}{%- endif -%}{{ '<|end|>' }}{%- endif -%}"
    "{%- set ns = namespace(last_user=-1, callee='') -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' and loop.first -%}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- if m.reasoning_content is defined and m.reasoning_content and loop.index0 > ns.last_user -%}"
    "{{ '<|start|>assistant<|channel|>analysis<|message|>' + m.reasoning_content + '<|end|>' }}{%- endif -%}"
    "{%- if m.tool_calls -%}{%- for c in m.tool_calls -%}{%- set ns.callee = c.function.name -%}"
    "{{ '<|start|>assistant<|channel|>commentary to=functions.' + c.function.name + ' <|constrain|>json<|message|>'"
    " + (c.function.arguments | tojson) + '<|call|>' }}{%- endfor -%}"
    "{%- else -%}{{ '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' }}{%- endif -%}"
    "{%- elif m.role == 'tool' -%}"
    "{{ '<|start|>functions.' + ns.callee + ' to=assistant<|channel|>commentary<|message|>' + m.content + '<|end|>' }}"
    "{%- else -%}{{ '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|start|>assistant' }}{%- endif -%}"
)
HARMONY_MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>")
_REASONING_CORPUS = [
    "<think>\nThe user asks about the weather. I should look it up.\n</think>\n\nIt is sunny in Paris.",
    "analysis commentary final to=functions.get_weather json Reasoning: medium",
    '{"city": "Paris"} {"location": "Rome"}',
]


def reasoning_chat_template(kind: str) -> str:
    """The test template of `kind`: "qwen3", "qwen3_keep", "qwen3_opened" or "harmony"."""
    if kind == "harmony":
        return HARMONY_TEMPLATE
    body = _QWEN3_BODY.replace("{keep}", _QWEN3_KEEPS[kind]).replace("{opening}", _QWEN3_OPENINGS[kind])
    return _QWEN3_SYSTEM + body


@functools.cache
def tiny_reasoning_model_dir(kind: str) -> Path:
    """The tiny llama checkpoint with a tokenizer and chat template of a thinking model. Qwen3-like kinds
    have `<think>` and `</think>` as added tokens (not special, as Qwen3's) and end turns with <|im_end|>,
    their one end-of-sequence token (id 2); "harmony" has gpt-oss's markers as special tokens, and ends
    replies with <|return|> (id 2) or <|call|> (id 3), its end-of-sequence tokens. The context is 4096
    tokens."""
    import json

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    harmony = kind == "harmony"
    specials = (["<pad>", "<s>", "<|return|>", "<|call|>", *HARMONY_MARKERS] if harmony
                else ["<pad>", "<s>", "<|im_end|>", "</s>", "<|im_start|>"])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB - 12, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((_TINY_CORPUS + _REASONING_CORPUS) * 4, trainer)
    if not harmony:
        tok.add_tokens([AddedToken("<think>", special=False, normalized=False),
                        AddedToken("</think>", special=False, normalized=False)])
    out = _workdir() / f"reasoning-{kind}"
    shutil.copytree(tiny_model_dir("llama"), out)
    config = json.loads((out / "config.json").read_text())
    config["eos_token_id"] = [2, 3] if harmony else 2
    config["max_position_embeddings"] = 4 * TINY_CONTEXT  # room for Anthropic's least thinking budget (1024)
    (out / "config.json").write_text(json.dumps(config))
    extra: dict[str, Any] = {"extra_special_tokens": list(HARMONY_MARKERS)} if harmony else {}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", pad_token="<pad>",
                                   eos_token="<|return|>" if harmony else "<|im_end|>",
                                   chat_template=reasoning_chat_template(kind), **extra)
    fast.save_pretrained(out)
    return out
