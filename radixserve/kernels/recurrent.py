"""Triton kernels of the recurrent layers (Gated DeltaNet, Mamba2, causal convolutions) over a step's items.

A step's tokens are grouped in items (`StepItems`): item b owns tokens starts[b] .. starts[b + 1],
continues the sequence whose state lives in slot slots[b] of the layer's state pool, and starts from
zeros instead when fresh[b] is 1 (a sequence at position 0). Each kernel reads the slot, runs the
item's tokens in order and leaves the state after its last token in the same slot, so a slot always
holds the state after its sequence's computed tokens (model/state_cache.py). Decode steps are items of
one token; prefill chunks and their mixes with decodes are the same call.

- `gated_delta_rule`: per token, S <- S g;  S <- S + k (beta (v - S^T k))^T;  o = S^T q, with the
  state [dk, dv] per value head (model/delta_net.py has the math and the torch reference).
- `mamba2_scan`: per token and head, S <- exp(decay) S + dt x B^T;  y = S C, the state [P, N]
  per head, B and C shared by a group of heads (model/mamba2.py).
- `causal_conv`: the depthwise convolution of each item's inputs after its slot's window of the last
  kernel - 1 inputs, then the window moved on (model/causal_conv.py).

One program owns a slice of one item's state (an item, a head and a tile of value or head channels)
and keeps it in registers across the item's tokens, so a token's result is one fixed-order chain of
fp32 operations whatever the other items of the step: batch invariant. The scans take an item's whole
chunks of `PREFILL_CHUNK` tokens (counted from the item's first token) in the chunked form, each chunk
a few [chunk, chunk] and [chunk, state] products on tensor cores (tf32x3, about fp32's precision): the
WY form of the delta rule (the written values solve a unit lower-triangular system, inverted by
forward substitution) and the state-space-dual form of Mamba2. They take the item's last tokens, and
every item shorter than a chunk (decodes, draft verification), token by token, as the C++ kernels on
CPU do (csrc/delta_rule.cpp, csrc/mamba2_scan.cpp). So an item's results depend only on its own
tokens, state and length: a prompt split across steps on a chunk's edge gives the same bits, split
elsewhere it rounds differently (`chunk` 0 runs every token one by one, which no split changes).

Invariants: the wrappers check shapes and dtypes on the host, and index values only on CPU under
the interpreter (on CUDA that would cost a sync per layer); they never sync, allocate only outputs,
and launch on the inputs' device. Scans are fp32 throughout; the convolution reads and writes the
model's dtype and sums in fp32, rounding once. Items own distinct slots, except the padding rows of
the padded decode path (model/decode_graphs.py): they all start fresh in the pool's last slot, its
scratch, which nothing reads, so their racing writes there change nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radixserve.kernels.common import check_device, head_dim_pad, next_pow2, should_check_values, upcast_in_kernel

PREFILL_CHUNK = 16  # tokens per chunk of the scans' chunked form (sm_90: 32 spills the fp32 products out of registers)
TILE = 4096  # state elements per program: its [dk, BLOCK_V] or [BLOCK_P, N] tile stays in registers beside a chunk's operands
SCAN_WARPS = 8  # the scans' warps: at 4 the sm_90 compile of the chunked form spills more
PRECISION: tl.constexpr = tl.constexpr("tf32x3")  # fp32 products on tensor cores, to about fp32's precision
CONV_TOKENS = 16  # tokens per program of the convolution
CONV_CHANNELS = 128  # channels per program of the convolution


@dataclass(frozen=True)
class StepItems:
    """Where each item of a step reads and leaves its state, on the device of the step's tensors."""

    starts: torch.Tensor  # [B + 1] int32: item b owns tokens starts[b] .. starts[b + 1]
    slots: torch.Tensor  # [B] int32: its slot in the layer's state pool
    fresh: torch.Tensor  # [B] int32: 1 to start from zeros (position 0), 0 to continue the slot's state
    longest: int  # host copy of the longest item's token count: sizes the convolution's launch

    @staticmethod
    def make(query_lens: list[int], slots: list[int], fresh: list[bool], device: torch.device) -> StepItems:
        if not (len(query_lens) == len(slots) == len(fresh)) or not query_lens:
            raise ValueError(f"a step needs one slot and one fresh flag per item, got {len(query_lens)} items, "
                             f"{len(slots)} slots, {len(fresh)} flags")
        if min(query_lens) < 1:
            raise ValueError(f"every item has at least one token, got {query_lens}")
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        host = torch.tensor([*starts, *slots, *(int(f) for f in fresh)], dtype=torch.int32)
        on_device = host.to(device, non_blocking=True)
        b = len(query_lens)
        return StepItems(on_device[:b + 1], on_device[b + 1:2 * b + 1], on_device[2 * b + 1:], max(query_lens))

    @property
    def num_items(self) -> int:
        return self.slots.shape[0]

    def check(self, kernel: object, tokens: int, num_slots: int, *tensors: torch.Tensor) -> None:
        check_device(kernel, self.starts, *tensors)
        if should_check_values(self.starts):
            starts = self.starts.tolist()
            if starts[0] != 0 or starts[-1] != tokens or any(a >= b for a, b in zip(starts, starts[1:])):
                raise ValueError(f"item starts {starts} do not split {tokens} tokens")
            slots = self.slots.tolist()
            owned = [s for s in slots if s != num_slots - 1]  # the scratch slot, which padding rows share
            if any(not 0 <= s < num_slots for s in slots) or len(set(owned)) != len(owned):
                raise ValueError(f"slots {slots}: each item needs its own slot of a pool of {num_slots} "
                                 "(only padding rows share the last, scratch slot)")


def _check_chunk(chunk: int) -> None:
    if chunk and (chunk < 16 or chunk & (chunk - 1)):
        raise ValueError(f"a chunk of the chunked scans is a power of two of at least 16 tokens (or 0), got {chunk}")


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> None:
    if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous {dtype} tensor {list(shape)}, "
                         f"got {t.dtype} {list(t.shape)}{'' if t.is_contiguous() else ' (not contiguous)'}")


@triton.jit
def _lower_inverse(strictly_lower, CHUNK: tl.constexpr):
    """(I + N)^-1 for N [CHUNK, CHUNK] strictly lower triangular, by forward substitution, row by row."""
    rows = tl.arange(0, CHUNK)
    inverse = (rows[:, None] == rows[None, :]).to(tl.float32)
    for i in range(1, CHUNK):
        below = tl.sum(tl.where(rows[:, None] == i, strictly_lower, 0.0), axis=0)  # N[i, :]
        inverse = tl.where(rows[:, None] == i, inverse - tl.sum(below[:, None] * inverse, axis=0)[None, :], inverse)
    return inverse


@triton.jit
def _delta_rule_chunk(q_ptr, k_ptr, v_ptr, beta_ptr, decay_ptr, out_ptr, state, first, head, keys, values,
                      key_mask, value_mask, HEADS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                      CHUNK: tl.constexpr):
    """CHUNK tokens from `first` at once (the WY form): with G the running sum of log decays in the chunk,
    the written values U solve (I + diag(beta) L) U = diag(beta) (V - diag(e^G) K S), L[t, s] =
    e^(G_t - G_s) k_t.k_s for s < t; then O = diag(e^G) Q S + (e^(G_t - G_s) q_t.k_s)_(s <= t) U and
    S <- e^G_last S + (K e^(G_last - G))^T U. Returns the state after the chunk."""
    rows = tl.arange(0, CHUNK)
    at = (first + rows) * HEADS + head
    k = tl.load(k_ptr + at[:, None] * DK + keys[None, :], mask=key_mask[None, :], other=0.0)
    q = tl.load(q_ptr + at[:, None] * DK + keys[None, :], mask=key_mask[None, :], other=0.0)
    v = tl.load(v_ptr + at[:, None] * DV + values[None, :], mask=value_mask[None, :], other=0.0)
    beta = tl.load(beta_ptr + at)
    # a decay that underflowed to 0 stays a finite log: the state it clears is still cleared, to 1e-30
    logs = tl.cumsum(tl.log(tl.maximum(tl.load(decay_ptr + at), 1e-30)), axis=0)
    last = tl.sum(tl.where(rows == CHUNK - 1, logs, 0.0), axis=0)
    causal = rows[:, None] >= rows[None, :]
    decays = tl.exp(tl.where(causal, logs[:, None] - logs[None, :], 0.0))
    keys_keys = tl.dot(k, tl.trans(k), input_precision=PRECISION)
    strictly_lower = tl.where(rows[:, None] > rows[None, :], beta[:, None] * decays * keys_keys, 0.0)
    grown = tl.exp(logs)
    targets = beta[:, None] * (v - grown[:, None] * tl.dot(k, state, input_precision=PRECISION))
    written = tl.dot(_lower_inverse(strictly_lower, CHUNK), targets, input_precision=PRECISION)
    scores = tl.where(causal, decays * tl.dot(q, tl.trans(k), input_precision=PRECISION), 0.0)
    out = grown[:, None] * tl.dot(q, state, input_precision=PRECISION) + tl.dot(scores, written,
                                                                                 input_precision=PRECISION)
    tl.store(out_ptr + at[:, None] * DV + values[None, :], out, mask=value_mask[None, :])
    aged = k * tl.exp(last - logs)[:, None]
    return state * tl.exp(last) + tl.dot(tl.trans(aged), written, input_precision=PRECISION)


@triton.jit
def _delta_rule_kernel(q_ptr, k_ptr, v_ptr, beta_ptr, decay_ptr, state_ptr, out_ptr, starts_ptr, slots_ptr,
                       fresh_ptr, HEADS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_V: tl.constexpr, CHUNK: tl.constexpr):
    item, head, tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    first, end = tl.load(starts_ptr + item).to(tl.int64), tl.load(starts_ptr + item + 1).to(tl.int64)
    slot = tl.load(slots_ptr + item).to(tl.int64)
    keys = tl.arange(0, BLOCK_K)
    values = tile * BLOCK_V + tl.arange(0, BLOCK_V)
    key_mask, value_mask = keys < DK, values < DV
    mask = key_mask[:, None] & value_mask[None, :]
    state_at = state_ptr + (slot * HEADS + head) * DK * DV + keys[:, None] * DV + values[None, :]
    state = tl.load(state_at, mask=mask & (tl.load(fresh_ptr + item) == 0), other=0.0)
    chunked_end = first
    if CHUNK > 0:
        chunked_end = first + (end - first) // CHUNK * CHUNK
        for start in range(first, chunked_end, CHUNK):
            state = _delta_rule_chunk(q_ptr, k_ptr, v_ptr, beta_ptr, decay_ptr, out_ptr, state, start, head, keys,
                                      values, key_mask, value_mask, HEADS, DK, DV, CHUNK)
    for t in range(chunked_end, end):
        row = t * HEADS + head
        k = tl.load(k_ptr + row * DK + keys, mask=key_mask, other=0.0)
        q = tl.load(q_ptr + row * DK + keys, mask=key_mask, other=0.0)
        v = tl.load(v_ptr + row * DV + values, mask=value_mask, other=0.0)
        state = state * tl.load(decay_ptr + row)
        remembered = tl.sum(state * k[:, None], axis=0)
        correction = (v - remembered) * tl.load(beta_ptr + row)
        state = state + k[:, None] * correction[None, :]
        tl.store(out_ptr + row * DV + values, tl.sum(state * q[:, None], axis=0), mask=value_mask)
    tl.store(state_at, state, mask=mask)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, decay: torch.Tensor,
                     states: torch.Tensor, items: StepItems, out: torch.Tensor, chunk: int = PREFILL_CHUNK) -> None:
    """q, k [T, H, dk] (q L2-normed and scaled, k L2-normed, key heads repeated over value heads); v, out
    [T, H, dv]; beta, decay [T, H]; states [S, H, dk, dv], updated at the items' slots. All fp32. Each
    item's whole `chunk`s of tokens run in the chunked form, the rest token by token (`chunk` 0: all)."""
    tokens, heads, dk = q.shape
    dv = v.shape[-1]
    for name, t, shape in (("q", q, (tokens, heads, dk)), ("k", k, (tokens, heads, dk)), ("v", v, (tokens, heads, dv)),
                           ("beta", beta, (tokens, heads)), ("decay", decay, (tokens, heads)),
                           ("states", states, (states.shape[0], heads, dk, dv)), ("out", out, (tokens, heads, dv))):
        _check(name, t, shape)
    items.check(_delta_rule_kernel, tokens, states.shape[0], q, k, v, beta, decay, states, out)
    _check_chunk(chunk)
    block_k = head_dim_pad(dk)
    block_v = min(head_dim_pad(dv), max(16, TILE // block_k))
    grid = (items.num_items, heads, triton.cdiv(dv, block_v))
    _delta_rule_kernel[grid](q, k, v, beta, decay, states, out, items.starts, items.slots, items.fresh,
                             HEADS=heads, DK=dk, DV=dv, BLOCK_K=block_k, BLOCK_V=block_v, CHUNK=chunk, num_warps=SCAN_WARPS)


@triton.jit
def _mamba2_chunk(x_ptr, dt_ptr, decay_ptr, b_ptr, c_ptr, out_ptr, state, first, head, group, channels, sizes,
                  channel_mask, size_mask, HEADS: tl.constexpr, GROUPS: tl.constexpr, P: tl.constexpr,
                  N: tl.constexpr, CHUNK: tl.constexpr):
    """CHUNK tokens from `first` at once (the state-space dual form): with G the running sum of log decays,
    Y = diag(e^G) C S^T + ((e^(G_t - G_s) c_t.b_s)_(s <= t)) (dt X) and S <- e^G_last S +
    (dt X e^(G_last - G))^T B. Returns the state after the chunk."""
    rows = tl.arange(0, CHUNK)
    at = (first + rows) * HEADS + head
    shared = ((first + rows) * GROUPS + group)[:, None] * N + sizes[None, :]
    b = tl.load(b_ptr + shared, mask=size_mask[None, :], other=0.0)
    c = tl.load(c_ptr + shared, mask=size_mask[None, :], other=0.0)
    x = tl.load(x_ptr + at[:, None] * P + channels[None, :], mask=channel_mask[None, :], other=0.0)
    written = x * tl.load(dt_ptr + at)[:, None]
    logs = tl.cumsum(tl.load(decay_ptr + at), axis=0)
    last = tl.sum(tl.where(rows == CHUNK - 1, logs, 0.0), axis=0)
    causal = rows[:, None] >= rows[None, :]
    scores = tl.where(causal, tl.exp(tl.where(causal, logs[:, None] - logs[None, :], 0.0))
                      * tl.dot(c, tl.trans(b), input_precision=PRECISION), 0.0)
    out = (tl.exp(logs)[:, None] * tl.dot(c, tl.trans(state), input_precision=PRECISION)
           + tl.dot(scores, written, input_precision=PRECISION))
    tl.store(out_ptr + at[:, None] * P + channels[None, :], out, mask=channel_mask[None, :])
    aged = written * tl.exp(last - logs)[:, None]
    return state * tl.exp(last) + tl.dot(tl.trans(aged), b, input_precision=PRECISION)


@triton.jit
def _mamba2_kernel(x_ptr, dt_ptr, decay_ptr, b_ptr, c_ptr, state_ptr, out_ptr, starts_ptr, slots_ptr, fresh_ptr,
                   HEADS: tl.constexpr, GROUPS: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
                   BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr):
    item, head, tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    group = head // (HEADS // GROUPS)
    first, end = tl.load(starts_ptr + item).to(tl.int64), tl.load(starts_ptr + item + 1).to(tl.int64)
    slot = tl.load(slots_ptr + item).to(tl.int64)
    channels = tile * BLOCK_P + tl.arange(0, BLOCK_P)
    sizes = tl.arange(0, BLOCK_N)
    channel_mask, size_mask = channels < P, sizes < N
    mask = channel_mask[:, None] & size_mask[None, :]
    state_at = state_ptr + (slot * HEADS + head) * P * N + channels[:, None] * N + sizes[None, :]
    state = tl.load(state_at, mask=mask & (tl.load(fresh_ptr + item) == 0), other=0.0)
    chunked_end = first
    if CHUNK > 0:
        chunked_end = first + (end - first) // CHUNK * CHUNK
        for start in range(first, chunked_end, CHUNK):
            state = _mamba2_chunk(x_ptr, dt_ptr, decay_ptr, b_ptr, c_ptr, out_ptr, state, start, head, group,
                                  channels, sizes, channel_mask, size_mask, HEADS, GROUPS, P, N, CHUNK)
    for t in range(chunked_end, end):
        row = t * HEADS + head
        shared = (t * GROUPS + group) * N + sizes
        b = tl.load(b_ptr + shared, mask=size_mask, other=0.0)
        c = tl.load(c_ptr + shared, mask=size_mask, other=0.0)
        x = tl.load(x_ptr + row * P + channels, mask=channel_mask, other=0.0)
        state = state * tl.exp(tl.load(decay_ptr + row)) + (tl.load(dt_ptr + row) * x)[:, None] * b[None, :]
        tl.store(out_ptr + row * P + channels, tl.sum(state * c[None, :], axis=1), mask=channel_mask)
    tl.store(state_at, state, mask=mask)


def mamba2_scan(xs: torch.Tensor, dt: torch.Tensor, decay: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                states: torch.Tensor, items: StepItems, out: torch.Tensor, chunk: int = PREFILL_CHUNK) -> None:
    """xs, out [T, H, P]; dt and decay (the log of each step's decay, dt A) [T, H]; b, c [T, G, N];
    states [S, H, P, N], updated at the items' slots. All fp32. out gets S C without the D skip. Each
    item's whole `chunk`s of tokens run in the chunked form, the rest token by token (`chunk` 0: all)."""
    tokens, heads, p = xs.shape
    groups, n = b.shape[1], b.shape[2]
    if heads % groups:
        raise ValueError(f"{heads} heads do not split into {groups} groups")
    for name, t, shape in (("xs", xs, (tokens, heads, p)), ("dt", dt, (tokens, heads)), ("decay", decay, (tokens, heads)),
                           ("b", b, (tokens, groups, n)), ("c", c, (tokens, groups, n)),
                           ("states", states, (states.shape[0], heads, p, n)), ("out", out, (tokens, heads, p))):
        _check(name, t, shape)
    items.check(_mamba2_kernel, tokens, states.shape[0], xs, dt, decay, b, c, states, out)
    _check_chunk(chunk)
    block_n = head_dim_pad(n)
    block_p = min(head_dim_pad(p), max(16, TILE // block_n))
    grid = (items.num_items, heads, triton.cdiv(p, block_p))
    _mamba2_kernel[grid](xs, dt, decay, b, c, states, out, items.starts, items.slots, items.fresh,
                         HEADS=heads, GROUPS=groups, P=p, N=n, BLOCK_P=block_p, BLOCK_N=block_n, CHUNK=chunk,
                         num_warps=SCAN_WARPS)


@triton.jit
def _conv_kernel(in_ptr, window_ptr, weight_ptr, bias_ptr, out_ptr, starts_ptr, slots_ptr, fresh_ptr,
                 CHANNELS: tl.constexpr, KERNEL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_C: tl.constexpr):
    item, channel_tile, token_tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    first, end = tl.load(starts_ptr + item), tl.load(starts_ptr + item + 1)
    tokens = first + token_tile * BLOCK_T + tl.arange(0, BLOCK_T)
    if first + token_tile * BLOCK_T < end:  # tiles past the item's end have nothing to do
        channels = channel_tile * BLOCK_C + tl.arange(0, BLOCK_C)
        channel_mask = channels < CHANNELS
        token_mask = tokens < end
        slot = tl.load(slots_ptr + item).to(tl.int64)
        continued = tl.load(fresh_ptr + item) == 0
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for tap in tl.static_range(KERNEL):
            source = tokens - (KERNEL - 1) + tap  # the input this tap reads: the item's, or the window's before it
            inside = source >= first
            from_input = tl.load(in_ptr + source.to(tl.int64)[:, None] * CHANNELS + channels[None, :],
                                 mask=(inside & token_mask)[:, None] & channel_mask[None, :], other=0.0)
            row = (KERNEL - 1) + source - first
            from_window = tl.load(window_ptr + (slot * (KERNEL - 1) + row.to(tl.int64))[:, None] * CHANNELS
                                  + channels[None, :],
                                  mask=((~inside) & continued & token_mask)[:, None] & channel_mask[None, :], other=0.0)
            weight = tl.load(weight_ptr + channels * KERNEL + tap, mask=channel_mask, other=0.0).to(tl.float32)
            acc += (from_input.to(tl.float32) + from_window.to(tl.float32)) * weight[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + channels, mask=channel_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + tokens.to(tl.int64)[:, None] * CHANNELS + channels[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=token_mask[:, None] & channel_mask[None, :])


@triton.jit
def _conv_window_kernel(in_ptr, window_ptr, starts_ptr, slots_ptr, fresh_ptr, CHANNELS: tl.constexpr,
                        KEPT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr):
    """Moves each item's window on to its last KEPT inputs (older window rows for a short item)."""
    item, channel_tile = tl.program_id(0), tl.program_id(1)
    first, end = tl.load(starts_ptr + item), tl.load(starts_ptr + item + 1)
    slot = tl.load(slots_ptr + item).to(tl.int64)
    continued = tl.load(fresh_ptr + item) == 0
    rows = tl.arange(0, BLOCK_K)
    channels = channel_tile * BLOCK_C + tl.arange(0, BLOCK_C)
    row_mask, channel_mask = rows < KEPT, channels < CHANNELS
    source = end - KEPT + rows
    inside = source >= first
    from_input = tl.load(in_ptr + source.to(tl.int64)[:, None] * CHANNELS + channels[None, :],
                         mask=(inside & row_mask)[:, None] & channel_mask[None, :], other=0.0)
    window_at = window_ptr + slot * KEPT * CHANNELS
    older = KEPT + source - first
    from_window = tl.load(window_at + older.to(tl.int64)[:, None] * CHANNELS + channels[None, :],
                          mask=((~inside) & continued & row_mask)[:, None] & channel_mask[None, :], other=0.0)
    moved = tl.where(inside[:, None], from_input, from_window)
    tl.debug_barrier()  # a short item's rows move up within the window: every thread reads before any writes
    tl.store(window_at + rows[:, None] * CHANNELS + channels[None, :], moved,
             mask=row_mask[:, None] & channel_mask[None, :])


def causal_conv(inputs: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                items: StepItems) -> torch.Tensor:
    """inputs [T, C] -> outputs [T, C] in inputs' dtype; windows [S, K - 1, C] of that dtype, read and
    moved on at the items' slots; weight [C, K] and bias [C] in any float dtype."""
    tokens, channels = inputs.shape
    kernel = weight.shape[-1]
    _check("inputs", inputs, (tokens, channels), inputs.dtype)
    _check("windows", windows, (windows.shape[0], kernel - 1, channels), inputs.dtype)
    _check("weight", weight, (channels, kernel), weight.dtype)
    if bias is not None:
        _check("bias", bias, (channels,), bias.dtype)
    if kernel < 2:
        raise ValueError(f"a causal convolution with a window needs a kernel of at least 2 taps, got {kernel}")
    items.check(_conv_kernel, tokens, windows.shape[0], inputs, windows, weight)
    if upcast_in_kernel(_conv_kernel, inputs.dtype):  # the interpreter cannot compute on bf16 bits
        wide = windows.float()
        out = causal_conv(inputs.float(), wide, weight.float(), None if bias is None else bias.float(), items)
        windows.copy_(wide)
        return out.to(inputs.dtype)
    out = torch.empty_like(inputs)
    block_c = min(CONV_CHANNELS, next_pow2(channels))
    grid = (items.num_items, triton.cdiv(channels, block_c), triton.cdiv(items.longest, CONV_TOKENS))
    _conv_kernel[grid](inputs, windows, weight, weight if bias is None else bias, out, items.starts, items.slots,
                       items.fresh, CHANNELS=channels, KERNEL=kernel, HAS_BIAS=bias is not None,
                       BLOCK_T=CONV_TOKENS, BLOCK_C=block_c)
    _conv_window_kernel[(items.num_items, triton.cdiv(channels, block_c))](
        inputs, windows, items.starts, items.slots, items.fresh, CHANNELS=channels, KEPT=kernel - 1,
        BLOCK_K=next_pow2(kernel - 1), BLOCK_C=block_c)
    return out
