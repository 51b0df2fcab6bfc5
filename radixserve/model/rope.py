"""Rotary position embeddings: inverse frequencies, a cos/sin table, and rotation by absolute position.

Supports the "default" (plain RoPE), "linear" and "llama3" frequency schemes, full rotary dimension
only. Convention is rotate-half (the first and second halves of a head are the pair), as in the HF
checkpoints. Invariants: the table is float32 and covers positions [0, max_positions); the products
`position * inv_freq` are formed in float32 exactly as the HF reference does, so fp32 runs agree bit
for bit on cos/sin; callers keep positions below the table size (the engine caps the context length
to the spec's max_position_embeddings, which is what the table is built for).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeParams:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0  # linear and llama3: how much the low frequencies are stretched
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only: pretraining context

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {self.rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
        if self.theta <= 0 or self.factor <= 0:
            raise ValueError("rope theta and factor must be > 0")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("llama3 rope needs high_freq_factor > low_freq_factor")


def inv_frequencies(head_dim: int, params: RopeParams) -> torch.Tensor:
    """float32 [head_dim // 2]: the rotation speed of each dimension pair."""
    if head_dim % 2:
        raise ValueError(f"rotary head_dim must be even, got {head_dim}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (params.theta**exponents)
    if params.rope_type == "linear":
        return inv_freq / params.factor
    if params.rope_type == "llama3":
        return _llama3_scale(inv_freq, params)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, p: RopeParams) -> torch.Tensor:
    # Wavelengths shorter than the high-frequency cutoff are kept, longer than the low-frequency
    # cutoff are slowed by `factor`, and the band between blends the two linearly in 1/wavelength.
    wavelen = 2 * math.pi / inv_freq
    short_cutoff = p.original_max_position_embeddings / p.high_freq_factor
    long_cutoff = p.original_max_position_embeddings / p.low_freq_factor
    slowed = inv_freq / p.factor
    blend = (p.original_max_position_embeddings / wavelen - p.low_freq_factor) / (
        p.high_freq_factor - p.low_freq_factor
    )
    mixed = (1 - blend) * inv_freq / p.factor + blend * inv_freq
    out = torch.where(wavelen > long_cutoff, slowed, inv_freq)
    in_band = (wavelen >= short_cutoff) & (wavelen <= long_cutoff)
    return torch.where(in_band, mixed, out)


class RotaryEmbedding(torch.nn.Module):
    """Holds the cos/sin table and rotates q/k of a flattened token batch by their positions."""

    def __init__(self, head_dim: int, max_positions: int, params: RopeParams, device: torch.device) -> None:
        super().__init__()
        if max_positions < 1:
            raise ValueError("max_positions must be >= 1")
        self.head_dim = head_dim
        self.max_positions = max_positions
        inv_freq = inv_frequencies(head_dim, params).to(device)
        freqs = torch.arange(max_positions, device=device).float()[:, None] * inv_freq[None, :]
        # Kept out of the state dict: derived from the config, never from the checkpoint.
        self.register_buffer("cos_table", freqs.cos(), persistent=False)  # [max_positions, D/2]
        self.register_buffer("sin_table", freqs.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin of each token, [T, 1, D] in `dtype`, shaped to broadcast over heads:
        (cos, cos) and (-sin, sin) along D, what `apply_rotary` takes."""
        cos = self.get_buffer("cos_table")[positions]
        sin = self.get_buffer("sin_table")[positions]
        cos = torch.cat((cos, cos), dim=-1).to(dtype).unsqueeze(1)
        signed_sin = torch.cat((-sin, sin), dim=-1).to(dtype).unsqueeze(1)
        return cos, signed_sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by the per-token angles from `RotaryEmbedding.cos_sin`: HF's
    x * cos + cat(-x2, x1) * sin, bit for bit (negating a factor is exact), with the sign moved into
    the shared sin so that a layer's rotation is a roll and three elementwise ops, not six."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin
