"""`paged_extend_attention`: packed new tokens of B sequences attend to their paged prefix + causally.

Grid (row tiles, B, Hkv). The rows of a tile are (token, q head) pairs of one sequence and one kv
head: row r is new token r // GROUP with q head kv_head * GROUP + r % GROUP, so the GROUP heads that
share K/V sit in one tile (a decode in the batch fills GROUP rows instead of one) and every K/V
tile is loaded once for all of them. Tile indices are walked last-first because the later tiles of
a causal sequence see the most keys. Keys are read from the cache through the block table (the
step's own K/V were stored there first); each row at absolute position p sees keys 0..p. Keys
before the tile's first token are visible to every row, so whole BLOCK_N tiles of them run
unmasked; only the tail up to the tile's last token is masked. Online softmax in base 2. An FP8
cache's rows are dequantized as they are loaded (radixserve/kernels/fp8.py).

Variants (common.AttentionVariant). With a sliding window, the row at position p sees keys
p - window < j <= p; the tile's rows span positions P0..P1, so its key loop starts at the BLOCK_N
tile holding P0 - window + 1 (nothing below is loaded), runs masked up to the first tile every row
sees whole (from P1 - window + 1 up), unmasked to P0, then masked to P1; when the tile's rows are
spread wider than the window there is no unmasked stretch. A row may see no key of a masked tile,
so its running max may stay -inf there; the update then keeps it and adds nothing. A softcap caps
scores before masking (common.scores_log2); sinks start each row's online softmax (max = its q head's
sink, sum = 1), so they are counted once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radixserve.kernels.common import (
    LOG2E_C,
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
    scheduling_kwargs,
    scores_log2,
    should_check_values,
    upcast_in_kernel,
)
from radixserve.kernels.fp8 import dequantize_rows


@triton.jit
def _attend_tile(
    q, acc, m_i, l_i, start, kv_lo, causal_end, q_pos,
    table_row, stride_tn, k_base, v_base,
    stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
    dims, dim_mask, score_scale, cap_log2, window,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, PAD_DIM: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    tokens = start + tl.arange(0, BLOCK_N)
    if HAS_WINDOW:
        token_mask = (tokens < causal_end) & (tokens >= kv_lo)  # below kv_lo: no row's window
    else:
        token_mask = tokens < causal_end
    if MASKED:
        page = tl.load(table_row + (tokens // PAGE_SIZE) * stride_tn, mask=token_mask, other=0).to(tl.int64)
    else:
        page = tl.load(table_row + (tokens // PAGE_SIZE) * stride_tn).to(tl.int64)
    in_page = tokens % PAGE_SIZE
    k_rows = k_base + page[:, None] * stride_kb + in_page[:, None] * stride_ks
    v_rows = v_base + page[:, None] * stride_vb + in_page[:, None] * stride_vs
    k_ptrs = k_rows + dims[None, :] * stride_kd
    v_ptrs = v_rows + dims[None, :] * stride_vd
    if MASKED:
        kv_mask = token_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    elif PAD_DIM:
        k = tl.load(k_ptrs, mask=dim_mask[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=dim_mask[None, :], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    if KV_FP8:
        k = dequantize_rows(k, k_rows, token_mask[:, None], HEAD_DIM).to(q.dtype)
        v = dequantize_rows(v, v_rows, token_mask[:, None], HEAD_DIM).to(q.dtype)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    scores = scores_log2(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), score_scale, cap_log2, SOFTCAP)
    if MASKED:
        visible = (tokens[None, :] <= q_pos[:, None]) & token_mask[None, :]
        if HAS_WINDOW:
            visible = visible & (tokens[None, :] > q_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    if HAS_WINDOW and MASKED:
        # a row that has seen no key yet and sees none here: subtract 0, not -inf (-inf - -inf is NaN)
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_sub = m_new
    alpha = tl.exp2(m_i - m_sub)
    p = tl.exp2(scores - m_sub[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _extend_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, cu_seqlens_ptr, seq_lens_ptr, out_ptr, sinks_ptr,
    score_scale, cap_log2, window,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_tb, stride_tn,
    stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
):
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    kv_head = tl.program_id(2)
    q_start = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_start
    row0 = tile * BLOCK_M
    if row0 >= q_len * GROUP:
        return
    prefix = tl.load(seq_lens_ptr + seq) - q_len

    rows = row0 + tl.arange(0, BLOCK_M)
    tok = rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_mask = tok < q_len
    q_pos = prefix + tok
    dims = tl.arange(0, DIM_PAD)
    dim_mask = dims < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64)
    io_mask = row_mask[:, None] & dim_mask[None, :]
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :] * stride_qd,
                mask=io_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    first_tok = row0 // GROUP
    last_tok = tl.minimum((row0 + BLOCK_M - 1) // GROUP, q_len - 1)
    full_end = ((prefix + first_tok + 1) // BLOCK_N) * BLOCK_N  # keys below: visible to every row
    causal_end = prefix + last_tok + 1
    if HAS_WINDOW:
        kv_lo = tl.maximum(prefix + first_tok - window + 1, 0)  # the first key any row sees
        kv_start = kv_lo // BLOCK_N * BLOCK_N
        every_lo = tl.maximum(prefix + last_tok - window + 1, 0)  # keys from here to P0: seen by every row
        full_start = tl.minimum((every_lo + BLOCK_N - 1) // BLOCK_N * BLOCK_N, full_end)
    else:
        kv_lo = 0
        kv_start = 0
        full_start = 0

    if SINKS:
        m_i = tl.load(sinks_ptr + heads).to(tl.float32) * LOG2E_C
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    table_row = block_table_ptr + seq * stride_tb
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    if HAS_WINDOW:
        for start in range(kv_start, full_start, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                q, acc, m_i, l_i, start, kv_lo, causal_end, q_pos, table_row, stride_tn, k_base, v_base,
                stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, dims, dim_mask,
                score_scale, cap_log2, window,
                PAGE_SIZE, BLOCK_N, True, DIM_PAD != HEAD_DIM, UPCAST, DOT_PRECISION, KV_FP8, HEAD_DIM,
                HAS_WINDOW, SOFTCAP,
            )
    for start in range(full_start, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, start, kv_lo, causal_end, q_pos, table_row, stride_tn, k_base, v_base,
            stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, dims, dim_mask,
            score_scale, cap_log2, window,
            PAGE_SIZE, BLOCK_N, False, DIM_PAD != HEAD_DIM, UPCAST, DOT_PRECISION, KV_FP8, HEAD_DIM,
            HAS_WINDOW, SOFTCAP,
        )
    for start in range(full_end, causal_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, start, kv_lo, causal_end, q_pos, table_row, stride_tn, k_base, v_base,
            stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, dims, dim_mask,
            score_scale, cap_log2, window,
            PAGE_SIZE, BLOCK_N, True, DIM_PAD != HEAD_DIM, UPCAST, DOT_PRECISION, KV_FP8, HEAD_DIM,
            HAS_WINDOW, SOFTCAP,
        )

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=io_mask)


def extend_configs(dtype: torch.dtype, head_dim: int, interpreted: bool) -> list[LaunchConfig]:
    """Candidate tiles, best first; later ones only if the earlier do not fit in shared memory."""
    if interpreted:
        return [LaunchConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)]
    if dtype == torch.float32 or head_dim > 128:
        return [LaunchConfig(64, 32, 4, 2), LaunchConfig(32, 32, 4, 1), LaunchConfig(16, 16, 4, 1)]
    return [
        LaunchConfig(128, 64, 8 if head_dim > 64 else 4, 3),
        LaunchConfig(128, 32, 4, 2),
        LaunchConfig(64, 32, 4, 2),
        LaunchConfig(16, 16, 4, 1),
    ]


@dataclass(frozen=True)
class ExtendLaunch:
    """A checked extend launch for one batch shape; calling it runs the kernel with no validation
    (a model validates once per step with `plan_extend` and launches once per layer)."""

    batch: int
    num_kv_heads: int
    tiles_for: Callable[[LaunchConfig], int]
    configs: tuple[LaunchConfig, ...]
    key: tuple
    scalars: tuple[float, float, int]  # AttentionVariant.scalars
    constants: dict

    def __call__(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
        cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`sinks` [Hq]: this layer's, given exactly when the plan was made with sinks."""
        if (sinks is not None) != self.constants["SINKS"]:
            raise ValueError("sinks must be given exactly when the plan was made with sinks")
        out = torch.empty_like(q) if out is None else out
        if self.batch == 0 or q.shape[0] == 0:
            return out
        sinks_arg = out if sinks is None else sinks  # unused by the kernel without SINKS

        def launch(cfg: LaunchConfig) -> None:
            _extend_kernel[(self.tiles_for(cfg), self.batch, self.num_kv_heads)](
                q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, out, sinks_arg,
                *self.scalars,
                *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_table.stride(), *out.stride(),
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **self.constants, **scheduling_kwargs(_extend_kernel, cfg),
            )

        launch_with_fallback(launch, list(self.configs), self.key)
        return out


def plan_extend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    config: LaunchConfig | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> ExtendLaunch:
    """Validate an extend launch and fix its parameters (see `paged_extend_attention`); `sinks` here
    only says that launches bring a sinks tensor and checks it, each launch passes its layer's."""
    num_blocks, block_size, num_kv_heads, head_dim = check_cache_pair(k_cache, v_cache)
    group = check_query(q, k_cache, num_kv_heads, head_dim)
    if seq_lens.dim() != 1:
        raise ValueError(f"seq_lens must be 1-D [B], got shape {tuple(seq_lens.shape)}")
    batch = seq_lens.shape[0]
    check_int_vector("seq_lens", seq_lens, batch, torch.int32)
    check_int_vector("cu_seqlens_q", cu_seqlens_q, batch + 1, torch.int32)
    check_block_table(block_table, batch, num_blocks)
    check_device(_extend_kernel, q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens)
    variant = check_variant(q, window, sinks, softcap)
    if should_check_values(seq_lens):
        _check_packing(q, cu_seqlens_q, seq_lens)
        check_table_covers(block_table, seq_lens, block_size, num_blocks)
    if batch > 65535 or num_kv_heads > 65535:
        raise ValueError("grid too large: at most 65535 sequences and 65535 kv heads per launch")
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if batch else 0
    rows = max(0, max_query_len) * group
    if rows == 0:
        batch = 0  # nothing to compute: the launch returns its (empty-sized) output untouched
    constants = {
        "GROUP": group, "HEAD_DIM": head_dim, "DIM_PAD": head_dim_pad(head_dim), "PAGE_SIZE": block_size,
        "UPCAST": upcast_in_kernel(_extend_kernel, q.dtype), "DOT_PRECISION": dot_precision(q.dtype),
        "KV_FP8": is_fp8_cache(k_cache), **variant.constants(),
    }
    configs = (config,) if config else tuple(extend_configs(q.dtype, head_dim, is_interpreted(_extend_kernel)))
    key = ("extend", q.dtype, is_fp8_cache(k_cache), head_dim, q.device, config, tuple(variant.constants().values()))
    return ExtendLaunch(batch, num_kv_heads, lambda cfg: triton.cdiv(rows, cfg.block_m), configs, key,
                        variant.scalars(scale), constants)


def paged_extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    config: LaunchConfig | None = None,
    out: torch.Tensor | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [T, Hq, D] packed new tokens -> out [T, Hq, D].

    Sequence b owns q[cu_seqlens_q[b]:cu_seqlens_q[b+1]] (int32, [B+1]) and has seq_lens[b] tokens in
    all, its new ones last; their K/V must already be in the cache. `max_query_len` (a host bound on
    the per-sequence new-token counts) saves a device sync; `config` overrides the tile choice.
    `window`, `sinks` [Hq] and `softcap`: the attention variants of common.AttentionVariant, with
    reference.paged_extend_attention_reference's semantics.
    """
    plan = plan_extend(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale,
                       max_query_len=max_query_len, config=config, window=window, sinks=sinks, softcap=softcap)
    return plan(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, check_out(out, q), sinks)


def _check_packing(q: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """Value checks (CPU only): cu_seqlens_q is a packing of q, and no sequence is shorter than its new part."""
    cu = cu_seqlens_q.long()
    if int(cu[0]) != 0 or int(cu[-1]) != q.shape[0]:
        raise ValueError(f"cu_seqlens_q must start at 0 and end at T={q.shape[0]}, got {cu.tolist()}")
    query_lens = cu[1:] - cu[:-1]
    if query_lens.numel() and int(query_lens.min()) < 0:
        raise ValueError("cu_seqlens_q must be non-decreasing")
    if bool((seq_lens.long() < query_lens).any()):
        raise ValueError("seq_lens[b] must be >= the number of new tokens of sequence b")
