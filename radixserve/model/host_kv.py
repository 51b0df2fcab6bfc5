"""The host tier's storage and the block copies between it and the device pool.

`HostKVCache` holds host blocks in a block-major tensor [num_blocks, num_layers, 2, block_size,
num_kv_heads, head_dim], so each block is one contiguous run of bytes (one DMA per run of
consecutive blocks); it is pinned on CUDA so copies are asynchronous. `apply` runs a step's
`Batch.copies` in the order the scheduler decided them, batching consecutive copies of one kind
into one gather / scatter unless a later copy of the run depends on an earlier one (a repeated
destination, or a source an earlier copy writes). On CUDA every copy is queued on the current
stream and nothing waits: the forward queued after them reads the loaded blocks, a block a
write-back reads is overwritten only by work queued later, and a host block is only ever touched
by the stream. Copies are timed per kind by `StepClock`-style marks and counted once complete
(`totals`), without a wait.

Which block belongs to whom is the scheduler's business (cache/radix_tree.py); this module only
moves bytes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from radixserve.core import BlockCopy, CopyKind
from radixserve.model.device import to_device
from radixserve.model.kv_cache import KVCache

STAGING_BYTES = 64 * 2**20  # device staging per gather/scatter: bounds the memory a large swap takes


def available_host_bytes() -> int:
    """Memory the kernel says can be allocated without swapping (MemAvailable), or physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass
class TransferTotals:
    blocks: dict[CopyKind, int] = field(default_factory=dict)
    seconds: dict[CopyKind, float] = field(default_factory=dict)


class HostKVCache:
    def __init__(self, kv: KVCache, num_blocks: int) -> None:
        layout = kv.layout
        self.kv = kv
        self.num_blocks = num_blocks
        self.bytes_per_block = layout.bytes_per_block
        self.cuda = kv.data.device.type == "cuda"
        shape = (num_blocks, layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.row)
        # on CPU, empty() leaves pages uncommitted until a block is first written
        self.data = torch.empty(shape, dtype=layout.storage_dtype, pin_memory=self.cuda)
        self.totals = TransferTotals()
        self._timing: list[tuple[CopyKind, int, Any, Any]] = []  # CUDA: (kind, blocks, start, end) not yet complete

    def apply(self, copies: list[BlockCopy]) -> None:
        for kind, src, dst in _runs(copies):
            start = self._mark()
            if kind is CopyKind.DEVICE:
                self.kv.copy_blocks(src, dst)
            elif kind is CopyKind.TO_HOST:
                self._to_host(src, dst)
            else:
                self._to_device(src, dst)
            self._timing.append((kind, len(src), start, self._mark()))
        self._collect()

    def _to_host(self, src: list[int], dst: list[int]) -> None:
        per = max(1, STAGING_BYTES // self.bytes_per_block)
        for lo in range(0, len(src), per):
            idx = to_device(src[lo:lo + per], torch.long, self.kv.data.device)
            blocks = self.kv.data[:, :, idx].permute(2, 0, 1, 3, 4, 5)  # [n, layers, 2, ...]: block-major
            if not self.cuda:
                self.data[torch.tensor(dst[lo:lo + per])] = blocks
                continue
            staged = blocks.contiguous()
            for i, j, first in _consecutive(dst[lo:lo + per]):
                self.data[first:first + j - i].copy_(staged[i:j], non_blocking=True)

    def _to_device(self, src: list[int], dst: list[int]) -> None:
        per = max(1, STAGING_BYTES // self.bytes_per_block)
        device = self.kv.data.device
        for lo in range(0, len(src), per):
            part = src[lo:lo + per]
            if self.cuda:
                staged = torch.empty((len(part), *self.data.shape[1:]), dtype=self.data.dtype, device=device)
                for i, j, first in _consecutive(part):
                    staged[i:j].copy_(self.data[first:first + j - i], non_blocking=True)
            else:
                staged = self.data[torch.tensor(part)]
            self.kv.data[:, :, to_device(dst[lo:lo + per], torch.long, device)] = staged.permute(1, 2, 0, 3, 4, 5)

    def _mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _collect(self) -> None:
        """Count the copies that completed; on CUDA, the rest stay for a later call (no wait)."""
        pending = []
        for kind, blocks, start, end in self._timing:
            if self.cuda and not end.query():
                pending.append((kind, blocks, start, end))
                continue
            seconds = float(start.elapsed_time(end)) / 1000.0 if self.cuda else end - start
            self.totals.blocks[kind] = self.totals.blocks.get(kind, 0) + blocks
            self.totals.seconds[kind] = self.totals.seconds.get(kind, 0.0) + seconds
        self._timing = pending

    def completed(self) -> TransferTotals:
        self._collect()
        return self.totals


def _runs(copies: list[BlockCopy]) -> Iterator[tuple[CopyKind, list[int], list[int]]]:
    """Consecutive copies of one kind that may run as one batched copy: none of them writes a block
    another one of the run reads or writes."""
    kind: CopyKind | None = None
    src: list[int] = []
    dst: list[int] = []
    written: set[int] = set()
    for c in copies:
        same_space = c.kind is CopyKind.DEVICE  # source and destination in one pool
        if c.kind is not kind or c.dst in written or (same_space and (c.src in written or c.dst in src)):
            if kind is not None:
                yield kind, src, dst
            kind, src, dst, written = c.kind, [], [], set()
        src.append(c.src)
        dst.append(c.dst)
        written.add(c.dst)
    if kind is not None:
        yield kind, src, dst


def _consecutive(blocks: list[int]) -> Iterator[tuple[int, int, int]]:
    """(i, j, first): blocks[i:j] == range(first, first + j - i), maximal runs in order."""
    i = 0
    while i < len(blocks):
        j = i + 1
        while j < len(blocks) and blocks[j] == blocks[j - 1] + 1:
            j += 1
        yield i, j, blocks[i]
        i = j
