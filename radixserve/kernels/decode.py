"""`paged_decode_attention`: one query token per sequence against its paged K/V, split-K.

Grid (B, Hkv, S). Program (b, h, s) takes the GROUP = Hq / Hkv query heads that share kv head h
as one [GROUP_PAD, D] tile (padded to >= 16 rows for tl.dot), so each K/V tile is read once per
group, and walks split s of the sequence: chunk = ceil(ceil(len / S) / BLOCK_N) * BLOCK_N tokens,
BLOCK_N tokens per step, each token's address looked up through the block table (so tiles and
pages are independent and shared/shuffled physical blocks need nothing special). An FP8 cache's
rows are dequantized as they are loaded (radixserve/kernels/fp8.py). Online softmax in base 2. With S == 1 the
program writes the output directly; otherwise it writes its normalized partial output and
log-sum-exp, and `_merge_kernel` (grid (B, Hq)) combines the S partials with weights
exp2(lse_s - max lse). Empty splits (short sequences) write lse = -inf and are ignored.

Variants (common.AttentionVariant): with a sliding window the query (position len - 1) sees keys
from lo = max(0, len - window) on, and a row's S splits share [lo rounded down to BLOCK_N, len)
instead of [0, len): keys below never load and a decode costs the window's length, not the
context's. A softcap caps the scores before masking (common.scores_log2). Sinks join the
denominator exactly once: as the running max and sum's starting point when S == 1, otherwise in
the merge (the partials stay plain softmaxes over their keys).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radixserve.kernels.common import (
    LOG2E_C,
    AttentionVariant,
    LaunchConfig,
    check_block_table,
    check_cache_pair,
    check_device,
    check_int_vector,
    check_out,
    check_query,
    check_table_covers,
    check_variant,
    dot_precision,
    head_dim_pad,
    is_fp8_cache,
    is_interpreted,
    launch_with_fallback,
    next_pow2,
    scheduling_kwargs,
    scores_log2,
    should_check_values,
    upcast_in_kernel,
)
from radixserve.kernels.fp8 import dequantize_rows

MAX_SPLITS = 64


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, out_ptr, part_out_ptr, part_lse_ptr, sinks_ptr,
    score_scale, cap_log2, window,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_tb, stride_tn,
    stride_ob, stride_oh, stride_od,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
    HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_q_heads = tl.num_programs(1) * GROUP

    seq_len = tl.load(seq_lens_ptr + seq)
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)  # the first key the query sees
    else:
        lo = 0
    base = lo // BLOCK_N * BLOCK_N
    # plain integer ceil-divisions: tl.cdiv is a jit helper, slow to call under the interpreter
    per_split = (seq_len - base + NUM_SPLITS - 1) // NUM_SPLITS
    chunk = (per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = base + split * chunk
    end = tl.minimum(start + chunk, seq_len)

    groups = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + groups
    dims = tl.arange(0, DIM_PAD)
    head_mask = groups < GROUP
    dim_mask = dims < HEAD_DIM
    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :] * stride_qd,
        mask=head_mask[:, None] & dim_mask[None, :], other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    if SINKS and NUM_SPLITS == 1:
        # the sink as the first term of the online softmax: max = sink, sum = 2^(sink - max) = 1
        m_i = tl.load(sinks_ptr + heads, mask=head_mask, other=0.0).to(tl.float32) * LOG2E_C
        l_i = tl.full([GROUP_PAD], 1.0, tl.float32)
    else:
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    table_row = block_table_ptr + seq * stride_tb
    # every tile holds a key the query sees (the first one holds lo), so no row's max stays -inf
    for tile_start in range(start, end, BLOCK_N):
        tokens = tile_start + tl.arange(0, BLOCK_N)
        if HAS_WINDOW:
            token_mask = (tokens < end) & (tokens >= lo)
        else:
            token_mask = tokens < end
        page = tl.load(table_row + (tokens // PAGE_SIZE) * stride_tn, mask=token_mask, other=0).to(tl.int64)
        in_page = tokens % PAGE_SIZE
        kv_mask = token_mask[:, None] & dim_mask[None, :]
        k_rows = k_cache_ptr + page[:, None] * stride_kb + in_page[:, None] * stride_ks + kv_head * stride_kh
        k = tl.load(k_rows + dims[None, :] * stride_kd, mask=kv_mask, other=0.0)
        if KV_FP8:
            k = dequantize_rows(k, k_rows, token_mask[:, None], HEAD_DIM).to(q.dtype)
        if UPCAST:
            k = k.to(tl.float32)
        scores = scores_log2(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), score_scale, cap_log2, SOFTCAP)
        scores = tl.where(token_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_rows = v_cache_ptr + page[:, None] * stride_vb + in_page[:, None] * stride_vs + kv_head * stride_vh
        v = tl.load(v_rows + dims[None, :] * stride_vd, mask=kv_mask, other=0.0)
        if KV_FP8:
            v = dequantize_rows(v, v_rows, token_mask[:, None], HEAD_DIM).to(q.dtype)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    store_mask = head_mask[:, None] & dim_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty), mask=store_mask,
        )
    else:
        # partials are [B, Hq, S, DIM_PAD] and [B, Hq, S], contiguous fp32
        row = (seq * num_q_heads + heads) * NUM_SPLITS + split
        tl.store(part_out_ptr + row[:, None] * DIM_PAD + dims[None, :], out, mask=store_mask)
        has_keys = l_i > 0
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=head_mask)


@triton.jit
def _merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, sinks_ptr,
    stride_ob, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    SINKS: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row0 = (seq * tl.num_programs(1) + head) * NUM_SPLITS
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, DIM_PAD)
    lse = tl.load(part_lse_ptr + row0 + splits, mask=splits < NUM_SPLITS, other=float("-inf"))
    has_keys = lse > float("-inf")
    top = tl.max(lse, 0)
    if SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E_C
        top = tl.maximum(top, sink)
    weight = tl.where(has_keys, tl.exp2(lse - top), 0.0)
    part = tl.load(
        part_out_ptr + (row0 + splits)[:, None] * DIM_PAD + dims[None, :],
        mask=has_keys[:, None] & (dims[None, :] < HEAD_DIM), other=0.0,
    )
    total = tl.sum(weight, 0)
    if SINKS:
        total += tl.exp2(sink - top)  # once per head: the sink is in no partial
    merged = tl.sum(part * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + seq * stride_ob + head * stride_oh + dims * stride_od,
        merged.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM,
    )


def decode_configs(dtype: torch.dtype, head_dim: int, interpreted: bool) -> list[LaunchConfig]:
    """Candidate tiles, best first; later ones only if the earlier do not fit in shared memory."""
    if interpreted:
        return [LaunchConfig(block_m=0, block_n=32, num_warps=4, num_stages=1)]
    wide = dtype == torch.float32 or head_dim > 128
    first = 32 if wide else 64
    return [
        LaunchConfig(0, first, 4, 3),
        LaunchConfig(0, first, 4, 2),
        LaunchConfig(0, 32, 4, 2),
        LaunchConfig(0, 16, 4, 1),
    ]


@functools.lru_cache(maxsize=8)
def _compute_units(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a nominal figure so the split heuristic behaves as on a small GPU


def auto_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, block_n: int, device: torch.device) -> int:
    """Enough splits that B * Hkv * S programs cover the GPU a few times over, each >= 4 tiles long."""
    programs = max(1, batch * num_kv_heads)
    want = math.ceil(4 * _compute_units(device) / programs)
    longest = math.ceil(max(1, max_seq_len) / (4 * block_n))
    return max(1, min(want, longest, MAX_SPLITS))


@dataclass(frozen=True)
class DecodeLaunch:
    """A checked decode launch for one batch shape: calling it runs the kernels with no validation.

    `plan_decode` validates once; a model then calls the plan once per layer (same shapes, other
    caches and queries), which is what keeps the per-layer host cost to Triton's own launch.
    """

    batch: int
    num_q_heads: int
    num_kv_heads: int
    splits_for: Callable[[LaunchConfig], int]
    configs: tuple[LaunchConfig, ...]
    key: tuple
    scalars: tuple[float, float, int]  # AttentionVariant.scalars
    constants: dict

    def __call__(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
        seq_lens: torch.Tensor, out: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`sinks` [Hq]: this layer's, given exactly when the plan was made with sinks."""
        if (sinks is not None) != self.constants["SINKS"]:
            raise ValueError("sinks must be given exactly when the plan was made with sinks")
        out = torch.empty_like(q) if out is None else out
        if self.batch == 0:
            return out
        dim_pad = self.constants["DIM_PAD"]
        sinks_arg = out if sinks is None else sinks  # unused by the kernels without SINKS

        def launch(cfg: LaunchConfig) -> None:
            splits = self.splits_for(cfg)
            if splits > 1:
                part_out = torch.empty(self.batch, self.num_q_heads, splits, dim_pad, dtype=torch.float32, device=q.device)
                part_lse = torch.empty(self.batch, self.num_q_heads, splits, dtype=torch.float32, device=q.device)
            else:
                part_out = part_lse = out  # unused by the kernel when NUM_SPLITS == 1
            _decode_split_kernel[(self.batch, self.num_kv_heads, splits)](
                q, k_cache, v_cache, block_table, seq_lens, out, part_out, part_lse, sinks_arg,
                *self.scalars,
                *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_table.stride(), *out.stride(),
                BLOCK_N=cfg.block_n, NUM_SPLITS=splits, **self.constants,
                **scheduling_kwargs(_decode_split_kernel, cfg),
            )
            if splits > 1:
                _merge_kernel[(self.batch, self.num_q_heads)](
                    part_out, part_lse, out, sinks_arg, *out.stride(),
                    HEAD_DIM=self.constants["HEAD_DIM"], DIM_PAD=dim_pad, NUM_SPLITS=splits,
                    SPLITS_PAD=next_pow2(splits), SINKS=self.constants["SINKS"],
                )

        launch_with_fallback(launch, list(self.configs), self.key)
        return out


def plan_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    config: LaunchConfig | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> DecodeLaunch:
    """Validate a decode launch and fix its parameters (see `paged_decode_attention` for the arguments).

    The split count depends only on the batch size, the kv heads, `max_seq_len` and the window, all
    host values, so a plan made with a fixed bound is replayable inside a CUDA graph whatever the
    live lengths (each row divides its own span among the splits at run time). `sinks` here only
    says that launches bring a sinks tensor and checks it; each launch passes its layer's.
    """
    num_blocks, block_size, num_kv_heads, head_dim = check_cache_pair(k_cache, v_cache)
    group = check_query(q, k_cache, num_kv_heads, head_dim)
    batch = q.shape[0]
    check_int_vector("seq_lens", seq_lens, batch, torch.int32)
    check_block_table(block_table, batch, num_blocks)
    check_device(_decode_split_kernel, q, k_cache, v_cache, block_table, seq_lens)
    variant = check_variant(q, window, sinks, softcap)
    if should_check_values(seq_lens):
        check_table_covers(block_table, seq_lens, block_size, num_blocks)
        if batch and int(seq_lens.min()) < 1:
            raise ValueError("decode seq_lens must be >= 1 (they count the current token)")
    if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    if max_seq_len is None:
        max_seq_len = block_table.shape[1] * block_size
    if batch > 2**31 - 1 or num_kv_heads > 65535:
        raise ValueError("grid too large: batch must be < 2^31 and Hkv <= 65535")
    interpreted = is_interpreted(_decode_split_kernel)
    constants = {
        "GROUP": group, "GROUP_PAD": max(16, next_pow2(group)), "HEAD_DIM": head_dim, "DIM_PAD": head_dim_pad(head_dim),
        "PAGE_SIZE": block_size, "UPCAST": upcast_in_kernel(_decode_split_kernel, q.dtype),
        "DOT_PRECISION": dot_precision(q.dtype), "KV_FP8": is_fp8_cache(k_cache), **variant.constants(),
    }
    device, bound = q.device, max_seq_len

    def splits_for(cfg: LaunchConfig) -> int:
        return num_splits or auto_num_splits(batch, num_kv_heads, window_span(bound, variant, cfg.block_n),
                                             cfg.block_n, device)

    configs = (config,) if config else tuple(decode_configs(q.dtype, head_dim, interpreted))
    key = ("decode", q.dtype, is_fp8_cache(k_cache), head_dim, q.device, config, tuple(variant.constants().values()))
    return DecodeLaunch(batch, q.shape[1], num_kv_heads, splits_for, configs, key, variant.scalars(scale), constants)


def window_span(max_seq_len: int, variant: AttentionVariant, block_n: int) -> int:
    """The most keys one row's splits share: its window's, from the BLOCK_N tile holding its first key."""
    if variant.window is None:
        return max_seq_len
    return min(max_seq_len, variant.window + block_n - 1)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    config: LaunchConfig | None = None,
    out: torch.Tensor | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [B, Hq, D], one token per sequence -> out [B, Hq, D].

    seq_lens [B] int32 counts the current token, whose K/V must already be in the cache.
    `max_seq_len` (a host bound on seq_lens), `num_splits` and `config` (tile override) only tune
    the launch; by default the bound is the block table's capacity, so no device sync is needed.
    `window`, `sinks` [Hq] and `softcap`: the attention variants of common.AttentionVariant, with
    reference.paged_decode_attention_reference's semantics.
    """
    plan = plan_decode(q, k_cache, v_cache, block_table, seq_lens, scale, max_seq_len=max_seq_len,
                       num_splits=num_splits, config=config, window=window, sinks=sinks, softcap=softcap)
    return plan(q, k_cache, v_cache, block_table, seq_lens, check_out(out, q), sinks)
