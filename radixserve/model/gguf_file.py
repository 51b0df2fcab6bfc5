"""A GGUF file's metadata and tensor table, read in milliseconds, its tensor data memory-mapped.

`gguf.GGUFReader` builds a numpy view per element of every metadata array: a 49k-token vocabulary
costs it about 4 s per open. Serving needs only the scalar and string values and short per-layer
arrays (the tokenizer's arrays are read once, by transformers, when the tokenizer is converted and
cached), so this reader decodes scalar arrays of at most `SMALL_ARRAY` items into lists and steps over
every other array without decoding it, keeping it as its item type and length.

Layout (GGUF v2/v3, little-endian): magic, version u32, tensor count u64, metadata count u64; the
metadata as (key string, type u32, value); the tensor infos as (name string, n_dims u32, dims u64 x
n_dims with the fastest-moving first, type u32, offset u64 from the data start); then the data,
starting at the next multiple of `general.alignment` (32 by default). A string is a u64 length
and UTF-8 bytes. Invariant: a file that breaks this layout raises ValueError naming what is wrong;
nothing past the file's end is ever read.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9
SMALL_ARRAY = 1024  # scalar arrays up to this long (per-layer settings) are decoded; longer ones (a vocabulary's) not
# metadata value types: struct format by GGUF type code
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


@dataclass(frozen=True)
class ArrayValue:
    """A metadata array left undecoded: its item type code, length and where its items start in the file."""

    item_type: int
    count: int
    offset: int = -1


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_code: int  # gguf.GGMLQuantizationType's value
    dims: tuple[int, ...]  # GGUF order: the fastest-moving (input) dimension first
    offset: int  # from the data start


class _Cursor:
    def __init__(self, buf: memoryview, name: str) -> None:
        self.buf, self.pos, self.name = buf, 0, name

    def unpack(self, fmt: str, whole: bool = False) -> Any:
        """The value `fmt` reads at pos (`whole`: every value it reads, as a tuple)."""
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ValueError(f"{self.name}: the GGUF header runs past the end of the file (truncated?)")
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return values if whole else values[0]

    def string(self) -> str:
        length = self.unpack("<Q")
        if self.pos + length > len(self.buf):
            raise ValueError(f"{self.name}: a GGUF string runs past the end of the file (truncated?)")
        value = bytes(self.buf[self.pos:self.pos + length]).decode("utf-8", errors="replace")
        self.pos += length
        return value

    def skip_strings(self, count: int) -> None:
        unpack, buf, pos = struct.unpack_from, self.buf, self.pos
        for _ in range(count):
            if pos + 8 > len(buf):
                raise ValueError(f"{self.name}: a GGUF string array runs past the end of the file (truncated?)")
            pos += 8 + unpack("<Q", buf, pos)[0]
        self.pos = pos

    def value(self, type_code: int) -> Any:
        if type_code in _SCALARS:
            return self.unpack(_SCALARS[type_code])
        if type_code == STRING:
            return self.string()
        if type_code == ARRAY:
            item_type, count = self.unpack("<I"), self.unpack("<Q")
            offset = self.pos
            if item_type == STRING:
                self.skip_strings(count)
            elif item_type in _SCALARS and count <= SMALL_ARRAY:  # per-layer settings: decoded
                return list(self.unpack("<" + _SCALARS[item_type][1] * count, whole=True))
            elif item_type in _SCALARS:
                self.pos += count * struct.calcsize(_SCALARS[item_type])
            else:
                raise ValueError(f"{self.name}: GGUF arrays of type {item_type} are not supported")
            return ArrayValue(item_type, count, offset)
        raise ValueError(f"{self.name}: unknown GGUF metadata type {type_code}")


class GGUFContents:
    """The metadata (scalars, strings and short scalar arrays as lists; other arrays as `ArrayValue`),
    the tensor infos in file order, and the memory-mapped file their data is read from."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        cursor = _Cursor(memoryview(self._map), self.path.name)  # type: ignore[arg-type]
        if bytes(self._map[:4]) != MAGIC:
            raise ValueError(f"{self.path.name} is not a GGUF file (it does not start with the GGUF magic bytes)")
        cursor.pos = 4
        version = cursor.unpack("<I")
        if version not in VERSIONS:
            raise ValueError(f"{self.path.name}: GGUF version {version} is not supported; supported: 2, 3")
        tensor_count, kv_count = cursor.unpack("<Q"), cursor.unpack("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = cursor.string()
            self.metadata[key] = cursor.value(cursor.unpack("<I"))
        self.tensors: list[TensorInfo] = []
        for _ in range(tensor_count):
            name = cursor.string()
            dims = tuple(cursor.unpack("<Q") for _ in range(cursor.unpack("<I")))
            self.tensors.append(TensorInfo(name, cursor.unpack("<I"), dims, cursor.unpack("<Q")))
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        self.data_start = -(-cursor.pos // alignment) * alignment

    def string_positions(self, key: str, wanted: tuple[str, ...]) -> dict[str, int]:
        """Where each of `wanted` first occurs in the string array `key` (a vocabulary: a token's id), found
        by comparing bytes, without decoding the array; strings not in it are left out."""
        array = self.metadata.get(key)
        if not isinstance(array, ArrayValue) or array.item_type != STRING:
            return {}
        encoded = {text.encode(): text for text in wanted}
        lengths = {len(b) for b in encoded}
        buf, pos = memoryview(self._map), array.offset  # type: ignore[arg-type]
        found: dict[str, int] = {}
        for index in range(array.count):
            length = struct.unpack_from("<Q", buf, pos)[0]
            if length in lengths and (text := encoded.get(bytes(buf[pos + 8:pos + 8 + length]))) is not None:
                found.setdefault(text, index)
            pos += 8 + length
        return found

    def data(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes as `gguf.GGUFReader` presents them: F32/F16 (and the integer types) as
        their numpy type in [rows, cols] (a vector: [n]); block types and BF16 as uint8 [rows, row_bytes]."""
        import gguf

        qtype = gguf.GGMLQuantizationType(info.type_code)
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        cols, rows = info.dims[0], int(np.prod(info.dims[1:], dtype=np.int64))
        if cols % block:
            raise ValueError(f"{self.path.name}: tensor {info.name} has rows of {cols}, not whole {qtype.name} blocks")
        row_bytes = cols // block * block_bytes
        start = self.data_start + info.offset
        if start + rows * row_bytes > len(self._map):
            raise ValueError(f"{self.path.name}: tensor {info.name} runs past the end of the file (truncated?)")
        raw = self._map[start:start + rows * row_bytes]
        typed = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                 "I32": np.int32, "I64": np.int64}.get(qtype.name)
        if typed is not None:
            values = raw.view(typed)
            return values if len(info.dims) == 1 else values.reshape(rows, cols)
        return raw if len(info.dims) == 1 else raw.reshape(rows, row_bytes)
