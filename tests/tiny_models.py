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
MISTRAL_WINDOW = 128  # smaller than the context: the spec must cap the usable context to it

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

_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral"}


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

    config = AutoConfig.for_model(_MODEL_TYPES[arch], **_COMMON, **TINY_CONFIGS[arch])
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.2)
            elif "norm" in name:
                param.uniform_(0.5, 1.5)
            elif "embed_tokens" in name or "lm_head" in name:
                param.mul_(4.0)  # logits spread ~4x wider: greedy choices far from ties
    out = _workdir() / arch
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


@functools.cache
def tiny_chat_model_dir(arch: str = "llama") -> Path:
    """The tiny `arch` checkpoint with a byte-level BPE tokenizer (special tokens at the ids the tiny
    configs name: 1 BOS, 2 and 3 EOS) and a ChatML template: what text, chat and grammar paths need."""
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
