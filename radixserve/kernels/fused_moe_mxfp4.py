"""The routed experts of a MoE layer whose expert weights are MXFP4 (gpt-oss), in Triton:
`fused_experts_mxfp4`, `fused_moe.fused_experts` with the weights decoded tile by tile in the GEMMs.

The same three launches after the same sort as `fused_moe` (its `_route` and `_sum_pairs_kernel`): a
grouped GEMM for each routed pair's gate and up projections with the gated activation in its epilogue,
one for the down projection times the routing weight, and the k-ordered sum. Only the grouped GEMMs'
weight loads differ: each (input k, output row) value is its e2m1 nibble, decoded by moving the bits
into fp16's fields (value / 2^14, subnormal 0.5 too), times its block's e8m0 scale built as an fp32
from its bits (2^(s - 127 + 14)). The product has at most two significant bits, so it is exact in
bf16 and fp32 (and in fp16 within its range): a tile equals that of `mxfp4_format.Mxfp4Experts
.dequantized` bit for bit, and the kernels compute exactly what `fused_experts` computes on the
dequantized experts, with the same tiles and the same invariants (batch invariance, no host sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.kernels.common import check_device, dot_precision, is_interpreted, upcast_in_kernel
from radixserve.kernels.fused_moe import (
    BLOCK_K,
    BLOCK_M,
    BLOCK_N,
    NUM_STAGES,
    NUM_WARPS,
    SUM_BLOCK,
    _gated_activation,
    _route,
    _sum_pairs_kernel,
)
from radixserve.kernels.moe import ACTIVATION_CODES, ExpertActivation
from radixserve.kernels.mxfp4_format import Mxfp4Experts


@triton.jit
def _mxfp4_tile(blocks_ptr, scales_ptr, rows, ks, mask, stride_br, stride_bg, stride_sr, stride_sg):
    """fp32 w [BLOCK_K, BLOCK_N]: input ks of output `rows` of one expert's MXFP4 weight."""
    group = ks // 32
    byte = tl.load(blocks_ptr + rows[None, :] * stride_br + group[:, None] * stride_bg + ((ks % 32) // 2)[:, None],
                   mask=mask, other=0)
    nibble = tl.where((ks % 2 == 1)[:, None], byte >> 4, byte & 0xF).to(tl.uint16)
    value = (((nibble & 0x7) << 9) | ((nibble & 0x8) << 12)).to(tl.float16, bitcast=True).to(tl.float32)
    s = tl.load(scales_ptr + rows[None, :] * stride_sr + group[:, None] * stride_sg, mask=mask, other=0)
    scale = ((tl.minimum(s.to(tl.uint32), 240) + 14) << 23).to(tl.float32, bitcast=True)
    return value * scale


@triton.jit
def _gate_up_mxfp4_kernel(
    x_ptr, wb_ptr, ws_ptr, bias_ptr, act_ptr, sorted_pairs_ptr, block_expert_ptr,
    num_pairs, num_experts, alpha, limit,
    stride_xt, stride_xh, stride_be, stride_br, stride_bg, stride_se, stride_sr, stride_sg,
    stride_biase, stride_biasn, stride_ap, stride_ai,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, TOPK: tl.constexpr, ACTIVATION: tl.constexpr,
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
    blocks, scales = wb_ptr + expert * stride_be, ws_ptr + expert * stride_se
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < HIDDEN
        a = tl.load(x_ptr + tokens[:, None] * stride_xt + ks[None, :] * stride_xh,
                    mask=valid[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & col_mask[None, :]
        w_gate = _mxfp4_tile(blocks, scales, cols, ks, w_mask, stride_br, stride_bg, stride_sr, stride_sg)
        w_up = _mxfp4_tile(blocks, scales, cols + INTER, ks, w_mask, stride_br, stride_bg, stride_sr, stride_sg)
        if UPCAST:
            a = a.to(tl.float32)
        w_gate, w_up = w_gate.to(a.dtype), w_up.to(a.dtype)  # exact: two significant bits
        acc_gate += tl.dot(a, w_gate, input_precision=DOT_PRECISION)
        acc_up += tl.dot(a, w_up, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        bias_row = bias_ptr + expert * stride_biase
        acc_gate += tl.load(bias_row + cols * stride_biasn, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        acc_up += tl.load(bias_row + (cols + INTER) * stride_biasn, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    value = _gated_activation(acc_gate, acc_up, alpha, limit, act_ptr.dtype.element_ty, ACTIVATION, UPCAST)
    tl.store(act_ptr + pairs[:, None] * stride_ap + cols[None, :] * stride_ai, value, mask=valid[:, None] & col_mask[None, :])


@triton.jit
def _down_mxfp4_kernel(
    act_ptr, wb_ptr, ws_ptr, bias_ptr, weights_ptr, out_ptr, sorted_pairs_ptr, block_expert_ptr,
    num_pairs, num_experts,
    stride_ap, stride_ai, stride_be, stride_br, stride_bg, stride_se, stride_sr, stride_sg,
    stride_biase, stride_biasn, stride_op,
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
    blocks, scales = wb_ptr + expert * stride_be, ws_ptr + expert * stride_se
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < INTER
        a = tl.load(act_ptr + pairs[:, None] * stride_ap + ks[None, :] * stride_ai,
                    mask=valid[:, None] & k_mask[None, :], other=0.0)
        w = _mxfp4_tile(blocks, scales, cols, ks, k_mask[:, None] & col_mask[None, :], stride_br, stride_bg,
                        stride_sr, stride_sg)
        if UPCAST:
            a = a.to(tl.float32)
        acc += tl.dot(a, w.to(a.dtype), input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_biase + cols * stride_biasn, mask=col_mask,
                       other=0.0).to(tl.float32)[None, :]
    routing = tl.load(weights_ptr + pairs, mask=valid, other=0.0)
    tl.store(out_ptr + pairs[:, None] * stride_op + cols[None, :], acc * routing[:, None],
             mask=valid[:, None] & col_mask[None, :])


def _check(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: Mxfp4Experts) -> None:
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32) or x.shape[1] != experts.hidden:
        raise ValueError(f"x must be fp16, bf16 or fp32 [tokens, {experts.hidden}], got {x.dtype} {tuple(x.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_ids.dtype != torch.int64:
        raise ValueError(f"topk_ids must be int64 [{x.shape[0]}, k], got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape or topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_weights must be fp32 {tuple(topk_ids.shape)}, got {topk_weights.dtype} "
                         f"{tuple(topk_weights.shape)}")
    tensors = [x, topk_ids, topk_weights, experts.gate_up_blocks, experts.gate_up_scales, experts.down_blocks,
               experts.down_scales] + [b for b in (experts.gate_up_bias, experts.down_bias) if b is not None]
    check_device(_gate_up_mxfp4_kernel, *tensors)
    if (x.device.type != "cuda" and topk_ids.numel()
            and not 0 <= int(topk_ids.min()) <= int(topk_ids.max()) < experts.num_experts):
        raise ValueError(f"topk_ids must be in [0, {experts.num_experts})")


def fused_experts_mxfp4(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: Mxfp4Experts,
                        activation: ExpertActivation) -> torch.Tensor:
    """[T, H]: Σ_k topk_weights[t, k] · expert_{topk_ids[t, k]}(x[t]) (kernels.moe's contract) with MXFP4
    expert weights, on CUDA tensors (or CPU ones under TRITON_INTERPRET=1), with fused_moe's tiles.
    Gated experts only (MXFP4 checkpoints are gpt-oss's)."""
    if not activation.gated:
        raise ValueError(f"MXFP4 experts with the ungated activation {activation.kind!r} are not supported")
    _check(x, topk_ids, topk_weights, experts)
    tokens, hidden = x.shape
    inter, top_k, num_experts = experts.intermediate, topk_ids.shape[1], experts.num_experts
    out = torch.empty_like(x)
    pairs = tokens * top_k
    if pairs == 0:
        return out.zero_()
    sorted_pairs, block_expert = _route(topk_ids, num_experts, BLOCK_M)
    blocks = block_expert.shape[0]
    act = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)
    pair_out = torch.empty((pairs, hidden), dtype=torch.float32, device=x.device)
    flat_weights = topk_weights.reshape(-1).contiguous()
    upcast = upcast_in_kernel(_gate_up_mxfp4_kernel, x.dtype)
    tiles = {} if is_interpreted(_gate_up_mxfp4_kernel) else {"num_warps": NUM_WARPS, "num_stages": NUM_STAGES}
    precision = dot_precision(x.dtype)
    gu_b, gu_s, dn_b, dn_s = experts.gate_up_blocks, experts.gate_up_scales, experts.down_blocks, experts.down_scales
    gate_up_bias = experts.gate_up_bias if experts.gate_up_bias is not None else gu_s
    has_gu_bias = experts.gate_up_bias is not None
    _gate_up_mxfp4_kernel[(blocks, triton.cdiv(inter, BLOCK_N))](
        x, gu_b, gu_s, gate_up_bias, act, sorted_pairs, block_expert,
        pairs, num_experts, float(activation.alpha), float(activation.limit),
        *x.stride(), gu_b.stride(0), gu_b.stride(1), gu_b.stride(2), gu_s.stride(0), gu_s.stride(1), gu_s.stride(2),
        gate_up_bias.stride(0), gate_up_bias.stride(1) if has_gu_bias else 0, *act.stride(),
        HIDDEN=hidden, INTER=inter, TOPK=top_k, ACTIVATION=ACTIVATION_CODES[activation.kind],
        HAS_BIAS=has_gu_bias, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        UPCAST=upcast, DOT_PRECISION=precision, **tiles,
    )
    down_bias = experts.down_bias if experts.down_bias is not None else dn_s
    has_down_bias = experts.down_bias is not None
    _down_mxfp4_kernel[(blocks, triton.cdiv(hidden, BLOCK_N))](
        act, dn_b, dn_s, down_bias, flat_weights, pair_out, sorted_pairs, block_expert,
        pairs, num_experts,
        *act.stride(), dn_b.stride(0), dn_b.stride(1), dn_b.stride(2), dn_s.stride(0), dn_s.stride(1), dn_s.stride(2),
        down_bias.stride(0), down_bias.stride(1) if has_down_bias else 0, pair_out.stride(0),
        HIDDEN=hidden, INTER=inter, HAS_BIAS=has_down_bias,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, UPCAST=upcast, DOT_PRECISION=precision, **tiles,
    )
    _sum_pairs_kernel[(tokens, triton.cdiv(hidden, SUM_BLOCK))](
        pair_out, out, pair_out.stride(0), out.stride(0),
        HIDDEN=hidden, TOPK=top_k, BLOCK=SUM_BLOCK, EMULATE_BF16=upcast,
    )
    return out
