"""transformers' own eager decode forward, timed beside `radixserve bench step`'s rows (step_bench.py).

The model: `AutoModelForCausalLM.from_pretrained(model_dir, dtype=<the engine's dtype>,
attn_implementation="sdpa")` when the directory holds weights (*.safetensors or *.bin), else
`from_config` of its config.json with transformers' random init (the `--shape llama-*` directories
hold no weights; the weights' values do not change the time); on the engine's device, in eval mode,
under `torch.inference_mode()`. If transformers cannot build it, the comparison is skipped with the
reason.

For each batch size: the same `batch` prompts of `context` token ids the engine ran, as one batch
(equal lengths: no padding, no attention mask) through one untimed prefill into a fresh `DynamicCache`,
then `warmup` untimed and `steps` timed single-token forwards, each feeding every sequence its
previous argmax. One timed step is `model(next_ids, cache=cache, logits_to_keep=1)` plus the
argmax that picks the next ids, by `time.perf_counter` (on CUDA synchronized before and after); the
figure is the median. No scheduling, no sampling beyond argmax, no detokenization: transformers'
forward alone, against which the engine's whole step (forward, sampling and host work) is compared.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from radixserve_bench.step_floor import sync

WEIGHT_SUFFIXES = (".safetensors", ".bin")


@dataclass
class HFForward:
    """transformers' decode forward per batch size, or why it was not timed."""

    source: str | None = None  # "checkpoint" (its weights) or "random-init" (config only)
    skipped: str | None = None
    step_ms: dict[int, list[float]] = field(default_factory=dict)  # per batch size, each timed forward

    def ms(self, batch: int) -> float | None:
        times = self.step_ms.get(batch)
        return statistics.median(times) if times else None

    def to_json(self) -> dict[str, Any]:
        return dict(source=self.source, skipped=self.skipped, attn_implementation="sdpa",
                    ms_median={str(b): self.ms(b) for b in self.step_ms},
                    step_ms={str(b): t for b, t in self.step_ms.items()})


def load_hf(model_dir: str, device: torch.device, dtype: torch.dtype) -> tuple[Any, str]:
    """The transformers model of `model_dir` and where its weights came from."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    model: Any
    hf_logging.disable_progress_bar()
    if Path(model_dir).is_file():  # a GGUF: transformers dequantizes it (slow, but once per bench)
        gguf = Path(model_dir)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype,
                                                     attn_implementation="sdpa")
        return model.to(device).eval(), "checkpoint"
    if any(p.suffix in WEIGHT_SUFFIXES for p in Path(model_dir).iterdir()):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
        return model.to(device).eval(), "checkpoint"
    config = AutoConfig.from_pretrained(model_dir)
    with device:  # random init where it runs: fast on a GPU, no host copy of an 8B model
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval(), "random-init"


@torch.inference_mode()
def time_decode(model: Any, prompts: list[list[int]], steps: int, warmup: int) -> list[float]:
    """Milliseconds of each of `steps` single-token forwards (+ argmax) of the batch (module docstring)."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    ids = torch.tensor(prompts, dtype=torch.long, device=device)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
    times: list[float] = []
    for i in range(warmup + steps):
        sync(device)
        t0 = time.perf_counter()
        out = model(input_ids=next_ids, cache=cache, use_cache=True, logits_to_keep=1)
        next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
        sync(device)
        if i >= warmup:
            times.append(1000 * (time.perf_counter() - t0))
    if cache.get_seq_length() != len(prompts[0]) + warmup + steps:
        raise RuntimeError(f"the cache holds {cache.get_seq_length()} tokens, not prefill + every forward")
    return times


def hf_forward(model_dir: str, device: torch.device, dtype: torch.dtype, prompts: dict[int, list[list[int]]],
               steps: int, warmup: int) -> HFForward:
    """Time transformers' decode forward for each batch size's prompts (module docstring)."""
    result = HFForward()
    try:
        model, result.source = load_hf(model_dir, device, dtype)
    except Exception as e:  # an architecture or config transformers does not take: say so, time nothing
        result.skipped = f"transformers could not build the model: {type(e).__name__}: {e}"[:300]
        return result
    try:
        for batch, batch_prompts in prompts.items():
            result.step_ms[batch] = time_decode(model, batch_prompts, steps, warmup)
    finally:
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result
