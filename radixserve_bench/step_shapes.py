"""The model shapes `radixserve bench step` can run without their weights (step_bench.py): the real
config.json of Llama 3.2 1B and Llama 3.1 8B, written into a directory under the cache with the
embedded model's tokenizer, for the engine to load with `load_format="dummy"`."""

from __future__ import annotations

import json
import os
import shutil
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
