"""Device and dtype rules, in one place for the engine and the benchmark's peers.

`auto` device is CUDA when present, else CPU; asking for CUDA without it is an error (never a silent
CPU fallback). `auto` dtype is bf16 on CUDA and fp32 on CPU (CPU bf16 matmuls are slower than fp32).
"""

from __future__ import annotations

from typing import Any

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but CUDA is not available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_device_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    dev = resolve_device(device)
    return dev, resolve_dtype(dtype, dev)


def to_device(values: list[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device` without waiting for the device: `torch.tensor(...,
    device=cuda)` synchronizes the stream (it would wait for the step in flight), while a
    non-blocking copy from pageable memory only stages the bytes."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)
