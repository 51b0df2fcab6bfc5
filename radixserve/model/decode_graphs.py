"""Decode steps from static buffers, padded to a ladder of batch sizes, replayed as CUDA graphs.

A decode-only step (every item one new token) of B sequences is padded to the smallest captured
size >= B. Its inputs, as `batch_inputs.build_inputs` computes them for every path (token ids,
positions, cache slots, sequence lengths, pending tokens), plus each row's block-table row, are
staged in one persistent host buffer and sent with one copy (`step_buffers.StagedCopy`); block
tables live on the device and change by deltas (`step_buffers.BlockTableRows`). A few device ops
then fill the static buffers (a pending token's id is taken from the previous step's sampled ids
there); the forward and the LM head read those buffers and write the logits of every padded row
into a static logits buffer. On CUDA with the Triton backend each size is captured once as a CUDA
graph at engine start and a step is one replay; elsewhere (CPU, or the torch backend on CUDA) the
very same padded path runs eagerly, so its padding and bucketing are exercised by every CPU test.
`--enforce-eager` bypasses this module altogether.

Window blocks (`--sliding-window-kv window-blocks`): the sliding layers read their K/V from the window
group's pool, through the step's window view (model/window_view.py). Each step stages its map of KV
block -> window block (`Batch.window_blocks`, every block its rows read or write in their windows)
beside the other inputs, and the view, kept in static buffers here, is made from it on the device,
as the eager path makes one per step. A graph then replays over those buffers.

Recurrent layers (hybrid models, on the Triton kernels): each row is one item of the kernels' item
table (`kernels/recurrent.StepItems`), whose slots and fresh flags are staged with the other inputs
into static buffers and put in the step's plans, where every recurrent layer finds them
(`causal_conv.step_items`). Padding rows start fresh in the state pool's scratch slot.

Invariants: padding rows hold token 0 at position 0 with one cached token, their slot is the first
slot of the KV cache's scratch block and their block-table row is the scratch row, so they
write and read only the scratch block, which no sequence ever owns (in the window view, only the
window group's scratch block; in the state pool, only its scratch slot); a captured graph's launch
parameters (decode split counts) are sized for the longest sequence the engine allows, so a replay
is right for any live lengths; the logits buffer is overwritten by the next step, so callers use
the returned view before they run another step.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from radixserve.core import Batch
from radixserve.model.attention import AttentionMetadata
from radixserve.model.batch_inputs import BuildTime, PendingInputs, build_inputs
from radixserve.model.causal_conv import RECURRENT_ITEMS
from radixserve.model.device import to_device
from radixserve.model.step_buffers import BlockTableRows, StagedCopy
from radixserve.model.window_view import WindowView, check_written_blocks_mapped

log = logging.getLogger(__name__)
_SEGMENTS = 5  # staged per row: token id, position, slot, length, block-table row


Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]  # ids, positions, meta -> logits


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to and including max_batch: padding wastes at most 15 rows."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
    return sorted(set(sizes))


def bucket_for(batch: int, sizes: list[int]) -> int | None:
    """The smallest size >= batch, or None when the batch is larger than every size."""
    i = bisect.bisect_left(sizes, batch)
    return sizes[i] if i < len(sizes) else None


@dataclass
class DecodeBuffers:
    """Static device inputs for up to `max_batch` decode rows, and pinned host staging for them."""

    input_ids: torch.Tensor  # [max_batch] int64
    positions: torch.Tensor  # [max_batch] int64
    slot_mapping: torch.Tensor  # [max_batch] int64
    seq_lens: torch.Tensor  # [max_batch] int32
    block_table: torch.Tensor  # [max_batch, max_blocks] int32
    cu_seqlens_q: torch.Tensor  # [max_batch + 1] int32: 0, 1, 2, ... (one token per row, never changes)
    logits: torch.Tensor  # [max_batch, vocab] float32: the LM head's output for every row

    @classmethod
    def allocate(cls, max_batch: int, max_blocks: int, vocab: int, device: torch.device) -> DecodeBuffers:
        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        return cls(
            input_ids=zeros(max_batch, dtype=torch.long), positions=zeros(max_batch, dtype=torch.long),
            slot_mapping=zeros(max_batch, dtype=torch.long), seq_lens=zeros(max_batch, dtype=torch.int32),
            block_table=zeros(max_batch, max_blocks, dtype=torch.int32),
            cu_seqlens_q=torch.arange(max_batch + 1, dtype=torch.int32, device=device),
            logits=zeros(max_batch, vocab, dtype=torch.float32),
        )


@dataclass
class RecurrentRows:
    """The recurrent layers' item table over the padded rows, in static buffers: row b is item b."""

    starts: torch.Tensor  # [max_batch + 1] int32: 0, 1, 2, ... (never changes)
    slots: torch.Tensor  # [max_batch] int32: each row's state slot, the scratch slot for padding
    fresh: torch.Tensor  # [max_batch] int32: 1 where a row starts from zeros (position 0, and padding)
    scratch_slot: int

    @classmethod
    def allocate(cls, max_batch: int, scratch_slot: int, device: torch.device) -> RecurrentRows:
        return cls(starts=torch.arange(max_batch + 1, dtype=torch.int32, device=device),
                   slots=torch.full((max_batch,), scratch_slot, dtype=torch.int32, device=device),
                   fresh=torch.ones(max_batch, dtype=torch.int32, device=device), scratch_slot=scratch_slot)


class PaddedDecoder:
    """Runs decode-only batches through the padded static-buffer path, from CUDA graphs when captured."""

    def __init__(self, max_batch: int, max_seq_len: int, block_size: int, scratch_block: int, vocab: int,
                 device: torch.device, build_time: BuildTime | None = None, window_scratch_block: int | None = None,
                 scratch_slot: int | None = None) -> None:
        """`window_scratch_block`: the window group's scratch block where the model has one (the KV
        cache's scratch block is its last, so its blocks number `scratch_block`). `scratch_slot`: the
        state pool's scratch slot where the model has recurrent layers (on the Triton kernels)."""
        self.sizes = capture_sizes(max_batch)
        self.max_seq_len = max_seq_len
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.device = device
        max_blocks = -(-max_seq_len // block_size)
        self.rows = self.sizes[-1]
        self.buffers = DecodeBuffers.allocate(self.rows, max_blocks, vocab, device)
        self.window = None if window_scratch_block is None else \
            WindowView.allocate(scratch_block, window_scratch_block, self.rows, self.rows, max_blocks, device)
        self.recurrent = None if scratch_slot is None else RecurrentRows.allocate(self.rows, scratch_slot, device)
        self._state_slots: list[int] = []  # the last step's, padding included (host copies for the meta)
        # then per pending row its token index and sampled-id row, then block-table deltas
        self.staging = StagedCopy((_SEGMENTS + 2) * self.rows + 3 * 4 * self.rows, device)
        self.tables = BlockTableRows(2 * self.rows, max_blocks, scratch_block, device)
        self._padding = (0, 0, scratch_block * block_size, 1, self.tables.scratch_row)  # what a padding row holds
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.build_time = build_time or BuildTime()  # `_fill`'s seconds go here (the runner's counter)

    def accepts(self, batch: Batch) -> bool:
        return 0 < len(batch.items) <= self.sizes[-1] and all(it.num_tokens == 1 for it in batch.items)

    def run(self, batch: Batch, forward: Forward, pending: PendingInputs | None = None) -> torch.Tensor:
        """Logits [rows, vocab] of the items that sample, as `ModelRunner.run` returns them."""
        rows = len(batch.items)
        size = bucket_for(rows, self.sizes)
        assert size is not None, "accepts() first"
        started = time.perf_counter()
        lens, sampling = self._fill(batch, size, pending)
        self.build_time.seconds += time.perf_counter() - started
        graph = self.graphs.get(size)
        if graph is not None:
            graph.replay()
        else:
            b = self.buffers
            b.logits[:size] = forward(b.input_ids[:size], b.positions[:size], self._meta(size, lens))
        logits = self.buffers.logits[:rows]
        return logits if len(sampling) == rows else logits[to_device(sampling, torch.long, logits.device)]

    def _fill(self, batch: Batch, size: int, pending: PendingInputs | None = None) -> tuple[list[int], list[int]]:
        """Stage the batch's rows (from `build_inputs`), then padding rows up to `size`, into one host
        buffer; send it with one copy and spread it into the static buffers on the device. Returns
        each row's length and the rows that sample."""
        x = build_inputs(batch, self.block_size, pending)
        m, n, p = self.rows, len(x.token_ids), len(x.pending_at)  # one token per row: n rows
        deltas: list[int] = []
        table_rows = self.tables.assign([it.seq for it in batch.items], x.positions, self.block_size, deltas)
        fixed = _SEGMENTS * m
        at_map = fixed + 2 * p + len(deltas)  # then the window blocks' map: its KV blocks, then theirs
        companions = batch.window_blocks if self.window is not None else {}
        if self.window is not None:
            check_written_blocks_mapped(x.slots, companions, self.block_size)
        at_items = at_map + 2 * len(companions)  # then, with recurrent layers, each row's slot and fresh flag
        used = at_items + (2 * size if self.recurrent is not None else 0)
        host = self.staging.host(used)
        for k, (values, filler) in enumerate(zip((x.token_ids, x.positions, x.slots, x.seq_lens, table_rows),
                                                 self._padding)):
            host[k * m:k * m + n] = values
            host[k * m + n:k * m + size] = filler
        host[fixed:fixed + p] = x.pending_at
        host[fixed + p:fixed + 2 * p] = x.pending_rows
        host[fixed + 2 * p:at_map] = deltas
        host[at_map:at_map + len(companions)] = list(companions)
        host[at_map + len(companions):at_items] = list(companions.values())
        if self.recurrent is not None:
            self._state_slots = x.state_slots + [self.recurrent.scratch_slot] * (size - n)
            host[at_items:at_items + size] = self._state_slots
            host[at_items + size:used] = [int(length == 1) for length in x.seq_lens] + [1] * (size - n)
        dev = self.staging.send(used)
        seg = dev[:fixed].view(_SEGMENTS, m)[:, :size]
        self.tables.apply(dev[fixed + 2 * p:at_map])
        b = self.buffers
        b.input_ids[:size] = seg[0]
        if p:
            assert pending is not None
            pending.gather_into(b.input_ids, dev[fixed:fixed + p], dev[fixed + p:fixed + 2 * p])
        b.positions[:size] = seg[1]
        b.slot_mapping[:size] = seg[2]
        b.seq_lens[:size] = seg[3]
        torch.index_select(self.tables.table, 0, seg[4], out=b.block_table[:size])
        if self.window is not None:
            self.window.fill(dev[at_map:at_items], b.slot_mapping[:size], b.block_table[:size], self.block_size)
        if self.recurrent is not None:
            self.recurrent.slots[:size] = dev[at_items:at_items + size]
            self.recurrent.fresh[:size] = dev[at_items + size:used]
        return x.seq_lens + [1] * (size - n), x.sample_rows

    def _meta(self, size: int, lens: list[int], graph: bool = False) -> AttentionMetadata:
        b = self.buffers

        def over(slots: torch.Tensor, table: torch.Tensor) -> AttentionMetadata:
            return AttentionMetadata(
                slot_mapping=slots[:size], cu_seqlens_q=b.cu_seqlens_q[: size + 1], seq_lens=b.seq_lens[:size],
                block_table=table[:size], query_lens=[1] * size, seq_lens_host=lens,
                max_seq_len=self.max_seq_len if graph else max(lens),
            )

        meta = over(b.slot_mapping, b.block_table)
        if self.window is not None:
            meta.window = over(self.window.slot_mapping, self.window.block_table)
        if self.recurrent is not None:
            from radixserve.kernels.recurrent import StepItems

            r = self.recurrent
            meta.state_slots = self._state_slots[:size]
            meta.plans[RECURRENT_ITEMS] = StepItems(r.starts[:size + 1], r.slots[:size], r.fresh[:size], longest=1)
        return meta

    def capture(self, forward: Forward) -> None:
        """Capture one CUDA graph per size, largest first so the smaller ones reuse its memory pool."""
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        pool = torch.cuda.graph_pool_handle()
        b = self.buffers
        for size in reversed(self.sizes):
            lens, _ = self._fill(Batch([], []), size)  # all padding: capture reads only the scratch block
            # eager first: compiles the kernels and settles launch configs outside the capture
            b.logits[:size] = forward(b.input_ids[:size], b.positions[:size], self._meta(size, lens, graph=True))
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                b.logits[:size] = forward(b.input_ids[:size], b.positions[:size], self._meta(size, lens, graph=True))
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        self.graph_bytes = max(0, free_before - torch.cuda.mem_get_info(self.device)[0])
        log.info("captured %d CUDA graphs for decode batches %s in %.1f s, using %.0f MiB of device memory",
                 len(self.graphs), self.sizes, self.capture_seconds, self.graph_bytes / 2**20)
