"""The recurrent layers' Triton kernels (kernels/recurrent.py) under the interpreter, against the torch
code of model/delta_net.py, model/mamba2.py and model/causal_conv.py: a step of every kind of item (a
fresh token, a fresh chunk, a chunk resumed from its slot, a resumed token, items shorter than the
convolution's window, items of whole and partial chunks of the scans' chunked form) in one launch
equals each item through the torch reference; each item's results and state are bit for bit the same
alone or among others, and with its prompt split across steps token by token, or in the chunked form
where the split falls on a chunk's edge; items shorter than a chunk run token by token; slots no item
names are untouched; bad calls are refused; the kernels compile for sm_90, the scans on tensor cores."""

from __future__ import annotations

import pytest
import torch
from test_kernels import _run_without_interpreter

from radixserve.kernels.recurrent import PREFILL_CHUNK, StepItems, causal_conv, gated_delta_rule, mamba2_scan
from radixserve.model.attention import AttentionMetadata
from radixserve.model.causal_conv import CausalConv
from radixserve.model.delta_net import GatedDeltaNet
from radixserve.model.mamba2 import recurrent_reference

LENS = [1, 9, 5, 1, 2]  # a fresh token, a fresh chunk, a resumed chunk, a resumed token, a resumed pair
FRESH = [True, True, False, False, False]
SLOTS = [4, 0, 2, 1, 5]  # out of order; slot 3 belongs to no item
# the chunked form: two chunks and 8 tokens, a token, a chunk and one token, exactly a chunk, 5 tokens
LONG = [2 * PREFILL_CHUNK + 8, 1, PREFILL_CHUNK + 1, PREFILL_CHUNK, 5]
POOL = 6
CPU = torch.device("cpu")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _spans(lens: list[int]) -> list[slice]:
    first, spans = 0, []
    for n in lens:
        spans.append(slice(first, first + n))
        first += n
    return spans


def _delta_inputs(tokens: int, heads: int, dk: int, dv: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = _gen(seed)
    q = torch.nn.functional.normalize(torch.randn(tokens, heads, dk, generator=g), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(tokens, heads, dk, generator=g), dim=-1)
    v = torch.randn(tokens, heads, dv, generator=g)
    beta = torch.rand(tokens, heads, generator=g)
    decay = torch.rand(tokens, heads, generator=g) * 0.5 + 0.5
    return q, k, v, beta, decay


def _delta_reference(inputs: tuple[torch.Tensor, ...], states: torch.Tensor, lens: list[int], slots: list[int],
                     fresh: list[bool]) -> torch.Tensor:
    q, k, v, beta, decay = inputs
    out = torch.empty_like(v)
    for span, slot, zero in zip(_spans(lens), slots, fresh):
        state = torch.zeros_like(states[slot]) if zero else states[slot].clone()
        for t in range(span.start, span.stop):
            state = GatedDeltaNet._step(state[None], q[t:t + 1], k[t:t + 1], v[t:t + 1], beta[t:t + 1],
                                        decay[t:t + 1], out[t:t + 1])[0]
        states[slot] = state
    return out


def _delta(inputs: tuple[torch.Tensor, ...], states: torch.Tensor, lens: list[int], slots: list[int],
           fresh: list[bool], rows: slice | None = None, chunk: int = PREFILL_CHUNK) -> torch.Tensor:
    rows = rows or slice(0, sum(lens))
    q, k, v, beta, decay = (t[rows].contiguous() for t in inputs)
    out = torch.empty_like(v)
    gated_delta_rule(q, k, v, beta, decay, states, StepItems.make(lens, slots, fresh, CPU), out, chunk)
    return out


@pytest.mark.parametrize("lens", [LENS, LONG])
@pytest.mark.parametrize("heads, dk, dv", [(2, 8, 12), (3, 16, 16), (1, 256, 40)])  # last: two value tiles
def test_delta_rule_equals_the_torch_recurrence(heads: int, dk: int, dv: int, lens: list[int]) -> None:
    inputs = _delta_inputs(sum(lens), heads, dk, dv, seed=dk)
    initial = torch.randn(POOL, heads, dk, dv, generator=_gen(1)) * 0.1
    got_states, want_states = initial.clone(), initial.clone()
    got = _delta(inputs, got_states, lens, SLOTS, FRESH)
    want = _delta_reference(inputs, want_states, lens, SLOTS, FRESH)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_states, want_states, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_states[3], initial[3])


@pytest.mark.parametrize("chunk", [0, PREFILL_CHUNK])
def test_delta_rule_is_batch_and_split_invariant(chunk: int) -> None:
    heads, dk, dv = 2, 16, 8
    inputs = _delta_inputs(sum(LONG), heads, dk, dv, seed=5)
    initial = torch.randn(POOL, heads, dk, dv, generator=_gen(2)) * 0.1
    together = initial.clone()
    got = _delta(inputs, together, LONG, SLOTS, FRESH, chunk=chunk)
    for i, span in enumerate(_spans(LONG)):
        alone = initial.clone()
        assert torch.equal(_delta(inputs, alone, [LONG[i]], [SLOTS[i]], [FRESH[i]], span, chunk), got[span])
        assert torch.equal(alone[SLOTS[i]], together[SLOTS[i]])
    span = _spans(LONG)[0]  # the fresh item split after its first chunk (any split, token by token)
    cut = PREFILL_CHUNK if chunk else 5
    split = initial.clone()
    head = _delta(inputs, split, [cut], [2], [True], slice(span.start, span.start + cut), chunk)
    tail = _delta(inputs, split, [LONG[0] - cut], [2], [False], slice(span.start + cut, span.stop), chunk)
    assert torch.equal(torch.cat([head, tail]), got[span]) and torch.equal(split[2], together[SLOTS[0]])


def test_items_shorter_than_a_chunk_run_token_by_token() -> None:
    """Decode steps and draft verification: the same bits as the token-by-token kernel."""
    inputs = _delta_inputs(sum(LENS), 2, 16, 8, seed=6)
    initial = torch.randn(POOL, 2, 16, 8, generator=_gen(7)) * 0.1
    chunked, tokens = initial.clone(), initial.clone()
    assert torch.equal(_delta(inputs, chunked, LENS, SLOTS, FRESH), _delta(inputs, tokens, LENS, SLOTS, FRESH, chunk=0))
    assert torch.equal(chunked, tokens)
    xs, dt, decay, b, c = _mamba_inputs(sum(LENS), 4, 2, 8, 16, seed=8)
    outs, pools = [], []
    for chunk in (PREFILL_CHUNK, 0):
        pools.append(torch.randn(POOL, 4, 8, 16, generator=_gen(9)) * 0.1)
        outs.append(torch.empty_like(xs))
        mamba2_scan(xs, dt, decay, b, c, pools[-1], StepItems.make(LENS, SLOTS, FRESH, CPU), outs[-1], chunk)
    assert torch.equal(outs[0], outs[1]) and torch.equal(pools[0], pools[1])


def _mamba_inputs(tokens: int, heads: int, groups: int, p: int, n: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = _gen(seed)
    xs = torch.randn(tokens, heads, p, generator=g)
    dt = torch.rand(tokens, heads, generator=g) * 0.5
    decay = -dt * torch.rand(heads, generator=g)
    b, c = (torch.randn(tokens, groups, n, generator=g) for _ in range(2))
    return xs, dt, decay, b, c


@pytest.mark.parametrize("lens", [LENS, LONG])
@pytest.mark.parametrize("heads, groups, p, n", [(4, 2, 6, 8), (2, 1, 16, 16), (2, 2, 48, 256)])  # last: 2 tiles
def test_mamba2_scan_equals_the_recurrence(heads: int, groups: int, p: int, n: int, lens: list[int]) -> None:
    xs, dt, decay, b, c = _mamba_inputs(sum(lens), heads, groups, p, n, seed=p)
    initial = torch.randn(POOL, heads, p, n, generator=_gen(3)) * 0.1
    got_states, want_states = initial.clone(), initial.clone()
    got = torch.empty_like(xs)
    mamba2_scan(xs, dt, decay, b, c, got_states, StepItems.make(lens, SLOTS, FRESH, CPU), got)
    per_group = heads // groups
    for span, slot, zero in zip(_spans(lens), SLOTS, FRESH):
        start = torch.zeros_like(initial[slot]) if zero else initial[slot]
        want, want_states[slot] = recurrent_reference(xs[span], dt[span], decay[span],
                                                      b[span].repeat_interleave(per_group, dim=1),
                                                      c[span].repeat_interleave(per_group, dim=1), start)
        torch.testing.assert_close(got[span], want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_states, want_states, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_states[3], initial[3])


@pytest.mark.parametrize("chunk", [0, PREFILL_CHUNK])
def test_mamba2_scan_is_batch_and_split_invariant(chunk: int) -> None:
    heads, groups, p, n = 4, 2, 8, 16
    inputs = _mamba_inputs(sum(LONG), heads, groups, p, n, seed=9)
    initial = torch.randn(POOL, heads, p, n, generator=_gen(4)) * 0.1

    def scan(states: torch.Tensor, lens: list[int], slots: list[int], fresh: list[bool], rows: slice) -> torch.Tensor:
        xs, dt, decay, b, c = (t[rows].contiguous() for t in inputs)
        out = torch.empty_like(xs)
        mamba2_scan(xs, dt, decay, b, c, states, StepItems.make(lens, slots, fresh, CPU), out, chunk)
        return out

    together = initial.clone()
    got = scan(together, LONG, SLOTS, FRESH, slice(0, sum(LONG)))
    for i, span in enumerate(_spans(LONG)):
        alone = initial.clone()
        assert torch.equal(scan(alone, [LONG[i]], [SLOTS[i]], [FRESH[i]], span), got[span])
        assert torch.equal(alone[SLOTS[i]], together[SLOTS[i]])
    span, split = _spans(LONG)[0], initial.clone()
    cut = 2 * PREFILL_CHUNK if chunk else 6  # on a chunk's edge for the chunked form
    head = scan(split, [cut], [2], [True], slice(span.start, span.start + cut))
    tail = scan(split, [LONG[0] - cut], [2], [False], slice(span.start + cut, span.stop))
    assert torch.equal(torch.cat([head, tail]), got[span]) and torch.equal(split[2], together[SLOTS[0]])


def _meta(lens: list[int], fresh: list[bool]) -> AttentionMetadata:
    return AttentionMetadata(slot_mapping=torch.zeros(0), cu_seqlens_q=torch.zeros(0), seq_lens=torch.zeros(0),
                             block_table=torch.zeros(0), query_lens=lens,
                             seq_lens_host=[n if f else n + 7 for n, f in zip(lens, fresh)], state_slots=[])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kernel, bias, channels", [(4, True, 10), (4, False, 200), (2, True, 3), (3, False, 16)])
@pytest.mark.parametrize("lens", [LENS, [1, 1, 1, 1, 1], [20, 1, 17, 2, 3]])  # mixed, a decode step, long chunks
def test_causal_conv_equals_the_torch_convolution(dtype: torch.dtype, kernel: int, bias: bool, channels: int,
                                                  lens: list[int]) -> None:
    conv = CausalConv(channels, kernel, bias)
    g = _gen(kernel * channels)
    for p in conv.parameters():
        p.data = torch.randn(p.shape, generator=g).to(dtype)
    inputs = torch.randn(sum(lens), channels, generator=g).to(dtype)
    windows = torch.randn(POOL, kernel - 1, channels, generator=g).to(dtype)
    fresh = FRESH if lens is LENS else [i % 3 == 0 for i in range(len(lens))]
    want_windows, got_windows = windows.clone(), windows.clone()
    want = conv(inputs, want_windows, SLOTS, fresh, _meta(lens, fresh))
    conv.implementation = "triton"
    got = conv(inputs, got_windows, SLOTS, fresh, _meta(lens, fresh))
    tolerance = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)
    assert torch.equal(got_windows, want_windows), "the windows must move on to exactly the last inputs"


def test_causal_conv_is_batch_invariant() -> None:
    channels, kernel = 24, 4
    g = _gen(11)
    inputs = torch.randn(sum(LENS), channels, generator=g)
    weight = torch.randn(channels, kernel, generator=g)
    windows = torch.randn(POOL, kernel - 1, channels, generator=g)
    together = windows.clone()
    got = causal_conv(inputs, together, weight, None, StepItems.make(LENS, SLOTS, FRESH, CPU))
    for i, span in enumerate(_spans(LENS)):
        alone = windows.clone()
        out = causal_conv(inputs[span].contiguous(), alone, weight, None,
                          StepItems.make([LENS[i]], [SLOTS[i]], [FRESH[i]], CPU))
        assert torch.equal(out, got[span]) and torch.equal(alone[SLOTS[i]], together[SLOTS[i]])
    assert torch.equal(together[3], windows[3])


def test_bad_calls_are_refused() -> None:
    with pytest.raises(ValueError, match="one slot and one fresh flag per item"):
        StepItems.make([2, 1], [0], [True, False], CPU)
    with pytest.raises(ValueError, match="at least one token"):
        StepItems.make([2, 0], [0, 1], [True, False], CPU)
    inputs = _delta_inputs(3, 1, 8, 8, seed=0)
    with pytest.raises(ValueError, match="its own slot"):
        _delta(inputs, torch.zeros(3, 1, 8, 8), [2, 1], [1, 1], [True, False])
    # padding rows of the padded decode path share the last slot, the pool's scratch
    _delta(_delta_inputs(2, 1, 8, 8, seed=0), torch.zeros(3, 1, 8, 8), [1, 1], [2, 2], [True, True])
    with pytest.raises(ValueError, match="its own slot"):
        _delta(inputs, torch.zeros(2, 1, 8, 8), [2, 1], [0, 2], [True, False])
    with pytest.raises(ValueError, match="do not split 3 tokens"):
        _delta(inputs, torch.zeros(2, 1, 8, 8), [1, 1], [0, 1], [True, False], slice(0, 3))
    q, k, v, beta, decay = inputs
    with pytest.raises(ValueError, match=r"states: expected a contiguous torch.float32 tensor \[2, 1, 8, 8\]"):
        gated_delta_rule(q, k, v, beta, decay, torch.zeros(2, 1, 8, 8, dtype=torch.float64),
                         StepItems.make([3], [0], [True], CPU), torch.empty_like(v))
    with pytest.raises(ValueError, match="a power of two of at least 16 tokens"):
        gated_delta_rule(q, k, v, beta, decay, torch.zeros(2, 1, 8, 8), StepItems.make([3], [0], [True], CPU),
                         torch.empty_like(v), chunk=24)
    with pytest.raises(ValueError, match="do not split into 3 groups"):
        mamba2_scan(torch.zeros(2, 4, 8), torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(2, 3, 8),
                    torch.zeros(2, 3, 8), torch.zeros(1, 4, 8, 8), StepItems.make([2], [0], [True], CPU),
                    torch.zeros(2, 4, 8))
    with pytest.raises(ValueError, match="at least 2 taps"):
        causal_conv(torch.zeros(2, 4), torch.zeros(1, 0, 4), torch.zeros(4, 1), None,
                    StepItems.make([2], [0], [True], CPU))


def test_recurrent_kernels_compile_for_hopper() -> None:
    """A real sm_90 compile through aot_check's stand-in driver (launches do nothing), within shared memory."""
    code = (
        "from radixserve.kernels.aot_check import check_recurrent\n"
        "for v in check_recurrent(90):\n"
        "    print(v.kernel, v.fits, v.tensor_cores)\n"
    )
    proc = _run_without_interpreter(code, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines()]
    assert sorted({name for name, _, _ in rows}) == ["_conv_kernel", "_conv_window_kernel", "_delta_rule_kernel",
                                                     "_mamba2_kernel"], rows
    assert all(fits == "True" for _, fits, _ in rows), rows
    # the scans' chunked form multiplies on tensor cores
    assert {name for name, _, mma in rows if mma == "True"} == {"_delta_rule_kernel", "_mamba2_kernel"}, rows
