"""GGUF's quantized weights (llama.cpp's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4) in the C++ CPU matmul.

A GGUF tensor stores each row as blocks of 32 (or 256) inputs, each block a scale or two and packed
quants. `pack_ggml` regroups a weight's rows 16 at a time, as the fp32 kernel groups outputs, and
interleaves the 16 rows' blocks: each quant byte column of the 16 rows as quads, four adjacent
columns of one row in one 32-bit lane (`csrc/ggml_formats.h` lists each format's tile). Nothing is
dequantized in memory: the packed weight holds the file's bytes (the K types' 12-byte sub-scale
field unpacked to 16 bytes: 2% more). The header says how the kernel (`radixserve::linear` on a
uint8 weight) takes its inputs, `activations`:
- "int8" (the default, llama.cpp's way): each row of inputs quantized to 8 bits per block of 32
  (scale fp16(max|x| / 127)), integer dot products of four quants at a time (VNNI where the CPU has
  it), then one fp32 multiply and add per sub-block;
- "float32": each column decoded to 16 fp32 weights in registers and the fp32 kernel's chain run
  over them, so the model computes exactly what its dequantized fp32 copy computes.

Invariants:
- a packed weight decodes, bit for bit, to what `gguf.quants.dequantize` gives for the file's rows,
  so with float32 activations `linear` over it equals `linear` over that dequantized matrix packed
  by `pack_linear`, bit for bit (tests/kernels/test_ggml_linear.py);
- with int8 activations `linear` equals the numpy emulation in tests/kernels/ggml_blocks.py bit for
  bit (tests/kernels/test_ggml_int8.py);
- either way a row's result is the same whatever the row or thread count;
- a fused projection may pack parts of different formats (rows of each part stay whole; every part
  but the last holds a multiple of 16 rows, or shares the next part's format).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

log = logging.getLogger(__name__)

LANES = 16  # outputs per packed block, as the fp32 kernel's blocks
_MAGIC = 0x31515352  # "RSQ1": the header csrc/linear.cpp checks
_HEADER_WORDS = 4
_ALIGN = 64
# how a packed weight's kernel takes its inputs, in the header's code order (csrc/linear.cpp):
# fp32 multiply-adds over the decoded weights, or 8-bit quantized rows and integer dot products
ACTIVATIONS: tuple[str, ...] = ("float32", "int8")


@dataclass(frozen=True)
class GgmlFormat:
    """One GGUF block type: its code, the inputs per block, the bytes per file block and per packed
    tile (16 rows' blocks interleaved, csrc/ggml_formats.h), and the file block's fields in the
    tile's order as (start, width, kind): "half" keeps a row's fp16 value together, "lanes" lays
    each byte column out across the 16 rows (MXFP4's exponent byte too), "columns" (quants) does so
    four columns at a time, each row's four bytes together, "scales" unpacks the K types' 12 bytes of
    6-bit sub-scales and mins into 8 + 8 byte columns."""

    name: str
    code: int
    group: int
    block_bytes: int
    tile_bytes: int
    fields: tuple[tuple[int, int, str], ...]


# the file blocks are gguf's own: Q4_0 d qs; Q4_1 d m qs; Q5_0 d qh qs; Q5_1 d m qh qs; Q8_0 d qs; Q4_K d dmin scales(12) qs;
# Q5_K d dmin scales(12) qh qs; Q6_K ql qh scales d; MXFP4 e (an E8M0 exponent) qs
FORMATS: dict[str, GgmlFormat] = {f.name: f for f in (
    GgmlFormat("Q4_0", 2, 32, 18, 288, ((0, 2, "half"), (2, 16, "columns"))),
    GgmlFormat("Q4_1", 3, 32, 20, 320, ((0, 2, "half"), (2, 2, "half"), (4, 16, "columns"))),
    GgmlFormat("Q5_0", 6, 32, 22, 352, ((0, 2, "half"), (2, 4, "columns"), (6, 16, "columns"))),
    GgmlFormat("Q5_1", 7, 32, 24, 384, ((0, 2, "half"), (2, 2, "half"), (4, 4, "columns"), (8, 16, "columns"))),
    GgmlFormat("Q8_0", 8, 32, 34, 544, ((0, 2, "half"), (2, 32, "columns"))),
    GgmlFormat("Q4_K", 12, 256, 144, 2368, ((0, 2, "half"), (2, 2, "half"), (4, 12, "scales"), (16, 128, "columns"))),
    GgmlFormat("Q5_K", 13, 256, 176, 2880,
               ((0, 2, "half"), (2, 2, "half"), (4, 12, "scales"), (16, 32, "columns"), (48, 128, "columns"))),
    GgmlFormat("Q6_K", 14, 256, 210, 3360,
               ((208, 2, "half"), (192, 16, "lanes"), (128, 64, "columns"), (0, 128, "columns"))),
    GgmlFormat("MXFP4", 39, 32, 17, 272, ((0, 1, "lanes"), (1, 16, "columns"))),
)}
SUPPORTED_TYPES: tuple[str, ...] = tuple(FORMATS)


def _tile(fmt: GgmlFormat, blocks: np.ndarray) -> np.ndarray:
    """[row_blocks, 16, groups, block_bytes] file blocks -> [row_blocks, groups, tile_bytes] tiles."""
    from gguf.quants import Q4_K

    row_blocks, _, groups, _ = blocks.shape
    pieces = []
    for start, width, kind in fmt.fields:
        field = blocks[..., start:start + width]
        if kind == "half":  # [rb, 16, g, 2] -> [rb, g, 16 * 2]
            pieces.append(field.transpose(0, 2, 1, 3).reshape(row_blocks, groups, LANES * width))
        elif kind == "lanes":  # [rb, 16, g, w] -> [rb, g, w, 16]: a byte per row, read as 16 lanes
            pieces.append(field.transpose(0, 2, 3, 1).reshape(row_blocks, groups, width * LANES))
        elif kind == "columns":  # quants as quads: [rb, 16, g, w / 4, 4] -> [rb, g, w / 4, 16, 4]
            quads = field.reshape(row_blocks, LANES, groups, width // 4, 4)
            pieces.append(quads.transpose(0, 2, 3, 1, 4).reshape(row_blocks, groups, width * LANES))
        else:  # the K types' packed 6-bit sub-scales and mins, unpacked: scale[8][16] then min[8][16]
            scales, mins = Q4_K.get_scale_min(np.ascontiguousarray(field).reshape(-1, width))
            for unpacked in (scales, mins):
                unpacked = unpacked.astype(np.uint8).reshape(row_blocks, LANES, groups, 8)
                pieces.append(unpacked.transpose(0, 2, 3, 1).reshape(row_blocks, groups, 8 * LANES))
    tiles = np.concatenate(pieces, axis=2)
    assert tiles.shape[2] == fmt.tile_bytes, (fmt.name, tiles.shape)
    return tiles


def _runs(parts: Sequence[tuple[str, np.ndarray]], in_features: int) -> list[tuple[GgmlFormat, np.ndarray]]:
    """Adjacent parts of one format joined: (format, raw rows [rows, row_bytes])."""
    runs: list[tuple[GgmlFormat, np.ndarray]] = []
    for type_name, raw in parts:
        if type_name not in FORMATS:
            raise ValueError(f"GGUF type {type_name} is not one the CPU kernels read ({', '.join(SUPPORTED_TYPES)})")
        fmt = FORMATS[type_name]
        if in_features % fmt.group:
            raise ValueError(f"{type_name} needs inputs in whole blocks of {fmt.group}; this weight has {in_features}")
        raw = np.asarray(raw, dtype=np.uint8)
        row_bytes = in_features // fmt.group * fmt.block_bytes
        if raw.ndim != 2 or raw.shape[1] != row_bytes:
            raise ValueError(f"{type_name} rows of {in_features} inputs are {row_bytes} bytes; got {raw.shape}")
        if runs and runs[-1][0] is fmt:
            runs[-1] = (fmt, np.concatenate([runs[-1][1], raw]))
        else:
            runs.append((fmt, raw))
    if not runs:
        raise ValueError("pack_ggml: no parts")
    for fmt, raw in runs[:-1]:
        if len(raw) % LANES:
            raise ValueError(f"a fused weight's {fmt.name} part has {len(raw)} rows, not a multiple of {LANES}, "
                             "and the next part has another format")
    return runs


def pack_ggml(parts: Sequence[tuple[str, np.ndarray]], in_features: int, activations: str = "int8") -> torch.Tensor:
    """The kernel's packed uint8 buffer for a weight whose rows are `parts` in order, each (GGUF type
    name, the file's bytes [rows, row_bytes]); the last block's missing rows are zero weights.
    `activations` ("int8" or "float32", ACTIVATIONS) is how the kernel meets inputs with it."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations {activations!r}: choose {' or '.join(ACTIVATIONS)}")
    runs = _runs(parts, in_features)
    tiles, formats = [], []
    for fmt, raw in runs:
        rows = len(raw)
        padded = np.zeros(((rows + LANES - 1) // LANES * LANES, raw.shape[1]), dtype=np.uint8)
        padded[:rows] = raw
        groups = in_features // fmt.group
        blocks = padded.reshape(-1, LANES, groups, fmt.block_bytes)
        tiles.append(_tile(fmt, blocks).reshape(len(blocks), -1))
        formats += [fmt.code] * len(blocks)
    count = len(formats)
    data_start = -(-(_HEADER_WORDS + 2 * count) * 8 // _ALIGN) * _ALIGN
    sizes = np.array([t.shape[1] for t in tiles for _ in range(len(t))], dtype=np.int64)
    offsets = data_start + np.concatenate([[0], np.cumsum(sizes)[:-1]])
    header = [_MAGIC, count, in_features, ACTIVATIONS.index(activations)]
    words = np.concatenate([header, np.stack([offsets, formats], axis=1).ravel()])
    buffer = np.zeros(data_start + int(sizes.sum()), dtype=np.uint8)
    buffer[:len(words) * 8] = words.astype("<i8").view(np.uint8)
    buffer[data_start:] = np.concatenate([t.ravel() for t in tiles])
    return torch.from_numpy(buffer)


def packed_activations(packed: torch.Tensor) -> str:
    """How a packed weight's kernel takes its inputs: "int8" or "float32"."""
    return ACTIVATIONS[int(packed[24:32].view(torch.int64))]


def packed_types(packed: torch.Tensor) -> dict[str, int]:
    """How many blocks of 16 rows each format holds in a packed weight."""
    count = int(packed[8:16].view(torch.int64))
    codes = packed[_HEADER_WORDS * 8:(_HEADER_WORDS + 2 * count) * 8].view(torch.int64)[1::2].tolist()
    names = {f.code: f.name for f in FORMATS.values()}
    return {name: codes.count(code) for code, name in names.items() if code in codes}


def dequantize(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The packed weight as fp32 [out_features, in] (equal to gguf.quants.dequantize of its rows)."""
    return torch.ops.radixserve.ggml_rows(packed, torch.arange(out_features))


@functools.cache
def kernels_available() -> bool:
    """Whether the C++ extension, which runs these kernels, loads on this machine."""
    from radixserve.kernels.cpu_extension import loaded_or_explained

    return loaded_or_explained() is not None


def _as_parameter(packed: torch.Tensor) -> nn.Parameter:
    return packed if isinstance(packed, nn.Parameter) else nn.Parameter(packed, requires_grad=False)


class QuantizedLinear(nn.Module):
    """y = x W^T + b with W a packed GGUF weight (`pack_ggml`) by the C++ kernel, its inputs taken as
    the weight's header says (int8 or float32 activations); x is [rows, in_features], each row's
    result the same whatever the row count."""

    def __init__(self, packed: torch.Tensor, out_features: int, in_features: int,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.weight = _as_parameter(packed)  # a tied head passes its embedding's: one buffer, held once
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = torch.ops.radixserve.linear(flat, self.weight, self.bias, self.out_features)
        return out.view(*x.shape[:-1], self.out_features)


class QuantizedEmbedding(nn.Module):
    """Token embeddings looked up from a packed GGUF weight, dequantized row by row to fp32."""

    def __init__(self, packed: torch.Tensor, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = _as_parameter(packed)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = torch.ops.radixserve.ggml_rows(self.weight, ids.reshape(-1))
        return rows.view(*ids.shape, self.embedding_dim)
