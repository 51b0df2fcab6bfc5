"""One scheduled batch as host lists of model inputs: the one place that decides where each new
token's K/V goes and which token ids are still on the device. Both forward paths build from it: the
eager path (`runner.ModelRunner.prepare`) sends the lists as fresh tensors, the padded decode path
(`decode_graphs.PaddedDecoder`) writes them into its static buffers and pads them there.

A batch's T new tokens are flattened in item order; item b (a sequence with `num_tokens` new tokens
from position `start`, any number of them: a prefill chunk, one decode token, or a draft to verify)
owns tokens cu_seqlens[b] to cu_seqlens[b+1]. Token t of it sits at position p = start + t and writes
slot block_table[p // block_size] * block_size + p % block_size. Its context length is start +
num_tokens, and it samples from its last token when that is the sequence's last token.

Pending tokens: only a sequence's last token may be PENDING_TOKEN (core.py), so only an item's last
new token can be; its id is the previous step's sampled id at `PendingInputs.rows[seq_id]`, gathered
on the device by `PendingInputs.gather_into`. Until then the host list holds PENDING_TOKEN there.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from radixserve.core import PENDING_TOKEN, Batch


@dataclass(slots=True)
class BuildTime:
    """Host seconds spent building steps' inputs so far, on either path (the eager `prepare` and the
    padded decoder's staging). One counter both add to; the engine's step clock reads `seconds` (an
    attribute, not a call) before and after a forward and charges the difference to batch building."""

    seconds: float = 0.0


@dataclass
class PendingInputs:
    """The previous step's sampled ids, still on the device: a token that is PENDING_TOKEN reads its
    id from `token_ids[rows[seq_id]]`."""

    token_ids: torch.Tensor
    rows: dict[int, int]

    def gather_into(self, input_ids: torch.Tensor, at: torch.Tensor, rows: torch.Tensor) -> None:
        """Set input_ids[at[i]] to the sampled id of row rows[i] (both on the device)."""
        input_ids[at] = self.token_ids[rows]


@dataclass(slots=True)
class BatchInputs:
    token_ids: list[int]  # [T]; PENDING_TOKEN where `pending_at` points
    positions: list[int]  # [T]
    slots: list[int]  # [T] the KV cache slot each token's K/V is written to
    query_lens: list[int]  # [B] new tokens of each item
    seq_lens: list[int]  # [B] context length of each item, its new tokens included
    block_tables: list[list[int]]  # [B] each sequence's own block_table (the list itself: read, never change)
    sample_rows: list[int]  # token indices whose logits the step needs: the last `logit_rows` of each item that samples
    pending_at: list[int]  # token indices whose id is still on the device ...
    pending_rows: list[int]  # ... at these rows of the previous step's sampled ids
    state_slots: list[int]  # [B] each sequence's recurrent-state slot (-1 for a model without recurrent layers)

    @property
    def cu_seqlens(self) -> list[int]:
        """[B+1] where each item's tokens start, and T."""
        return list(itertools.accumulate(self.query_lens, initial=0))

    def block_table_array(self) -> np.ndarray:
        """[B, max blocks] int32: the block tables as rows, padded with block 0 (never read: the
        sequence's length stops short of it)."""
        width = max(map(len, self.block_tables), default=1) or 1
        out = np.zeros((len(self.block_tables), width), dtype=np.int32)
        for row, table in zip(out, self.block_tables):
            row[:len(table)] = table
        return out


def build_inputs(batch: Batch, block_size: int, pending: PendingInputs | None = None) -> BatchInputs:
    """The batch's inputs; `pending` is needed when a scheduled last token is PENDING_TOKEN."""
    bs = block_size
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    tables: list[list[int]] = []
    sample_rows: list[int] = []
    pending_at: list[int] = []
    pending_rows: list[int] = []
    state_slots: list[int] = []
    for item in batch.items:
        seq, start, n = item.seq, item.start, item.num_tokens
        tokens, table, end = seq.token_ids, seq.block_table, start + n
        if n == 1:  # the common decode token: no ranges to build
            ids.append(tokens[start])
            positions.append(start)
            slots.append(table[start // bs] * bs + start % bs)
        else:
            ids += tokens[start:end]
            positions += range(start, end)
            p = start
            while p < end:  # one range per block the item writes, not one step per token
                block, offset = divmod(p, bs)
                run = min(end - p, bs - offset)
                first = table[block] * bs + offset
                slots += range(first, first + run)
                p += run
        if tokens[end - 1] == PENDING_TOKEN:
            assert pending is not None, "a pending token needs the previous step's sampled ids"
            pending_at.append(len(ids) - 1)
            pending_rows.append(pending.rows[seq.seq_id])
        query_lens.append(n)
        seq_lens.append(end)
        tables.append(table)
        state_slots.append(seq.state_slot)
        if end == len(tokens):  # the chunk samples: its last `logit_rows` positions give logits
            sample_rows += range(len(ids) - item.logit_rows, len(ids))
    return BatchInputs(ids, positions, slots, query_lens, seq_lens, tables, sample_rows, pending_at, pending_rows,
                       state_slots)
