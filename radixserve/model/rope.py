"""Rotary position embeddings: inverse frequencies, a cos/sin table, and rotation by absolute position.

Frequency schemes: "default" (plain RoPE), "linear" and "llama3" computed here; "yarn", "longrope"
and "proportional" as transformers computes them for the checkpoint's config (`RopeParams.frequencies`
holds the result, `attention_scaling` the factor they scale cos and sin by). A rotation covers the
first `rotary_dim` dimensions of a head (partial rotary: Phi-3, GLM), the rest pass through; the pairs
are the two halves of those dimensions (rotate-half, most checkpoints) or neighbours (`interleaved`,
GLM). Invariants: the table is float32 and covers positions [0, max_positions); the products
`position * inv_freq` are formed in float32 exactly as the HF reference does, so fp32 runs agree bit
for bit on cos/sin; callers keep positions below the table size (the engine caps the context length
to the spec's max_position_embeddings, which is what the table is built for).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "proportional")
_PRECOMPUTED = ("yarn", "longrope", "proportional")


@dataclass(frozen=True)
class RopeParams:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0  # linear and llama3: how much the low frequencies are stretched
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only: pretraining context
    rotary_dim: int | None = None  # dimensions rotated, None: the whole head
    interleaved: bool = False  # pairs are neighbours (2i, 2i+1), not halves (i, i + dim/2)
    attention_scaling: float = 1.0  # cos and sin are multiplied by it (yarn's mscale)
    # yarn / longrope / proportional: inv_freq as transformers has it; a GGUF file's rope_freqs: divided by them
    frequencies: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {self.rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
        if self.theta <= 0 or self.factor <= 0:
            raise ValueError("rope theta and factor must be > 0")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("llama3 rope needs high_freq_factor > low_freq_factor")
        if self.rope_type in _PRECOMPUTED and self.frequencies is None:
            raise ValueError(f"{self.rope_type} rope needs its frequencies computed from the config")

    def dim(self, head_dim: int) -> int:
        return self.rotary_dim or head_dim


def inv_frequencies(head_dim: int, params: RopeParams) -> torch.Tensor:
    """float32 [dim // 2]: the rotation speed of each dimension pair (dim: the rotated dimensions)."""
    dim = params.dim(head_dim)
    if dim % 2:
        raise ValueError(f"rotary dimension must be even, got {dim}")
    if params.frequencies is not None:
        if len(params.frequencies) != dim // 2:
            raise ValueError(f"{params.rope_type} rope has {len(params.frequencies)} frequencies for {dim} dimensions")
        return torch.tensor(params.frequencies, dtype=torch.float32)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
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
        self.rotary_dim = params.dim(head_dim)
        self.interleaved = params.interleaved
        self.max_positions = max_positions
        inv_freq = inv_frequencies(head_dim, params).to(device)
        freqs = torch.arange(max_positions, device=device).float()[:, None] * inv_freq[None, :]
        # Kept out of the state dict: derived from the config, never from the checkpoint.
        self.register_buffer("cos_table", freqs.cos() * params.attention_scaling, persistent=False)  # [max, dim/2]
        self.register_buffer("sin_table", freqs.sin() * params.attention_scaling, persistent=False)

    @property
    def plain(self) -> bool:
        """Whole heads in rotate-half pairs: what the fused Triton rotary and the C++ step take."""
        return self.rotary_dim == self.head_dim and not self.interleaved

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin of each token, [T, 1, dim] in `dtype`, shaped to broadcast over heads:
        (cos, cos) and (-sin, sin) along the rotated dimensions (each pair's two members), what
        `apply_rotary` takes."""
        cos = self.get_buffer("cos_table")[positions]
        sin = self.get_buffer("sin_table")[positions]
        if self.interleaved:
            cos = cos.repeat_interleave(2, dim=-1)
            signed_sin = torch.stack((-sin, sin), dim=-1).flatten(-2)
        else:
            cos = torch.cat((cos, cos), dim=-1)
            signed_sin = torch.cat((-sin, sin), dim=-1)
        return cos.to(dtype).unsqueeze(1), signed_sin.to(dtype).unsqueeze(1)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, head_dim] rotated over its first `rotary_dim` dimensions (a new tensor)."""
        if self.plain:
            return apply_rotary(x, cos, signed_sin)
        part, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        if self.interleaved:  # each pair (a, b) becomes (a cos - b sin, b cos + a sin)
            swapped = part.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
            rotated = part * cos + swapped * signed_sin
        else:
            rotated = apply_rotary(part, cos, signed_sin)
        return torch.cat((rotated, rest), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by the per-token angles from `RotaryEmbedding.cos_sin`: HF's
    x * cos + cat(-x2, x1) * sin, bit for bit (negating a factor is exact), with the sign moved into
    the shared sin so that a layer's rotation is a roll and three elementwise ops, not six."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin
