"""Write a random-weight HF checkpoint of a real model's shapes (for end-to-end GPU benchmarks
against transformers, which needs weights on disk; `radixserve bench step` needs none).

    radixserve bench random-checkpoint --shape llama-3.2-1b --out /tmp/rs-1b [--tokenizer DIR]

transformers builds the model from the shape's config.json (its own initialisation, bf16, on the
GPU when there is one) and saves it as safetensors; the tokenizer files are copied from --tokenizer.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from radixserve_bench.step_shapes import SHAPES, write_shape_dir


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer", default=None, help="directory holding tokenizer.json etc.")
    p.add_argument("--seed", type=int, default=0)


def run(a: argparse.Namespace) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = Path(a.tokenizer) if a.tokenizer and Path(a.tokenizer).is_dir() else None
    out = write_shape_dir(SHAPES[a.shape], Path(a.out), tokenizer)
    torch.manual_seed(a.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out), dtype=torch.bfloat16)
    model.save_pretrained(out)
    print(f"wrote {a.shape} with random weights to {out}")
    return 0
