"""The padded decode path's persistent inputs: device block-table rows change only where a
sequence's blocks changed (a new block, copy-on-write of the block being written, a rebuilt table),
rows are reclaimed from sequences that stopped decoding, and the staged copy grows when needed."""

from __future__ import annotations

import torch

from radixserve.core import Request, Sequence
from radixserve.model.step_buffers import BlockTableRows, StagedCopy
from radixserve.sampling_params import SamplingParams

SCRATCH = 99


def seq(table: list[int]) -> Sequence:
    req = Request("r", [1, 2], SamplingParams())
    return Sequence(req, 0, [1, 2], 2, block_table=table)


def triples(deltas: list[int]) -> list[tuple[int, ...]]:
    return [tuple(deltas[i:i + 3]) for i in range(0, len(deltas), 3)]


def assign(rows: BlockTableRows, seqs: list[Sequence], positions: list[int],
           block_size: int = 1) -> tuple[list[int], list[tuple[int, ...]]]:
    deltas: list[int] = []
    out = rows.assign(seqs, positions, block_size, deltas)
    rows.apply(torch.tensor(deltas, dtype=torch.long))
    return out, triples(deltas)


def test_rows_change_only_when_a_sequence_gains_or_replaces_a_block() -> None:
    rows = BlockTableRows(4, 6, SCRATCH, torch.device("cpu"))
    a, b = seq([3, 4]), seq([7])
    (ra, rb), deltas = assign(rows, [a, b], [1, 0])
    assert deltas == [(ra, 0, 3), (ra, 1, 4), (rb, 0, 7)]  # first decode: whole rows
    assert assign(rows, [a, b], [1, 0])[1] == []  # nothing changed: nothing sent
    a.block_table.append(5)
    assert assign(rows, [a, b], [2, 0])[1] == [(ra, 2, 5)]  # one new block: one entry
    b.block_table[0] = 8  # copy-on-write replaced the block being written, in place
    assert assign(rows, [a, b], [2, 0])[1] == [(rb, 0, 8)]
    a.block_table = [3, 4, 6]  # rebuilt (preempted and re-admitted): written again in full
    assert assign(rows, [a, b], [2, 0])[1] == [(ra, 0, 3), (ra, 1, 4), (ra, 2, 6)]
    assert rows.table[ra, :3].tolist() == [3, 4, 6] and rows.table[rb, 0] == 8
    assert rows.table[rows.scratch_row].tolist() == [SCRATCH] * 6


def test_rows_of_sequences_that_stopped_decoding_are_reclaimed() -> None:
    rows = BlockTableRows(2, 4, SCRATCH, torch.device("cpu"))
    first = [seq([1]), seq([2])]
    assign(rows, first, [0, 0])
    later = [seq([5]), seq([6])]
    got, deltas = assign(rows, later, [0, 0])
    assert sorted(got) == [0, 1] and len(deltas) == 2
    assert sorted(rows.table[:2, 0].tolist()) == [5, 6]


def test_staged_copy_sends_what_was_written_and_grows() -> None:
    staged = StagedCopy(4, torch.device("cpu"))
    staged.host(3)[:3] = [5, 6, 7]
    assert staged.send(3).tolist() == [5, 6, 7]
    staged.host(10)[:10] = range(10)  # larger than the buffers: both sides grow
    assert staged.send(10).tolist() == list(range(10))


def test_a_sequence_that_ran_an_extend_in_between_has_its_row_compared_in_full() -> None:
    """A verifying extend copied an earlier block (copy-on-write) and rolled a later one back, then
    decoding resumes here: every entry that changed is sent, not only the one being written."""
    rows = BlockTableRows(2, 6, SCRATCH, torch.device("cpu"))
    a = seq([3, 4])
    (ra,), _ = assign(rows, [a], [4], block_size=4)  # decodes position 4 (block column 1)
    assert assign(rows, [a], [5], block_size=4)[1] == []  # the next position: nothing to send
    a.block_table[1] = 9  # an extend over positions 6..9 copied column 1 ...
    a.block_table.append(10)
    del a.block_table[2:]  # ... and its rejected drafts' block went back
    a.block_table.append(11)  # decoding resumes at position 8 in a fresh block
    assert assign(rows, [a], [8], block_size=4)[1] == [(ra, 1, 9), (ra, 2, 11)]
    assert rows.table[ra, :3].tolist() == [3, 9, 11]
