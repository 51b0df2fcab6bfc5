"""Persistent inputs of the padded decode path: one packed host buffer sent by one copy per step,
and block tables that live on the device and change only where a sequence's blocks changed.

`StagedCopy`: a step's integer inputs are written into a preallocated int64 host buffer (pinned on
CUDA) and sent with one asynchronous copy into its device twin. Two host buffers alternate, so the
host fills step N+1's while step N's copy may still be queued; the engine resolves step N before it
prepares step N+2, which is what makes reusing a buffer two steps later safe. The buffers grow
(rarely: a step that brings many new sequences) and never shrink.

`BlockTableRows`: each decoding sequence owns a row of a device block table. A row is written in full
when its sequence first decodes there, or when the sequence's table was rebuilt (preemption,
re-admission: a new list object); otherwise only its new entries, plus the entry being written when
copy-on-write replaced it in place, travel as (row, column, block) deltas, except that a sequence
that ran an extend since its last decode here (verifying drafts, forced tokens) has its whole row
compared. Rows of sequences that no
longer decode are reclaimed when the rows run out. The last row is the scratch row (every entry the
scratch block), which padding rows point at.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from radixserve.core import Sequence


class StagedCopy:
    def __init__(self, capacity: int, device: torch.device) -> None:
        self.device = device
        self._pin = device.type == "cuda"
        self._host = [self._alloc_host(capacity) for _ in range(2)]
        self._device = torch.zeros(capacity, dtype=torch.long, device=device)
        self._turn = 0

    def _alloc_host(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.long, pin_memory=self._pin)

    def host(self, n: int) -> np.ndarray:
        """This step's host buffer (at least n entries) as a writable numpy view."""
        if n > self._host[self._turn].numel():
            self._host[self._turn] = self._alloc_host(2 * n)
        return self._host[self._turn].numpy()

    def send(self, n: int) -> torch.Tensor:
        """Copy the first n entries to the device (asynchronously on CUDA); their device view."""
        if n > self._device.numel():
            self._device = torch.zeros(2 * n, dtype=torch.long, device=self.device)
        out = self._device[:n]
        out.copy_(self._host[self._turn][:n], non_blocking=True)
        self._turn ^= 1
        return out


@dataclass(slots=True)
class _Row:
    index: int
    table: list[int]  # the sequence's block_table object this row mirrors
    written: list[int]  # what the device row holds, entry by entry
    last_step: int
    next_position: int = -1  # where its next decode here writes, if it runs nowhere else in between


class BlockTableRows:
    def __init__(self, num_rows: int, max_blocks: int, scratch_block: int, device: torch.device) -> None:
        self.table = torch.full((num_rows + 1, max_blocks), scratch_block, dtype=torch.int32, device=device)
        self.scratch_row = num_rows
        self._rows: dict[int, _Row] = {}  # seq_id -> its row
        self._free = list(range(num_rows - 1, -1, -1))
        self._step = 0

    def assign(self, seqs: list[Sequence], positions: list[int], block_size: int, deltas: list[int]) -> list[int]:
        """The row of each sequence, extending `deltas` with the (row, column, block) entries that
        must change on the device first. `positions[i]`: the position seqs[i] writes this step. From
        one decode here to the next (one position on), only the entry being written can have been
        replaced (copy-on-write); a sequence that ran elsewhere in between (an extend verifying drafts
        or appending forced tokens, which may copy any block it writes and roll blocks back) has its
        whole row compared."""
        self._step += 1
        out = []
        for seq, position in zip(seqs, positions):
            row = self._rows.get(seq.seq_id)
            table = seq.block_table
            if row is None or row.table is not table:
                row = self._fresh(seq, row)
            row.last_step = self._step
            written, col = row.written, position // block_size
            if position != row.next_position:
                del written[len(table):]
                changed = [c for c in range(len(written)) if written[c] != table[c]]
            else:
                changed = [col] if col < len(written) and written[col] != table[col] else []
            for c in changed:
                written[c] = table[c]
                deltas += (row.index, c, table[c])
            for c in range(len(written), len(table)):
                written.append(table[c])
                deltas += (row.index, c, table[c])
            row.next_position = position + 1
            out.append(row.index)
        return out

    def _fresh(self, seq: Sequence, old: _Row | None) -> _Row:
        if old is not None:
            index = old.index
        else:
            if not self._free:
                self._reclaim()
            index = self._free.pop()
        row = _Row(index, seq.block_table, [], self._step)
        self._rows[seq.seq_id] = row
        return row

    def _reclaim(self) -> None:
        """Free every row not used by the step being prepared (its sequences have stopped decoding)."""
        for seq_id, row in list(self._rows.items()):
            if row.last_step < self._step:
                del self._rows[seq_id]
                self._free.append(row.index)
        assert self._free, "more sequences in one step than block-table rows"

    def apply(self, deltas: torch.Tensor) -> None:
        """Write (row, column, block) triples, already on the device, into the table."""
        if deltas.numel():
            d = deltas.view(-1, 3)
            self.table.index_put_((d[:, 0], d[:, 1]), d[:, 2].to(torch.int32))
