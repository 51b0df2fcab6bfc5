"""A Qwen3.5-shaped random-weight checkpoint scaled to a 2-core CPU, for `radixserve bench run` on a
hybrid model (docs/bench/hybrid/): Qwen3.5's layer pattern (3 Gated DeltaNet layers to 1 full
attention layer), head dims and gating, at hidden 1024 and 12 layers (about 200M parameters, fp32),
with the tokenizer and chat template of `radixserve bench random-checkpoint --family qwen3.5`.

    radixserve bench random-checkpoint --family qwen3.5 --out /tmp/rs-qwen35-tiny
    python scripts/hybrid_checkpoint.py /tmp/rs-qwen35-tiny /tmp/rs-qwen35-cpu
    radixserve bench run --model /tmp/rs-qwen35-cpu --systems radixserve,radixserve-nocache \\
        --workload multi-turn,shared-prefix,random
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

LAYERS = 12


def main(tokenizer_dir: Path, out: Path) -> None:
    tiny = json.loads((tokenizer_dir / "config.json").read_text())
    config = AutoConfig.for_model(
        "qwen3_5_text", architectures=["Qwen3_5ForCausalLM"], hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=LAYERS, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
        linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, vocab_size=tiny["vocab_size"], eos_token_id=tiny["eos_token_id"],
        max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (LAYERS // 4))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    print(f"wrote {out}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
