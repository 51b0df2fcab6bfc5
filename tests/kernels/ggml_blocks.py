"""GGUF blocks for the kernel tests: random blocks of each format, gguf's own dequantization, and the
int8-activation GGUF matmul (`radixserve::linear` on a weight packed with activations="int8")
written again in numpy from the GGUF file's bytes, op for op in fp32, so a test can ask for the
kernel's bits exactly.

Each row's inputs are quantized per block of 32: d = fp16(max|x| / 127), q = round-half-even(x *
(127 / max|x|)). Each weight sub-block is w = scale * (quant - offset) + minimum (GGUF's own fields:
scale d or d * sub-scale, minimum m or -dmin * sub-min). Then, over the 32-input segments in order
(Q6_K: its two 16-input halves in order), each a separate fp32 multiply and add:
    acc = acc + (scale * d) * (sum quant * q - offset * sum q)
    acc = acc + minimum * (d * sum q)                  (where the format has a minimum)
and finally + bias.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import Q4_K, dequantize

from radixserve.kernels.ggml_quants import FORMATS

F32 = np.float32


def random_blocks(name: str, rows: int, in_features: int, seed: int) -> np.ndarray:
    """A GGUF tensor's bytes [rows, row_bytes] of random quants, with finite fp16 scales (random
    bytes in a scale field would be NaN or huge about one time in thirty)."""
    fmt = FORMATS[name]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, in_features // fmt.group, fmt.block_bytes), dtype=np.uint8)
    if name == "MXFP4":  # exponents near 2^0 (a random one reaches 2^127, where products overflow), and the subnormal two
        exponents = rng.integers(118, 136, size=blocks.shape[:2])
        exponents[:, 0] = rng.integers(0, 2, size=rows)
        blocks[..., 0] = exponents
    for start, _, kind in fmt.fields:
        if kind == "half":
            scales = rng.uniform(-0.02, 0.02, size=blocks.shape[:2]).astype(np.float16)
            blocks[..., start:start + 2] = scales.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)


def reference(name: str, raw: np.ndarray, in_features: int) -> torch.Tensor:
    return torch.from_numpy(dequantize(raw, GGMLQuantizationType[name]).reshape(len(raw), in_features).copy())


@dataclass
class SubBlocks:
    """A weight as [rows, sub-blocks] scales/minimums and [rows, in] unsigned quants."""

    width: int  # inputs per sub-block: 32, or 16 for Q6_K
    scale: np.ndarray
    minimum: np.ndarray | None
    quants: np.ndarray
    offset: int


def _halves(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(F32)[..., 0]


def sub_blocks(name: str, raw: np.ndarray, in_features: int) -> SubBlocks:
    """The file's rows [rows, row_bytes] of GGUF type `name` split into scales and quants."""
    rows = len(raw)
    if name == "MXFP4":  # the doubled E2M1 values offset by 12, scaled by 2^(e - 128)
        blocks = raw.reshape(rows, -1, 17)
        exponent = blocks[..., 0].astype(np.uint32)
        bits = np.where(exponent < 2, np.uint32(0x00200000) << exponent, (exponent - 1) << np.uint32(23))
        qs = blocks[..., 1:].astype(np.int64)
        codes = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(rows, in_features)
        values = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12])
        return SubBlocks(32, bits.astype(np.uint32).view(F32), None, values[codes] + 12, 12)
    if name in ("Q4_0", "Q4_1", "Q8_0"):
        block_bytes = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[name]
        blocks = raw.reshape(rows, -1, block_bytes)
        d = _halves(blocks[..., 0:2])
        if name == "Q8_0":
            quants = blocks[..., 2:].view(np.int8).astype(np.int64) + 128
            return SubBlocks(32, d, None, quants.reshape(rows, in_features), 128)
        start = 4 if name == "Q4_1" else 2
        qs = blocks[..., start:start + 16].astype(np.int64)
        quants = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(rows, in_features)
        if name == "Q4_0":
            return SubBlocks(32, d, None, quants, 8)
        return SubBlocks(32, d, _halves(blocks[..., 2:4]), quants, 0)
    if name in ("Q5_0", "Q5_1"):  # Q4_0's and Q4_1's nibbles and a fifth bit each, bit j of a 32-bit qh for input j
        start = 2 if name == "Q5_0" else 4
        blocks = raw.reshape(rows, -1, 22 if name == "Q5_0" else 24)
        d = _halves(blocks[..., 0:2])
        qh = np.ascontiguousarray(blocks[..., start:start + 4]).view("<u4").astype(np.int64)  # [rows, groups, 1]
        qs = blocks[..., start + 4:start + 20].astype(np.int64)
        low = np.concatenate([qs & 15, qs >> 4], axis=-1)  # [rows, groups, 32]
        quants = (low | (((qh >> np.arange(32)) & 1) << 4)).reshape(rows, in_features)
        if name == "Q5_0":
            return SubBlocks(32, d, None, quants, 16)
        return SubBlocks(32, d, _halves(blocks[..., 2:4]), quants, 0)
    if name in ("Q4_K", "Q5_K"):
        block_bytes = 144 if name == "Q4_K" else 176
        blocks = raw.reshape(rows, -1, block_bytes)
        groups = blocks.shape[1]
        d, dmin = _halves(blocks[..., 0:2]), _halves(blocks[..., 2:4])
        sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(blocks[..., 4:16]).reshape(-1, 12))
        sc = sc.reshape(rows, groups, 8).astype(F32)
        mn = mn.reshape(rows, groups, 8).astype(F32)
        qs = blocks[..., -128:].reshape(rows, groups, 4, 1, 32).astype(np.int64)
        quants = np.concatenate([qs & 15, qs >> 4], axis=3).reshape(rows, groups, 256)
        if name == "Q5_K":
            qh = blocks[..., 16:48].astype(np.int64)  # bit s of byte j: input 32 s + j
            high = (qh[:, :, None, :] >> np.arange(8)[None, None, :, None]) & 1
            quants = quants | (high.reshape(rows, groups, 256) << 4)
        scale = (d[..., None] * sc).astype(F32)
        minimum = -(dmin[..., None] * mn).astype(F32)
        return SubBlocks(32, scale.reshape(rows, -1), minimum.reshape(rows, -1), quants.reshape(rows, in_features), 0)
    assert name == "Q6_K", name
    blocks = raw.reshape(rows, -1, 210)
    groups = blocks.shape[1]
    ql = blocks[..., 0:128].reshape(rows, groups, 2, 2, 32).astype(np.int64)  # [c][t % 2][l]
    qh = blocks[..., 128:192].reshape(rows, groups, 2, 1, 32).astype(np.int64)  # [c][l]
    sc = blocks[..., 192:208].view(np.int8).astype(F32)
    d = _halves(blocks[..., 208:210])
    low = np.concatenate([ql & 15, ql >> 4], axis=3)  # [c][t][l], t = 0..3
    high = (qh >> (2 * np.arange(4))[None, None, None, :, None]) & 3
    quants = (low | (high << 4)).reshape(rows, in_features)
    return SubBlocks(16, (d[..., None] * sc).astype(F32).reshape(rows, -1), None, quants, 32)


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows [R, in] fp32 -> int quants [R, in] and scales d [R, in / 32] (the kernel's edge cases: all
    zeros, a block too small for 127 / max to be finite, a non-finite input making d NaN)."""
    blocks = x.astype(F32).reshape(len(x), -1, 32)
    finite = np.isfinite(blocks).all(axis=-1)
    most = np.abs(np.where(np.isfinite(blocks), blocks, F32(0))).max(axis=-1)
    with np.errstate(divide="ignore", over="ignore"):
        inverse = (F32(127) / most).astype(F32)
        d = (most / F32(127)).astype(np.float16).astype(F32)
    usable = finite & (most > 0) & np.isfinite(inverse)
    d = np.where(finite, d, F32(np.nan)).astype(F32)
    with np.errstate(invalid="ignore"):
        q = np.where(usable[..., None], np.rint(blocks * np.where(usable, inverse, F32(0))[..., None]), 0)
    return q.astype(np.int64).reshape(x.shape), d


def int8_linear(x: np.ndarray, parts: list[tuple[str, np.ndarray]], in_features: int,
                bias: np.ndarray | None = None) -> np.ndarray:
    """What the kernel computes for fp32 rows x [R, in] and a weight whose rows are `parts`."""
    q, d = quantize_rows(x)
    outputs = []
    for name, raw in parts:
        w = sub_blocks(name, raw, in_features)
        acc = np.zeros((len(x), len(raw)), dtype=F32)
        for i in range(in_features // w.width):
            k = slice(i * w.width, (i + 1) * w.width)
            count = q[:, k] @ w.quants[:, k].T  # exact: int64
            total = q[:, k].sum(axis=1)
            da = d[:, i * w.width // 32][:, None]
            scaled = (w.scale[None, :, i] * da).astype(F32)
            acc = (acc + scaled * (count - w.offset * total[:, None]).astype(F32)).astype(F32)
            if w.minimum is not None:
                acc = (acc + w.minimum[None, :, i] * (da * total[:, None].astype(F32))).astype(F32)
        outputs.append(acc)
    out = np.concatenate(outputs, axis=1)
    return out if bias is None else (out + bias.astype(F32)).astype(F32)
