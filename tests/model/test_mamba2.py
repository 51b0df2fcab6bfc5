"""The Mamba2 layer's chunked prefill scan (model/mamba2.py) against its token-by-token recurrence:
equal at every chunk size, from zeros and from a state, and a prompt split across steps continues
exactly from the state the first part left; a step of items of every kind (fresh and resumed
prefill chunks, single tokens) through the layer equals each item run alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixserve.kernels.cpu_extension import loaded_or_explained
from radixserve.model.attention import AttentionMetadata
from radixserve.model.mamba2 import Mamba2Mixer, chunked_scan, recurrent_reference
from radixserve.model.spec import Mamba2Spec
from radixserve.model.state_cache import StateCache, StateLayout

HEADS, HEAD_DIM, STATE = 4, 6, 5


def _inputs(n: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(n, HEADS, HEAD_DIM, generator=g)
    dt = F.softplus(torch.randn(n, HEADS, generator=g))
    decay = dt * -torch.exp(torch.randn(HEADS, generator=g))
    b, c = torch.randn(n, HEADS, STATE, generator=g), torch.randn(n, HEADS, STATE, generator=g)
    return xs, dt, decay, b, c


@pytest.mark.parametrize("chunk", [1, 3, 8, 64])
@pytest.mark.parametrize("from_state", [False, True])
def test_chunked_scan_equals_the_recurrence(chunk: int, from_state: bool) -> None:
    xs, dt, decay, b, c = _inputs(19, seed=chunk)
    state = torch.randn(HEADS, HEAD_DIM, STATE) if from_state else torch.zeros(HEADS, HEAD_DIM, STATE)
    got, got_state = chunked_scan(xs, dt, decay, b, c, state, chunk=chunk)
    want, want_state = recurrent_reference(xs, dt, decay, b, c, state)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_state, want_state, atol=1e-4, rtol=1e-4)


def test_a_scan_split_in_two_continues_from_its_state() -> None:
    inputs = _inputs(23, seed=5)
    whole, whole_state = chunked_scan(*inputs, torch.zeros(HEADS, HEAD_DIM, STATE), chunk=8)
    first, state = chunked_scan(*(t[:10] for t in inputs), torch.zeros(HEADS, HEAD_DIM, STATE), chunk=8)
    second, end = chunked_scan(*(t[10:] for t in inputs), state, chunk=8)
    torch.testing.assert_close(torch.cat([first, second]), whole, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(end, whole_state, atol=1e-4, rtol=1e-4)


class _Spec:
    hidden_size = 32
    rms_norm_eps = 1e-6


def _meta(query_lens: list[int], starts: list[int], slots: list[int]) -> AttentionMetadata:
    seq_lens = [s + n for s, n in zip(starts, query_lens)]
    return AttentionMetadata(slot_mapping=torch.zeros(0), cu_seqlens_q=torch.zeros(0), seq_lens=torch.zeros(0),
                             block_table=torch.zeros(0), query_lens=query_lens, seq_lens_host=seq_lens,
                             state_slots=slots)


def test_mixed_and_decode_steps_equal_each_item_alone() -> None:
    m = Mamba2Spec(HEADS, HEAD_DIM, STATE, groups=2, conv_kernel=4)
    torch.manual_seed(3)
    layer = Mamba2Mixer(_Spec(), m, 0)  # type: ignore[arg-type]
    for p in layer.parameters():
        p.data.normal_(0.0, 0.3)
    layout = StateLayout((m,), torch.float32)
    batched, alone = StateCache(layout, 4, torch.device("cpu")), StateCache(layout, 4, torch.device("cpu"))
    for states in (batched, alone):  # every slot holds the same stale state: fresh items ignore theirs
        torch.manual_seed(7)
        states.conv[0].normal_()
        ssm = states.ssm[0]
        assert ssm is not None
        ssm.normal_(0.0, 0.1)
    lens, starts = [1, 9, 5, 1], [0, 0, 6, 3]  # a fresh token, a fresh chunk, a resumed chunk, a token
    x = torch.randn(sum(lens), _Spec.hidden_size)
    with torch.inference_mode():
        got = layer(x, batched, _meta(lens, starts, [0, 1, 2, 3]))
        pieces, first = [], 0
        for i, (n, start) in enumerate(zip(lens, starts)):
            pieces.append(layer(x[first:first + n], alone, _meta([n], [start], [i])))
            first += n
    # fp32 rounding: a batched product sums in another order than one item's (which BLAS kernel runs
    # depends on the machine and its load: differences of 2e-5 were seen)
    close = dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got, torch.cat(pieces), **close)
    torch.testing.assert_close(batched.ssm[0], alone.ssm[0], **close)
    torch.testing.assert_close(batched.conv[0], alone.conv[0], **close)
    # a step of single tokens only (the batched update) equals each token alone
    x = torch.randn(3, _Spec.hidden_size)
    with torch.inference_mode():
        got = layer(x, batched, _meta([1, 1, 1], [10, 0, 12], [1, 3, 2]))
        pieces = [layer(x[i:i + 1], alone, _meta([1], [start], [slot]))
                  for i, (start, slot) in enumerate(zip([10, 0, 12], [1, 3, 2]))]
    torch.testing.assert_close(got, torch.cat(pieces), **close)
    torch.testing.assert_close(batched.ssm[0], alone.ssm[0], **close)


def _layer_and_states(m: Mamba2Spec, slots: int) -> tuple[Mamba2Mixer, StateCache, StateCache]:
    torch.manual_seed(3)
    layer = Mamba2Mixer(_Spec(), m, 0)  # type: ignore[arg-type]
    for p in layer.parameters():
        p.data.normal_(0.0, 0.3)
    layout = StateLayout((m,), torch.float32)
    pair = StateCache(layout, slots, torch.device("cpu")), StateCache(layout, slots, torch.device("cpu"))
    for states in pair:  # every slot holds the same stale state: fresh items ignore theirs
        torch.manual_seed(7)
        states.conv[0].normal_()
        ssm = states.ssm[0]
        assert ssm is not None
        ssm.normal_(0.0, 0.1)
    return layer, *pair


@pytest.mark.skipif(loaded_or_explained() is None, reason="the C++ extension does not build here")
@pytest.mark.parametrize("threads", [1, 2])
def test_the_cpu_kernel_equals_the_torch_scan(threads: int) -> None:
    """`radixserve::mamba2_scan` (csrc/mamba2_scan.cpp) through the layer: a step of every kind of item
    equals the torch path (the chunked scan, the batched update), on 1 or 2 threads."""
    m = Mamba2Spec(HEADS, HEAD_DIM, STATE, groups=2, conv_kernel=4)
    layer, kernel, reference = _layer_and_states(m, 4)
    lens, starts = [1, 9, 5, 1], [0, 0, 6, 3]  # a fresh token, a fresh chunk, a resumed chunk, a token
    x = torch.randn(sum(lens), _Spec.hidden_size, generator=torch.Generator().manual_seed(1))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            layer.implementation = "cpp"
            got = layer(x, kernel, _meta(lens, starts, [0, 1, 2, 3]))
            layer.implementation = "torch"
            want = layer(x, reference, _meta(lens, starts, [0, 1, 2, 3]))
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kernel.ssm[0], reference.ssm[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kernel.conv[0], reference.conv[0])


@pytest.mark.skipif(loaded_or_explained() is None, reason="the C++ extension does not build here")
def test_the_cpu_kernel_is_the_recurrence_whatever_the_batch_threads_or_chunks() -> None:
    """Each item's outputs and state are bit for bit the same alone or among others, on 1 or 2 threads, and
    with its prompt split across calls; and they are the recurrence (`recurrent_reference`)."""
    groups, lens = 2, [1, 9, 5, 1]
    xs, dt, decay, b, c = _inputs(sum(lens), seed=4)
    b, c = b[:, ::2].contiguous(), c[:, ::2].contiguous()  # [T, groups, N]: heads 0-1 read group 0, 2-3 group 1
    initial = torch.randn(4, HEADS, HEAD_DIM, STATE, generator=torch.Generator().manual_seed(5))
    fresh = [1, 1, 0, 0]

    def scan(rows: slice, slots: list[int], items: list[int], flags: list[int], states: torch.Tensor) -> torch.Tensor:
        out = torch.empty(rows.stop - rows.start, HEADS, HEAD_DIM)
        torch.ops.radixserve.mamba2_scan(xs[rows].contiguous(), dt[rows].contiguous(), decay[rows].contiguous(),
                                         b[rows].contiguous(), c[rows].contiguous(), states, slots, items, flags, out)
        return out

    together = initial.clone()
    got = scan(slice(0, sum(lens)), [0, 1, 2, 3], lens, fresh, together)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = initial.clone()
        assert torch.equal(scan(slice(0, sum(lens)), [0, 1, 2, 3], lens, fresh, one_thread), got)
        assert torch.equal(one_thread, together)
    finally:
        torch.set_num_threads(before)
    first = 0
    for i, n in enumerate(lens):
        alone = initial.clone()
        assert torch.equal(scan(slice(first, first + n), [i], [n], [fresh[i]], alone), got[first:first + n])
        assert torch.equal(alone[i], together[i])
        expand = [t[first:first + n].repeat_interleave(HEADS // groups, dim=1) for t in (b, c)]
        start = torch.zeros(HEADS, HEAD_DIM, STATE) if fresh[i] else initial[i]
        want, want_state = recurrent_reference(xs[first:first + n], dt[first:first + n], decay[first:first + n],
                                               *expand, start)
        torch.testing.assert_close(got[first:first + n], want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(together[i], want_state, atol=1e-5, rtol=1e-5)
        first += n
    split = initial.clone()  # item 1's nine tokens as four, then five from the state the four left
    head = scan(slice(1, 5), [1], [4], [1], split)
    tail = scan(slice(5, 10), [1], [5], [0], split)
    assert torch.equal(torch.cat([head, tail]), got[1:10]) and torch.equal(split[1], together[1])


def test_two_items_on_one_slot_are_refused_by_the_kernel() -> None:
    if loaded_or_explained() is None:
        pytest.skip("the C++ extension does not build here")
    x = torch.zeros(2, HEADS, HEAD_DIM)
    with pytest.raises(RuntimeError, match="belongs to two items"):
        torch.ops.radixserve.mamba2_scan(x, torch.zeros(2, HEADS), torch.zeros(2, HEADS), torch.zeros(2, 2, STATE),
                                         torch.zeros(2, 2, STATE), torch.zeros(3, HEADS, HEAD_DIM, STATE), [1, 1],
                                         [1, 1], [0, 0], torch.empty(2, HEADS, HEAD_DIM))
