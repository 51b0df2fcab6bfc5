"""Tiny GGUF files written in the test process, laid out as llama.cpp's converter writes them.

A file holds a tiny decoder of one GGUF architecture (llama, qwen2, qwen3, qwen3moe, gemma2, gemma3, phi3,
lfm2, qwen35, qwen35moe; gpt-oss, Mixtral, LFM2-MoE, Qwen3-Next, Nemotron-H, Granite 4, OLMo 2 / 3, SmolLM3,
Granite 3, Falcon-H1, GLM-4 and GLM-4-0414 by `write_gpt_oss_gguf`, `write_mixtral_gguf`,
`write_lfm2_moe_gguf`, `write_qwen3_next_gguf`, `write_nemotron_h_gguf`, `write_granite_hybrid_gguf`,
`write_olmo_gguf`, `write_llama_like_gguf`, `write_falcon_h1_gguf`, `write_glm_gguf` and `write_gemma4_gguf`
(Gemma 4 dense and MoE, with a Gemma 4 vocabulary), from the transformers model they return), its tensors
in the GGUF types a test asks for, and a small byte-level BPE tokenizer with a ChatML template in its metadata
(262 tokens: a tokenizer of a real vocabulary would cost seconds per file to convert). Float weights are drawn
seeded and quantized with `gguf.quants.quantize` where gguf implements the type (Q4_0, Q4_1, Q8_0, the float
types); the K-quants, which it cannot quantize, get random blocks with small fp16 scales, so their values stay
in a model's range. Llama's q/k rows are stored permuted as the converter permutes them (pairs of a head's
halves interleaved); the others' rows are not. Norm weights are drawn near 1, which for Gemma and Qwen3.5 is
what the converter writes (1 + w).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType

HIDDEN = 256  # the K-quants' block: every input width is a multiple of it
INTERMEDIATE = 512
LAYERS = 2
# (heads, kv heads) by architecture: transformers reads no head size from a qwen3 file and takes its
# config default, 128, so the tiny qwen3 has heads of 128
HEADS = {"llama": (4, 2), "qwen2": (4, 2), "qwen3": (2, 1), "qwen3moe": (2, 1), "gemma2": (1, 1), "gemma3": (1, 1),
         "phi3": (4, 2), "lfm2": (4, 2), "qwen35": (4, 2), "qwen35moe": (4, 2)}
# Qwen3-MoE: every layer's MLP 4 experts, 2 per token, each as wide as transformers' default (it reads no
# expert width from the file)
EXPERTS, EXPERTS_PER_TOKEN, EXPERT_WIDTH = 4, 2, 768
# LFM2: which layers attend (the others are gated short convolutions of LFM2_TAPS taps), as the file
# says it, a kv head count per layer
LFM2_ATTENDS = (False, True, False)
LFM2_TAPS = 3
# Qwen3.5: three Gated DeltaNet layers to one full attention layer, then the multi-token-prediction block the
# converter writes as one more (the server skips it); DeltaNet heads: 2 key heads of 32, 6 value heads of
# 32 (three per key head, which the converter tiles: a reorder that is not its own inverse), a 4-tap
# convolution; a quarter of each attention head turned
QWEN35_LAYERS, QWEN35_INTERVAL = 4, 4
DELTA_KEY_HEADS, DELTA_VALUE_HEADS, DELTA_HEAD, DELTA_TAPS = 2, 6, 32, 4
QWEN35 = ("qwen35", "qwen35moe")
# Qwen3.5-MoE: 4 routed experts of 256 (2 per token) and a shared one of 256 in every layer
QWEN35_EXPERT_WIDTH = 256
# Gemma: enough layers that llama.cpp's pattern (Gemma 2: every other layer sliding; Gemma 3: 5 sliding, 1
# global) has both kinds and a sliding layer after a global one, and a window the tests' prompts cross;
# transformers reads no query scale from the file and takes its default, 256, which llama.cpp's rule
# (head_dim) gives for heads of 256; nor Gemma 2's softcaps, whose defaults the file states
LAYERS_OF = {"gemma2": 3, "gemma3": 7, "lfm2": 3, "qwen35": QWEN35_LAYERS + 1, "qwen35moe": QWEN35_LAYERS + 1}
GEMMA_WINDOW = 8
GEMMA = ("gemma2", "gemma3")
CONTEXT = 512
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_ID = 2
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_MERGES = ("Ġ t", "h e", "Ġt he", "Ġ a", "i n", "e r")


@dataclass(frozen=True)
class TinyGGUF:
    """What to write: the architecture, each tensor kind's GGUF type (by the GGUF name's last part,
    e.g. "attn_q"; `types_by_layer` overrides one layer's), whether the LM head is tied."""

    arch: str = "llama"
    types: dict[str, str] = field(default_factory=dict)
    types_by_layer: dict[tuple[int, str], str] = field(default_factory=dict)
    tied: bool = True
    seed: int = 0
    extra_vectors: tuple[tuple[str, int], ...] = ()  # (name, length): F32 tensors beyond the model's
    # Llama 3.1's rope scaling (transformers' rope_parameters of type llama3), written as the converter
    # bakes it: a rope_freqs vector of per-frequency divisors
    llama3_rope: dict[str, float] | None = None
    # Phi-3: the rotated dimensions of a head (None: all), a sliding window (0: none, as Phi-4's files say),
    # and LongRoPE's long and short factors with the pretraining context they extend and the attention factor
    rotary_dims: int | None = None
    window: int = 0
    longrope: tuple[list[float], list[float], int, float] | None = None
    # `{arch}.rope.scaling.KEY` values (YaRN's: type, factor, original_context_length, ...)
    rope_scaling: tuple[tuple[str, str | int | float], ...] = ()

    def type_of(self, layer: int | None, kind: str) -> str:
        if layer is not None and (layer, kind) in self.types_by_layer:
            return self.types_by_layer[(layer, kind)]
        return self.types.get(kind, "F32" if kind.endswith(("norm", "bias")) else "Q8_0")


def byte_tokens() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (what a byte-level BPE vocabulary holds)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def vocabulary() -> list[str]:
    return list(SPECIALS) + byte_tokens() + ["".join(m.split()) for m in _MERGES]


# Gemma's tokenizers are sentencepiece ("llama" in GGUF) with byte fallback, <unk> and <bos> first
GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>")
GEMMA_PIECES = ("\u2581", "t", "h", "e", "a", "c", "i", "n", "r", "\u2581t", "he", "\u2581the", "\u2581a", "in")
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


# Gemma 4's: its own markers of a turn and of a tool's response (a tool call's end, for llama.cpp), its merges
# written (the converter writes them), its template's turns of `<|turn>` and `<turn|>`
GEMMA4_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>", "<|tool_response>",
                   "<tool_response|>")
GEMMA_MERGES = ("\u2581 t", "h e", "\u2581t he", "\u2581 a", "i n")
GEMMA4_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)


def gemma_vocabulary(arch: str = "gemma3") -> tuple[list[str], list[int]]:
    """Tokens and their GGUF types (3 control, 6 byte, 1 normal) of a tiny Gemma-style vocabulary."""
    specials = GEMMA4_SPECIALS if arch == "gemma4" else GEMMA_SPECIALS
    tokens = list(specials) + [f"<0x{b:02X}>" for b in range(256)] + list(GEMMA_PIECES)
    return tokens, [3] * len(specials) + [6] * 256 + [1] * len(GEMMA_PIECES)


def vocabulary_size(arch: str) -> int:
    return len(gemma_vocabulary(arch)[0]) if arch in (*GEMMA, "gemma4") else len(vocabulary())


def _write_tokenizer(writer: gguf.GGUFWriter, arch: str) -> int:
    """The file's tokenizer and chat template; returns the vocabulary size."""
    if arch in (*GEMMA, "gemma4"):
        tokens, types = gemma_vocabulary(arch)
        writer.add_tokenizer_model("gemma4" if arch == "gemma4" else "llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores([-float(i) for i in range(len(tokens))])
        writer.add_token_types(types)
        if arch == "gemma4":
            writer.add_token_merges(list(GEMMA_MERGES))
        writer.add_bos_token_id(2)
        writer.add_eos_token_id(1)
        writer.add_unk_token_id(3)
        writer.add_pad_token_id(0)
        writer.add_add_bos_token(True)
        writer.add_chat_template(GEMMA4_TEMPLATE if arch == "gemma4" else GEMMA_TEMPLATE)
        return len(tokens)
    tokens = vocabulary()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    writer.add_token_merges(list(_MERGES))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(EOS_ID)
    writer.add_pad_token_id(EOS_ID)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    return len(tokens)


def write_tiny_gguf(path: Path, spec: TinyGGUF) -> Path:
    rng = np.random.default_rng(spec.seed)
    heads, kv_heads = HEADS.get(spec.arch, (4, 2))
    head_dim = HIDDEN // heads
    writer = gguf.GGUFWriter(str(path), spec.arch)
    vocab = _write_tokenizer(writer, spec.arch)
    layers = LAYERS_OF.get(spec.arch, LAYERS)
    writer.add_name(f"tiny-{spec.arch}")
    writer.add_block_count(layers)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(heads)
    if spec.arch == "qwen35moe":
        writer.add_expert_count(EXPERTS)
        writer.add_expert_used_count(EXPERTS_PER_TOKEN)
        writer.add_expert_feed_forward_length(QWEN35_EXPERT_WIDTH)
        writer.add_expert_shared_feed_forward_length(QWEN35_EXPERT_WIDTH)
    if spec.arch in QWEN35:
        writer.add_full_attention_interval(QWEN35_INTERVAL)
        writer.add_nextn_predict_layers(1)
        writer.add_ssm_conv_kernel(DELTA_TAPS)
        writer.add_ssm_state_size(DELTA_HEAD)
        writer.add_ssm_group_count(DELTA_KEY_HEADS)
        writer.add_ssm_time_step_rank(DELTA_VALUE_HEADS)
        writer.add_ssm_inner_size(DELTA_VALUE_HEADS * DELTA_HEAD)
        writer.add_rope_dimension_count(head_dim // 4)
        writer.add_rope_dimension_sections([3, 3, 2, 0])
    if spec.arch == "lfm2":
        writer.add_head_count_kv([kv_heads if attends else 0 for attends in LFM2_ATTENDS])
        writer.add_shortconv_l_cache(LFM2_TAPS)
    else:
        writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    for key, value in spec.rope_scaling:
        name = f"{spec.arch}.rope.scaling.{key}"
        if isinstance(value, str):
            writer.add_string(name, value)
        elif isinstance(value, int):
            writer.add_uint32(name, value)
        else:
            writer.add_float32(name, value)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    if spec.arch == "qwen3moe":
        writer.add_expert_count(EXPERTS)
        writer.add_expert_used_count(EXPERTS_PER_TOKEN)
        writer.add_expert_feed_forward_length(EXPERT_WIDTH)
    if spec.arch in GEMMA:
        writer.add_sliding_window(GEMMA_WINDOW)
    if spec.arch == "gemma2":
        writer.add_attn_logit_softcapping(50.0)
        writer.add_final_logit_softcapping(30.0)
    if spec.arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    elif spec.arch == "phi3":  # as the converter writes Phi-3: no key length, the rotated width, the window
        writer.add_rope_dimension_count(spec.rotary_dims or head_dim)
        writer.add_sliding_window(spec.window)
        if spec.longrope is not None:
            writer.add_rope_scaling_orig_ctx_len(spec.longrope[2])
            writer.add_rope_scaling_attn_factors(spec.longrope[3])
    else:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)

    def add(name: str, layer: int | None, kind: str, rows: int, cols: int, scale: float = 0.08,
            heads: int | None = None, experts: int = 0) -> None:
        qtype = spec.type_of(layer, kind)
        if experts:  # stacked [experts, rows, cols], as the converter writes a MoE layer's experts
            writer.add_tensor(name, np.stack([_matrix(rng, QType[qtype], rows, cols, scale) for _ in range(experts)]),
                              raw_dtype=QType[qtype])
            return
        if cols == 0:  # a vector: a norm (near 1) or a bias
            values = (1.0 + 0.1 * rng.standard_normal(rows) if kind.endswith("norm")
                      else 0.05 * rng.standard_normal(rows)).astype(np.float32)
            writer.add_tensor(name, values if qtype == "F32" else gguf.quants.quantize(values, QType[qtype]),
                              raw_dtype=QType[qtype])
            return
        data = _matrix(rng, QType[qtype], rows, cols, scale)
        if heads is not None and spec.arch == "llama":
            data = data[llama_permutation(rows, heads)]
        writer.add_tensor(name, data, raw_dtype=QType[qtype])

    def feed_forward(b: str, i: int) -> None:
        if spec.arch not in QWEN35:  # whose norm before the MLP is its post_attention_norm
            add(b + "ffn_norm.weight", i, "ffn_norm", HIDDEN, 0)
        if spec.arch == "qwen35moe":  # routed experts beside a shared one, whose output a per-token gate scales
            add(b + "ffn_gate_inp.weight", i, "ffn_gate_inp", EXPERTS, HIDDEN, scale=0.5)
            for part, rows, cols in (("gate", QWEN35_EXPERT_WIDTH, HIDDEN), ("up", QWEN35_EXPERT_WIDTH, HIDDEN),
                                     ("down", HIDDEN, QWEN35_EXPERT_WIDTH)):
                add(b + f"ffn_{part}_exps.weight", i, f"ffn_{part}_exps", rows, cols, experts=EXPERTS)
                add(b + f"ffn_{part}_shexp.weight", i, f"ffn_{part}_shexp", rows, cols)
            writer.add_tensor(b + "ffn_gate_inp_shexp.weight", (0.5 * rng.standard_normal(HIDDEN)).astype(np.float32))
            return
        if spec.arch == "qwen3moe":
            add(b + "ffn_gate_inp.weight", i, "ffn_gate_inp", EXPERTS, HIDDEN, scale=0.5)
            add(b + "ffn_gate_exps.weight", i, "ffn_gate_exps", EXPERT_WIDTH, HIDDEN, experts=EXPERTS)
            add(b + "ffn_up_exps.weight", i, "ffn_up_exps", EXPERT_WIDTH, HIDDEN, experts=EXPERTS)
            add(b + "ffn_down_exps.weight", i, "ffn_down_exps", HIDDEN, EXPERT_WIDTH, experts=EXPERTS)
            return
        if spec.arch == "phi3":  # the gate's rows then up's, in one tensor
            add(b + "ffn_up.weight", i, "ffn_up", 2 * INTERMEDIATE, HIDDEN)
        else:
            add(b + "ffn_gate.weight", i, "ffn_gate", INTERMEDIATE, HIDDEN)
            add(b + "ffn_up.weight", i, "ffn_up", INTERMEDIATE, HIDDEN)
        add(b + "ffn_down.weight", i, "ffn_down", HIDDEN, INTERMEDIATE)

    # Gemma scales the embedding by sqrt(hidden): smaller rows keep a tied head from echoing the last token
    add("token_embd.weight", None, "token_embd", vocab, HIDDEN, scale=0.005 if spec.arch in GEMMA else 0.5)
    for i in range(layers):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", i, "attn_norm", HIDDEN, 0)
        if spec.arch in QWEN35 and i == QWEN35_LAYERS:  # the multi-token-prediction block: a few of its tensors
            add(b + "nextn.eh_proj.weight", i, "nextn.eh_proj", HIDDEN, 2 * HIDDEN)
            add(b + "nextn.enorm.weight", i, "nextn.enorm", HIDDEN, 0)
            continue
        if spec.arch in QWEN35 and (i + 1) % QWEN35_INTERVAL:  # a Gated DeltaNet layer, as the converter writes it
            conv = 2 * DELTA_KEY_HEADS * DELTA_HEAD + DELTA_VALUE_HEADS * DELTA_HEAD
            add(b + "attn_qkv.weight", i, "attn_qkv", conv, HIDDEN)
            add(b + "attn_gate.weight", i, "attn_gate", DELTA_VALUE_HEADS * DELTA_HEAD, HIDDEN)
            add(b + "ssm_alpha.weight", i, "ssm_alpha", DELTA_VALUE_HEADS, HIDDEN, scale=0.3)
            add(b + "ssm_beta.weight", i, "ssm_beta", DELTA_VALUE_HEADS, HIDDEN, scale=0.3)
            writer.add_tensor(b + "ssm_conv1d.weight", (0.3 * rng.standard_normal((conv, DELTA_TAPS))).astype(np.float32))
            writer.add_tensor(b + "ssm_dt.bias", rng.uniform(-1.0, 1.0, DELTA_VALUE_HEADS).astype(np.float32))
            writer.add_tensor(b + "ssm_a", -rng.uniform(0.2, 2.0, DELTA_VALUE_HEADS).astype(np.float32))  # -exp(A_log)
            add(b + "ssm_norm.weight", i, "ssm_norm", DELTA_HEAD, 0)
            add(b + "ssm_out.weight", i, "ssm_out", HIDDEN, DELTA_VALUE_HEADS * DELTA_HEAD)
            add(b + "post_attention_norm.weight", i, "post_attention_norm", HIDDEN, 0)
            feed_forward(b, i)
            continue
        if spec.arch == "lfm2" and not LFM2_ATTENDS[i]:  # a gated short convolution, its kernel [channels, taps]
            add(b + "shortconv.in_proj.weight", i, "shortconv.in_proj", 3 * HIDDEN, HIDDEN)
            writer.add_tensor(b + "shortconv.conv.weight",
                              (0.3 * rng.standard_normal((HIDDEN, LFM2_TAPS))).astype(np.float32))
            add(b + "shortconv.out_proj.weight", i, "shortconv.out_proj", HIDDEN, HIDDEN)
            feed_forward(b, i)
            continue
        if spec.arch == "phi3":  # q, k and v rows in one tensor
            add(b + "attn_qkv.weight", i, "attn_qkv", (heads + 2 * kv_heads) * head_dim, HIDDEN)
        elif spec.arch in QWEN35:  # each head's query and its output gate
            add(b + "attn_q.weight", i, "attn_q", 2 * heads * head_dim, HIDDEN)
            add(b + "attn_k.weight", i, "attn_k", kv_heads * head_dim, HIDDEN)
            add(b + "attn_v.weight", i, "attn_v", kv_heads * head_dim, HIDDEN)
        else:
            add(b + "attn_q.weight", i, "attn_q", heads * head_dim, HIDDEN, heads=heads)
            add(b + "attn_k.weight", i, "attn_k", kv_heads * head_dim, HIDDEN, heads=kv_heads)
            add(b + "attn_v.weight", i, "attn_v", kv_heads * head_dim, HIDDEN)
        if spec.arch == "qwen2":
            add(b + "attn_q.bias", i, "attn_q.bias", heads * head_dim, 0)
            add(b + "attn_k.bias", i, "attn_k.bias", kv_heads * head_dim, 0)
            add(b + "attn_v.bias", i, "attn_v.bias", kv_heads * head_dim, 0)
        if spec.arch in ("qwen3", "qwen3moe", "gemma3", "lfm2", *QWEN35):
            add(b + "attn_q_norm.weight", i, "attn_q_norm", head_dim, 0)
            add(b + "attn_k_norm.weight", i, "attn_k_norm", head_dim, 0)
        add(b + "attn_output.weight", i, "attn_output", HIDDEN, heads * head_dim)
        if spec.arch in GEMMA:  # Gemma's sandwich: a norm after attention and after the MLP too
            add(b + "post_attention_norm.weight", i, "post_attention_norm", HIDDEN, 0)
            add(b + "post_ffw_norm.weight", i, "post_ffw_norm", HIDDEN, 0)
        if spec.arch in QWEN35:  # its norm before the MLP
            add(b + "post_attention_norm.weight", i, "post_attention_norm", HIDDEN, 0)
        feed_forward(b, i)
    # LFM2's final norm is written as the embedding's
    add("token_embd_norm.weight" if spec.arch == "lfm2" else "output_norm.weight", None, "output_norm", HIDDEN, 0)
    if not spec.tied:
        add("output.weight", None, "output", vocab, HIDDEN, scale=0.5)
    if spec.longrope is not None:
        writer.add_tensor("rope_factors_long.weight", np.asarray(spec.longrope[0], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.asarray(spec.longrope[1], dtype=np.float32))
    if spec.llama3_rope is not None:
        writer.add_tensor("rope_freqs.weight", llama3_rope_divisors(spec.llama3_rope, head_dim))
    for name, length in spec.extra_vectors:
        writer.add_tensor(name, np.ones(length, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama3_rope_divisors(rope: dict[str, float], head_dim: int) -> np.ndarray:
    """What each rotation pair's frequency is divided by under Llama 3.1's scaling: 1 for wavelengths
    below the pretraining context / high_freq_factor, `factor` above context / low_freq_factor, and
    between them the divisor that blends 1/factor and 1 linearly in context / wavelength."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / head_dim
    wavelengths = 2 * np.pi * np.float32(rope["rope_theta"]) ** exponents
    context, low, high, factor = (rope["original_max_position_embeddings"], rope["low_freq_factor"],
                                  rope["high_freq_factor"], rope["factor"])
    blend = np.clip((context / wavelengths - low) / (high - low), 0.0, 1.0)
    divisors = 1 / ((1 - blend) / factor + blend)
    return divisors.astype(np.float32)


def llama_permutation(rows: int, heads: int) -> np.ndarray:
    """The HF row each stored row holds (the converter's permutation): stored row (h, j, i) holds HF
    row (h, i, j), h the head, i the half of the head and j the index in that half."""
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, 2, half).swapaxes(1, 2).reshape(-1)


# bytes per 256 values, where the fp16 super-block scales sit (offset, count), and the largest
# |value| per unit of d (scale bits times quant bits), which sizes d
_K_BLOCKS = {
    "Q4_K": (144, (0, 2), 63 * 15),
    "Q5_K": (176, (0, 2), 63 * 31),
    "Q6_K": (210, (208, 1), 128 * 32),
    "Q2_K": (84, (80, 2), 15 * 3),
}


def _matrix(rng: np.random.Generator, qtype: QType, rows: int, cols: int, scale: float) -> np.ndarray:
    if qtype.name in _K_BLOCKS:
        size, (offset, count), reach = _K_BLOCKS[qtype.name]
        blocks = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
        # d (and dmin) small enough that a value stays within a few times `scale`
        d = (rng.uniform(0.3, 1.0, size=(rows, cols // 256, count)) * 4 * scale / reach).astype(np.float16)
        blocks[:, :, offset:offset + 2 * count] = d.view(np.uint8)
        return blocks.reshape(rows, -1)
    values = (scale * rng.standard_normal((rows, cols))).astype(np.float32)
    return values if qtype == QType.F32 else gguf.quants.quantize(values, qtype)


# Files written from a transformers model (the families transformers' GGUF reader does not read): the model's
# weights, quantized into the file, are set back to the file's dequantized values, so the model is the oracle
# gpt-oss: 4 heads of 64 (2 kv heads), a sliding and a full layer, 4 experts of 64 (2 per token), YaRN
GPT_OSS_HEADS, GPT_OSS_KV_HEADS, GPT_OSS_EXPERT_WIDTH, GPT_OSS_WINDOW = 4, 2, 64, 8
GPT_OSS_ROPE = dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
                    original_max_position_embeddings=64)
# Mixtral: Llama's attention (q/k rows permuted in the file) and 4 experts of 128 (2 per token)
MIXTRAL_EXPERT_WIDTH = 128
# LFM2-MoE: a dense convolution layer, then an attention and a convolution layer with 4 experts of 64 each
LFM2_MOE_LAYERS, LFM2_MOE_EXPERT_WIDTH = ("conv", "full_attention", "conv"), 64
# Qwen3-Next: Qwen3.5's DeltaNet and attention layers, 4 experts of 64 (2 per token) and a shared one of 64
QWEN3_NEXT_EXPERT_WIDTH = 64
# Nemotron-H: one block per layer; Mamba2 mixers of 8 heads of 32 in 2 groups, state 16
NEMOTRON_H_LAYERS = ("linear_attention", "mlp", "full_attention", "mlp", "linear_attention")
MAMBA_HEADS, MAMBA_HEAD, MAMBA_GROUPS, MAMBA_STATE = 8, 32, 2, 16
NEMOTRON_H_EPS = 0.01  # far from any default, so that reading the file's matters
# Nemotron 3 (nemotron_h_moe): experts of 64 within a latent space of 64, beside a shared expert of 512
NEMOTRON_H_MOE_LAYERS = ("linear_attention", "moe", "full_attention", "moe", "linear_attention")
NEMOTRON_3_EXPERT_WIDTH, NEMOTRON_3_LATENT = 64, 64
# Granite 4: Mamba2 mixers (as Nemotron-H's) and an attention layer, each with the shared MLP of 96 (and, with
# experts, 4 experts of 64, 2 per token), no position embedding, Granite's multipliers
# Falcon-H1's muP multipliers, none 1, so that a file read as though they were not folded in answers otherwise;
# powers of two, so that transformers' weights are the file's divided by them exactly
FALCON_H1_SCALES: dict[str, Any] = dict(
    attention_in_multiplier=0.5, attention_out_multiplier=2.0, key_multiplier=0.5, ssm_in_multiplier=2.0,
    ssm_out_multiplier=0.5, ssm_multipliers=[2.0, 0.5, 0.5, 2.0, 0.25], mlp_multipliers=[2.0, 0.5],
    embedding_multiplier=2.0, lm_head_multiplier=0.5)
GRANITE_LAYERS = ("linear_attention", "full_attention", "linear_attention")
GRANITE_SHARED_WIDTH, GRANITE_EXPERT_WIDTH = 96, 64
# OLMo 3: a window of 8 on three of every four layers (OLMo 2: no window); its global layers' rope scaled
OLMO_LAYERS, OLMO_WINDOW = 4, 8
OLMO3_ROPE = dict(rope_type="linear", rope_theta=10000.0, factor=4.0)
GRANITE_SCALES = dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0)


class _FromTransformers:
    """A GGUF of `arch` being written from a seeded random transformers model of `model_type`: metadata as
    llama.cpp's converter writes it, then tensors `put` one at a time in `types[kind]` (F32 by default)."""

    def __init__(self, path: Path, arch: str, types: dict[str, str], seed: int, model_type: str,
                 kv_heads: list[int] | None = None, experts: bool = True, rms_eps_key: bool = True,
                 **fields: Any) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        self.path, self.types = path, types
        config = AutoConfig.for_model(model_type, **{
            "vocab_size": vocabulary_size(arch), "hidden_size": HIDDEN, "num_hidden_layers": 2,
            "max_position_embeddings": CONTEXT, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
            "eos_token_id": EOS_ID, "bos_token_id": 1, "pad_token_id": None, **fields})
        self.layers = int(config.num_hidden_layers)
        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        rng = np.random.default_rng(seed)
        with torch.no_grad():
            for name, param in self.model.named_parameters():  # spread as tests/tiny_models.py spreads its models
                if name.endswith(("bias", "sinks")):
                    values = 0.2 * rng.standard_normal(tuple(param.shape))
                elif "norm" in name:
                    values = rng.uniform(0.5, 1.5, tuple(param.shape))
                else:
                    values = (0.5 if "embed_tokens" in name or "lm_head" in name else 0.08) * rng.standard_normal(
                        tuple(param.shape))
                param.copy_(torch.from_numpy(values.astype(np.float32)))
            for name, buffer in self.model.named_buffers():  # (LFM2-MoE's expert bias is a buffer)
                if name.endswith(("expert_bias", "e_score_correction_bias")):
                    buffer.copy_(torch.from_numpy((0.2 * rng.standard_normal(tuple(buffer.shape))).astype(np.float32)))
        self.state = {**dict(self.model.named_buffers()), **{n: p.detach() for n, p in self.model.named_parameters()}}
        self.writer = gguf.GGUFWriter(str(path), arch)
        w = self.writer
        _write_tokenizer(w, arch)
        w.add_name(f"tiny-{arch}")
        w.add_block_count(self.layers)
        w.add_context_length(CONTEXT)
        w.add_embedding_length(HIDDEN)
        w.add_head_count(config.num_attention_heads)
        w.add_head_count_kv(config.num_key_value_heads if kv_heads is None else kv_heads)
        rope = getattr(config, "rope_parameters", None) or {}
        rope = rope.get("full_attention", rope)  # (OLMo 3's, per kind of layer: the global layers' base)
        if "rope_theta" in rope:
            w.add_rope_freq_base(float(rope["rope_theta"]))
        if rms_eps_key:  # (Nemotron-H's converter writes the norms' epsilon under layer_norm_epsilon)
            w.add_layer_norm_rms_eps(1e-5)
        if experts:
            w.add_expert_count(EXPERTS)
            w.add_expert_used_count(EXPERTS_PER_TOKEN)
        w.add_vocab_size(vocabulary_size(arch))

    def put(self, name: str, kind: str, values: Any) -> Any:
        """Write `values` (a tensor: [out, in], [experts, out, in] or a vector) as `kind`'s type; returns what
        the file holds, dequantized, as a tensor."""
        import torch

        qtype = QType[self.types.get(kind, "F32")]
        array = np.ascontiguousarray(values.numpy(), dtype=np.float32)
        raw = array if qtype == QType.F32 else gguf.quants.quantize(array, qtype)
        self.writer.add_tensor(name, raw, raw_dtype=qtype)
        stored = array if qtype == QType.F32 else gguf.quants.dequantize(raw, qtype).reshape(array.shape)
        return torch.from_numpy(np.ascontiguousarray(stored))

    def own(self, hf: str, name: str, kind: str, rows: np.ndarray | None = None, shift: float = 0.0) -> None:
        """Transformers' tensor `hf` written as `name` (its rows in the file's order `rows`; plus `shift`, as
        the converter writes Qwen3.5's norms), and set to what the file holds."""
        tensor = self.state[hf]
        stored = self.put(name, kind, (tensor if rows is None else tensor[rows]) + shift) - shift
        if rows is None:
            tensor.copy_(stored)
        else:
            tensor[rows] = stored

    def fold(self, hf: str, name: str, kind: str, scale: Any) -> None:
        """Transformers' tensor `hf` written times `scale` (a number, or a factor per row) as the converter
        folds a multiplier into a weight, and set to what the file holds divided by it."""
        import torch

        tensor = self.state[hf]
        factor = torch.as_tensor(scale, dtype=tensor.dtype)
        factor = factor.reshape(-1, *[1] * (tensor.dim() - 1)) if factor.dim() else factor
        tensor.copy_(self.put(name, kind, tensor * factor) / factor)

    def permuted_attention(self, attention: str, block: str, heads: int, kv_heads: int) -> None:
        """Transformers' q/k/v/o projections under `attention` as the converter writes Llama's: q and k rows
        permuted (`llama_permutation`)."""
        self.own(attention + "q_proj.weight", block + "attn_q.weight", "attn_q", llama_permutation(HIDDEN, heads))
        self.own(attention + "k_proj.weight", block + "attn_k.weight", "attn_k",
                 llama_permutation(kv_heads * HIDDEN // heads, kv_heads))
        self.own(attention + "v_proj.weight", block + "attn_v.weight", "attn_v")
        self.own(attention + "o_proj.weight", block + "attn_output.weight", "attn_output")

    def experts(self, experts: str, block: str) -> None:
        """Transformers' stacked experts under `experts` (gate_up_proj [E, 2I, H], gate rows then up rows;
        down_proj [E, H, I]) written as blk's ffn_gate_exps, ffn_up_exps and ffn_down_exps, as the converter
        writes them."""
        gate_up = self.state[experts + "gate_up_proj"]
        width = gate_up.shape[1] // 2
        for rows, part in ((slice(0, width), "gate"), (slice(width, None), "up")):
            gate_up[:, rows] = self.put(block + f"ffn_{part}_exps.weight", f"ffn_{part}_exps", gate_up[:, rows])
        self.own(experts + "down_proj", block + "ffn_down_exps.weight", "ffn_down_exps")

    def finish(self) -> tuple[Path, Any]:
        # the oracle's greedy replies run their full length as ignore_eos's do: no end token stops them, or is
        # suppressed (as generate's min_new_tokens would, where the end token is the argmax)
        self.model.generation_config.eos_token_id = None
        self.writer.write_header_to_file()
        self.writer.write_kv_data_to_file()
        self.writer.write_tensors_to_file()
        self.writer.close()
        return self.path, self.model


def write_gpt_oss_gguf(path: Path, types: dict[str, str], seed: int = 0) -> tuple[Path, Any]:
    """A tiny gpt-oss GGUF laid out as llama.cpp's converter writes one (its experts' gate and up columns
    split out of transformers' interleaved gate_up_proj and transposed, as are its down_proj; biases per
    projection [experts, out]; the sinks as attn_sinks.weight), and the transformers model the file holds.
    YaRN as the file states it is llama.cpp's (truncated correction range), transformers' default."""
    f = _FromTransformers(path, "gpt-oss", types, seed, "gpt_oss", num_attention_heads=GPT_OSS_HEADS,
                          num_key_value_heads=GPT_OSS_KV_HEADS, head_dim=HIDDEN // GPT_OSS_HEADS,
                          intermediate_size=GPT_OSS_EXPERT_WIDTH, num_local_experts=EXPERTS,
                          num_experts_per_tok=EXPERTS_PER_TOKEN, sliding_window=GPT_OSS_WINDOW,
                          layer_types=["sliding_attention", "full_attention"], rope_parameters=dict(GPT_OSS_ROPE))
    w = f.writer
    w.add_feed_forward_length(GPT_OSS_EXPERT_WIDTH)
    w.add_key_length(HIDDEN // GPT_OSS_HEADS)
    w.add_value_length(HIDDEN // GPT_OSS_HEADS)
    w.add_sliding_window(GPT_OSS_WINDOW)
    w.add_expert_feed_forward_length(GPT_OSS_EXPERT_WIDTH)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(GPT_OSS_ROPE["factor"])
    w.add_rope_scaling_orig_ctx_len(GPT_OSS_ROPE["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(GPT_OSS_ROPE["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(GPT_OSS_ROPE["beta_slow"])
    f.own("model.embed_tokens.weight", "token_embd.weight", "token_embd")
    for i in range(f.layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        f.own(p + "input_layernorm.weight", b + "attn_norm.weight", "attn_norm")
        f.own(p + "post_attention_layernorm.weight", b + "post_attention_norm.weight", "post_attention_norm")
        for ours, theirs in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
            f.own(p + f"self_attn.{ours}.weight", b + f"{theirs}.weight", theirs)
            f.own(p + f"self_attn.{ours}.bias", b + f"{theirs}.bias", f"{theirs}.bias")
        f.own(p + "self_attn.sinks", b + "attn_sinks.weight", "attn_sinks")
        f.own(p + "mlp.router.weight", b + "ffn_gate_inp.weight", "ffn_gate_inp")
        f.own(p + "mlp.router.bias", b + "ffn_gate_inp.bias", "ffn_gate_inp.bias")
        e = p + "mlp.experts."
        gate_up, gate_up_bias = f.state[e + "gate_up_proj"], f.state[e + "gate_up_proj_bias"]  # [E, H, 2I], [E, 2I]
        for half, part in ((0, "gate"), (1, "up")):
            stored = f.put(b + f"ffn_{part}_exps.weight", f"ffn_{part}_exps", gate_up[:, :, half::2].transpose(1, 2))
            gate_up[:, :, half::2] = stored.transpose(1, 2)
            gate_up_bias[:, half::2] = f.put(b + f"ffn_{part}_exps.bias", "exps.bias", gate_up_bias[:, half::2])
        down = f.state[e + "down_proj"]  # [E, I, H]
        down.copy_(f.put(b + "ffn_down_exps.weight", "ffn_down_exps", down.transpose(1, 2)).transpose(1, 2))
        f.own(e + "down_proj_bias", b + "ffn_down_exps.bias", "exps.bias")
    f.own("model.norm.weight", "output_norm.weight", "output_norm")
    f.own("lm_head.weight", "output.weight", "output")
    return f.finish()


def write_mixtral_gguf(path: Path, types: dict[str, str], seed: int = 0) -> tuple[Path, Any]:
    """A tiny Mixtral GGUF as llama.cpp's converter writes one: a `llama` file with experts (expert_count),
    q/k rows permuted as Llama's, the router as ffn_gate_inp and each projection's experts stacked
    [experts, out, in]; and the transformers model the file holds."""
    heads, kv_heads = HEADS["llama"]
    f = _FromTransformers(path, "llama", types, seed, "mixtral", num_attention_heads=heads, num_key_value_heads=kv_heads,
                          intermediate_size=MIXTRAL_EXPERT_WIDTH, num_local_experts=EXPERTS,
                          num_experts_per_tok=EXPERTS_PER_TOKEN)
    f.writer.add_feed_forward_length(MIXTRAL_EXPERT_WIDTH)
    f.writer.add_rope_dimension_count(HIDDEN // heads)
    f.own("model.embed_tokens.weight", "token_embd.weight", "token_embd")
    for i in range(f.layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        f.own(p + "input_layernorm.weight", b + "attn_norm.weight", "attn_norm")
        f.own(p + "post_attention_layernorm.weight", b + "ffn_norm.weight", "ffn_norm")
        f.permuted_attention(p + "self_attn.", b, heads, kv_heads)
        f.own(p + "mlp.gate.weight", b + "ffn_gate_inp.weight", "ffn_gate_inp")
        f.experts(p + "mlp.experts.", b)
    f.own("model.norm.weight", "output_norm.weight", "output_norm")
    f.own("lm_head.weight", "output.weight", "output")
    return f.finish()


def write_lfm2_moe_gguf(path: Path, types: dict[str, str], seed: int = 0) -> tuple[Path, Any]:
    """A tiny LFM2-MoE GGUF as llama.cpp's converter writes one: LFM2's names (a kv head count per layer, 0
    on a convolution layer; convolution kernels [channels, taps]; the final norm as token_embd_norm), a
    leading dense layer, then experts chosen by sigmoid scores and an expert bias (exp_probs_b); and the
    transformers model the file holds."""
    heads, kv_heads = HEADS["lfm2"]
    f = _FromTransformers(path, "lfm2moe", types, seed, "lfm2_moe",
                          kv_heads=[kv_heads if kind == "full_attention" else 0 for kind in LFM2_MOE_LAYERS],
                          num_hidden_layers=len(LFM2_MOE_LAYERS), layer_types=list(LFM2_MOE_LAYERS),
                          num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=INTERMEDIATE,
                          moe_intermediate_size=LFM2_MOE_EXPERT_WIDTH, num_experts=EXPERTS,
                          num_experts_per_tok=EXPERTS_PER_TOKEN, num_dense_layers=1, conv_L_cache=LFM2_TAPS)
    w = f.writer
    w.add_feed_forward_length(INTERMEDIATE)
    w.add_key_length(HIDDEN // heads)
    w.add_value_length(HIDDEN // heads)
    w.add_expert_feed_forward_length(LFM2_MOE_EXPERT_WIDTH)
    w.add_leading_dense_block_count(1)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_shortconv_l_cache(LFM2_TAPS)
    f.own("model.embed_tokens.weight", "token_embd.weight", "token_embd")
    for i, kind in enumerate(LFM2_MOE_LAYERS):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        f.own(p + "operator_norm.weight", b + "attn_norm.weight", "attn_norm")
        f.own(p + "ffn_norm.weight", b + "ffn_norm.weight", "ffn_norm")
        if kind == "conv":
            conv = f.state[p + "conv.conv.weight"]  # [channels, 1, taps], written [channels, taps]
            conv.copy_(f.put(b + "shortconv.conv.weight", "shortconv.conv", conv[:, 0])[:, None])
            f.own(p + "conv.in_proj.weight", b + "shortconv.in_proj.weight", "shortconv.in_proj")
            f.own(p + "conv.out_proj.weight", b + "shortconv.out_proj.weight", "shortconv.out_proj")
        else:
            for ours, theirs in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"),
                                 ("out_proj", "attn_output"), ("q_layernorm", "attn_q_norm"),
                                 ("k_layernorm", "attn_k_norm")):
                f.own(p + f"self_attn.{ours}.weight", b + f"{theirs}.weight", theirs)
        m = p + "feed_forward."
        if i == 0:  # the leading dense layer
            for ours, theirs in (("w1", "ffn_gate"), ("w3", "ffn_up"), ("w2", "ffn_down")):
                f.own(m + f"{ours}.weight", b + f"{theirs}.weight", theirs)
            continue
        f.own(m + "gate.weight", b + "ffn_gate_inp.weight", "ffn_gate_inp")
        f.own(m + "expert_bias", b + "exp_probs_b.bias", "exp_probs_b")
        f.experts(m + "experts.", b)
    f.own("model.embedding_norm.weight", "token_embd_norm.weight", "output_norm")
    f.own("lm_head.weight", "output.weight", "output")
    return f.finish()


def write_qwen3_next_gguf(path: Path, types: dict[str, str], seed: int = 0, fused: bool = False) -> tuple[Path, Any]:
    """A tiny Qwen3-Next GGUF as llama.cpp's converter writes one: three Gated DeltaNet layers (two key heads,
    three value heads each) and a gated attention layer, each under routed experts and a gated shared expert;
    the DeltaNet's q/k/v/z projection split by kind out of its per-key-head groups into attn_qkv and attn_gate
    (`fused`: kept whole as `ssm_in`, as its first converter wrote it), beta and alpha kept in one `ssm_ba`,
    A as -exp(A_log), the norms as 1 + w but the DeltaNet's gated one; and the transformers model it holds."""
    import torch

    heads, kv_heads = HEADS["qwen35"]
    head_dim = HIDDEN // heads
    layer_types = ["linear_attention"] * 3 + ["full_attention"]
    f = _FromTransformers(path, "qwen3next", types, seed, "qwen3_next", num_hidden_layers=len(layer_types),
                          layer_types=layer_types, num_attention_heads=heads, num_key_value_heads=kv_heads,
                          head_dim=head_dim, linear_num_key_heads=DELTA_KEY_HEADS,
                          linear_num_value_heads=DELTA_VALUE_HEADS, linear_key_head_dim=DELTA_HEAD,
                          linear_value_head_dim=DELTA_HEAD, linear_conv_kernel_dim=DELTA_TAPS, num_experts=EXPERTS,
                          num_experts_per_tok=EXPERTS_PER_TOKEN, moe_intermediate_size=QWEN3_NEXT_EXPERT_WIDTH,
                          shared_expert_intermediate_size=QWEN3_NEXT_EXPERT_WIDTH,
                          rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25))
    w = f.writer
    w.add_feed_forward_length(INTERMEDIATE)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_expert_feed_forward_length(QWEN3_NEXT_EXPERT_WIDTH)
    w.add_expert_shared_feed_forward_length(QWEN3_NEXT_EXPERT_WIDTH)
    w.add_ssm_conv_kernel(DELTA_TAPS)
    w.add_ssm_state_size(DELTA_HEAD)
    w.add_ssm_group_count(DELTA_KEY_HEADS)
    w.add_ssm_time_step_rank(DELTA_VALUE_HEADS)
    w.add_ssm_inner_size(DELTA_VALUE_HEADS * DELTA_HEAD)
    w.add_array("qwen3next.attention.recurrent_layers", [kind == "linear_attention" for kind in layer_types])
    w.add_full_attention_interval(4)
    w.add_rope_dimension_count(head_dim // 4)
    # transformers' in_proj_qkvz rows: per key head, its q, its k, its value heads' v, then their z
    per_key = DELTA_VALUE_HEADS // DELTA_KEY_HEADS * DELTA_HEAD
    group = np.arange(DELTA_KEY_HEADS * (2 * DELTA_HEAD + 2 * per_key)).reshape(DELTA_KEY_HEADS, -1)
    q, k, v, z = np.split(group, np.cumsum([DELTA_HEAD, DELTA_HEAD, per_key]), axis=1)
    qkv, gate = np.concatenate([q.reshape(-1), k.reshape(-1), v.reshape(-1)]), z.reshape(-1)
    f.own("model.embed_tokens.weight", "token_embd.weight", "token_embd")
    for i, kind in enumerate(layer_types):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        f.own(p + "input_layernorm.weight", b + "attn_norm.weight", "attn_norm", shift=1.0)
        f.own(p + "post_attention_layernorm.weight", b + "post_attention_norm.weight", "post_attention_norm", shift=1.0)
        if kind == "linear_attention":
            d = p + "linear_attn."
            if fused:
                f.own(d + "in_proj_qkvz.weight", b + "ssm_in.weight", "ssm_in")
            else:
                f.own(d + "in_proj_qkvz.weight", b + "attn_qkv.weight", "attn_qkv", rows=qkv)
                f.own(d + "in_proj_qkvz.weight", b + "attn_gate.weight", "attn_gate", rows=gate)
            f.own(d + "in_proj_ba.weight", b + "ssm_ba.weight", "ssm_ba")
            conv = f.state[d + "conv1d.weight"]  # [channels, 1, taps], written [channels, taps]
            conv.copy_(f.put(b + "ssm_conv1d.weight", "ssm_conv1d", conv[:, 0])[:, None])
            f.own(d + "dt_bias", b + "ssm_dt.bias", "ssm_dt")
            a_log = f.state[d + "A_log"]
            a_log.copy_(torch.log(-f.put(b + "ssm_a", "ssm_a", -torch.exp(a_log))))
            f.own(d + "norm.weight", b + "ssm_norm.weight", "ssm_norm")
            f.own(d + "out_proj.weight", b + "ssm_out.weight", "ssm_out")
        else:
            for ours, theirs in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
                f.own(p + f"self_attn.{ours}.weight", b + f"{theirs}.weight", theirs)
            f.own(p + "self_attn.q_norm.weight", b + "attn_q_norm.weight", "attn_q_norm", shift=1.0)
            f.own(p + "self_attn.k_norm.weight", b + "attn_k_norm.weight", "attn_k_norm", shift=1.0)
        m = p + "mlp."
        f.own(m + "gate.weight", b + "ffn_gate_inp.weight", "ffn_gate_inp")
        f.experts(m + "experts.", b)
        shared_gate = f.state[m + "shared_expert_gate.weight"]  # [1, H], written as a vector
        shared_gate.copy_(f.put(b + "ffn_gate_inp_shexp.weight", "ffn_gate_inp_shexp", shared_gate[0])[None])
        for part in ("gate", "up", "down"):
            f.own(m + f"shared_expert.{part}_proj.weight", b + f"ffn_{part}_shexp.weight", f"ffn_{part}_shexp")
    f.own("model.norm.weight", "output_norm.weight", "output_norm", shift=1.0)
    f.own("lm_head.weight", "output.weight", "output")
    return f.finish()


def write_nemotron_h_gguf(path: Path, types: dict[str, str], seed: int = 0, experts: bool = False
                          ) -> tuple[Path, Any]:
    """A tiny Nemotron-H GGUF as llama.cpp's converter writes one: a kv head count and an MLP width per layer
    (0 where the layer has none); the norms' epsilon as `attention.layer_norm_epsilon`; Mamba2 mixers with A as
    -exp(A_log), A and D as [heads, 1], the gated norm as [groups, width / groups] and the convolution kernels
    [channels, taps]; q/k rows permuted as Llama's (no rope turns them). With `experts`, Nemotron 3's
    (`nemotron_h_moe`): sigmoid routing within the best of 2 groups with a correction bias (exp_probs_b), a
    shared expert, a latent space around the experts, its routing settings in the metadata. And the
    transformers model the file holds."""
    heads, kv_heads = HEADS["llama"]
    layers = NEMOTRON_H_MOE_LAYERS if experts else NEMOTRON_H_LAYERS
    moe: dict[str, Any] = dict(n_routed_experts=EXPERTS, num_experts_per_tok=EXPERTS_PER_TOKEN,
                               moe_intermediate_size=NEMOTRON_3_EXPERT_WIDTH, moe_latent_size=NEMOTRON_3_LATENT,
                               moe_shared_expert_intermediate_size=INTERMEDIATE, n_group=2, topk_group=1,
                               routed_scaling_factor=2.5, norm_topk_prob=True) if experts else {}
    arch = "nemotron_h_moe" if experts else "nemotron_h"
    f = _FromTransformers(path, arch, types, seed, "nemotron_h", experts=experts, rms_eps_key=False,
                          kv_heads=[kv_heads if kind == "full_attention" else 0 for kind in layers],
                          num_hidden_layers=len(layers), layers_block_type=list(layers),
                          num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=HIDDEN // heads,
                          intermediate_size=INTERMEDIATE, mamba_num_heads=MAMBA_HEADS, mamba_head_dim=MAMBA_HEAD,
                          ssm_state_size=MAMBA_STATE, n_groups=MAMBA_GROUPS, conv_kernel=DELTA_TAPS,
                          layer_norm_epsilon=NEMOTRON_H_EPS, **moe)
    w = f.writer
    w.add_layer_norm_eps(NEMOTRON_H_EPS)
    width = {"mlp": INTERMEDIATE, "moe": NEMOTRON_3_EXPERT_WIDTH}
    w.add_feed_forward_length([width.get(kind, 0) for kind in layers])
    w.add_key_length(HIDDEN // heads)
    w.add_value_length(HIDDEN // heads)
    _mamba2_metadata(w)
    if experts:
        w.add_expert_feed_forward_length(NEMOTRON_3_EXPERT_WIDTH)
        w.add_expert_shared_feed_forward_length(INTERMEDIATE)
        w.add_expert_group_count(moe["n_group"])
        w.add_expert_group_used_count(moe["topk_group"])
        w.add_expert_weights_norm(moe["norm_topk_prob"])
        w.add_expert_weights_scale(moe["routed_scaling_factor"])
        w.add_uint32(f"{arch}.moe_latent_size", NEMOTRON_3_LATENT)
    f.own("model.embeddings.weight", "token_embd.weight", "token_embd")
    for i, kind in enumerate(layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        f.own(p + "norm.weight", b + "attn_norm.weight", "attn_norm")
        m = p + "mixer."
        if kind == "linear_attention":
            _mamba2(f, m, b)
        elif kind == "full_attention":
            f.permuted_attention(m, b, heads, kv_heads)
        elif kind == "moe":  # experts [E, out, in] within the latent space, as transformers stacks them
            f.own(m + "gate.weight", b + "ffn_gate_inp.weight", "ffn_gate_inp")
            f.own(m + "gate.e_score_correction_bias", b + "exp_probs_b.bias", "exp_probs_b")
            f.own(m + "experts.up_proj", b + "ffn_up_exps.weight", "ffn_up_exps")
            f.own(m + "experts.down_proj", b + "ffn_down_exps.weight", "ffn_down_exps")
            f.own(m + "fc1_latent_proj.weight", b + "ffn_latent_down.weight", "ffn_latent_down")
            f.own(m + "fc2_latent_proj.weight", b + "ffn_latent_up.weight", "ffn_latent_up")
            f.own(m + "shared_experts.up_proj.weight", b + "ffn_up_shexp.weight", "ffn_up_shexp")
            f.own(m + "shared_experts.down_proj.weight", b + "ffn_down_shexp.weight", "ffn_down_shexp")
        else:
            f.own(m + "up_proj.weight", b + "ffn_up.weight", "ffn_up")
            f.own(m + "down_proj.weight", b + "ffn_down.weight", "ffn_down")
    f.own("model.norm_f.weight", "output_norm.weight", "output_norm")
    f.own("lm_head.weight", "output.weight", "output")
    return f.finish()


def _mamba2_metadata(w: gguf.GGUFWriter) -> None:
    """The `ssm.*` shape of the tiny Mamba2 mixers, as the converter writes it."""
    w.add_ssm_conv_kernel(DELTA_TAPS)
    w.add_ssm_state_size(MAMBA_STATE)
    w.add_ssm_group_count(MAMBA_GROUPS)
    w.add_ssm_inner_size(MAMBA_HEADS * MAMBA_HEAD)
    w.add_ssm_time_step_rank(MAMBA_HEADS)


def _mamba2(f: _FromTransformers, mixer: str, block: str, in_scale: Any = 1.0, out_scale: float = 1.0) -> None:
    """A Mamba2 mixer as the converter writes one: A as -exp(A_log), A and D as [heads, 1], the gated norm as
    [groups, width / groups], the convolution kernel [channels, taps]; its projections times `in_scale` (a
    factor per row) and `out_scale` (Falcon-H1's multipliers, which the converter folds in)."""
    import torch

    f.fold(mixer + "in_proj.weight", block + "ssm_in.weight", "ssm_in", in_scale)
    conv = f.state[mixer + "conv1d.weight"]  # [channels, 1, taps], written [channels, taps]
    conv.copy_(f.put(block + "ssm_conv1d.weight", "ssm_conv1d", conv[:, 0])[:, None])
    f.own(mixer + "conv1d.bias", block + "ssm_conv1d.bias", "ssm_conv1d.bias")
    f.own(mixer + "dt_bias", block + "ssm_dt.bias", "ssm_dt")
    a_log = f.state[mixer + "A_log"]
    a_log.copy_(torch.log(-f.put(block + "ssm_a", "ssm_a", -torch.exp(a_log)[:, None])[:, 0]))
    d = f.state[mixer + "D"]
    d.copy_(f.put(block + "ssm_d", "ssm_d", d[:, None])[:, 0])
    norm = f.state[mixer + "norm.weight"]
    norm.copy_(f.put(block + "ssm_norm.weight", "ssm_norm", norm.reshape(MAMBA_GROUPS, -1)).reshape(-1))
    f.fold(mixer + "out_proj.weight", block + "ssm_out.weight", "ssm_out", out_scale)


def write_granite_hybrid_gguf(path: Path, types: dict[str, str], seed: int = 0, experts: bool = False
                              ) -> tuple[Path, Any]:
    """A tiny Granite 4 GGUF as llama.cpp's converter writes one: a kv head count per layer (0 on a Mamba2
    layer), Granite's multipliers as its scales, no rope (`rope.scaling.finetuned` false), q/k rows permuted
    as Llama's, the shared MLP's gate and up rows apart (ffn_gate / ffn_up, or beside `experts` ffn_*_shexp,
    and then the experts' as Mixtral's); and the transformers model the file holds."""
    heads, kv_heads = HEADS["llama"]
    fields: dict[str, Any] = dict(num_local_experts=EXPERTS, num_experts_per_tok=EXPERTS_PER_TOKEN,
                                  intermediate_size=GRANITE_EXPERT_WIDTH) if experts else dict(num_local_experts=0)
    f = _FromTransformers(path, "granitehybrid", types, seed, "granitemoehybrid", experts=experts,
                          kv_heads=[kv_heads if kind == "full_attention" else 0 for kind in GRANITE_LAYERS],
                          num_hidden_layers=len(GRANITE_LAYERS), layer_types=list(GRANITE_LAYERS),
                          num_attention_heads=heads, num_key_value_heads=kv_heads,
                          shared_intermediate_size=GRANITE_SHARED_WIDTH, mamba_n_heads=MAMBA_HEADS,
                          mamba_d_head=MAMBA_HEAD, mamba_d_state=MAMBA_STATE, mamba_n_groups=MAMBA_GROUPS,
                          mamba_d_conv=DELTA_TAPS, mamba_expand=MAMBA_HEADS * MAMBA_HEAD // HIDDEN,
                          position_embedding_type="nope", **GRANITE_SCALES, **fields)
    w = f.writer
    w.add_feed_forward_length(GRANITE_EXPERT_WIDTH if experts else GRANITE_SHARED_WIDTH)
    w.add_expert_shared_feed_forward_length(GRANITE_SHARED_WIDTH)
    _mamba2_metadata(w)
    w.add_attention_scale(GRANITE_SCALES["attention_multiplier"])
    w.add_embedding_scale(GRANITE_SCALES["embedding_multiplier"])
    w.add_residual_scale(GRANITE_SCALES["residual_multiplier"])
    w.add_logit_scale(GRANITE_SCALES["logits_scaling"])
    w.add_rope_scaling_finetuned(False)
    f.own("model.embed_tokens.weight", "token_embd.weight", "token_embd")
    for i, kind in enumerate(GRANITE_LAYERS):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        f.own(p + "input_layernorm.weight", b + "attn_norm.weight", "attn_norm")
        f.own(p + "post_attention_layernorm.weight", b + "ffn_norm.weight", "ffn_norm")
        if kind == "linear_attention":
            _mamba2(f, p + "mamba.", b)
        else:
            f.permuted_attention(p + "self_attn.", b, heads, kv_heads)
        shared = "_shexp" if experts else ""
        gate_up = f.state[p + "shared_mlp.input_linear.weight"]  # [2S, H]: gate rows, then up rows
        for rows, part in ((slice(0, GRANITE_SHARED_WIDTH), "gate"), (slice(GRANITE_SHARED_WIDTH, None), "up")):
            gate_up[rows] = f.put(b + f"ffn_{part}{shared}.weight", f"ffn_{part}{shared}", gate_up[rows])
        f.own(p + "shared_mlp.output_linear.weight", b + f"ffn_down{shared}.weight", f"ffn_down{shared}")
        if experts:
            f.own(p + "block_sparse_moe.router.weight", b + "ffn_gate_inp.weight", "ffn_gate_inp")
            f.experts(p + "block_sparse_moe.experts.", b)
    f.own("model.norm.weight", "output_norm.weight", "output_norm")
    f.own("lm_head.weight", "output.weight", "output")
    return f.finish()


def write_falcon_h1_gguf(path: Path, types: dict[str, str], seed: int = 0) -> tuple[Path, Any]:
    """A tiny Falcon-H1 GGUF as llama.cpp's converter writes one: attention and a Mamba2 mixer in every layer
    (q/k rows as they are: its rope turns halves), the gated norm after the gate, every muP multiplier
    (`FALCON_H1_SCALES`, none 1) multiplied into the weights it scales, the MLP norm named `ffn_norm` without
    `.weight`; and the transformers model the file holds."""
    import torch

    heads, kv_heads = HEADS["llama"]
    inner, group_state = MAMBA_HEADS * MAMBA_HEAD, MAMBA_GROUPS * MAMBA_STATE
    scales = FALCON_H1_SCALES
    f = _FromTransformers(path, "falcon-h1", types, seed, "falcon_h1", experts=False, num_hidden_layers=LAYERS,
                          num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=HIDDEN // heads,
                          intermediate_size=INTERMEDIATE, mamba_d_ssm=inner, mamba_n_heads=MAMBA_HEADS,
                          mamba_d_head=MAMBA_HEAD, mamba_n_groups=MAMBA_GROUPS, mamba_d_state=MAMBA_STATE,
                          mamba_d_conv=DELTA_TAPS, mamba_expand=inner // HIDDEN, mamba_rms_norm=True,
                          mamba_norm_before_gate=False, **scales)
    w = f.writer
    w.add_feed_forward_length(INTERMEDIATE)
    w.add_key_length(HIDDEN // heads)
    w.add_value_length(HIDDEN // heads)
    _mamba2_metadata(w)
    # in_proj's rows: z, x, B, C, dt, each section by its ssm multiplier, all by the mixer's input multiplier
    sections = (inner, inner, group_state, group_state, MAMBA_HEADS)
    in_scale = scales["ssm_in_multiplier"] * torch.cat([torch.full((n,), m) for n, m in zip(sections,
                                                                                            scales["ssm_multipliers"])])
    attention_in, (gate, down) = scales["attention_in_multiplier"], scales["mlp_multipliers"]
    f.fold("model.embed_tokens.weight", "token_embd.weight", "token_embd", scales["embedding_multiplier"])
    for i in range(f.layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        f.own(p + "input_layernorm.weight", b + "attn_norm.weight", "attn_norm")
        f.fold(p + "self_attn.q_proj.weight", b + "attn_q.weight", "attn_q", attention_in)
        f.fold(p + "self_attn.k_proj.weight", b + "attn_k.weight", "attn_k", attention_in * scales["key_multiplier"])
        f.fold(p + "self_attn.v_proj.weight", b + "attn_v.weight", "attn_v", attention_in)
        f.fold(p + "self_attn.o_proj.weight", b + "attn_output.weight", "attn_output",
               scales["attention_out_multiplier"])
        _mamba2(f, p + "mamba.", b, in_scale, scales["ssm_out_multiplier"])
        f.own(p + "pre_ff_layernorm.weight", b + "ffn_norm", "ffn_norm")
        f.fold(p + "feed_forward.gate_proj.weight", b + "ffn_gate.weight", "ffn_gate", gate)
        f.own(p + "feed_forward.up_proj.weight", b + "ffn_up.weight", "ffn_up")
        f.fold(p + "feed_forward.down_proj.weight", b + "ffn_down.weight", "ffn_down", down)
    f.own("model.final_layernorm.weight", "output_norm.weight", "output_norm")
    f.fold("lm_head.weight", "output.weight", "output", scales["lm_head_multiplier"])
    return f.finish()


def write_glm_gguf(path: Path, types: dict[str, str], seed: int = 0, arch: str = "glm4") -> tuple[Path, Any]:
    """A tiny GLM-4-0414 (`glm4`) or GLM-4 (`chatglm`) GGUF as llama.cpp's converter writes them: rows as they
    are (their rope turns interleaved pairs of the first half of each head, `rope.dimension_count`), q/k/v
    biases, gate and up in one ffn_up; GLM-4-0414's sandwich norms as post_attention_norm and post_ffw_norm;
    and the transformers model the file holds."""
    heads, kv_heads = HEADS["llama"]
    head_dim = HIDDEN // heads
    sandwich = arch == "glm4"
    f = _FromTransformers(path, arch, types, seed, "glm4" if sandwich else "glm", experts=False, num_hidden_layers=LAYERS,
                          num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                          intermediate_size=INTERMEDIATE, attention_bias=True,
                          rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))
    w = f.writer
    w.add_feed_forward_length(INTERMEDIATE)
    w.add_rope_dimension_count(head_dim // 2)
    f.own("model.embed_tokens.weight", "token_embd.weight", "token_embd")
    for i in range(f.layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        f.own(p + "input_layernorm.weight", b + "attn_norm.weight", "attn_norm")
        for n in "qkv":
            f.own(p + f"self_attn.{n}_proj.weight", b + f"attn_{n}.weight", f"attn_{n}")
            f.own(p + f"self_attn.{n}_proj.bias", b + f"attn_{n}.bias", f"attn_{n}.bias")
        f.own(p + "self_attn.o_proj.weight", b + "attn_output.weight", "attn_output")
        if sandwich:
            f.own(p + "post_self_attn_layernorm.weight", b + "post_attention_norm.weight", "post_attention_norm")
            f.own(p + "post_mlp_layernorm.weight", b + "post_ffw_norm.weight", "post_ffw_norm")
        f.own(p + "post_attention_layernorm.weight", b + "ffn_norm.weight", "ffn_norm")
        f.own(p + "mlp.gate_up_proj.weight", b + "ffn_up.weight", "ffn_up")
        f.own(p + "mlp.down_proj.weight", b + "ffn_down.weight", "ffn_down")
    f.own("model.norm.weight", "output_norm.weight", "output_norm")
    f.own("lm_head.weight", "output.weight", "output")
    return f.finish()


def write_olmo_gguf(path: Path, types: dict[str, str], seed: int = 0, window: bool = False) -> tuple[Path, Any]:
    """A tiny OLMo 2 (or, with a `window`, OLMo 3) GGUF as llama.cpp's converter writes both, as `olmo2`: norms
    after attention and after the MLP only, q and k normed over all their heads, rows not permuted; OLMo 3's
    window with its default pattern (not written) and its global layers' rope scaling; and the transformers
    model the file holds."""
    heads, kv_heads = HEADS["llama"]
    fields: dict[str, Any] = dict(
        sliding_window=OLMO_WINDOW, rope_parameters={"full_attention": dict(OLMO3_ROPE), "sliding_attention": dict(
            rope_type="default", rope_theta=OLMO3_ROPE["rope_theta"])}) if window else dict(
        rope_parameters=dict(rope_type="default", rope_theta=OLMO3_ROPE["rope_theta"]))
    f = _FromTransformers(path, "olmo2", types, seed, "olmo3" if window else "olmo2", experts=False,
                          num_hidden_layers=OLMO_LAYERS, num_attention_heads=heads, num_key_value_heads=kv_heads,
                          intermediate_size=INTERMEDIATE, **fields)
    w = f.writer
    w.add_feed_forward_length(INTERMEDIATE)
    if window:
        w.add_sliding_window(OLMO_WINDOW)
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(OLMO3_ROPE["factor"])
    f.own("model.embed_tokens.weight", "token_embd.weight", "token_embd")
    for i in range(OLMO_LAYERS):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        for ours, theirs in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output"),
                             ("q_norm", "attn_q_norm"), ("k_norm", "attn_k_norm")):
            f.own(p + f"self_attn.{ours}.weight", b + f"{theirs}.weight", theirs)
        f.own(p + "post_attention_layernorm.weight", b + "post_attention_norm.weight", "post_attention_norm")
        f.own(p + "post_feedforward_layernorm.weight", b + "post_ffw_norm.weight", "post_ffw_norm")
        for ours, theirs in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
            f.own(p + f"mlp.{ours}.weight", b + f"{theirs}.weight", theirs)
    f.own("model.norm.weight", "output_norm.weight", "output_norm")
    f.own("lm_head.weight", "output.weight", "output")
    return f.finish()


def write_llama_like_gguf(path: Path, types: dict[str, str], seed: int = 0, arch: str = "smollm3") -> tuple[Path, Any]:
    """A tiny file of a family llama.cpp's converter writes as Llama's (q/k rows permuted, attn_norm and
    ffn_norm) under a name of its own: `smollm3` (every fourth layer turns no rope: llama.cpp's constant, not
    in the file) or `granite` (Granite 3: its multipliers as the file's scales); and the transformers model the
    file holds."""
    heads, kv_heads = HEADS["llama"]
    fields: dict[str, Any] = dict(GRANITE_SCALES) if arch == "granite" else dict(
        no_rope_layers=[int((i + 1) % 4 != 0) for i in range(OLMO_LAYERS)])
    f = _FromTransformers(path, arch, types, seed, arch, experts=False, num_hidden_layers=OLMO_LAYERS,
                          num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=INTERMEDIATE,
                          rope_parameters=dict(rope_type="default", rope_theta=10000.0), **fields)
    w = f.writer
    w.add_feed_forward_length(INTERMEDIATE)
    w.add_rope_dimension_count(HIDDEN // heads)
    if arch == "granite":
        w.add_attention_scale(GRANITE_SCALES["attention_multiplier"])
        w.add_embedding_scale(GRANITE_SCALES["embedding_multiplier"])
        w.add_residual_scale(GRANITE_SCALES["residual_multiplier"])
        w.add_logit_scale(GRANITE_SCALES["logits_scaling"])
    f.own("model.embed_tokens.weight", "token_embd.weight", "token_embd")
    for i in range(OLMO_LAYERS):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        f.own(p + "input_layernorm.weight", b + "attn_norm.weight", "attn_norm")
        f.own(p + "post_attention_layernorm.weight", b + "ffn_norm.weight", "ffn_norm")
        f.permuted_attention(p + "self_attn.", b, heads, kv_heads)
        for ours, theirs in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
            f.own(p + f"mlp.{ours}.weight", b + f"{theirs}.weight", theirs)
    f.own("model.norm.weight", "output_norm.weight", "output_norm")
    f.own("lm_head.weight", "output.weight", "output")
    return f.finish()


# Gemma 4 as its E2B/E4B models: sliding and global layers, the global ones with wider heads, one kv head and values
# from the keys, a quarter of each head turned; the last three layers read the K/V of the last two before them (as
# llama.cpp requires: a sliding one, then a global one) with twice-wide MLPs; per-layer inputs
GEMMA4_LAYERS = ("sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention",
                 "sliding_attention", "sliding_attention", "full_attention")
GEMMA4_SHARED, GEMMA4_PER_LAYER, GEMMA4_HEAD, GEMMA4_GLOBAL_HEAD = 3, 32, 64, 128
# its MoE model (26B-A4B): routed experts beside every layer's MLP, neither per-layer inputs nor shared K/V
GEMMA4_MOE_LAYERS = ("sliding_attention", "sliding_attention", "full_attention")
EMBEDDING_SHRINK = 0.1


def write_gemma4_gguf(path: Path, types: dict[str, str], seed: int = 0, layer_types: tuple[str, ...] = GEMMA4_LAYERS,
                      rope_freqs: list[float] | None = None, experts: bool = False) -> tuple[Path, Any]:
    """A tiny Gemma 4 GGUF as llama.cpp's converter writes one: per-layer head sizes and kv heads, no attn_v where
    the values are the keys' (the global layers), no K/V in the layers reading another's, their MLP widths, the
    per-layer inputs' tensors, each layer's output scale, and the global layers' proportional rope as a full rope
    with a divisor of 1e30 on the pairs it leaves still (`rope_freqs`, unless given); with `experts`, the MoE
    model's (`GEMMA4_MOE_LAYERS`): the router with its scales, the experts' stacked gate/up and down, the norms
    around them; and the transformers model the file holds."""
    import torch

    layer_types = GEMMA4_MOE_LAYERS if experts else layer_types
    layers, shared, per_layer = len(layer_types), 0 if experts else GEMMA4_SHARED, 0 if experts else GEMMA4_PER_LAYER
    moe = dict(enable_moe_block=True, num_experts=EXPERTS, top_k_experts=EXPERTS_PER_TOKEN,
               moe_intermediate_size=INTERMEDIATE // 2) if experts else {}
    f = _FromTransformers(
        path, "gemma4", types, seed, "gemma4_text", experts=False, tie_word_embeddings=True,
        kv_heads=[2 if kind == "sliding_attention" else 1 for kind in layer_types], num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=2, head_dim=GEMMA4_HEAD, global_head_dim=GEMMA4_GLOBAL_HEAD,
        num_global_key_value_heads=1, attention_k_eq_v=True, layer_types=list(layer_types),
        sliding_window=GEMMA_WINDOW, num_kv_shared_layers=shared, use_double_wide_mlp=True,
        intermediate_size=INTERMEDIATE, hidden_size_per_layer_input=per_layer, **moe,
        vocab_size_per_layer_input=vocabulary_size("gemma4"), final_logit_softcapping=30.0, pad_token_id=0,
        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                         "full_attention": dict(rope_type="proportional", partial_rotary_factor=0.25,
                                                rope_theta=1000000.0)})
    w = f.writer
    w.add_feed_forward_length([INTERMEDIATE * (2 if i >= layers - shared else 1) for i in range(layers)])
    w.add_key_length(GEMMA4_GLOBAL_HEAD)
    w.add_value_length(GEMMA4_GLOBAL_HEAD)
    w.add_key_length_swa(GEMMA4_HEAD)
    w.add_value_length_swa(GEMMA4_HEAD)
    w.add_rope_dimension_count(GEMMA4_GLOBAL_HEAD)
    w.add_rope_dimension_count_swa(GEMMA4_HEAD)
    w.add_rope_freq_base_swa(10000.0)
    w.add_final_logit_softcapping(30.0)
    w.add_sliding_window(GEMMA_WINDOW)
    w.add_shared_kv_layers(shared)
    w.add_embedding_length_per_layer_input(per_layer)
    if experts:
        w.add_expert_count(EXPERTS)
        w.add_expert_used_count(EXPERTS_PER_TOKEN)
        w.add_expert_feed_forward_length(INTERMEDIATE // 2)
    w.add_sliding_window_pattern([kind == "sliding_attention" for kind in layer_types])
    turned = GEMMA4_GLOBAL_HEAD // 8  # a quarter of the head's pairs
    f.put("rope_freqs.weight", "rope_freqs",
          torch.tensor(rope_freqs or [1.0] * turned + [1e30] * (GEMMA4_GLOBAL_HEAD // 2 - turned)))
    f.state["model.embed_tokens.weight"].mul_(EMBEDDING_SHRINK)  # (at 0.5, scaled by hidden ** 0.5, the tied
    # embedding drowns the layers and greedy replies echo the last token)
    f.own("model.embed_tokens.weight", "token_embd.weight", "token_embd")
    if per_layer:
        f.own("model.embed_tokens_per_layer.weight", "per_layer_token_embd.weight", "per_layer_token_embd")
        f.own("model.per_layer_model_projection.weight", "per_layer_model_proj.weight", "per_layer_model_proj")
        f.own("model.per_layer_projection_norm.weight", "per_layer_proj_norm.weight", "per_layer_proj_norm")
    rng = np.random.default_rng(seed + 1)
    for i in range(layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        f.state[p + "layer_scalar"].copy_(torch.from_numpy(rng.uniform(0.5, 1.5, 1).astype(np.float32)))
        f.own(p + "layer_scalar", b + "layer_output_scale.weight", "layer_output_scale")
        norms = [("input_layernorm", "attn_norm"), ("post_attention_layernorm", "post_attention_norm"),
                 ("pre_feedforward_layernorm", "ffn_norm"), ("post_feedforward_layernorm", "post_ffw_norm"),
                 ("self_attn.q_norm", "attn_q_norm")]
        norms += [("pre_feedforward_layernorm_2", "pre_ffw_norm_2"), ("post_feedforward_layernorm_1", "post_ffw_norm_1"),
                  ("post_feedforward_layernorm_2", "post_ffw_norm_2")] if experts else [
                      ("post_per_layer_input_norm", "post_norm")]
        for ours, theirs in norms:
            f.own(p + ours + ".weight", b + theirs + ".weight", theirs)
        projections = ["q", "o"] if i >= layers - shared else ["q", "k", "o"] + (
            ["v"] if layer_types[i] == "sliding_attention" else [])
        if "k" in projections:
            f.own(p + "self_attn.k_norm.weight", b + "attn_k_norm.weight", "attn_k_norm")
        for n in projections:
            f.own(p + f"self_attn.{n}_proj.weight", b + ("attn_output" if n == "o" else f"attn_{n}") + ".weight",
                  "attn_output" if n == "o" else f"attn_{n}")
        mlp = [("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"), ("mlp.down_proj", "ffn_down")]
        for ours, theirs in mlp + ([] if experts else [("per_layer_input_gate", "inp_gate"),
                                                       ("per_layer_projection", "proj")]):
            f.own(p + ours + ".weight", b + theirs + ".weight", theirs)
        if experts:  # the router's scales near 1 (drawn as weights, they would all but silence the experts)
            for scale in ("router.scale", "router.per_expert_scale"):
                f.state[p + scale].copy_(torch.from_numpy(rng.uniform(0.5, 1.5, f.state[p + scale].shape).astype(np.float32)))
            for ours, theirs in (("router.proj.weight", "ffn_gate_inp.weight"), ("router.scale", "ffn_gate_inp.scale"),
                                 ("router.per_expert_scale", "ffn_down_exps.scale"),
                                 ("experts.gate_up_proj", "ffn_gate_up_exps.weight"),
                                 ("experts.down_proj", "ffn_down_exps.weight")):
                f.own(p + ours, b + theirs, theirs.removesuffix(".weight"))
    f.own("model.norm.weight", "output_norm.weight", "output_norm")
    return f.finish()
