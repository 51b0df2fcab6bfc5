"""Loading the peers' transformers model from the very directory radixserve loads, with the same
dtype and device, so every system runs the same weights."""

from __future__ import annotations

from typing import Any

from radixserve.model.device import resolve_device_dtype


def load_hf_model(model_dir: str, device: str, dtype: str, attn_implementation: str = "sdpa") -> Any:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar (the benchmark's) is enough on the terminal

    dev, dt = resolve_device_dtype(device, dtype)
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dt, attn_implementation=attn_implementation)
    return model.to(dev).eval()


def eos_ids(model: Any) -> list[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = model.config.eos_token_id
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else [int(e) for e in eos]


_MODELS: dict[tuple[str, str, str, str], Any] = {}


def shared_hf_model(model_dir: str, device: str, dtype: str, user: str) -> Any:
    """One loaded model per (directory, device, dtype, user) for the whole benchmark, so repeats do not
    reload weights; each peer gets its own instance because continuous batching swaps the attention
    implementation of the model it runs."""
    key = (model_dir, device, dtype, user)
    if key not in _MODELS:
        _MODELS[key] = load_hf_model(model_dir, device, dtype)
    return _MODELS[key]


def release_hf_models() -> None:
    _MODELS.clear()
