"""The batch -> inputs builder (`model/batch_inputs.py`): token ids, positions, slots, lengths, block
tables, sampling rows and pending tokens, on hand-built batches, against hand-computed values and
a one-token-at-a-time reference loop; and the eager and padded decode paths, which both build from
it, put the same values into their tensors."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import tiny_model_dir

from radixserve.core import PENDING_TOKEN, Batch, Request, ScheduledSeq, Sequence
from radixserve.model.batch_inputs import BatchInputs, PendingInputs, build_inputs
from radixserve.model.runner import ModelRunner
from radixserve.sampling_params import SamplingParams


def seq(tokens: list[int], table: list[int]) -> Sequence:
    return Sequence(Request("r", tokens[:1], SamplingParams()), 0, tokens, 1, block_table=table)


def reference(batch: Batch, block_size: int, pending: PendingInputs | None) -> dict[str, list]:
    """Token by token: which block a position falls in is counted, not divided."""
    out: dict[str, list] = {k: [] for k in ("ids", "positions", "slots", "seq_lens", "sample", "at", "rows")}
    for item in batch.items:
        s = item.seq
        for pos in range(item.start, item.start + item.num_tokens):
            block, offset = 0, pos
            while offset >= block_size:
                block, offset = block + 1, offset - block_size
            if s.token_ids[pos] == PENDING_TOKEN:
                assert pending is not None
                out["at"].append(len(out["ids"]))
                out["rows"].append(pending.rows[s.seq_id])
            out["ids"].append(s.token_ids[pos])
            out["positions"].append(pos)
            out["slots"].append(s.block_table[block] * block_size + offset)
        out["seq_lens"].append(item.start + item.num_tokens)
        if item.start + item.num_tokens == len(s.token_ids):
            out["sample"].append(len(out["ids"]) - 1)
    return out


def check_against_reference(x: BatchInputs, batch: Batch, block_size: int, pending: PendingInputs | None) -> None:
    ref = reference(batch, block_size, pending)
    assert x.token_ids == ref["ids"]
    assert x.positions == ref["positions"]
    assert x.slots == ref["slots"]
    assert x.seq_lens == ref["seq_lens"]
    assert x.query_lens == [it.num_tokens for it in batch.items]
    assert x.cu_seqlens[-1] == len(ref["ids"]) and len(x.cu_seqlens) == len(batch.items) + 1
    assert x.sample_rows == ref["sample"]
    assert (x.pending_at, x.pending_rows) == (ref["at"], ref["rows"])


def test_hand_computed_mixed_batch() -> None:
    # block size 4. a: a chunk from mid-block position 2 over two block boundaries, reaching its end;
    # b: one decode token whose id is still on the device; c: the first chunk of a longer prompt
    a = seq(list(range(100, 109)), [7, 3, 9])
    b = seq([5, 6, 7, 8, 9, PENDING_TOKEN], [1, 4])
    c = seq(list(range(200, 209)), [2, 6, 8])
    batch = Batch([ScheduledSeq(a, 2, 7), ScheduledSeq(b, 5, 1), ScheduledSeq(c, 0, 4)])
    pending = PendingInputs(torch.tensor([50, 51, 52]), {b.seq_id: 2, a.seq_id: 0})
    x = build_inputs(batch, 4, pending)
    assert x.token_ids == [102, 103, 104, 105, 106, 107, 108, PENDING_TOKEN, 200, 201, 202, 203]
    assert x.positions == [2, 3, 4, 5, 6, 7, 8, 5, 0, 1, 2, 3]
    assert x.slots == [30, 31, 12, 13, 14, 15, 36, 17, 8, 9, 10, 11]
    assert x.query_lens == [7, 1, 4] and x.cu_seqlens == [0, 7, 8, 12]
    assert x.seq_lens == [9, 6, 4]
    assert x.sample_rows == [6, 7]  # c's chunk stops short of its last token
    assert (x.pending_at, x.pending_rows) == ([7], [2])
    assert x.block_table_array().tolist() == [[7, 3, 9], [1, 4, 0], [2, 6, 8]]
    assert x.block_tables[0] is a.block_table
    check_against_reference(x, batch, 4, pending)


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
def test_random_batches_match_the_reference_loop(block_size: int) -> None:
    rng = random.Random(block_size)
    for _ in range(40):
        items, rows = [], {}
        for _ in range(rng.randint(1, 6)):
            length = rng.randint(1, 70)
            tokens = [rng.randint(0, 999) for _ in range(length)]
            if rng.random() < 0.4:  # a sampled id still in flight: only ever the last token
                tokens[-1] = PENDING_TOKEN
            table = rng.sample(range(500), -(-length // block_size))
            s = seq(tokens, table)
            # a whole prompt, a chunk of it from anywhere, one decode token, or a draft of k+1 to verify
            start = rng.choice([0, rng.randrange(length), length - 1, max(0, length - rng.randint(2, 5))])
            end = rng.choice([length, rng.randint(start + 1, length)])
            items.append(ScheduledSeq(s, start, end - start))
            rows[s.seq_id] = rng.randrange(8)
        batch = Batch(items)
        pending = PendingInputs(torch.arange(8), rows)
        check_against_reference(build_inputs(batch, block_size, pending), batch, block_size, pending)


def test_several_new_tokens_ending_in_a_pending_one() -> None:
    # speculative decoding's shape: k+1 new tokens, the last one still on the device
    s = seq([1, 2, 3, 4, 5, 6, 7, PENDING_TOKEN], [4, 2])
    batch = Batch([ScheduledSeq(s, 4, 4)])
    pending = PendingInputs(torch.tensor([0, 77]), {s.seq_id: 1})
    x = build_inputs(batch, 4, pending)
    assert x.slots == [8, 9, 10, 11] and x.sample_rows == [3]
    assert (x.pending_at, x.pending_rows) == ([3], [1])
    ids = torch.tensor(x.token_ids)
    pending.gather_into(ids, torch.tensor(x.pending_at), torch.tensor(x.pending_rows))
    assert ids.tolist() == [5, 6, 7, 77]


def test_a_pending_token_needs_the_sampled_ids() -> None:
    s = seq([1, 2, PENDING_TOKEN], [0])
    with pytest.raises(AssertionError, match="previous step's sampled ids"):
        build_inputs(Batch([ScheduledSeq(s, 2, 1)]), 4)


def test_empty_batch() -> None:
    x = build_inputs(Batch([]), 4)
    assert x.token_ids == [] and x.cu_seqlens == [0] and x.block_table_array().shape == (0, 1)


def test_eager_and_padded_paths_put_the_same_inputs_in_their_tensors() -> None:
    bs = 4
    runner = ModelRunner(str(tiny_model_dir("llama")), "float32", "cpu", "torch", bs)
    runner.allocate_kv_cache(64)
    runner.prepare_decode(8, 64)
    decoder, kv = runner.decoder, runner.kv_cache
    assert decoder is not None and kv is not None
    seqs = [seq([3] * 7 + [PENDING_TOKEN], [10, 11]),  # last slot of a block
            seq([4] * 9, [20, 21, 22]),  # first slot of a block
            seq([5] * 3 + [PENDING_TOKEN], [30])]
    batch = Batch([ScheduledSeq(s, len(s.token_ids) - 1, 1) for s in seqs])
    pending = PendingInputs(torch.tensor([90, 91, 92]), {seqs[0].seq_id: 2, seqs[2].seq_id: 0})
    eager = runner.prepare(batch, pending)
    lens, sampling = decoder._fill(batch, 4, pending)  # three rows padded to four
    b = decoder.buffers
    assert eager.input_ids.tolist() == b.input_ids[:3].tolist() == [92, 4, 90]
    assert eager.positions.tolist() == b.positions[:3].tolist() == [7, 8, 3]
    assert eager.meta.slot_mapping.tolist() == b.slot_mapping[:3].tolist() == [47, 88, 123]
    assert eager.meta.seq_lens.tolist() == b.seq_lens[:3].tolist() == lens[:3] == [8, 9, 4]
    assert eager.sample_rows.tolist() == sampling == [0, 1, 2]
    for row, s in enumerate(seqs):
        width = len(s.block_table)
        assert eager.meta.block_table[row, :width].tolist() == b.block_table[row, :width].tolist() == s.block_table
    scratch = kv.scratch_block
    assert (b.input_ids[3], b.positions[3], b.slot_mapping[3], b.seq_lens[3]) == (0, 0, scratch * bs, 1)
    assert set(b.block_table[3].tolist()) == {scratch}
