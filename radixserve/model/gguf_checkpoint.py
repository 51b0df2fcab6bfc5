"""Serve a llama.cpp GGUF file directly: its config, tokenizer and tensors, quantized ones kept in
their GGUF block types.

The file is read by `gguf_file.GGUFContents` (metadata and tensor table in milliseconds, data
memory-mapped; `gguf.GGUFReader` takes seconds over a large vocabulary). The HF config is built
here from the metadata (transformers' GGUF config path re-reads the whole file: seconds per
start); the tokenizer is transformers' conversion of the metadata, done once and cached as
tokenizer files under `paths.cache_root()`, keyed by the file's name, size and modification time
and written to a temp directory renamed into place, so a cache directory under its final name is
always complete.

Two ways to serve (`serves_quantized`): on CPU with the C++ kernels, no explicit `--dtype` and no
`--enforce-eager`, each quantized projection becomes one `ggml_quants.QuantizedLinear` over the
file's bytes (a fused q/k/v or gate/up projection packs its parts in order) and a quantized token
embedding a `QuantizedEmbedding` (a tied head shares its packed buffer); F32/F16/BF16 tensors
(norms, biases, unquantized weights) load as ordinary parameters. Otherwise every tensor is
dequantized at load (`gguf.quants.dequantize`) into ordinary parameters of the model dtype. Both
compute the same model: the kernels decode the file's blocks bit for bit as gguf dequantizes them.

Invariants: every parameter is filled from exactly one GGUF tensor (or its row range of a fused
one), or loading fails naming what is missing or left over; a file is refused at start, in one
line naming the thing, when it is not a GGUF, its architecture is not one we map, or a tensor's type
is one we cannot read. llama.cpp's converter permutes the q/k rows of `llama` files (each head's two
rotary halves interleaved); they are un-permuted here as whole byte rows, exact in every block type
because a row's blocks never span rows. A Llama 3.1+ file's rope scaling comes as a `rope_freqs`
vector of per-frequency divisors, which divide the layers' rope frequencies (`rope_factors`); YaRN in the
metadata is transformers' `yarn` (`_yarn`); a Phi-3
file's LongRoPE factors make transformers' `longrope` (`_phi3_fields`); an LFM2 file names its attention
layers by a kv head count per layer (`_lfm2_fields`), and a tensor the converter wrote with its size-1
dimensions dropped (LFM2's convolution kernels) takes its parameter's shape; a Qwen3.5 file's DeltaNet
value heads are regrouped by key head (`_value_head_rows`, `value_columns`: the converter tiles them), its
A taken back from -exp(A_log) and its multi-token-prediction block dropped (Qwen3.5-MoE's too, whose
shared expert loads as transformers names it); Qwen3-Next's are Qwen3.5's but for their value heads, in
order, and its beta and alpha rows, in one tensor (`_split_beta_alpha`). Nemotron-H and Granite 4 name their
layers' kinds by per-layer arrays and write Mamba2 mixers alike (`_MAMBA2`: A as -exp(A_log), the gated
norm by groups, `_flatten_group_norms`), as do Falcon-H1's, whose muP multipliers the converter folds into
the weights (served with each multiplier 1) and whose Mamba2 output llama.cpp gates, then norms. GLM-4-0414's
sandwich norms are named as its checkpoints name them (GLM-4's `chatglm` file is one without them). A Gemma 4
file gives per-layer head shapes and kv heads, values from the keys where a global layer has no `attn_v`, K/V
layers shared as llama.cpp shares them (a file where transformers would share others is refused), and its
proportional rope as a `rope_freqs` of 1 and 1e30 (`_turned_pairs`); its MoE model's stacked experts, beside
the MLP, are split per expert at load like any MoE's (`_experts_beside_per_expert`). A file
means what llama.cpp computes from it: Gemma 2's and 3's
sliding pattern, window, rope bases, softcaps and query scale follow llama.cpp's defaults and rules where
the metadata is silent (`_GEMMA_RULES`), as do gpt-oss's sliding pattern, Granite's scales and rope switch,
and Nemotron-H's norm epsilon; Gemma's and Qwen3.5's norm weights are stored as 1 + w (`_SHIFTED_NORMS`),
and Qwen3-MoE renormalises its chosen experts' weights; a reply ends at the tokens llama.cpp ends it at
(`eos_token_ids`: the named end tokens and those of `_END_OF_GENERATION`'s texts). A MoE layer's stacked
expert tensors (and gpt-oss's expert biases) are split per expert at load; served quantized, the experts
stay in their blocks (`kernels.moe.GgmlExperts`; gpt-oss's MXFP4 too). A `llama` file with experts is
Mixtral. A cached tokenizer splits text as the converted one does (`_keep_as_converted`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from radixserve.model.decoder import CausalLM
from radixserve.model.delta_net import GatedDeltaNet
from radixserve.model.gguf_file import GGUFContents
from radixserve.model.moe import MoE
from radixserve.model.rope import inv_frequencies
from radixserve.model.spec import LayerSpec, ModelSpec
from radixserve.paths import cache_root

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
FLOAT_TYPES = ("F32", "F16", "BF16")
# GGUF architecture -> the HF architecture it is served as (Mistral files are written as `llama`, and so are
# Mixtral's, with experts: `_MIXTURE_OF`)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3moe": "Qwen3MoeForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                 "phi3": "Phi3ForCausalLM", "lfm2": "Lfm2ForCausalLM", "qwen35": "Qwen3_5ForCausalLM",
                 "qwen35moe": "Qwen3_5MoeForCausalLM", "gpt-oss": "GptOssForCausalLM",
                 "lfm2moe": "Lfm2MoeForCausalLM", "qwen3next": "Qwen3NextForCausalLM",
                 "nemotron_h": "NemotronHForCausalLM", "nemotron_h_moe": "NemotronHForCausalLM",
                 "granitehybrid": "GraniteMoeHybridForCausalLM",
                 "olmo2": "Olmo2ForCausalLM", "smollm3": "SmolLM3ForCausalLM", "granite": "GraniteForCausalLM",
                 "falcon-h1": "FalconH1ForCausalLM", "glm4": "Glm4ForCausalLM", "chatglm": "GlmForCausalLM",
                 "gemma4": "Gemma4ForCausalLM"}
# a `llama` file with experts is Mixtral
_MIXTURE_OF = {"llama": ("MixtralForCausalLM", "mixtral")}
# an `olmo2` file with a sliding window is OLMo 3 (llama.cpp's converter writes both as olmo2)
_WINDOWED_OF = {"olmo2": ("Olmo3ForCausalLM", "olmo3")}
_OLMO3_PERIOD = 4  # llama.cpp's sliding pattern for OLMo 3 where the file states none: the fourth layer global
# the transformers model type, where it is not the GGUF name
_MODEL_TYPES = {"gemma3": "gemma3_text", "qwen3moe": "qwen3_moe", "qwen35": "qwen3_5_text",
                "qwen35moe": "qwen3_5_moe_text", "gpt-oss": "gpt_oss", "lfm2moe": "lfm2_moe",
                "qwen3next": "qwen3_next", "granitehybrid": "granitemoehybrid", "nemotron_h_moe": "nemotron_h",
                "falcon-h1": "falcon_h1", "chatglm": "glm", "gemma4": "gemma4_text"}
_NEMOTRON_H = frozenset({"nemotron_h", "nemotron_h_moe"})  # Nemotron-H and Nemotron 3 (its MoE): one layout
_LFM2 = frozenset({"lfm2", "lfm2moe"})  # LFM2 dense and MoE: one layout but for the MoE layers
_QWEN35 = frozenset({"qwen35", "qwen35moe"})  # Qwen3.5 dense and MoE: one layout but for the MLP
# files with Gated DeltaNet layers: Qwen3.5's and Qwen3-Next's, whose converter writes them alike but for the
# order of the value heads (Qwen3.5's tiled, `_value_head_rows`) and Qwen3-Next's beta and alpha rows (one
# tensor, `ssm_ba`, grouped by key head as transformers' in_proj_ba; `_split_beta_alpha`)
_DELTA_NET = frozenset({*_QWEN35, "qwen3next"})
# a MoE layer's experts come stacked in one tensor per projection, [experts, out, in], and their biases
# (gpt-oss) in one per projection, [experts, out]: split per expert here
_EXPERT_TENSOR = re.compile(r"^(blk\.\d+\.ffn_(?:gate_up|gate|up|down)_exps)\.(weight|bias)$")
_EXPERT_PART = re.compile(r"^ffn_(gate_up|gate|up|down)_exps\.(\d+)$")
# the converter interleaves these architectures' rotary halves (Nemotron-H's too, though it turns none)
_PERMUTED_QK = frozenset({"llama", "smollm3", "granite", *_NEMOTRON_H, "granitehybrid"})
_SMOLLM3_NOPE_PERIOD = 4  # llama.cpp's SmolLM3: every fourth layer turns no rope (a constant, not in the file)
_GLM = frozenset({"chatglm", "glm4"})  # GLM-4 and GLM-4-0414: half of each head turned, by interleaved pairs
_MAMBA2 = frozenset({*_NEMOTRON_H, "granitehybrid", "falcon-h1"})  # files with Mamba2 layers, written alike
# Gemma 4's global layers turn a leading part of each head (transformers' `proportional` rope): the converter writes
# a full rope with a divisor per rotation pair, 1 on the turned pairs and this on the others, which stops them
_GEMMA4_STILL = 1e30
# the tokens llama.cpp ends a reply at besides the file's end-of-sequence and end-of-turn tokens, by their text
# (llama-vocab.cpp: most files name only one end token, and chats end at their template's turn end); but not
# "<|end|>" where "<|return|>" or "<|flush|>" and a call token say it ends a message only (gpt-oss's harmony),
# nor "</s>" beside "<|tool_response>" (Gemma 4, whose "</s>" is an ordinary token)
_END_OF_GENERATION = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
                      "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
                      "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
                      "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[")
# a vector of per-frequency divisors of the rope (Llama 3.1's scaling, as the converter bakes it):
# rotation pair i turns at theta^(-2i/d) / factor[i], as llama.cpp's rope reads it
_ROPE_FACTORS = "rope_freqs.weight"
_ROPE_FACTOR_ARCHITECTURES = frozenset({"llama"})
# Phi-3.5's and Phi-4-mini's LongRoPE: per-frequency divisors for contexts past the pretraining one (long)
# and within it (short), which the converter writes beside `rope.scaling.original_context_length`
_LONGROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")


@dataclass(frozen=True)
class _GemmaRules:
    """What llama.cpp assumes of a Gemma file where its metadata is silent."""

    period: int  # the sliding pattern: of every `period` layers the last is global
    window: int  # the sliding window (0: no sliding layers)
    attention_softcap: float | None
    final_softcap: float | None
    sliding_rope_base: float | None  # None: the global layers' base
    big_model_layers: int  # the layer count of the model whose queries scale by (hidden / heads)^-1/2


_GEMMA_RULES = {"gemma2": _GemmaRules(2, 4096, 50.0, 30.0, None, 46),
                "gemma3": _GemmaRules(6, 0, None, None, 10000.0, 62)}
# llama.cpp's sliding pattern for gpt-oss where the file states none: every other layer, the first sliding
_GPT_OSS_PERIOD = 2
# the converter writes Gemma's norm weights w as 1 + w (llama.cpp multiplies by them as they are): served
# with the plain fp32 weight-times-normed style, which is Gemma's x * (1 + w) on these values
_SHIFTED_NORMS = frozenset({*_GEMMA_RULES, *_DELTA_NET})  # Qwen3.5's too, but for the DeltaNet's gated norm
TOKENIZER_CACHE_FORMAT = 2  # bump when the layout of a cached tokenizer directory changes
# text a saved tokenizer must split as the converted one does: spaces, runs of them, punctuation, digits,
# newlines, tabs and non-ASCII
_TOKENIZER_PROBE = "Hello, world! It's 12 345 now.\n  indented\ttab  café ☃ 東京 <b>x</b>"

# GGUF tensor name (after "blk.N.") -> the HF checkpoint name (after "model.layers.N.")
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a MoE layer's router (`GGUFFile.spec` names the experts' layout)
}
# Gemma's sandwich norms: ffn_norm is the norm before the MLP, and each block has a norm after it
_GEMMA_LAYER_TENSORS = {**_LAYER_TENSORS, "ffn_norm": "pre_feedforward_layernorm",
                        "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# Qwen3.5: Gated DeltaNet layers, and full attention whose q_proj also yields the gate
_QWEN35_TENSORS = {**_LAYER_TENSORS, "post_attention_norm": "post_attention_layernorm",
                   "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
                   "ssm_alpha": "linear_attn.in_proj_a", "ssm_beta": "linear_attn.in_proj_b",
                   "ssm_conv1d": "linear_attn.conv1d", "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj"}
_LAYER_TENSORS_OF = {**{arch: _GEMMA_LAYER_TENSORS for arch in _GEMMA_RULES},
                     # gpt-oss: its norm before the MoE is the post-attention one
                     "gpt-oss": {**_LAYER_TENSORS, "post_attention_norm": "post_attention_layernorm"},
                     # Phi-3's fused projections: q, k and v rows in one tensor, and ffn_up the gate rows then up's
                     "phi3": {**_LAYER_TENSORS, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
                     # LFM2: its own names, and the gated short convolution's three tensors (LFM2-MoE: its
                     # leading dense layers', beside its MoE layers' generic ones)
                     **dict.fromkeys(_LFM2, {
                         "ffn_gate_inp": "mlp.gate", "attn_norm": "operator_norm", "ffn_norm": "ffn_norm",
                         "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                         "attn_output": "self_attn.out_proj", "attn_q_norm": "self_attn.q_layernorm",
                         "attn_k_norm": "self_attn.k_layernorm", "ffn_gate": "feed_forward.w1",
                         "ffn_up": "feed_forward.w3", "ffn_down": "feed_forward.w2", "shortconv.in_proj": "conv.in_proj",
                         "shortconv.conv": "conv.conv", "shortconv.out_proj": "conv.out_proj"}),
                     "qwen35": _QWEN35_TENSORS,
                     # and its MoE's router, routed experts (split per expert at load) and shared expert;
                     # Qwen3-Next's the same, or (files of its first converter) q/k/v/z in one `ssm_in`
                     **dict.fromkeys(("qwen35moe", "qwen3next"), {
                         **_QWEN35_TENSORS, "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
                         "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
                         "ffn_down_shexp": "mlp.shared_expert.down_proj", "ssm_in": "linear_attn.in_proj_qkvz",
                         "ssm_ba": "linear_attn.in_proj_ba"})}
# a layer's tensors named whole, without a leaf: GGUF name (after "blk.N.") -> the HF name
_MAMBA_MIXER_TENSORS = {"ssm_a": "mamba.A_log", "ssm_d": "mamba.D", "ssm_dt.bias": "mamba.dt_bias"}  # Granite 4's, Falcon-H1's
_WHOLE_LAYER_TENSORS_OF = {**dict.fromkeys(_DELTA_NET, {"ssm_a": "linear_attn.A_log",
                                                          "ssm_dt.bias": "linear_attn.dt_bias"}),
                           "gpt-oss": {"attn_sinks.weight": "self_attn.sinks"},
                           "lfm2moe": {"exp_probs_b.bias": "mlp.expert_bias"},
                           **dict.fromkeys(_NEMOTRON_H, {"ssm_a": "mixer.A_log", "ssm_d": "mixer.D",
                                                         "ssm_dt.bias": "mixer.dt_bias",
                                                         "exp_probs_b.bias": "mixer.gate.e_score_correction_bias"}),
                           "granitehybrid": _MAMBA_MIXER_TENSORS,
                           # (Falcon-H1's MLP norm the converter names without a `.weight`)
                           "falcon-h1": {**_MAMBA_MIXER_TENSORS, "ffn_norm": "pre_ff_layernorm.weight"}}
# Nemotron-H: one block per layer (a Mamba2 mixer, attention, an MLP, or Nemotron 3's experts beside a shared
# one, with a latent space around them), named as its checkpoints name them
_LAYER_TENSORS_OF.update(dict.fromkeys(_NEMOTRON_H, {
    "attn_norm": "norm", "ssm_in": "mixer.in_proj", "ssm_conv1d": "mixer.conv1d", "ssm_norm": "mixer.norm",
    "ssm_out": "mixer.out_proj", "attn_q": "mixer.q_proj", "attn_k": "mixer.k_proj", "attn_v": "mixer.v_proj",
    "attn_output": "mixer.o_proj", "ffn_up": "mixer.up_proj", "ffn_down": "mixer.down_proj", "ffn_gate_inp": "mixer.gate",
    "ffn_up_shexp": "mixer.shared_experts.up_proj", "ffn_down_shexp": "mixer.shared_experts.down_proj",
    "ffn_latent_down": "mixer.fc1_latent_proj", "ffn_latent_up": "mixer.fc2_latent_proj"}))
# Granite 4: Mamba2 or attention, then its shared MLP (the dense models' MLP, beside the MoE models' experts),
# whose gate and up rows the converter writes apart; named as its checkpoints name them (the shared MLP's
# down projection), or by our own names where they hold it fused (gate and up)
_LAYER_TENSORS_OF["granitehybrid"] = {
    **_LAYER_TENSORS, "ssm_in": "mamba.in_proj", "ssm_conv1d": "mamba.conv1d", "ssm_norm": "mamba.norm",
    "ssm_out": "mamba.out_proj", "ffn_down": "shared_mlp.output_linear", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "shared_mlp.output_linear"}
# Falcon-H1: attention and a Mamba2 mixer side by side, then the MLP (`feed_forward`), named as its checkpoints
# name them; its muP multipliers the converter folds into the weights
_LAYER_TENSORS_OF["falcon-h1"] = {
    **_LAYER_TENSORS, "ssm_in": "mamba.in_proj", "ssm_conv1d": "mamba.conv1d", "ssm_norm": "mamba.norm",
    "ssm_out": "mamba.out_proj", "ffn_gate": "feed_forward.gate_proj", "ffn_up": "feed_forward.up_proj",
    "ffn_down": "feed_forward.down_proj"}
# GLM-4 and GLM-4-0414: gate and up in one tensor; GLM-4-0414's sandwich norms (GLM's names: the MLP's input norm
# is post_attention_layernorm)
_LAYER_TENSORS_OF["chatglm"] = {**_LAYER_TENSORS, "ffn_up": "mlp.gate_up_proj"}
_LAYER_TENSORS_OF["glm4"] = {**_LAYER_TENSORS_OF["chatglm"], "post_attention_norm": "post_self_attn_layernorm",
                             "post_ffw_norm": "post_mlp_layernorm"}
# Gemma 4: Gemma's sandwich norms, the per-layer input's gate, projection and norm; the MoE model's router and the
# norms around its experts (which sit beside the MLP, `experts.E`, stacked in transformers' checkpoints)
_LAYER_TENSORS_OF["gemma4"] = {**_GEMMA_LAYER_TENSORS, "inp_gate": "per_layer_input_gate",
                               "proj": "per_layer_projection", "post_norm": "post_per_layer_input_norm",
                               "ffn_gate_inp": "router.proj", "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
                               "post_ffw_norm_1": "post_feedforward_layernorm_1",
                               "post_ffw_norm_2": "post_feedforward_layernorm_2"}
_WHOLE_LAYER_TENSORS_OF["gemma4"] = {"layer_output_scale.weight": "layer_scalar", "ffn_gate_inp.scale": "router.scale",
                                     "ffn_down_exps.scale": "router.per_expert_scale"}
# OLMo 2 and 3: norms after attention and after the MLP only, q and k normed over all their heads
_LAYER_TENSORS_OF["olmo2"] = {**_LAYER_TENSORS, "post_attention_norm": "post_attention_layernorm",
                              "post_ffw_norm": "post_feedforward_layernorm"}
_LAYER_PREFIX_OF = dict.fromkeys(_NEMOTRON_H, "backbone.layers")  # where not model.layers
_MLP_NAME_OF = dict.fromkeys(_NEMOTRON_H, "mixer")  # where a layer's experts sit, where not in mlp
_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.(.+)$")
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")
_MODEL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# LFM2's final norm is written as the embedding's (transformers names it embedding_norm too)
_MODEL_TENSORS_OF = {**dict.fromkeys(_LFM2, {**_MODEL_TENSORS, "token_embd_norm": "model.embedding_norm"}),
                     **dict.fromkeys(_NEMOTRON_H, {"token_embd": "backbone.embeddings", "output_norm": "backbone.norm_f",
                                                   "output": "lm_head"}),
                     "falcon-h1": {**_MODEL_TENSORS, "output_norm": "model.final_layernorm"},
                     "gemma4": {**_MODEL_TENSORS, "per_layer_token_embd": "model.embed_tokens_per_layer",
                                "per_layer_model_proj": "model.per_layer_model_projection",
                                "per_layer_proj_norm": "model.per_layer_projection_norm"}}
# files whose A is stored as -exp(A_log): the DeltaNet's and Mamba2's
_NEGATED_A = frozenset({*_DELTA_NET, *_MAMBA2})


def is_gguf_path(path: str | Path) -> bool:
    """Whether `path` names a file to be read as a GGUF: one starting with the GGUF magic, or any
    non-directory named *.gguf (opening it then says what is wrong with it)."""
    p = Path(path)
    if p.is_dir():
        return False
    return p.suffix.lower() == ".gguf" or (p.is_file() and _magic(p) == GGUF_MAGIC)


def _magic(path: Path) -> bytes:
    try:
        with path.open("rb") as f:
            return f.read(4)
    except OSError:
        return b""


def serves_quantized(dtype: str, device: torch.device, enforce_eager: bool = False) -> bool:
    """Whether a GGUF is served with its quantized tensors as they are: on CPU, where the C++ kernels
    run, and only when no dtype was asked for (an explicit one means dequantized weights of it) and
    not under `enforce_eager` (which runs no C++ kernel: oneDNN matmuls over dequantized weights)."""
    if dtype != "auto" or device.type != "cpu" or enforce_eager:
        return False
    from radixserve.kernels.ggml_quants import kernels_available

    return kernels_available()


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file: its GGUF type name, rows x cols in torch's order (cols 0 for a
    vector) and its raw data as the reader maps it ([rows, row_bytes] uint8 for a block type)."""

    name: str
    type_name: str
    rows: int
    cols: int
    data: np.ndarray

    @property
    def quantized(self) -> bool:
        return self.type_name not in FLOAT_TYPES


class GGUFFile:
    """An opened GGUF: its metadata and tensors, checked to be ones we serve."""

    def __init__(self, path: str | Path) -> None:
        import gguf

        from radixserve.kernels.ggml_quants import SUPPORTED_TYPES

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"model file {str(self.path)!r} does not exist (radixserve never downloads models)")
        if _magic(self.path) != GGUF_MAGIC:
            raise ValueError(f"{self.path.name} is not a GGUF file (it does not start with the GGUF magic bytes)")
        try:
            self.contents = GGUFContents(self.path)
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"{self.path.name}: cannot read the GGUF file: {err}") from None
        self.arch = str(self._value("general.architecture", ""))
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"{self.path.name}: GGUF architecture {self.arch!r} is not supported; "
                             f"supported: {', '.join(ARCHITECTURES)}")
        codes = {t.value: t.name for t in gguf.GGMLQuantizationType}
        self.tensors: dict[str, GGUFTensor] = {}
        for info in self.contents.tensors:
            type_name = codes.get(info.type_code, f"type {info.type_code}")
            if type_name not in SUPPORTED_TYPES and type_name not in FLOAT_TYPES:
                raise ValueError(f"{self.path.name}: tensor {info.name} is {type_name}; supported GGUF types: "
                                 f"{', '.join(SUPPORTED_TYPES + FLOAT_TYPES)}")
            shape = info.dims  # GGUF order: the fastest-moving (input) dimension first
            stacked = _EXPERT_TENSOR.match(info.name)
            if stacked and len(shape) == (3 if stacked.group(2) == "weight" else 2):
                # one tensor per expert, named blk.N.ffn_gate_exps.E.weight (a matrix) or .bias (a vector)
                data, out = self.contents.data(info), shape[1] if len(shape) == 3 else shape[0]
                cols = shape[0] if len(shape) == 3 else 0
                for e in range(shape[-1]):
                    name = f"{stacked.group(1)}.{e}.{stacked.group(2)}"
                    part = data[e * out:(e + 1) * out] if cols else data[e]
                    self.tensors[name] = GGUFTensor(name, type_name, out, cols, part)
                continue
            if len(shape) not in (1, 2):
                raise ValueError(f"{self.path.name}: tensor {info.name} has {len(shape)} dimensions; expected 1 or 2")
            rows, cols = (shape[1], shape[0]) if len(shape) == 2 else (shape[0], 0)
            self.tensors[info.name] = GGUFTensor(info.name, type_name, rows, cols, self.contents.data(info))
        self._drop_multi_token_prediction()
        self._split_beta_alpha()
        self._flatten_group_norms()
        factors = self.tensors.pop(_ROPE_FACTORS, None)
        self.turned_pairs = self._turned_pairs(factors) if self.arch == "gemma4" else None
        self.rope_factors = None if self.arch == "gemma4" else self._rope_factors(factors)
        long_short = [self.tensors.pop(name, None) for name in _LONGROPE_FACTORS]
        self.longrope_factors = self._longrope_factors(*long_short)

    def _drop_multi_token_prediction(self) -> None:
        """A Qwen3.5 file writes its multi-token-prediction block as the last `nextn_predict_layers`
        blocks; like transformers, the server does not run it."""
        extra = int(self._arch_value("nextn_predict_layers", 0) or 0)
        if self.arch not in (*_DELTA_NET, "nemotron_h_moe") or not extra:
            return
        first = int(self._arch_value("block_count")) - extra
        for name in [n for n in self.tensors if (b := _BLOCK_NAME.match(n)) and int(b.group(1)) >= first]:
            del self.tensors[name]

    @property
    def fused_delta_projections(self) -> bool:
        """Whether a Qwen3-Next file holds q/k/v/z in one tensor per layer (`ssm_in`, as its first converter
        wrote them), served as transformers' fused in_proj_qkvz and in_proj_ba; else as Qwen3.5's."""
        return self._has(".ssm_in.weight")

    def _split_beta_alpha(self) -> None:
        """A Qwen3-Next file with q/k/v and z apart (its converter's current layout) keeps beta and alpha in one
        tensor, per key head its value heads' beta rows then their alpha rows: served as Qwen3.5's
        `ssm_beta` and `ssm_alpha` (whole rows of the file, so quantized blocks stay as they are)."""
        if self.arch != "qwen3next" or self.fused_delta_projections:
            return
        key_heads, value_heads = int(self._arch_value("ssm.group_count")), int(self._arch_value("ssm.time_step_rank"))
        per_key = value_heads // key_heads
        grouped = np.arange(2 * value_heads).reshape(key_heads, 2, per_key)
        for name in [n for n in self.tensors if n.endswith(".ssm_ba.weight")]:
            both = self.tensors.pop(name)
            if both.rows != 2 * value_heads:
                raise ValueError(f"{self.path.name}: tensor {name} has {both.rows} rows; expected {2 * value_heads}")
            for half, kind in enumerate(("ssm_beta", "ssm_alpha")):
                part = name.replace(".ssm_ba.", f".{kind}.")
                self.tensors[part] = GGUFTensor(part, both.type_name, value_heads, both.cols,
                                                both.data[grouped[:, half].reshape(-1)])

    def _flatten_group_norms(self) -> None:
        """A Mamba2 layer's gated norm, which the converter writes [groups, width / groups]: the vector it is."""
        if self.arch not in _MAMBA2:
            return
        for name, norm in list(self.tensors.items()):
            if name.endswith(".ssm_norm.weight") and norm.cols:
                self.tensors[name] = GGUFTensor(name, norm.type_name, norm.rows * norm.cols, 0, norm.data.reshape(-1))

    def _rope_factors(self, tensor: GGUFTensor | None) -> tuple[float, ...] | None:
        """The per-frequency rope divisors of the file's `rope_freqs` tensor (the converter writes it for
        Llama 3.1's rope scaling), checked: one positive finite fp32 value per rotation pair."""
        if tensor is None:
            return None
        if self.arch not in _ROPE_FACTOR_ARCHITECTURES:
            raise ValueError(f"{self.path.name}: per-frequency rope factors (tensor rope_freqs) in a "
                             f"{self.arch!r} file are not supported")
        return tuple(_float_vector(self.path, tensor))

    def _turned_pairs(self, tensor: GGUFTensor | None) -> tuple[int, int] | None:
        """How many leading rotation pairs of a Gemma 4 global layer's head turn, of how many, from the file's
        `rope_freqs` (None: all of them, as a file without it means): its divisors must be 1 on those and
        `_GEMMA4_STILL` on the rest, which is the proportional rope the converter writes; any other vector is
        refused."""
        if tensor is None:
            return None
        factors = _float_vector(self.path, tensor)
        turned = next((i for i, f in enumerate(factors) if f != 1.0), len(factors))
        if not turned or any(f < _GEMMA4_STILL / 10 for f in factors[turned:]):
            raise ValueError(f"{self.path.name}: tensor {_ROPE_FACTORS} is not a proportional rope's (leading factors "
                             f"of 1, then {_GEMMA4_STILL:g}): {factors[:4]}...")
        return turned, len(factors)

    def _longrope_factors(self, long: GGUFTensor | None,
                          short: GGUFTensor | None) -> tuple[list[float], list[float]] | None:
        """The LongRoPE factors (long, short) of a Phi-3 file, checked; None when it has none."""
        if long is None and short is None:
            return None
        if self.arch != "phi3" or long is None or short is None:
            present = ", ".join(t.name for t in (long, short) if t is not None)
            raise ValueError(f"{self.path.name}: LongRoPE factors ({present}) are read from a phi3 file with both "
                             f"{' and '.join(_LONGROPE_FACTORS)}")
        return _float_vector(self.path, long), _float_vector(self.path, short)

    def _has(self, suffix: str) -> bool:
        """Whether some tensor's name ends with `suffix` (a layer's optional tensor, e.g. ".ssm_in.bias")."""
        return any(name.endswith(suffix) for name in self.tensors)

    def _value(self, key: str, default: Any = None) -> Any:
        return self.contents.metadata.get(key, default)

    def _arch_value(self, key: str, default: Any = None) -> Any:
        return self._value(f"{self.arch}.{key}", default)

    @cached_property
    def hf_config(self) -> Any:
        """The transformers config of this file's model, from the metadata."""
        from transformers import AutoConfig

        hidden = int(self._arch_value("embedding_length"))
        heads = int(self._arch_value("attention.head_count"))
        head_dim = self._arch_value("attention.key_length") or (
            self._arch_value("rope.dimension_count") if self.arch == "llama" else None) or hidden // heads
        embed = self.tensors.get("token_embd.weight")
        vocab = self._arch_value("vocab_size") or (embed.rows if embed is not None else None)
        if vocab is None:
            raise ValueError(f"{self.path.name}: the metadata names no vocabulary size and there is no token_embd")
        layers = int(self._arch_value("block_count"))
        architecture, model_type = self._architecture()
        fields: dict[str, Any] = dict(
            architectures=[architecture],
            num_hidden_layers=layers,
            hidden_size=hidden,
            intermediate_size=self._intermediate_size(),
            num_attention_heads=heads,
            num_key_value_heads=max(self._kv_heads_per_layer(heads, layers)),
            head_dim=int(head_dim),
            max_position_embeddings=int(self._arch_value("context_length")),
            rms_norm_eps=self._rms_norm_eps(1e-6),
            vocab_size=int(vocab),
            tie_word_embeddings="output.weight" not in self.tensors,
            rope_parameters=self._rope(),
            bos_token_id=self._value("tokenizer.ggml.bos_token_id"),
            eos_token_id=self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids) or None,
        )
        if self.arch == "llama":
            fields["attention_bias"] = "blk.0.attn_q.bias" in self.tensors
        if self.arch in _GEMMA_RULES:
            fields.update(self._gemma_fields(_GEMMA_RULES[self.arch], hidden, heads, int(head_dim), layers))
        if self.arch == "phi3":
            fields.update(self._phi3_fields(int(head_dim)))
        if self.arch in _LFM2:
            fields.update(self._lfm2_fields(self._kv_heads_per_layer(heads, layers)))
        if self.arch == "lfm2moe":
            fields.update(self._lfm2_moe_fields())
        if self.arch in _NEMOTRON_H:
            fields.update(self._nemotron_h_fields(self._kv_heads_per_layer(heads, layers)))
        if self.arch == "granitehybrid":
            fields.update(self._granite_hybrid_fields(self._kv_heads_per_layer(heads, layers), int(head_dim)))
        if self.arch == "falcon-h1":
            fields.update(self._falcon_h1_fields(hidden))
        if self.arch == "gemma4":
            fields.update(self._gemma4_fields(layers))
        if self.arch in _GLM:  # half of each head turned (by interleaved pairs, as llama.cpp's rope turns them)
            rotary = int(self._arch_value("rope.dimension_count", int(head_dim) // 2))
            fields.update(attention_bias="blk.0.attn_q.bias" in self.tensors,
                          rope_parameters={**self._rope(), "partial_rotary_factor": rotary / int(head_dim)})
        if self.arch == "granite":
            fields.update(self._granite_scales(int(head_dim)))
            if fields.pop("position_embedding_type") != "rope":
                raise ValueError(f"{self.path.name}: a granite file without rope (granite.rope.scaling.finetuned false) "
                                 "is not supported")
        if self.arch == "smollm3":
            fields["no_rope_layers"] = [int((i + 1) % _SMOLLM3_NOPE_PERIOD != 0) for i in range(layers)]
        if self.arch in _DELTA_NET:
            fields.update(self._qwen35_fields(layers, int(head_dim)))
        if self.arch in ("qwen35moe", "qwen3next"):
            fields.update(self._expert_fields(),
                          shared_expert_intermediate_size=int(self._arch_value("expert_shared_feed_forward_length")))
        if self.arch == "qwen3moe":
            fields.update(self._expert_fields(), decoder_sparse_step=1, mlp_only_layers=[])
        if self.arch == "gpt-oss":
            fields.update(self._gpt_oss_fields(layers))
        if model_type == "olmo3":
            fields.update(self._olmo3_fields(layers))
        if model_type == "mixtral":
            fields.update(num_local_experts=int(self._arch_value("expert_count")), sliding_window=None,
                          num_experts_per_tok=int(self._arch_value("expert_used_count")))
        return AutoConfig.for_model(model_type, **fields)

    def _olmo3_fields(self, layers: int) -> dict[str, Any]:
        """OLMo 3's fields as llama.cpp reads an `olmo2` file with a window: the layers sliding by
        `attention.sliding_window_pattern` (every fourth global where absent), the sliding layers' rope at
        `rope.freq_base_swa` (else the global base), unscaled; the global layers' with the file's scaling."""
        window = int(self._arch_value("attention.sliding_window"))
        rope = self._rope()
        local_base = float(self._arch_value("rope.freq_base_swa", rope["rope_theta"]))
        return dict(layer_types=["sliding_attention" if s else "full_attention"
                                 for s in self._sliding_layers(window, _OLMO3_PERIOD, layers)],
                    sliding_window=window, rope_parameters={
                        "full_attention": rope, "sliding_attention": {"rope_type": "default", "rope_theta": local_base}})

    def _architecture(self) -> tuple[str, str]:
        """The HF architecture and transformers model type the file is served as."""
        if self.arch in _MIXTURE_OF and int(self._arch_value("expert_count", 0) or 0):
            return _MIXTURE_OF[self.arch]
        if self.arch in _WINDOWED_OF and int(self._arch_value("attention.sliding_window", 0) or 0):
            return _WINDOWED_OF[self.arch]
        return ARCHITECTURES[self.arch], _MODEL_TYPES.get(self.arch, self.arch)

    def _rms_norm_eps(self, default: float) -> float:
        """The RMS norms' epsilon: `attention.layer_norm_rms_epsilon`, or (as llama.cpp reads a Nemotron-H file,
        whose converter writes only it) `attention.layer_norm_epsilon`."""
        eps = self._arch_value("attention.layer_norm_rms_epsilon")
        if eps is None and self.arch in _NEMOTRON_H:
            eps = self._arch_value("attention.layer_norm_epsilon")
        return float(default if eps is None else eps)

    def _intermediate_size(self) -> int:
        """The MLP width: `feed_forward_length` (per layer in a Nemotron-H file, 0 where a layer has no MLP: the
        widest), or the experts' where the file states none."""
        width = self._arch_value("feed_forward_length", 0)
        if isinstance(width, list):
            return max(int(w) for w in width)
        return int(width or self._arch_value("expert_feed_forward_length"))

    def _expert_fields(self) -> dict[str, Any]:
        """A MoE file's routed experts: how many, how many per token, how wide; llama.cpp always renormalises
        the chosen experts' weights."""
        return dict(num_experts=int(self._arch_value("expert_count")),
                    num_experts_per_tok=int(self._arch_value("expert_used_count")),
                    moe_intermediate_size=int(self._arch_value("expert_feed_forward_length")), norm_topk_prob=True)

    def _gpt_oss_fields(self, layers: int) -> dict[str, Any]:
        """gpt-oss's fields as llama.cpp reads them: biased attention with sinks, every other layer sliding
        (the first) unless the file states a pattern, one rope for both kinds of layer, and routed experts of
        `expert_feed_forward_length` (their clamped SwiGLU's limit and alpha are llama.cpp's constants,
        which are transformers' defaults)."""
        window = int(self._arch_value("attention.sliding_window"))
        rope = self._rope()
        sliding_base = self._arch_value("rope.freq_base_swa")
        if sliding_base is not None and float(sliding_base) != rope["rope_theta"]:
            raise ValueError(f"{self.path.name}: a gpt-oss file with another rope base on its sliding layers "
                             f"({sliding_base}) than on its full ones ({rope['rope_theta']}) is not supported")
        return dict(layer_types=["sliding_attention" if s else "full_attention"
                                 for s in self._sliding_layers(window, _GPT_OSS_PERIOD, layers)],
                    sliding_window=window, attention_bias=True, num_local_experts=int(self._arch_value("expert_count")),
                    num_experts_per_tok=int(self._arch_value("expert_used_count")),
                    intermediate_size=int(self._arch_value("expert_feed_forward_length")))

    def _sliding_layers(self, window: int, period: int, layers: int) -> list[bool]:
        """Which layers slide, as llama.cpp reads `attention.sliding_window_pattern`: per-layer flags, or a
        period (`period` where the file states none) whose last layer is global; none without a window."""
        pattern = self._arch_value("attention.sliding_window_pattern", period)
        if not window:
            return [False] * layers
        if isinstance(pattern, list):
            return [bool(flag) for flag in pattern[:layers]]
        period = int(pattern)
        return [period == 0 or i % period < period - 1 for i in range(layers)]

    def _kv_heads_per_layer(self, heads: int, layers: int) -> list[int]:
        """`attention.head_count_kv`: one count for every layer, or (LFM2) a count per layer, 0 on a layer
        without attention."""
        kv = self._arch_value("attention.head_count_kv", heads)
        if not isinstance(kv, list):
            return [int(kv)] * layers
        if self.arch not in (*_LFM2, *_MAMBA2, "gemma4") or len(kv) != layers or not any(kv):
            raise ValueError(f"{self.path.name}: per-layer kv head counts ({self.arch}.attention.head_count_kv, "
                             f"{len(kv)} values for {layers} layers) are read from an lfm2, lfm2moe, nemotron_h, "
                             "nemotron_h_moe, granitehybrid, falcon-h1 or gemma4 file only")
        return [int(n) for n in kv]

    def _lfm2_fields(self, kv_heads: list[int]) -> dict[str, Any]:
        """LFM2's fields: the layers with kv heads attend, the others are gated short convolutions of
        `shortconv.l_cache` taps; the MLP width is stated final (no auto-adjustment)."""
        if len(set(n for n in kv_heads if n)) > 1:
            raise ValueError(f"{self.path.name}: attention layers with different kv head counts ({kv_heads})")
        return dict(layer_types=["full_attention" if n else "conv" for n in kv_heads],
                    conv_L_cache=int(self._arch_value("shortconv.l_cache")), block_auto_adjust_ff_dim=False,
                    conv_bias=self._has(".shortconv.in_proj.bias"),
                    norm_eps=float(self._arch_value("attention.layer_norm_rms_epsilon", 1e-5)))

    def _nemotron_h_fields(self, kv_heads: list[int]) -> dict[str, Any]:
        """Nemotron-H's fields: each layer one block, which the per-layer arrays tell (kv heads: attention; an
        MLP width: a squared-ReLU MLP, or Nemotron 3's experts; neither: a Mamba2 mixer of the `ssm.*` shape,
        `ssm.time_step_rank` heads); no position embedding. Nemotron 3's routing as llama.cpp reads it: sigmoid
        scores plus `exp_probs_b` within the `expert_group_used_count` best of `expert_group_count` groups,
        renormalised where `expert_weights_norm`, scaled by `expert_weights_scale`."""
        widths = self._arch_value("feed_forward_length")
        widths = widths if isinstance(widths, list) else [int(widths)] * len(kv_heads)
        if len(widths) != len(kv_heads):
            raise ValueError(f"{self.path.name}: {len(widths)} feed_forward_length values for {len(kv_heads)} layers")
        heads = int(self._arch_value("ssm.time_step_rank"))
        experts = self.arch == "nemotron_h_moe"
        moe: dict[str, Any] = dict(
            n_routed_experts=int(self._arch_value("expert_count")), num_experts_per_tok=int(self._arch_value(
                "expert_used_count")), moe_intermediate_size=int(self._arch_value("expert_feed_forward_length")),
            moe_shared_expert_intermediate_size=int(self._arch_value("expert_shared_feed_forward_length")),
            n_group=int(self._arch_value("expert_group_count", 1) or 1),
            topk_group=int(self._arch_value("expert_group_used_count", 1) or 1),
            routed_scaling_factor=float(self._arch_value("expert_weights_scale", 0.0) or 1.0),
            norm_topk_prob=bool(self._arch_value("expert_weights_norm", False)),
            moe_latent_size=int(self._arch_value("moe_latent_size", 0) or 0) or None) if experts else {}
        return dict(moe, layers_block_type=["full_attention" if kv else ("moe" if experts else "mlp") if width
                                            else "linear_attention" for kv, width in zip(kv_heads, widths)],
                    intermediate_size=max(int(w) for w in widths), mamba_num_heads=heads,
                    mamba_head_dim=int(self._arch_value("ssm.inner_size")) // heads,
                    ssm_state_size=int(self._arch_value("ssm.state_size")), n_groups=int(self._arch_value("ssm.group_count")),
                    conv_kernel=int(self._arch_value("ssm.conv_kernel")),
                    use_conv_bias=self._has(".ssm_conv1d.bias"),
                    use_bias=self._has(".ssm_in.bias"),
                    layer_norm_epsilon=self._rms_norm_eps(1e-5))

    def _granite_hybrid_fields(self, kv_heads: list[int], head_dim: int) -> dict[str, Any]:
        """Granite 4's fields as llama.cpp reads them: layers with kv heads attend, the others are Mamba2 mixers
        (`ssm.*`); Granite's scales and rope switch (`_granite_scales`); the MLP of `feed_forward_length`, or,
        beside experts, a shared one of `expert_shared_feed_forward_length`."""
        heads = int(self._arch_value("ssm.time_step_rank"))
        inner = int(self._arch_value("ssm.inner_size"))
        experts = int(self._arch_value("expert_count", 0) or 0)
        fields: dict[str, Any] = dict(
            self._granite_scales(head_dim),
            layer_types=["full_attention" if kv else "linear_attention" for kv in kv_heads],
            mamba_n_heads=heads, mamba_d_head=inner // heads, mamba_d_state=int(self._arch_value("ssm.state_size")),
            mamba_n_groups=int(self._arch_value("ssm.group_count")), mamba_d_conv=int(self._arch_value("ssm.conv_kernel")),
            mamba_expand=inner // int(self._arch_value("embedding_length")),
            mamba_conv_bias=self._has(".ssm_conv1d.bias"),
            mamba_proj_bias=self._has(".ssm_in.bias"),
            num_local_experts=experts,
            # (a dense model's shared MLP is its MLP, of feed_forward_length, as llama.cpp reads it)
            shared_intermediate_size=int(self._arch_value("expert_shared_feed_forward_length")) if experts
            else self._intermediate_size())
        if experts:
            fields.update(num_experts_per_tok=int(self._arch_value("expert_used_count")),
                          intermediate_size=int(self._arch_value("expert_feed_forward_length", 0) or
                                                self._intermediate_size()))
        return fields

    def _falcon_h1_fields(self, hidden: int) -> dict[str, Any]:
        """Falcon-H1's fields as llama.cpp reads them: a Mamba2 mixer of the `ssm.*` shape beside attention in
        every layer, its output gated, then normed by groups where the file has the norm; every muP multiplier
        1 (transformers' default), as the converter multiplied the weights by them."""
        heads, inner = int(self._arch_value("ssm.time_step_rank")), int(self._arch_value("ssm.inner_size"))
        return dict(mamba_d_ssm=inner, mamba_n_heads=heads, mamba_d_head=inner // heads,
                    mamba_d_state=int(self._arch_value("ssm.state_size")),
                    mamba_n_groups=int(self._arch_value("ssm.group_count")),
                    mamba_d_conv=int(self._arch_value("ssm.conv_kernel")), mamba_expand=inner // hidden,
                    mamba_conv_bias=self._has(".ssm_conv1d.bias"),
                    mamba_proj_bias=self._has(".ssm_in.bias"),
                    projectors_bias=self._has(".attn_q.bias"),
                    mamba_rms_norm=self._has(".ssm_norm.weight"),
                    mamba_norm_before_gate=False, hidden_act="silu")

    def _granite_scales(self, head_dim: int) -> dict[str, Any]:
        """Granite's multipliers as llama.cpp reads them (`embedding_scale`, `residual_scale`, `logit_scale`,
        `attention.scale`; where absent, none, and queries by head_dim^-1/2), and whether the rope turns
        (`rope.scaling.finetuned`, which Granite's converter uses as that switch; true where absent)."""
        return dict(embedding_multiplier=float(self._arch_value("embedding_scale", 0.0) or 1.0),
                    residual_multiplier=float(self._arch_value("residual_scale", 0.0) or 1.0),
                    logits_scaling=float(self._arch_value("logit_scale", 0.0) or 1.0),
                    attention_multiplier=float(self._arch_value("attention.scale", 0.0) or head_dim ** -0.5),
                    position_embedding_type="rope" if self._arch_value("rope.scaling.finetuned", True) else "nope")

    def _lfm2_moe_fields(self) -> dict[str, Any]:
        """LFM2-MoE's fields as llama.cpp reads them: `leading_dense_block_count` dense layers, then experts
        chosen by sigmoid scores (plus `exp_probs_b`, where the file has it), their weights renormalised and
        scaled by `expert_weights_scale` (none written: 1)."""
        gating = int(self._arch_value("expert_gating_func", 0) or 0)
        if gating != 2:  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
            raise ValueError(f"{self.path.name}: lfm2moe expert gating function {gating} is not supported; "
                             "supported: 2 (sigmoid)")
        return dict(self._expert_fields(), num_dense_layers=int(self._arch_value("leading_dense_block_count", 0) or 0),
                    use_expert_bias=self._has(".exp_probs_b.bias"),
                    routed_scaling_factor=float(self._arch_value("expert_weights_scale", 0.0) or 1.0))

    def _qwen35_fields(self, blocks: int, head_dim: int) -> dict[str, Any]:
        """Qwen3.5's and Qwen3-Next's fields: the layers `attention.recurrent_layers` flags, or else all but
        every `full_attention_interval`-th, are Gated DeltaNet layers of the `ssm.*` shape (`ssm.inner_size`
        is every value head's width together); the rope turns `rope.dimension_count` dimensions of a head,
        with Qwen3.5's interleaved multimodal sections, which text positions make plain rope."""
        layers = blocks - int(self._arch_value("nextn_predict_layers", 0) or 0)
        interval = int(self._arch_value("full_attention_interval", 4))
        recurrent = self._arch_value("attention.recurrent_layers")  # where absent, every interval-th attends
        if recurrent is None:
            recurrent = [(i + 1) % interval != 0 for i in range(layers)]
        value_heads = int(self._arch_value("ssm.time_step_rank"))
        sections = [int(n) for n in self._arch_value("rope.dimension_sections", []) if n]
        rope = {**self._rope(), "partial_rotary_factor": int(self._arch_value("rope.dimension_count")) / head_dim}
        if sections:
            rope.update(mrope_section=sections, mrope_interleaved=True)
        return dict(num_hidden_layers=layers, full_attention_interval=interval,
                    layer_types=["linear_attention" if flag else "full_attention" for flag in recurrent[:layers]],
                    linear_conv_kernel_dim=int(self._arch_value("ssm.conv_kernel")),
                    linear_key_head_dim=int(self._arch_value("ssm.state_size")),
                    linear_num_key_heads=int(self._arch_value("ssm.group_count")), linear_num_value_heads=value_heads,
                    linear_value_head_dim=int(self._arch_value("ssm.inner_size")) // value_heads,
                    rope_parameters=rope)

    def hf_values(self, tensor: GGUFTensor, values: np.ndarray, spec: ModelSpec) -> np.ndarray:
        """A dequantized tensor's values as transformers holds them, where the converter changed more
        than the rows' order: a Qwen3.5 out_proj's columns (`value_columns`), and its A, stored as
        -exp(A_log)."""
        columns = self.value_columns(tensor, spec)
        if columns is not None:
            values = values[:, columns]
        if self.arch in _NEGATED_A and tensor.name.endswith(".ssm_a"):
            if not (values < 0).all():
                raise ValueError(f"{self.path.name}: tensor {tensor.name} holds a value that is not negative; the "
                                 "converter writes -exp(A_log) there")
            values = torch.log(-torch.from_numpy(np.array(values, dtype=np.float32))).numpy()  # (a copy: F32 is mapped)
        return values

    def _phi3_fields(self, head_dim: int) -> dict[str, Any]:
        """Phi-3's fields: its sliding window (0, Phi-4's: none), the share of a head its rope turns
        (`rope.dimension_count`), and LongRoPE (Phi-3.5, Phi-4-mini) as transformers' `longrope`, whose
        attention factor is the file's where it states one. Served, like such a checkpoint, within its
        pretraining context, where transformers and llama.cpp both turn by the short factors."""
        rotary = int(self._arch_value("rope.dimension_count", head_dim))
        rope: dict[str, Any] = {**self._rope(), "partial_rotary_factor": rotary / head_dim}
        fields: dict[str, Any] = dict(sliding_window=int(self._arch_value("attention.sliding_window", 0) or 0) or None)
        if self.longrope_factors is not None:
            long, short = self.longrope_factors
            if len(long) != rotary // 2 or len(short) != rotary // 2:
                raise ValueError(f"{self.path.name}: LongRoPE factors of {len(long)} and {len(short)} values for "
                                 f"{rotary // 2} rotation pairs")
            original = int(self._arch_value("rope.scaling.original_context_length", 0) or 0)
            if not original:
                raise ValueError(f"{self.path.name}: LongRoPE factors without "
                                 f"{self.arch}.rope.scaling.original_context_length")
            rope.update(rope_type="longrope", long_factor=long, short_factor=short,
                        original_max_position_embeddings=original)
            attention_factor = self._arch_value("rope.scaling.attn_factor")
            if attention_factor is not None:
                rope["attention_factor"] = float(attention_factor)
            fields["original_max_position_embeddings"] = original
        return dict(fields, rope_parameters=rope)

    def _gemma_fields(self, rules: _GemmaRules, hidden: int, heads: int, head_dim: int, layers: int) -> dict[str, Any]:
        """Gemma 2's and 3's fields as llama.cpp reads the file, with `rules` where it is silent: the layers
        sliding by `sliding_window_pattern` (per-layer flags, or a period whose last layer is global), the
        sliding layers' rope at `rope.freq_base_swa`, unscaled, the global layers' at `rope.freq_base`
        with the file's scaling, the softcaps, and queries scaled by head_dim^-1/2, or (hidden / heads)^-1/2
        for the 27B models (by their layer count), as gemma_pytorch and llama.cpp do."""
        window = int(self._arch_value("attention.sliding_window", rules.window) or 0)
        sliding = self._sliding_layers(window, rules.period, layers)
        global_rope = self._rope()
        local_base = self._arch_value("rope.freq_base_swa", rules.sliding_rope_base)
        local_rope = {"rope_type": "default", "rope_theta": float(local_base)} if local_base is not None else None
        if self.arch == "gemma2":  # one rope for every layer
            if local_rope is not None and local_rope != global_rope:
                raise ValueError(f"{self.path.name}: a Gemma 2 file with another rope on its sliding layers "
                                 f"({local_rope}) than on its global ones ({global_rope}) is not supported")
            rope: dict[str, Any] = global_rope
        else:
            rope = {"full_attention": global_rope, "sliding_attention": local_rope or global_rope}
        attention_softcap = self._arch_value("attn_logit_softcapping", rules.attention_softcap)
        final_softcap = self._arch_value("final_logit_softcapping", rules.final_softcap)
        return dict(
            layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
            sliding_window=window or None,
            query_pre_attn_scalar=hidden // heads if layers == rules.big_model_layers else head_dim,
            attn_logit_softcapping=float(attention_softcap) if attention_softcap else None,
            final_logit_softcapping=float(final_softcap) if final_softcap else None,
            rope_parameters=rope,
        )

    def _gemma4_fields(self, layers: int) -> dict[str, Any]:
        """Gemma 4's fields as llama.cpp reads the file: the sliding layers by per-layer flags, their heads of
        `key_length_swa` and the global layers' of `key_length`, kv heads per layer, the global layers' values
        taken from their keys where they have no `attn_v` (`attention_k_eq_v`), the last `shared_kv_layers`
        layers reading an earlier layer's K/V (with twice-wide MLPs where `feed_forward_length` says so),
        per-layer inputs of `embedding_length_per_layer_input`, the sliding layers' rope at `freq_base_swa`
        and the global layers' proportional one (`turned_pairs`), the final softcap; the MoE model's experts
        beside every layer's MLP (`expert_count`)."""
        window = int(self._arch_value("attention.sliding_window"))
        sliding = self._sliding_layers(window, 0, layers)
        if sliding[-1]:
            raise ValueError(f"{self.path.name}: a Gemma 4 file whose last layer slides is not supported")
        heads = int(self._arch_value("attention.head_count"))
        kv = self._kv_heads_per_layer(heads, layers)
        head_dim, global_head_dim = int(self._arch_value("attention.key_length_swa")), int(
            self._arch_value("attention.key_length"))
        if int(self._arch_value("rope.dimension_count_swa", head_dim)) != head_dim:
            raise ValueError(f"{self.path.name}: a Gemma 4 file whose sliding layers turn part of each head is not "
                             "supported")
        shared = int(self._arch_value("attention.shared_kv_layers", 0) or 0)
        if shared and (layers - shared < 2 or sliding[layers - shared - 1] or not sliding[layers - shared - 2]):
            # llama.cpp's readers take the last two layers before them for their sources, a sliding one then a global
            raise ValueError(f"{self.path.name}: a Gemma 4 file whose last layers projecting K/V are not a sliding one "
                             "and then a global one is not supported (llama.cpp's shared K/V layers read those)")
        widths = self._arch_value("feed_forward_length")
        widths = [int(w) for w in widths] if isinstance(widths, list) else [int(widths)] * layers
        doubled = [w == 2 * widths[0] for w in widths[layers - shared:]]
        if widths[:layers - shared] != [widths[0]] * (layers - shared) or (shared and len(set(doubled)) > 1) or (
                not all(doubled) and widths[layers - shared:] != [widths[0]] * shared):
            raise ValueError(f"{self.path.name}: MLP widths {widths} are not Gemma 4's (one width, or twice it on the "
                             f"last {shared} layers)")
        global_layers = [i for i in range(layers) if not sliding[i]]
        if len({kv[i] for i in global_layers}) > 1 or len({kv[i] for i in range(layers) if sliding[i]}) > 1:
            raise ValueError(f"{self.path.name}: layers of one kind with different kv head counts ({kv})")
        value_from_key = not any(f"blk.{i}.attn_v.weight" in self.tensors for i in global_layers if i < layers - shared)
        per_layer = int(self._arch_value("embedding_length_per_layer_input", 0) or 0)
        per_layer_embed = self.tensors.get("per_layer_token_embd.weight")
        if per_layer and per_layer_embed is None:
            raise ValueError(f"{self.path.name}: per-layer inputs of {per_layer} without per_layer_token_embd")
        turned, pairs = self.turned_pairs or (global_head_dim // 2, global_head_dim // 2)
        if pairs != global_head_dim // 2:
            raise ValueError(f"{self.path.name}: tensor {_ROPE_FACTORS} has {pairs} factors for "
                             f"{global_head_dim // 2} rotation pairs")
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": float(self._arch_value("rope.freq_base_swa"))},
                "full_attention": {"rope_type": "proportional", "rope_theta": float(self._arch_value("rope.freq_base")),
                                   "partial_rotary_factor": 2 * turned / global_head_dim}}
        softcap = self._arch_value("final_logit_softcapping")
        experts = int(self._arch_value("expert_count", 0) or 0)
        optional: dict[str, Any] = dict(
            enable_moe_block=True, num_experts=experts, top_k_experts=int(self._arch_value("expert_used_count")),
            moe_intermediate_size=int(self._arch_value("expert_feed_forward_length"))) if experts else {}
        if per_layer and per_layer_embed is not None:
            optional["vocab_size_per_layer_input"] = per_layer_embed.rows
        return dict(
            layer_types=["sliding_attention" if s else "full_attention" for s in sliding], sliding_window=window,
            head_dim=head_dim, num_key_value_heads=kv[sliding.index(True)] if any(sliding) else kv[-1],
            per_layer_config={i: {"head_dim": global_head_dim, "num_key_value_heads": kv[i]} for i in global_layers},
            attention_k_eq_v=value_from_key, num_kv_shared_layers=shared,
            use_double_wide_mlp=bool(shared) and all(doubled), intermediate_size=widths[0],
            hidden_size_per_layer_input=per_layer, final_logit_softcapping=float(softcap) if softcap else None,
            rope_parameters=rope, **optional)

    def _rope(self) -> dict[str, Any]:
        theta = float(self._arch_value("rope.freq_base", 10000.0))
        kind = self._arch_value("rope.scaling.type")
        if kind in (None, "none"):
            return {"rope_type": "default", "rope_theta": theta}
        if kind == "linear":
            return {"rope_type": "linear", "rope_theta": theta, "factor": float(self._arch_value("rope.scaling.factor"))}
        if kind == "yarn":
            return self._yarn(theta)
        raise ValueError(f"{self.path.name}: rope scaling {kind!r} is not supported for GGUF files; supported: none, "
                         "linear, yarn")

    def _yarn(self, theta: float) -> dict[str, Any]:
        """YaRN as transformers' `yarn` rope, which is llama.cpp's at its defaults: the file's factor and
        pretraining context, and its beta_fast / beta_slow where stated. A file that moves what transformers
        has no setting for (an extrapolation or attention factor other than 1, a log multiplier) is refused."""
        defaults = {"yarn_ext_factor": 1.0, "yarn_attn_factor": 1.0, "yarn_log_multiplier": 0.0}
        for key, default in defaults.items():
            value = self._arch_value(f"rope.scaling.{key}")
            if value is not None and float(value) != default:
                raise ValueError(f"{self.path.name}: YaRN with {self.arch}.rope.scaling.{key} = {value} is not "
                                 f"supported (only {default})")
        original = int(self._arch_value("rope.scaling.original_context_length", 0) or 0)
        if not original:
            raise ValueError(f"{self.path.name}: YaRN without {self.arch}.rope.scaling.original_context_length")
        rope: dict[str, Any] = {"rope_type": "yarn", "rope_theta": theta, "original_max_position_embeddings": original,
                                "factor": float(self._arch_value("rope.scaling.factor"))}
        for key in ("beta_fast", "beta_slow"):
            if (value := self._arch_value(f"rope.scaling.yarn_{key}")) is not None:
                rope[key] = float(value)
        return rope

    @cached_property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The tokens a reply ends at, as llama.cpp ends it: the end-of-sequence, end-of-turn and end-of-message
        tokens the metadata names, and the vocabulary's tokens of `_END_OF_GENERATION`'s texts."""
        ids = [self._value(f"tokenizer.ggml.{key}") for key in ("eos_token_id", "eot_token_id", "eom_token_id")]
        found = self.contents.string_positions("tokenizer.ggml.tokens", _END_OF_GENERATION)
        if "<|end|>" in found and ("<|return|>" in found or "<|flush|>" in found) and (
                "<|call|>" in found or "<|calls|>" in found):
            del found["<|end|>"]
        if "</s>" in found and "<|tool_response>" in found:
            del found["</s>"]
        return tuple(dict.fromkeys(int(i) for i in [*ids, *sorted(found.values())] if i is not None))

    def spec(self) -> ModelSpec:
        spec = ModelSpec.from_hf_config(self.hf_config, self.eos_token_ids)
        if self.arch == "granitehybrid":  # the converter writes the shared MLP's gate and up rows apart
            spec = dataclasses.replace(spec, checkpoint=dataclasses.replace(spec.checkpoint, fused_gate_up=False))
        if self.arch == "qwen3next" and not self.fused_delta_projections:
            spec = dataclasses.replace(spec, layers=tuple(
                layer if layer.delta_net is None else dataclasses.replace(
                    layer, delta_net=dataclasses.replace(layer.delta_net, fused_projections=False))
                for layer in spec.layers))
        if any(layer.mlp is not None and layer.mlp.is_moe for layer in spec.layers):
            # a MoE file's experts are named once split (blk.N.ffn_gate_exps.E -> mlp.experts.E.gate_proj), and its
            # router (ffn_gate_inp -> mlp.gate), whatever the family's checkpoints call them (Mixtral's are
            # block_sparse_moe.experts.E.w1; gpt-oss stacks and interleaves its experts and names its router `router`)
            layout = dataclasses.replace(spec.checkpoint, mlp_name="mlp", router_name="gate", experts="per_expert")
            spec = dataclasses.replace(spec, checkpoint=layout)
        if self.rope_factors is not None:
            spec = dataclasses.replace(spec, layers=tuple(self._with_rope_factors(layer, spec) for layer in spec.layers))
        return dataclasses.replace(spec, norm_style="fp32_weight") if self.arch in _SHIFTED_NORMS else spec

    def _with_rope_factors(self, layer: LayerSpec, spec: ModelSpec) -> LayerSpec:
        """`layer` with its rope's frequencies divided by the file's factors (`rope_factors`)."""
        attention = layer.attention
        if attention is None or attention.rope is None:
            return layer
        head_dim = spec.head_dim_of(attention)
        plain = inv_frequencies(head_dim, attention.rope)
        factors = torch.tensor(self.rope_factors, dtype=torch.float32)
        if factors.numel() != plain.numel():
            raise ValueError(f"{self.path.name}: tensor {_ROPE_FACTORS} has {factors.numel()} factors for "
                             f"{plain.numel()} rotation pairs")
        rope = dataclasses.replace(attention.rope, frequencies=tuple((plain / factors).tolist()))
        return dataclasses.replace(layer, attention=dataclasses.replace(attention, rope=rope))

    def hf_name(self, name: str) -> str:
        """The HF checkpoint name of a GGUF tensor name (unknown names come back as they are)."""
        block = _BLOCK_NAME.match(name)
        whole = _WHOLE_LAYER_TENSORS_OF.get(self.arch, {})
        layers = _LAYER_PREFIX_OF.get(self.arch, "model.layers")
        if block and block.group(2) in whole:
            return f"{layers}.{block.group(1)}.{whole[block.group(2)]}"
        base, dot, leaf = name.rpartition(".")
        if base.startswith("blk."):
            _, index, kind = base.split(".", 2)
            layer_tensors = _LAYER_TENSORS_OF.get(self.arch, _LAYER_TENSORS)
            if kind in layer_tensors:
                return f"{layers}.{index}.{layer_tensors[kind]}{dot}{leaf}"
            part = _EXPERT_PART.match(kind)
            if part and self.arch == "gemma4":  # experts beside the MLP (`_experts_beside_per_expert`)
                return f"{layers}.{index}.experts.{part.group(2)}.{part.group(1)}_proj"
            if part:
                mlp = _MLP_NAME_OF.get(self.arch, "mlp")
                return f"{layers}.{index}.{mlp}.experts.{part.group(2)}.{part.group(1)}_proj{dot}{leaf}"
        elif base in _MODEL_TENSORS_OF.get(self.arch, _MODEL_TENSORS):
            return f"{_MODEL_TENSORS_OF.get(self.arch, _MODEL_TENSORS)[base]}{dot}{leaf}"
        return name

    def rows(self, tensor: GGUFTensor, spec: ModelSpec) -> np.ndarray:
        """The tensor's rows in the HF order: q/k of a permuted architecture un-permuted, a DeltaNet's
        value heads regrouped."""
        value_rows = self._value_head_rows(tensor, spec)
        if value_rows is not None:
            return tensor.data[value_rows]
        heads = self._permuted_heads(tensor.name, spec)
        if heads is None:
            return tensor.data
        # stored row (h, j, i) holds HF row (h, i, j): h the head, i the rotary half, j the index in it
        order = np.arange(tensor.rows).reshape(heads, tensor.rows // heads // 2, 2).swapaxes(1, 2).reshape(-1)
        return tensor.data[order]

    def _value_head_rows(self, tensor: GGUFTensor, spec: ModelSpec) -> np.ndarray | None:
        """Where a Qwen3.5 DeltaNet tensor's HF rows are in the file, or None for any other tensor. With
        more value heads than key heads, the converter tiles the value heads (the first of every key
        head's group, then the second, ...) where transformers groups them by key head."""
        kind = _BLOCK_NAME.match(tensor.name)
        if self.arch not in _QWEN35 or kind is None:
            return None
        layer = spec.layers[int(kind.group(1))] if int(kind.group(1)) < spec.num_layers else None
        d = layer.delta_net if layer is not None else None
        per_row = {"attn_qkv.weight": d.value_head_dim, "attn_gate.weight": d.value_head_dim,
                   "ssm_conv1d.weight": d.value_head_dim, "ssm_alpha.weight": 1, "ssm_beta.weight": 1,
                   "ssm_a": 1, "ssm_dt.bias": 1}.get(kind.group(2)) if d is not None else None
        if d is None or per_row is None:
            return None
        value_rows = d.num_value_heads * per_row
        lead = tensor.rows - value_rows  # q and k rows (in_proj_qkv, conv1d) come first, in order
        tiled = np.arange(value_rows).reshape(d.num_value_heads // d.num_key_heads, d.num_key_heads, per_row)
        return np.concatenate([np.arange(lead), lead + tiled.swapaxes(0, 1).reshape(-1)])

    def value_columns(self, tensor: GGUFTensor, spec: ModelSpec) -> np.ndarray | None:
        """Where a Qwen3.5 DeltaNet out_proj's HF columns are in the file (its inputs are the value
        heads, tiled as `_value_head_rows` says), or None for any other tensor. Dequantized, its columns
        are put in order; kept in its blocks, which run along those columns, it takes its inputs
        reordered instead (`GatedDeltaNet.out_proj_inputs`)."""
        kind = _BLOCK_NAME.match(tensor.name)
        if self.arch not in _QWEN35 or kind is None or kind.group(2) != "ssm_out.weight":
            return None
        d = spec.layers[int(kind.group(1))].delta_net
        assert d is not None, "ssm_out is a DeltaNet layer's"
        tiled = np.arange(tensor.cols).reshape(d.num_value_heads // d.num_key_heads, d.num_key_heads, d.value_head_dim)
        return tiled.swapaxes(0, 1).reshape(-1)

    def _permuted_heads(self, name: str, spec: ModelSpec) -> int | None:
        if self.arch not in _PERMUTED_QK:
            return None
        if name.endswith((".attn_q.weight", ".attn_q.bias")):
            return spec.num_heads
        if name.endswith((".attn_k.weight", ".attn_k.bias")):
            return spec.num_kv_heads
        return None

    def type_counts(self) -> str:
        counts = Counter(t.type_name for t in self.tensors.values())
        return ", ".join(f"{name} x{n}" for name, n in counts.most_common())


def _float_vector(path: Path, tensor: GGUFTensor) -> list[float]:
    """A vector of rope factors: floats, every one positive and finite."""
    import gguf

    if tensor.type_name not in FLOAT_TYPES or tensor.cols:
        raise ValueError(f"{path.name}: tensor {tensor.name} is a {tensor.type_name} matrix; llama.cpp reads a "
                         "vector of floats")
    values = gguf.quants.dequantize(tensor.data, gguf.GGMLQuantizationType[tensor.type_name]).astype(np.float32)
    if not (np.isfinite(values).all() and (values > 0).all()):
        raise ValueError(f"{path.name}: tensor {tensor.name} holds a factor that is not a positive finite number")
    return [float(v) for v in values]


def load_gguf_spec(path: str | Path) -> ModelSpec:
    return GGUFFile(path).spec()


def load_gguf_model(path: str | Path, dtype: torch.dtype, device: torch.device, keep_quantized: bool,
                    load_format: str = "auto", activations: str = "int8",
                    sliding_window_kv: str = "all") -> tuple[CausalLM, ModelSpec]:
    """The model of a GGUF file: with `keep_quantized` (no dtype was asked for), its quantized
    tensors as they are where the device and kernels run them (`serves_quantized`), taking
    `activations` inputs ("int8" or "float32", ggml_quants.ACTIVATIONS), else every tensor
    dequantized into `dtype` parameters. load_format "dummy" fills the file's shapes with seeded
    random weights instead. `sliding_window_kv`: as `loader.load_model`'s."""
    from radixserve.model.loader import fill_dummy_weights

    file = GGUFFile(path)  # refuses a file we cannot serve before anything is built or loaded
    spec = file.spec().with_sliding_window_kv(sliding_window_kv)
    quantized = keep_quantized and serves_quantized("auto", device)
    model = CausalLM(spec, dtype, device)
    if load_format == "dummy":
        fill_dummy_weights(model)
        how = "random weights of its shapes (--load-format dummy)"
    elif load_format == "auto":
        how = _how(_fill(model, file, quantized, activations), file, dtype, activations)
    else:
        raise ValueError(f"unknown load_format {load_format!r}; choose auto or dummy")
    model.eval()
    log.info("weights: %s %s, %d MB", file.path.name, how, round(_weight_bytes(model) / 1e6))
    return model, spec


def _weight_bytes(model: CausalLM) -> int:
    """The bytes the weights take: the parameters and the experts kept in the file's blocks (`GgmlExperts`)."""
    from radixserve.kernels.moe import GgmlExperts

    size = sum(p.numel() * p.element_size() for p in model.parameters())
    for moe in model.modules():
        if isinstance(moe, MoE) and isinstance(moe.packed, GgmlExperts):
            tensors = [*moe.packed.gate_up, *moe.packed.down, moe.packed.gate_up_bias, moe.packed.down_bias]
            size += sum(t.numel() * t.element_size() for t in tensors if t is not None)
    return size


def _how(kept: int, file: GGUFFile, dtype: torch.dtype, activations: str) -> str:
    """How the weights run, for the one log line: kept = GGUF-quantized tensors served as they are."""
    quantized = sum(t.quantized for t in file.tensors.values())
    name, counts = str(dtype).removeprefix("torch."), file.type_counts()
    if quantized and kept == quantized:
        return f"served as shipped ({counts}; {activations} activations)"
    if kept:
        return (f"served as shipped ({activations} activations) but {quantized - kept} quantized tensors "
                f"dequantized to {name} ({counts})")
    return f"dequantized to {name} ({counts})" if quantized else f"loaded as {name} ({counts})"


@torch.no_grad()
def _fill(model: CausalLM, file: GGUFFile, quantized: bool, activations: str) -> int:
    """Fill every parameter from the file; returns how many GGUF tensors stayed quantized."""
    from radixserve.model.loader import Target, checkpoint_targets

    spec = model.spec
    targets = _experts_beside_per_expert(checkpoint_targets(model), spec)
    if spec.tie_word_embeddings:
        targets.pop("lm_head.weight", None)
    by_param: dict[str, list[tuple[Target, GGUFTensor]]] = {}
    unexpected: list[str] = []
    for tensor in file.tensors.values():
        target = targets.pop(file.hf_name(tensor.name), None)
        if target is None:
            unexpected.append(tensor.name)
            continue
        by_param.setdefault(target.param, []).append((target, tensor))
    if unexpected:
        raise ValueError(f"{file.path.name} has {len(unexpected)} tensors this architecture does not use: "
                         f"{', '.join(sorted(unexpected)[:8])}")
    if targets:
        raise ValueError(f"{file.path.name} lacks {len(targets)} tensors: {', '.join(sorted(targets)[:8])}")
    params = dict(model.named_parameters())
    kept_modules: dict[str, list[tuple[Target, GGUFTensor]]] = {}
    kept_experts: dict[str, dict[str, list[tuple[Target, GGUFTensor]]]] = {}
    if quantized:  # a MoE layer's experts stay in their blocks when both projections' are quantized
        for module in {m.rpartition(".")[0] for m in by_param if m.endswith((".gate_up", ".down"))}:
            leaves = {leaf: by_param.get(f"{module}.{leaf}", []) for leaf in ("gate_up", "down")}
            if (isinstance(model.get_submodule(module), MoE)
                    and all(parts and all(t.quantized for _, t in parts) for parts in leaves.values())):
                kept_experts[module] = leaves
    for param, parts in by_param.items():
        module, _, leaf = param.rpartition(".")
        if module in kept_experts and leaf in ("gate_up", "down"):
            continue
        if quantized and leaf == "weight" and all(t.quantized for _, t in parts) and _quantizable(model, module):
            kept_modules[module] = sorted(parts, key=lambda p: p[0].first_row)
            continue
        for target, tensor in parts:
            _fill_dequantized(params[param], target, file, tensor, spec)
    # biases (and every float tensor) are in place before the quantized modules take them over
    kept = 0
    for module, parts in kept_modules.items():
        swapped = _swap_quantized(model, file, module, parts, activations)
        kept += swapped
        columns = file.value_columns(parts[0][1], spec)
        if swapped and columns is not None:  # the blocks keep the file's columns: the layer reorders out_proj's inputs
            owner = model.get_submodule(module.rpartition(".")[0])
            assert isinstance(owner, GatedDeltaNet), "value_columns names a DeltaNet's out_proj"
            owner.out_proj_inputs = torch.from_numpy(np.argsort(columns)).to(owner.A_log.device)
    for module, by_leaf in kept_experts.items():
        moe = model.get_submodule(module)
        assert isinstance(moe, MoE), "kept_experts holds MoE layers only"
        kept += _keep_experts(moe, file, by_leaf, activations)
    return kept


def _experts_beside_per_expert(targets: dict[str, Any], spec: ModelSpec) -> dict[str, Any]:
    """`targets` with the stacked experts beside a layer's MLP (Gemma 4's `experts.gate_up_proj`, `down_proj`) named
    per expert, `experts.E.gate_up_proj`, as the file's stacked tensors are split at load."""
    out = {}
    for name, target in targets.items():
        layer = _LAYER_NAME.match(name)
        beside = spec.layers[int(layer.group(1))].experts_beside if layer else None
        if beside is None or not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[name] = target
            continue
        stem, _, leaf = name.rpartition(".")
        out.update({f"{stem}.{e}.{leaf}": dataclasses.replace(target, expert=e) for e in range(beside.num_experts)})
    return out


def _keep_experts(moe: MoE, file: GGUFFile, by_leaf: dict[str, list[tuple[Any, GGUFTensor]]], activations: str) -> int:
    """A MoE layer's experts kept in the file's blocks (`GgmlExperts`), one packed gate/up and down per
    expert, the stacked parameters dropped; returns the tensors kept."""
    from radixserve.kernels.ggml_quants import pack_ggml
    from radixserve.kernels.moe import GgmlExperts

    stacked = {leaf: getattr(moe, leaf) for leaf in ("gate_up", "down")}
    packed: dict[str, list[torch.Tensor]] = {}
    for leaf, parts in by_leaf.items():
        width = stacked[leaf].shape[2]
        per_expert: dict[int, list[tuple[Any, GGUFTensor]]] = {}
        for target, tensor in parts:
            per_expert.setdefault(target.expert, []).append((target, tensor))
        try:
            packed[leaf] = [pack_ggml([(t.type_name, t.data) for _, t in sorted(per_expert[e], key=lambda p: p[0].first_row)],
                                      width, activations) for e in range(len(per_expert))]
        except ValueError as err:  # a layout the kernel cannot pack (rows not in whole tiles): dequantize
            log.info("experts stay dequantized: %s", err)
            spec = file.spec()
            for each_leaf, each_parts in by_leaf.items():
                for target, tensor in each_parts:
                    _fill_dequantized(stacked[each_leaf], target, file, tensor, spec)
            return 0
    biases = [None if b is None else b.detach().float().contiguous() for b in (moe.gate_up_bias, moe.down_bias)]
    moe.packed = GgmlExperts(packed["gate_up"], packed["down"], stacked["gate_up"].shape[1], stacked["down"].shape[1],
                             *biases)
    for name in ("gate_up", "down", "gate_up_bias", "down_bias"):  # the packed experts hold them from now on
        if isinstance(getattr(moe, name), nn.Parameter):
            moe.register_parameter(name, None)
    return sum(len(parts) for parts in by_leaf.values())


def _fill_dequantized(param: torch.Tensor, target: Any, file: GGUFFile, tensor: GGUFTensor, spec: ModelSpec) -> None:
    """Copy `tensor`, dequantized, into its place in `param`: its expert's slice, its rows."""
    dest = param if target.expert is None else param[target.expert]
    if target.rows is not None:
        dest = dest.narrow(0, target.first_row, target.rows)
    values = _dequantized(file, tensor, spec)
    if _squeezed(values.shape) == _squeezed(dest.shape):  # the converter drops size-1 dimensions (a conv's [C, 1, K])
        values = values.reshape(dest.shape)
    if tuple(values.shape) != tuple(dest.shape):
        raise ValueError(f"{file.path.name}: tensor {tensor.name} has shape {tuple(values.shape)}, "
                         f"the metadata implies {tuple(dest.shape)}")
    dest.copy_(values)


def _squeezed(shape: torch.Size) -> tuple[int, ...]:
    return tuple(n for n in shape if n != 1)


def _quantizable(model: CausalLM, module: str) -> bool:
    return isinstance(model.get_submodule(module), nn.Linear | nn.Embedding)


def _dequantized(file: GGUFFile, tensor: GGUFTensor, spec: ModelSpec) -> torch.Tensor:
    import gguf

    values = gguf.quants.dequantize(file.rows(tensor, spec), gguf.GGMLQuantizationType[tensor.type_name])
    values = np.ascontiguousarray(file.hf_values(tensor, values, spec), dtype=np.float32)
    return torch.from_numpy(values if values.flags.writeable else values.copy())  # F32 comes back as the file's map


def _swap_quantized(model: CausalLM, file: GGUFFile, name: str, parts: list[tuple[Any, GGUFTensor]],
                    activations: str) -> int:
    """Replace module `name` by its quantized form over the parts' bytes; returns the tensors kept."""
    from radixserve.kernels.ggml_quants import QuantizedEmbedding, QuantizedLinear, pack_ggml

    old = model.get_submodule(name)
    spec = model.spec
    shapes = {t.cols for _, t in parts}
    if isinstance(old, nn.Embedding):
        in_features, out_features, bias = old.embedding_dim, old.num_embeddings, None
    else:
        assert isinstance(old, nn.Linear), "_quantizable"
        in_features, out_features, bias = old.in_features, old.out_features, old.bias
    rows = sum(t.rows for _, t in parts)
    if shapes != {in_features} or rows != out_features:
        raise ValueError(f"{file.path.name}: tensors {', '.join(t.name for _, t in parts)} hold {rows} x "
                         f"{sorted(shapes)}, the metadata implies {out_features} x {in_features}")
    try:
        packed = pack_ggml([(t.type_name, file.rows(t, spec)) for _, t in parts], in_features, activations)
    except ValueError as err:  # a layout the kernel cannot pack (e.g. a fused part of odd rows): dequantize it
        log.info("%s stays dequantized: %s", name, err)
        weight = torch.cat([_dequantized(file, t, spec) for _, t in parts])
        old.weight.copy_(weight)
        return 0
    new: nn.Module
    if isinstance(old, nn.Embedding):
        new = QuantizedEmbedding(packed, out_features, in_features)
    else:
        new = QuantizedLinear(packed, out_features, in_features, bias)
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)
    if isinstance(new, QuantizedEmbedding) and model.lm_head is None:
        # a tied head reads the embedding's packed buffer: one copy of the bytes serves both
        model.lm_head = QuantizedLinear(new.weight, out_features, in_features)
    return len(parts)


def load_gguf_tokenizer(path: str | Path) -> Any:
    """The file's tokenizer (transformers' conversion of its metadata), converted once and cached."""
    from radixserve.model.loader import load_tokenizer

    gguf_path = Path(path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"model file {str(gguf_path)!r} does not exist")
    root, stat = cache_root(), gguf_path.stat()
    key = f"{gguf_path.stem.lower()}-{stat.st_size}-{stat.st_mtime_ns}-v{TOKENIZER_CACHE_FORMAT}"
    target = root / f"gguf-tokenizer-{key}"
    if not (target / "tokenizer_config.json").is_file():
        _convert_tokenizer(gguf_path, root, target)
    return load_tokenizer(target)


def _convert_tokenizer(gguf_path: Path, root: Path, target: Path) -> None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        try:
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        except Exception as err:  # transformers' converter fails in many ways on metadata it does not know
            try:  # the generic class reads only the tokenizer's metadata (transformers 5.24 misreads a gpt-oss
                # file's rope scaling while choosing the model's own class)
                tokenizer = PreTrainedTokenizerFast.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
            except Exception:
                raise ValueError(f"{gguf_path.name}: cannot build its tokenizer from the GGUF metadata: {err}") from None
        tokenizer.save_pretrained(tmp)
        _keep_as_converted(tokenizer, tmp, gguf_path.name)
        if target.exists():  # damaged by hand: never trust a partial directory
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "tokenizer_config.json").is_file():  # not a lost race with another process
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _keep_as_converted(tokenizer: Any, directory: Path, name: str) -> None:
    """Make the tokenizer saved in `directory` load as the converted one splits text. A model-specific
    class may rebuild its own pipeline on load and drop the file's (Gemma's class over a byte-level
    vocabulary turns every space into <unk>); the generic fast class then reads tokenizer.json as saved."""
    from transformers import AutoTokenizer

    want = tokenizer(_TOKENIZER_PROBE).input_ids
    if AutoTokenizer.from_pretrained(directory, local_files_only=True)(_TOKENIZER_PROBE).input_ids == want:
        return
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False))
    if AutoTokenizer.from_pretrained(directory, local_files_only=True)(_TOKENIZER_PROBE).input_ids != want:
        raise ValueError(f"{name}: its tokenizer, converted from the GGUF metadata, does not split text the same "
                         "once saved")
