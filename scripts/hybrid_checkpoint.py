"""Random-weight checkpoints of hybrid shapes scaled to a 2-core CPU, for `radixserve bench` on hybrid
models (docs/bench/hybrid.md), with the tokenizer and chat template of `radixserve bench
random-checkpoint --family F`:
- `qwen3.5` (the default): Qwen3.5's layer pattern (3 Gated DeltaNet layers to 1 full attention
  layer), head dims and gating, at hidden 1024 and 12 layers (about 200M parameters, fp32);
- `gemma3`: Gemma 3 1B's attention (4 query heads, 1 kv head of 256, a 512-token window, 5 sliding
  layers to 1 full, local and global rope) at 12 layers, hidden 1152 and an MLP of 2304 (about 130M);
- `gemma4`: Gemma 4 E2B's attention (8 query heads, 1 kv head of 256 on sliding layers and of 512 on
  global ones, a 512-token window, 4 sliding layers to 1 global, proportional rope on the global ones),
  its K/V sharing (the last 4 of 10 layers read the last earlier layer of their kind's, with
  twice-wide MLPs) and per-layer embeddings of 256, at 10 layers, hidden 1024 and an MLP of 2048
  (about 160M).

    radixserve bench random-checkpoint --family qwen3.5 --out /tmp/rs-qwen35-tiny
    python scripts/hybrid_checkpoint.py /tmp/rs-qwen35-tiny /tmp/rs-qwen35-cpu
    radixserve bench random-checkpoint --family gemma3 --out /tmp/rs-gemma3-tiny
    python scripts/hybrid_checkpoint.py /tmp/rs-gemma3-tiny /tmp/rs-gemma3-cpu gemma3
    radixserve bench random-checkpoint --family gemma-4 --out /tmp/rs-gemma4-tiny
    python scripts/hybrid_checkpoint.py /tmp/rs-gemma4-tiny /tmp/rs-gemma4-cpu gemma4
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

LAYERS = 12


def _qwen35(tiny: dict) -> PretrainedConfig:
    return AutoConfig.for_model(
        "qwen3_5_text", architectures=["Qwen3_5ForCausalLM"], hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=LAYERS, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
        linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, vocab_size=tiny["vocab_size"], eos_token_id=tiny["eos_token_id"],
        max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (LAYERS // 4))


def _gemma3(tiny: dict) -> PretrainedConfig:
    return AutoConfig.for_model(
        "gemma3_text", architectures=["Gemma3ForCausalLM"], hidden_size=1152, intermediate_size=2304,
        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
        query_pre_attn_scalar=256, sliding_window=512, vocab_size=tiny["vocab_size"],
        eos_token_id=tiny["eos_token_id"], bos_token_id=tiny.get("bos_token_id"), pad_token_id=0,
        max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
        hidden_activation="gelu_pytorch_tanh",
        rope_parameters={"full_attention": dict(rope_type="default", rope_theta=1000000.0),
                         "sliding_attention": dict(rope_type="default", rope_theta=10000.0)},
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * (LAYERS // 6))


def _gemma4(tiny: dict) -> PretrainedConfig:
    layers = 10
    return AutoConfig.for_model(
        "gemma4_text", architectures=["Gemma4ForCausalLM"], hidden_size=1024, intermediate_size=2048,
        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=1, head_dim=256, global_head_dim=512,
        sliding_window=512, num_kv_shared_layers=4, use_double_wide_mlp=True, hidden_size_per_layer_input=256,
        vocab_size=tiny["vocab_size"], vocab_size_per_layer_input=tiny["vocab_size"],
        eos_token_id=tiny["eos_token_id"], bos_token_id=tiny.get("bos_token_id"), pad_token_id=0,
        max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True, final_logit_softcapping=30.0,
        hidden_activation="gelu_pytorch_tanh",
        layer_types=["full_attention" if i % 5 == 4 else "sliding_attention" for i in range(layers)])


SHAPES = {"qwen3.5": _qwen35, "gemma3": _gemma3, "gemma4": _gemma4}


def main(tokenizer_dir: Path, out: Path, shape: str = "qwen3.5") -> None:
    tiny = json.loads((tokenizer_dir / "config.json").read_text())
    config = SHAPES[shape](tiny)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    print(f"wrote {out}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), *sys.argv[3:4])
