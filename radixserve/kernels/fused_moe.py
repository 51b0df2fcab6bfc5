"""The routed experts of a mixture-of-experts layer on the GPU, in Triton: `fused_experts`.

Three launches after a sort of the token-expert pairs: the pairs t * k + j are grouped by expert, each
expert's group padded to a whole number of `block_m` rows (`_route`); a grouped GEMM computes every
routed pair's gate and up projections (an ungated expert's up projection only), one tile of rows of
one expert per program, and applies the activation in its epilogue; a second computes the down
projection and multiplies by the pair's routing weight; a last kernel sums each token's k pair
outputs in k order and rounds once to x's dtype. Only the routed experts' weights are read; a
program whose rows are all padding returns at once.

Invariants:
- batch invariance: each output value of a pair is computed by the same program code, with the same
  tile sizes, over K in the same blocks, whichever other pairs share its tile; there is no split-K and no
  atomic, and a token's k outputs are added in k order. The tile sizes are fixed (never chosen from the
  token count), so a token's result is the same alone or among others.
- no host sync and no shape-dependent host work beyond the grid: the sort is torch operators whose
  sizes depend on T, k and E only (the padded capacity is an upper bound), so a step can be captured
  in a CUDA graph.
- numerics: fp32 accumulation; the activation is written in the model dtype (as the reference's
  intermediate is) and the weighted pair outputs kept in fp32 for the sum. Under TRITON_INTERPRET=1
  bf16 is raw bits: values are widened on load and rounded to nearest even by `_round` (as fused.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.kernels.common import check_device, dot_precision, is_interpreted, upcast_in_kernel
from radixserve.kernels.fused import _round
from radixserve.kernels.moe import ACTIVATION_CODES, ExpertActivation, ExpertWeights

BLOCK_M = 16  # rows (token-expert pairs) per tile: a decode step routes a few rows to each expert
BLOCK_N = 64
BLOCK_K = 64
SUM_BLOCK = 256
NUM_WARPS = 4
NUM_STAGES = 3


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _gated_activation(acc_gate, acc_up, alpha, limit, DTYPE: tl.constexpr, ACTIVATION: tl.constexpr,
                      UPCAST: tl.constexpr):
    """act(gate) * up of fp32 accumulators, as the model dtype: the projections round to it before the
    activation, as the reference's do (fp32 values of DTYPE, returned as DTYPE)."""
    gate, up = _round(acc_gate, DTYPE, UPCAST), _round(acc_up, DTYPE, UPCAST)
    if ACTIVATION == 0:  # silu
        value = gate * _sigmoid(gate) * up
    elif ACTIVATION == 1:  # gelu_tanh: 0.5 g (1 + tanh z) = g sigmoid(2z), without 1 + tanh's cancellation
        value = gate * _sigmoid(1.5957691216057308 * (gate + 0.044715 * gate * gate * gate)) * up  # 2 sqrt(2/pi)
    elif ACTIVATION == 3:  # relu2, ungated: the up projection alone (`gate` is unused)
        value = tl.maximum(up, 0.0) * tl.maximum(up, 0.0)
    else:  # clamped_swiglu (gpt-oss)
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        value = gate * _sigmoid(alpha * gate) * (up + 1.0)
    return _round(value, DTYPE, UPCAST).to(DTYPE)


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, bias_ptr, act_ptr, sorted_pairs_ptr, block_expert_ptr,
    num_pairs, num_experts, alpha, limit,
    stride_xt, stride_xh, stride_we, stride_wn, stride_wk, stride_be, stride_bn, stride_ap, stride_ai,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, TOPK: tl.constexpr, ACTIVATION: tl.constexpr, GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert >= num_experts:  # past the routed pairs
        return
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pairs < num_pairs
    tokens = pairs // TOPK
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < INTER
    w_expert = w_ptr + expert * stride_we
    up_row = INTER if GATED else 0  # where the up rows start: after the gate rows, or first
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < HIDDEN
        a = tl.load(x_ptr + tokens[:, None] * stride_xt + ks[None, :] * stride_xh,
                    mask=valid[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & col_mask[None, :]
        w_up = tl.load(w_expert + (cols[None, :] + up_row) * stride_wn + ks[:, None] * stride_wk, mask=w_mask,
                       other=0.0)
        if UPCAST:
            a, w_up = a.to(tl.float32), w_up.to(tl.float32)
        acc_up += tl.dot(a, w_up, input_precision=DOT_PRECISION)
        if GATED:
            w_gate = tl.load(w_expert + cols[None, :] * stride_wn + ks[:, None] * stride_wk, mask=w_mask, other=0.0)
            if UPCAST:
                w_gate = w_gate.to(tl.float32)
            acc_gate += tl.dot(a, w_gate, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        bias_row = bias_ptr + expert * stride_be
        acc_up += tl.load(bias_row + (cols + up_row) * stride_bn, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_gate += tl.load(bias_row + cols * stride_bn, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    value = _gated_activation(acc_gate, acc_up, alpha, limit, act_ptr.dtype.element_ty, ACTIVATION, UPCAST)
    tl.store(act_ptr + pairs[:, None] * stride_ap + cols[None, :] * stride_ai, value, mask=valid[:, None] & col_mask[None, :])


@triton.jit
def _down_kernel(
    act_ptr, w_ptr, bias_ptr, weights_ptr, out_ptr, sorted_pairs_ptr, block_expert_ptr,
    num_pairs, num_experts,
    stride_ap, stride_ai, stride_we, stride_wn, stride_wk, stride_be, stride_bn, stride_op,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert >= num_experts:
        return
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pairs < num_pairs
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < HIDDEN
    w_expert = w_ptr + expert * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < INTER
        a = tl.load(act_ptr + pairs[:, None] * stride_ap + ks[None, :] * stride_ai,
                    mask=valid[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_expert + cols[None, :] * stride_wn + ks[:, None] * stride_wk,
                    mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_be + cols * stride_bn, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    routing = tl.load(weights_ptr + pairs, mask=valid, other=0.0)
    tl.store(out_ptr + pairs[:, None] * stride_op + cols[None, :], acc * routing[:, None],
             mask=valid[:, None] & col_mask[None, :])


@triton.jit
def _sum_pairs_kernel(
    pairs_ptr, out_ptr, stride_pp, stride_ot,
    HIDDEN: tl.constexpr, TOPK: tl.constexpr, BLOCK: tl.constexpr, EMULATE_BF16: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    row = pairs_ptr + token * TOPK * stride_pp + cols
    total = tl.load(row, mask=mask, other=0.0)
    for j in tl.static_range(1, TOPK):  # in k order
        total += tl.load(row + j * stride_pp, mask=mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + token * stride_ot + cols, _round(total, dtype, EMULATE_BF16).to(dtype), mask=mask)


def _route(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs [blocks * block_m] int32, block_expert [blocks] int32): the pairs t * k + j
    grouped by expert, ascending within one, each expert's group padded with the sentinel T * k to a
    multiple of block_m; block b's rows all belong to expert block_expert[b], or to none
    (num_experts) past the last group. `blocks` is an upper bound from the shapes alone."""
    flat = topk_ids.reshape(-1)
    pairs, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would sync on CUDA
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    rank = torch.arange(pairs, device=device) - (torch.cumsum(counts, 0) - counts)[experts]
    # each routed expert fills at most one partial block, and no block holds fewer than one pair
    blocks = min(pairs, -(-pairs // block_m) + num_experts)
    sorted_pairs = torch.full((blocks * block_m,), pairs, dtype=torch.int32, device=device)
    sorted_pairs[(padded_end - padded)[experts] + rank] = order.to(torch.int32)
    starts = torch.arange(blocks, dtype=torch.int64, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, starts, right=True).to(torch.int32)
    return sorted_pairs, block_expert


def _check(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, weights: ExpertWeights,
           gated: bool) -> None:
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be fp16, bf16 or fp32 [tokens, hidden], got {x.dtype} {tuple(x.shape)}")
    tokens, hidden = x.shape
    experts, rows, _ = weights.gate_up.shape
    inter = rows // 2 if gated else rows
    if weights.gate_up.shape[2] != hidden or (gated and rows % 2) or weights.down.shape != (experts, hidden, inter):
        raise ValueError(f"expert weights gate_up {tuple(weights.gate_up.shape)} and down "
                         f"{tuple(weights.down.shape)} do not fit hidden size {hidden}")
    if weights.gate_up.dtype != x.dtype or weights.down.dtype != x.dtype:
        raise ValueError(f"expert weights must be in x's dtype {x.dtype}, got {weights.gate_up.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != tokens or topk_ids.dtype != torch.int64:
        raise ValueError(f"topk_ids must be int64 [{tokens}, k], got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape or topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_weights must be fp32 {tuple(topk_ids.shape)}, got {topk_weights.dtype} "
                         f"{tuple(topk_weights.shape)}")
    for name, bias, width in (("gate_up_bias", weights.gate_up_bias, rows), ("down_bias", weights.down_bias, hidden)):
        if bias is not None and bias.shape != (experts, width):
            raise ValueError(f"{name} must be [{experts}, {width}], got {tuple(bias.shape)}")
    tensors = [x, topk_ids, topk_weights, weights.gate_up, weights.down]
    tensors += [b for b in (weights.gate_up_bias, weights.down_bias) if b is not None]
    check_device(_gate_up_kernel, *tensors)
    if x.device.type != "cuda" and topk_ids.numel() and not 0 <= int(topk_ids.min()) <= int(topk_ids.max()) < experts:
        raise ValueError(f"topk_ids must be in [0, {experts})")


def fused_experts(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, weights: ExpertWeights,
    activation: ExpertActivation, *, block_m: int = BLOCK_M, block_n: int = BLOCK_N, block_k: int = BLOCK_K,
) -> torch.Tensor:
    """[T, H]: Σ_k topk_weights[t, k] · expert_{topk_ids[t, k]}(x[t]) (kernels.moe's contract), on CUDA
    tensors (or CPU ones under TRITON_INTERPRET=1). Weights as `ExpertWeights` stacks them, in x's
    dtype. The tile sizes (keyword-only, powers of two >= 16) are fixed per call site: a token's
    result is the same whatever the other tokens only for one choice of them."""
    _check(x, topk_ids, topk_weights, weights, activation.gated)
    tokens, hidden = x.shape
    experts, rows, _ = weights.gate_up.shape
    inter, top_k = rows // 2 if activation.gated else rows, topk_ids.shape[1]
    out = torch.empty_like(x)
    pairs = tokens * top_k
    if pairs == 0:
        return out.zero_()
    sorted_pairs, block_expert = _route(topk_ids, experts, block_m)
    blocks = block_expert.shape[0]
    act = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)
    pair_out = torch.empty((pairs, hidden), dtype=torch.float32, device=x.device)
    flat_weights = topk_weights.reshape(-1).contiguous()
    upcast = upcast_in_kernel(_gate_up_kernel, x.dtype)
    tiles = {} if is_interpreted(_gate_up_kernel) else {"num_warps": NUM_WARPS, "num_stages": NUM_STAGES}
    precision = dot_precision(x.dtype)
    gate_up_bias = weights.gate_up_bias if weights.gate_up_bias is not None else weights.gate_up
    _gate_up_kernel[(blocks, triton.cdiv(inter, block_n))](
        x, weights.gate_up, gate_up_bias, act, sorted_pairs, block_expert,
        pairs, experts, float(activation.alpha), float(activation.limit),
        *x.stride(), *weights.gate_up.stride(),
        gate_up_bias.stride(0), gate_up_bias.stride(1) if weights.gate_up_bias is not None else 0, *act.stride(),
        HIDDEN=hidden, INTER=inter, TOPK=top_k, ACTIVATION=ACTIVATION_CODES[activation.kind], GATED=activation.gated,
        HAS_BIAS=weights.gate_up_bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        UPCAST=upcast, DOT_PRECISION=precision, **tiles,
    )
    down_bias = weights.down_bias if weights.down_bias is not None else weights.down
    _down_kernel[(blocks, triton.cdiv(hidden, block_n))](
        act, weights.down, down_bias, flat_weights, pair_out, sorted_pairs, block_expert,
        pairs, experts,
        *act.stride(), *weights.down.stride(),
        down_bias.stride(0), down_bias.stride(1) if weights.down_bias is not None else 0, pair_out.stride(0),
        HIDDEN=hidden, INTER=inter, HAS_BIAS=weights.down_bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=upcast, DOT_PRECISION=precision, **tiles,
    )
    _sum_pairs_kernel[(tokens, triton.cdiv(hidden, SUM_BLOCK))](
        pair_out, out, pair_out.stride(0), out.stride(0),
        HIDDEN=hidden, TOPK=top_k, BLOCK=SUM_BLOCK, EMULATE_BF16=upcast,
    )
    return out
