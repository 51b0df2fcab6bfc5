"""The two layouts of quantized linear weights the dequantize-GEMM kernels (`kernels.quant_gemm`) read,
their torch references (`dequantize`), and the packing helpers the checkpoint readers repack with.
Plain torch: importable where Triton is not (a CPU-only install dequantizes these at load).

- `Fp8Weight`: `weight` [N, K] e4m3 bytes (uint8), `scale` [N, KB] fp32: row n's k-th block of
  `block_k` columns is scaled by scale[n, k // block_k]. One row scale per k-block covers per-tensor
  (a scale repeated down the rows, KB = 1), per-channel (KB = 1) and 128x128 block scales (each block
  row repeated down its rows), and lets the q/k/v or gate/up pieces of a packed projection be
  concatenated whatever their own scale shapes (`concat_rows`).
- `Int4Weight`: `qweight` [ceil(K/8), N] int32, nibble i (bits 4i..4i+3) of qweight[r, n] holding
  k = 8r + i of column n as an unsigned 0..15; `zeros` [G, N] uint8 (0..16: GPTQ v1's stored zero
  + 1 may reach 16) and `scales` [G, N] fp32 per group of `group_size` consecutive k:
  W[n, k] = (q - zeros[g, n]) * scales[g, n], g = k // group_size.

Invariant: a k tile of MIN_BLOCK_K..128 columns never straddles two scale blocks or groups, so the
kernels apply one scale per column per tile: block_k and group_size are multiples of MIN_BLOCK_K
unless a single block or group spans all of K (checked at construction).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIN_BLOCK_K = 16  # tl.dot needs K >= 16 on NVIDIA (which the interpreter would not catch)


@dataclass(frozen=True)
class Fp8Weight:
    """An FP8 e4m3 weight in the kernel layout (module docstring)."""

    weight: torch.Tensor  # [N, K] uint8 (e4m3 bits)
    scale: torch.Tensor  # [N, KB] float32
    block_k: int  # columns per scale block; >= K when KB == 1

    def __post_init__(self) -> None:
        if self.weight.dim() != 2 or self.weight.dtype != torch.uint8:
            raise ValueError(f"FP8 weight must be [N, K] uint8 e4m3 bits, got {self.weight.dtype} "
                             f"{tuple(self.weight.shape)}")
        n, k = self.weight.shape
        blocks = -(-k // self.block_k)
        if self.scale.shape != (n, blocks) or self.scale.dtype != torch.float32:
            raise ValueError(f"FP8 scale must be [{n}, {blocks}] float32 for K={k}, block_k={self.block_k}, "
                             f"got {self.scale.dtype} {tuple(self.scale.shape)}")
        if blocks > 1 and self.block_k % MIN_BLOCK_K:
            raise ValueError(f"FP8 scale blocks of {self.block_k} columns are not a multiple of {MIN_BLOCK_K}")

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.weight.shape[0]), int(self.weight.shape[1]))

    def to(self, device: torch.device) -> Fp8Weight:
        return Fp8Weight(self.weight.to(device), self.scale.to(device), self.block_k)


@dataclass(frozen=True)
class Int4Weight:
    """A 4-bit integer weight with per-group zeros and scales in the kernel layout (module docstring)."""

    qweight: torch.Tensor  # [ceil(K/8), N] int32
    zeros: torch.Tensor  # [G, N] uint8, 0..15
    scales: torch.Tensor  # [G, N] float32
    group_size: int
    in_features: int  # K

    def __post_init__(self) -> None:
        k, group = self.in_features, self.group_size
        if self.qweight.dim() != 2 or self.qweight.dtype != torch.int32 or self.qweight.shape[0] != -(-k // 8):
            raise ValueError(f"int4 qweight must be [ceil({k}/8), N] int32, got {self.qweight.dtype} "
                             f"{tuple(self.qweight.shape)}")
        n, groups = int(self.qweight.shape[1]), -(-k // group)
        if self.scales.shape != (groups, n) or self.scales.dtype != torch.float32:
            raise ValueError(f"int4 scales must be [{groups}, {n}] float32, got {self.scales.dtype} "
                             f"{tuple(self.scales.shape)}")
        if self.zeros.shape != (groups, n) or self.zeros.dtype != torch.uint8:
            raise ValueError(f"int4 zeros must be [{groups}, {n}] uint8, got {self.zeros.dtype} {tuple(self.zeros.shape)}")
        if groups > 1 and group % MIN_BLOCK_K:
            raise ValueError(f"int4 group size {group} is not a multiple of {MIN_BLOCK_K}")

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.qweight.shape[1]), self.in_features)

    def to(self, device: torch.device) -> Int4Weight:
        return Int4Weight(self.qweight.to(device), self.zeros.to(device), self.scales.to(device), self.group_size,
                          self.in_features)


QuantWeight = Fp8Weight | Int4Weight


# ---------------------------------------------------------------- torch references and packing


def e4m3_to_float(bits: torch.Tensor) -> torch.Tensor:
    """uint8 e4m3 bits -> float32 values (exact)."""
    return bits.view(torch.float8_e4m3fn).float()


def dequantize_fp8(w: Fp8Weight) -> torch.Tensor:
    """The [N, K] float32 weight an Fp8Weight stands for."""
    k = w.shape[1]
    scale = w.scale.repeat_interleave(w.block_k, dim=1)[:, :k] if w.scale.shape[1] > 1 else w.scale
    return e4m3_to_float(w.weight) * scale


def unpack_int4_along_k(qweight: torch.Tensor, in_features: int) -> torch.Tensor:
    """[ceil(K/8), N] int32 -> [K, N] int32 values 0..15 (nibble i of row r is k = 8r + i)."""
    shifts = torch.arange(0, 32, 4, device=qweight.device, dtype=torch.int32)
    nibbles = (qweight[:, None, :] >> shifts[None, :, None]) & 0xF
    return nibbles.reshape(-1, qweight.shape[1])[:in_features]


def pack_int4_along_k(values: torch.Tensor) -> torch.Tensor:
    """[K, N] integers 0..15 -> [ceil(K/8), N] int32, the inverse of `unpack_int4_along_k`."""
    if values.numel() and (int(values.min()) < 0 or int(values.max()) > 15):
        raise ValueError("4-bit values must lie in 0..15")
    k, n = values.shape
    padded = torch.zeros((-(-k // 8) * 8, n), dtype=torch.int64, device=values.device)
    padded[:k] = values.to(torch.int64)
    shifts = torch.arange(0, 32, 4, device=values.device, dtype=torch.int64)
    packed = (padded.reshape(-1, 8, n) << shifts[None, :, None]).sum(dim=1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # the top nibble sets the sign bit


def dequantize_int4(w: Int4Weight) -> torch.Tensor:
    """The [N, K] float32 weight an Int4Weight stands for."""
    k = w.in_features
    q = unpack_int4_along_k(w.qweight, k).float()
    zeros = w.zeros.float().repeat_interleave(w.group_size, dim=0)[:k]
    scales = w.scales.repeat_interleave(w.group_size, dim=0)[:k]
    return ((q - zeros) * scales).t().contiguous()


def dequantize(w: QuantWeight) -> torch.Tensor:
    return dequantize_fp8(w) if isinstance(w, Fp8Weight) else dequantize_int4(w)


def concat_rows(pieces: list[QuantWeight]) -> QuantWeight:
    """The weights of a packed projection (q/k/v, gate/up): `pieces` stacked along N, in order."""
    first = pieces[0]
    if isinstance(first, Fp8Weight):
        fp8 = [p for p in pieces if isinstance(p, Fp8Weight)]
        if len(fp8) != len(pieces) or len({p.shape[1] for p in fp8}) != 1:
            raise ValueError("the pieces of a packed FP8 projection differ in kind or in_features")
        k = first.shape[1]
        blocks = {p.block_k for p in fp8 if p.scale.shape[1] > 1}
        if len(blocks) > 1:
            raise ValueError(f"the pieces of a packed FP8 projection have different scale blocks {sorted(blocks)}")
        block_k = blocks.pop() if blocks else k
        kb = -(-k // block_k)
        scales = [p.scale.expand(-1, kb) if p.scale.shape[1] == 1 else p.scale for p in fp8]
        return Fp8Weight(torch.cat([p.weight for p in fp8]), torch.cat(scales).contiguous(), block_k)
    int4 = [p for p in pieces if isinstance(p, Int4Weight)]
    if len(int4) != len(pieces) or len({(p.group_size, p.in_features) for p in int4}) != 1:
        raise ValueError("the pieces of a packed int4 projection differ in kind, group size or in_features")
    return Int4Weight(torch.cat([p.qweight for p in int4], dim=1), torch.cat([p.zeros for p in int4], dim=1),
                      torch.cat([p.scales for p in int4], dim=1), first.group_size, first.in_features)
