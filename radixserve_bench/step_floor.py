"""The memory floor of `radixserve bench step` (step_bench.py): the bytes one decode step must read
(`weight_bytes`, plus the KV the bench counts), the device's copy bandwidth (`measure_bandwidth`),
and the time reading those bytes once at that bandwidth takes (`floor_ms`): no decode step can be
faster on a memory-bound device."""

from __future__ import annotations

import statistics
import time

import torch

from radixserve.model.decoder import CausalLM


def measure_bandwidth(device: torch.device, nbytes: int, repeats: int = 5) -> float:
    """Bytes per second of a large copy (read + written), median of `repeats` after one warm-up."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    del src, dst
    return 2 * nbytes / statistics.median(times[1:])


def weight_bytes(model: CausalLM, batch: int) -> int:
    """Bytes of weights one decode step of `batch` sequences reads: every parameter once (a tied
    embedding counts once: the LM head reads all of it), but an untied input embedding only the
    `batch` rows its lookup reads."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # shared (tied) params once
    embed = model.model.embed_tokens.weight
    head = getattr(model.lm_head, "weight", None)
    if model.lm_head is not None and head is not embed:  # untied: the lookup reads `batch` rows only
        # by share of the rows: a GGUF model's embedding is a packed byte buffer, not a matrix
        vocab = model.spec.vocab_size
        total -= (vocab - batch) * (embed.numel() * embed.element_size()) // vocab
    return total


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def floor_ms(bytes_per_step: float, bandwidth: float) -> float:
    """Milliseconds reading `bytes_per_step` once takes at `bandwidth` bytes per second."""
    return 1000 * bytes_per_step / bandwidth
