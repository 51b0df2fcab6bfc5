"""Tiny GGUF files written in the test process, laid out as llama.cpp's converter writes them.

A file holds a tiny decoder of one GGUF architecture (llama, qwen2, qwen3, qwen3moe, gemma2, gemma3, phi3,
lfm2, qwen35, qwen35moe), its tensors in the GGUF types a test asks for, and a small byte-level BPE
tokenizer with a ChatML template in its metadata (262 tokens: a tokenizer of a real vocabulary would
cost seconds per file to convert). Float weights are drawn seeded and quantized with
`gguf.quants.quantize` where gguf implements the type (Q4_0, Q4_1, Q8_0, the float types); the
K-quants, which it cannot quantize, get random blocks with small fp16 scales, so their values stay in
a model's range. Llama's q/k rows are stored permuted as the converter permutes them (pairs of a
head's halves interleaved); the others' rows are not. Norm weights are drawn near 1, which for Gemma
and Qwen3.5 is what the converter writes (1 + w).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

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


def gemma_vocabulary() -> tuple[list[str], list[int]]:
    """Tokens and their GGUF types (3 control, 6 byte, 1 normal) of a tiny Gemma-style vocabulary."""
    tokens = list(GEMMA_SPECIALS) + [f"<0x{b:02X}>" for b in range(256)] + list(GEMMA_PIECES)
    return tokens, [3] * len(GEMMA_SPECIALS) + [6] * 256 + [1] * len(GEMMA_PIECES)


def _write_tokenizer(writer: gguf.GGUFWriter, arch: str) -> int:
    """The file's tokenizer and chat template; returns the vocabulary size."""
    if arch in GEMMA:
        tokens, types = gemma_vocabulary()
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores([-float(i) for i in range(len(tokens))])
        writer.add_token_types(types)
        writer.add_bos_token_id(2)
        writer.add_eos_token_id(1)
        writer.add_unk_token_id(3)
        writer.add_pad_token_id(0)
        writer.add_add_bos_token(True)
        writer.add_chat_template(GEMMA_TEMPLATE)
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
