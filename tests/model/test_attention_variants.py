"""Sliding-window, attention-sink and logit-softcap attention on the CPU paths: the torch backend
(`model/attention.py`: padded SDPA for short rows, SDPA for long ones, explicit attention where
there are sinks or a softcap) against a dense reference written here, the C++ kernel
(`radixserve::paged_attention`) against the torch backend and the reference, and the compiled step
(`radixserve::short_step`) against the Python layers bit for bit.

The reference is plain attention over each row's whole unpaged K/V in float64 with transformers'
formulas: query p sees keys j with p - window < j <= p; s = scale * q.k, capped to softcap *
tanh(s / softcap); the sink joins the softmax as one more logit whose weight is dropped. Every case
puts NaN in the blocks wholly outside the window of every query of a row, so a path that read them
(rather than skipping them) fails."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from typing import Any

import pytest
import torch
from tiny_models import TINY_VOCAB, tiny_model_dir

from radixserve.kernels import cpu_extension
from radixserve.model import attention
from radixserve.model.attention import AttentionMetadata, TorchAttentionBackend
from radixserve.model.kv_fp8 import readable, storable

no_compiler = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                 reason="no C++ compiler")
HEADS, KV_HEADS, DIM, BLOCK = 8, 2, 32, 4
WINDOW = 24
SCALE = DIM**-0.5


@dataclasses.dataclass
class Case:
    """A step over a paged cache: row b has rows[b] = (length, new tokens); `k_cache`/`v_cache` hold
    every row's prefix over shuffled blocks, the step's new K/V are `k_new`/`v_new`, and
    `k_stored`/`v_stored` are the caches with them stored; `keys`/`values` are each row's whole K/V
    [length, Hkv, D] as attention reads them from the cache (float64)."""

    rows: list[tuple[int, int]]
    q: torch.Tensor
    k_new: torch.Tensor
    v_new: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_stored: torch.Tensor
    v_stored: torch.Tensor
    table: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    def meta(self) -> AttentionMetadata:  # a fresh one per step: plans are kept on it
        news = [new for _, new in self.rows]
        return AttentionMetadata(
            slot_mapping=self.slots(), cu_seqlens_q=torch.tensor([0, *news]).cumsum(0, dtype=torch.int32),
            seq_lens=torch.tensor([n for n, _ in self.rows], dtype=torch.int32), block_table=self.table,
            query_lens=news, seq_lens_host=[n for n, _ in self.rows])

    def slots(self) -> torch.Tensor:
        block = self.k_cache.shape[1]
        return torch.tensor([int(self.table[b, p // block]) * block + p % block
                             for b, (n, new) in enumerate(self.rows) for p in range(n - new, n)])

    def forward(self, cpu_kernel: bool = False, **variant: Any) -> torch.Tensor:
        """The torch backend's answer on fresh copies of the caches (each call stores the new K/V)."""
        backend = TorchAttentionBackend(cpu_kernel=cpu_kernel)
        return backend.forward(self.q, self.k_new, self.v_new, self.k_cache.clone(), self.v_cache.clone(), self.meta(),
                               SCALE, **variant)


def _case(rows: list[tuple[int, int]], dtype: torch.dtype, seed: int, kv_dtype: str = "auto",
          window: int | None = WINDOW, block: int = BLOCK, heads: int = HEADS, kv_heads: int = KV_HEADS,
          dim: int = DIM) -> Case:
    """Rows of random K/V (q scaled up, so scores spread and caps and windows matter) in `dtype`, a
    cache of `dtype` values, fp16 values (kv_dtype "fp16") or FP8 rows ("fp8"); the block no row owns
    and, under `window`, each row's blocks wholly before its first query's first key hold NaN."""
    g = torch.Generator().manual_seed(seed)
    blocks = sum(-(-n // block) for n, _ in rows) + 3
    stored = {"fp8": torch.uint8, "fp16": torch.float16}.get(kv_dtype, dtype)
    # stale values where rows do not write (the tails of their last blocks), NaN in the block no row
    # owns, which pads every table row
    caches = [storable(torch.randn(blocks, block, kv_heads, dim, generator=g).to(dtype), empty) for empty in
              (torch.empty(0, dtype=stored),) * 2]
    outside = [blocks - 1]
    order = torch.randperm(blocks - 1, generator=g).tolist()
    table = torch.full((len(rows), max(-(-n // block) for n, _ in rows) + 2), blocks - 1, dtype=torch.int32)
    new_kv: list[list[torch.Tensor]] = [[], []]
    row_slots = []
    for b, (n, new) in enumerate(rows):
        own = [order.pop() for _ in range(-(-n // block))]
        table[b, :len(own)] = torch.tensor(own, dtype=torch.int32)
        row_slots.append(torch.tensor([own[p // block] * block + p % block for p in range(n)]))
        for cache, news in zip(caches, new_kv):
            x = torch.randn(n, kv_heads, dim, generator=g).to(dtype)
            cache.view(-1, kv_heads, cache.shape[-1]).index_copy_(0, row_slots[b][: n - new], storable(x[: n - new], cache))
            news.append(x[n - new:])
        if window is not None:
            outside += own[: max(0, n - new + 1 - window) // block]
    k_new, v_new = torch.cat(new_kv[0]), torch.cat(new_kv[1])
    stored = [cache.clone() for cache in caches]
    for cache, x in zip(stored, (k_new, v_new)):  # as the backend stores them
        cache.view(-1, kv_heads, cache.shape[-1]).index_copy_(0, torch.cat([s[n - new:] for s, (n, new) in
                                                                            zip(row_slots, rows)]), storable(x, cache))
    # what attention reads: the cache's values in the model's dtype
    keys, values = ([readable(cache.view(-1, kv_heads, cache.shape[-1])[s], dtype).double() for s in row_slots]
                    for cache in stored)
    for cache in (*caches, *stored):  # and blocks wholly before any query's window: never to be read
        cache[outside] = 0x7F if kv_dtype == "fp8" else float("nan")
    q = (3 * torch.randn(sum(new for _, new in rows), heads, dim, generator=g)).to(dtype)
    return Case(rows, q, k_new, v_new, caches[0], caches[1], stored[0], stored[1], table, keys, values)


def _sinks(heads: int = HEADS, seed: int = 0) -> torch.Tensor:
    return 2 * torch.randn(heads, generator=torch.Generator().manual_seed(seed))


def _reference(case: Case, window: int | None = None, sinks: torch.Tensor | None = None,
               softcap: float | None = None) -> torch.Tensor:
    """Attention of each row's new tokens over its whole unpaged K/V, in float64."""
    out = []
    group = case.q.shape[1] // case.keys[0].shape[1]
    token = 0
    for b, (n, new) in enumerate(case.rows):
        q = case.q[token : token + new].double()
        token += new
        keys = case.keys[b].repeat_interleave(group, dim=1)
        values = case.values[b].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, keys) * SCALE
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos, k_pos = torch.arange(n - new, n)[:, None], torch.arange(n)[None, :]
        allowed = k_pos <= q_pos
        if window is not None:
            allowed &= k_pos > q_pos - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            scores = torch.cat([scores, sinks.double()[:, None, None].expand(-1, new, 1)], dim=-1)
        weights = torch.softmax(scores, dim=-1)[..., :n]
        out.append(torch.einsum("hqk,khd->qhd", weights, values))
    return torch.cat(out)


VARIANTS: dict[str, dict[str, Any]] = {
    "window": dict(window=WINDOW),
    "sinks": dict(sinks=_sinks()),
    "softcap": dict(softcap=5.0),
    "window+sinks+softcap": dict(window=WINDOW, sinks=_sinks(), softcap=5.0),
    "sinks+softcap": dict(sinks=_sinks(), softcap=5.0),
}
MIXES = {
    # decodes far past the window (the first key 277, in the kernel's second partition), a little
    # past it and inside it; a verification across its edge
    "short": [(300, 1), (40, 1), (10, 1), (100, 5)],
    # the same beside prefill chunks: one crossing the window's edge over a cached prefix, a prompt
    # longer than the window without one, a long chunk in several pieces
    "mixed": [(300, 1), (90, 40), (60, 60), (100, 5), (700, 520), (21, 16)],
}


def _tolerance(dtype: torch.dtype) -> dict[str, Any]:
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kv_dtype", ["auto", "fp16", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_torch_backend_is_the_dense_reference(variant: str, mix: str, dtype: torch.dtype, kv_dtype: str) -> None:
    """GQA 4:1, blocks of 4 in shuffled order, the new K/V stored by the backend, every variant and
    combination, fp32 and bf16 values or an FP8 cache (the reference reads what the cache holds)."""
    args = VARIANTS[variant]
    case = _case(MIXES[mix], dtype, seed=len(variant) + len(mix), kv_dtype=kv_dtype, window=args.get("window"))
    got = case.forward(**args)
    assert got.dtype == dtype and got.isfinite().all()
    torch.testing.assert_close(got.double(), _reference(case, **args), **_tolerance(dtype))


def test_without_variants_the_backend_is_plain_causal_attention() -> None:
    case = _case(MIXES["mixed"], torch.float32, seed=3, window=None)
    torch.testing.assert_close(case.forward().double(), _reference(case), **_tolerance(torch.float32))


@pytest.mark.parametrize("variant", ["window", "sinks+softcap", "window+sinks+softcap"])
def test_explicit_attention_of_a_long_row_in_pieces_is_the_same(variant: str, monkeypatch) -> None:
    """With room for only about 20 queries' scores at once, a 520-token chunk runs in many pieces."""
    args = VARIANTS[variant]
    case = _case([(700, 520), (30, 20)], torch.float32, seed=4, window=args.get("window"))
    monkeypatch.setattr(attention, "EXPLICIT_SCORES", HEADS * 700 * 20)
    monkeypatch.setattr(attention, "WINDOW_PIECE", 30)
    torch.testing.assert_close(case.forward(**args).double(), _reference(case, **args), **_tolerance(torch.float32))


def test_a_short_plan_is_made_once_per_step_and_window() -> None:
    """Layers with the same window share their step's plan; a window that hides no key of the step
    shares the full-attention layers' plan."""
    case = _case(MIXES["short"], torch.float32, seed=5)
    meta, backend = case.meta(), TorchAttentionBackend()
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    for layer_window in (WINDOW, None, WINDOW, 300, 7):
        backend.forward(case.q, case.k_new, case.v_new, k_cache, v_cache, meta, SCALE, window=layer_window)
    assert sorted(meta.plans) == ["torch_short", "torch_short/24", "torch_short/7"]
    plan = meta.plans["torch_short/24"]
    backend.forward(case.q, case.k_new, case.v_new, k_cache, v_cache, meta, SCALE, window=WINDOW)
    assert meta.plans["torch_short/24"] is plan
    # each row gathers from the block of its first query's first key on: row 0 (300 tokens, first
    # key 276) 6 blocks, not 75; the widest, row 3 (100 tokens, 5 new, first key 72), 7 from block 18
    assert plan.max_len == 100 - 18 * BLOCK and plan.blocks.numel() == 4 * 7


def test_bad_variants_are_refused() -> None:
    case = _case([(10, 1)], torch.float32, seed=6)
    with pytest.raises(ValueError, match="window 0"):
        case.forward(window=0)
    with pytest.raises(ValueError, match="softcap -1"):
        case.forward(softcap=-1.0)


# the C++ kernel


@pytest.fixture(scope="module")
def extension() -> None:
    cpu_extension.load_extension()


def _paged(case: Case, max_query: int = 16, window: int | None = None, sinks: torch.Tensor | None = None,
           softcap: float | None = None) -> torch.Tensor:
    """The kernel over the case's cache with its new K/V stored (short rows only; long ones stay 7)."""
    out = torch.full_like(case.q, 7.0)
    torch.ops.radixserve.paged_attention(case.q, case.k_stored, case.v_stored, case.table, [n for n, _ in case.rows],
                                         [new for _, new in case.rows], SCALE, max_query, out, window or 0, sinks,
                                         softcap or 0.0)
    return out


def _near(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, sdpa: bool) -> None:
    """fp32: within 1e-5 of each other. bf16: against explicit attention, each an fp32 result rounded
    once, so at most one bf16 step apart (2^-7 relative: the spacing at the smaller of two
    neighbours); against SDPA, which rounds its bf16 probabilities, as near as either is to float64."""
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    elif sdpa:
        torch.testing.assert_close(got.double(), want.double(), **_tolerance(dtype))
    else:
        assert ((got.double() - want.double()).abs() <= want.double().abs() * 2**-7 + 1e-3).all()


@no_compiler
@pytest.mark.usefixtures("extension")
@pytest.mark.parametrize("dtype, kv_dtype", [(torch.float32, "auto"), (torch.bfloat16, "auto"), (torch.float32, "fp16")])
@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_kernel_is_the_torch_backend_and_the_reference(variant: str, mix: str, dtype: torch.dtype,
                                                           kv_dtype: str) -> None:
    """The backend with the kernel (short rows in C++, long ones in SDPA or explicit attention)
    against the backend without it, and the kernel alone against the reference; over a cache of the
    model's dtype or of fp16 (which both read exactly widened)."""
    args = VARIANTS[variant]
    case = _case(MIXES[mix], dtype, seed=len(variant) * len(mix), kv_dtype=kv_dtype, window=args.get("window"))
    with_kernel = case.forward(cpu_kernel=True, **args)
    assert with_kernel.isfinite().all()
    _near(with_kernel, case.forward(**args), dtype, sdpa="sinks" not in args and "softcap" not in args)
    torch.testing.assert_close(with_kernel.double(), _reference(case, **args), **_tolerance(dtype))
    if mix == "short":  # the kernel called directly: its fp32 answer against float64
        torch.testing.assert_close(_paged(case, **args).double(), _reference(case, **args), **_tolerance(dtype))


@no_compiler
@pytest.mark.usefixtures("extension")
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block"), [(4, 1, 256, 16), (6, 2, 128, 7), (2, 2, 16, 12)])
def test_the_kernel_under_every_variant_at_other_shapes(heads: int, kv_heads: int, dim: int, block: int) -> None:
    """head_dim 256, 128 and 16, GQA 4:1, 3:1 and none, blocks that do not divide a partition; a
    window of 300 (wider than a partition of 256), decodes and verifications around its edges."""
    rows = [(1000, 1), (301, 1), (302, 3), (556, 16), (299, 2)]
    sinks = _sinks(heads, seed=1).bfloat16()  # in the model's dtype
    case = _case(rows, torch.float32, seed=dim, window=300, block=block, heads=heads, kv_heads=kv_heads, dim=dim)
    got = _paged(case, window=300, sinks=sinks, softcap=3.0)
    assert got.isfinite().all()
    torch.testing.assert_close(got.double(), _reference(case, 300, sinks.float(), 3.0), rtol=1e-5, atol=1e-5)


@no_compiler
@pytest.mark.usefixtures("extension")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_attention_still_depends_on_nothing_but_its_own_row(dtype: torch.dtype) -> None:
    """Bit for bit under every variant at once: a row alone or among others, on one thread or two, a
    query decoded alone or as the last of a verification (whose first queries reach further back:
    its tasks start a partition earlier), and a window that hides no key is no window."""
    args = VARIANTS["window+sinks+softcap"]
    rows = [(37, 1), (600, 3), (20, 9), (513, 1), (281, 6)]
    case = _case(rows, dtype, seed=11)
    together = _paged(case, **args)
    assert together.isfinite().all()
    alone = dataclasses.replace(case, rows=rows[1:2], q=case.q[1:4], table=case.table[1:2])
    assert torch.equal(_paged(alone, **args), together[1:4])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(_paged(case, **args), together)
    finally:
        torch.set_num_threads(threads)
    # row 4's last query, at 280, sees keys from 257 on (one partition); its first, at 275, from 252
    decode = dataclasses.replace(case, rows=[(281, 1)], q=case.q[-1:], table=case.table[4:5])
    assert torch.equal(_paged(decode, **args), together[-1:])
    whole = _case(rows, dtype, seed=11, window=None)  # no block poisoned
    assert torch.equal(_paged(whole, **dict(args, window=600)), _paged(whole, **dict(args, window=None)))


@no_compiler
@pytest.mark.usefixtures("extension")
def test_bad_variant_arguments_to_the_kernel_are_refused() -> None:
    case = _case([(20, 1)], torch.float32, seed=1)
    out = torch.empty_like(case.q)
    call = torch.ops.radixserve.paged_attention
    with pytest.raises(RuntimeError, match="window and softcap"):
        call(case.q, case.k_cache, case.v_cache, case.table, [20], [1], 0.1, 16, out, -1)
    with pytest.raises(RuntimeError, match="one float per q head"):
        call(case.q, case.k_cache, case.v_cache, case.table, [20], [1], 0.1, 16, out, 0, torch.zeros(HEADS + 1))


# the compiled step


def _windowed_step(arch: str, dtype: torch.dtype, rows: list[tuple[int, int]], seed: int) -> tuple[Any, ...]:
    """A packed tiny model, a cache of random K/V over shuffled blocks for `rows`, and the step's
    inputs; `meta()` makes a fresh metadata per forward."""
    from radixserve.kernels.cpu_linear import BlockedLinear, pack_for_cpu
    from radixserve.model.kv_cache import KVCache, KVLayout
    from radixserve.model.loader import load_model

    cpu_extension.load_extension()
    model, spec = load_model(tiny_model_dir(arch), dtype, torch.device("cpu"))
    pack_for_cpu(model, model.model.embed_tokens.weight if model.lm_head is None else None, BlockedLinear)
    g = torch.Generator().manual_seed(seed)
    blocks = sum(-(-n // 16) for n, _ in rows) + 2
    cache = KVCache(KVLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, 16, dtype), blocks - 1,
                    torch.device("cpu"))
    cache.data.copy_(torch.randn(cache.data.shape, generator=g))
    cache.data[:, :, cache.scratch_block] = float("nan")
    order = torch.randperm(blocks - 1, generator=g).tolist()
    table = torch.full((len(rows), max(-(-n // 16) for n, _ in rows) + 1), cache.scratch_block, dtype=torch.int32)
    for b, (n, _) in enumerate(rows):
        own = [order.pop() for _ in range(-(-n // 16))]
        table[b, : len(own)] = torch.tensor(own, dtype=torch.int32)
    positions = [p for n, new in rows for p in range(n - new, n)]
    rows_of = [b for b, (_, new) in enumerate(rows) for _ in range(new)]
    slots = torch.tensor([int(table[b, p // 16]) * 16 + p % 16 for b, p in zip(rows_of, positions)])
    news = [new for _, new in rows]

    def meta() -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=slots, cu_seqlens_q=torch.tensor([0, *news]).cumsum(0, dtype=torch.int32),
            seq_lens=torch.tensor([n for n, _ in rows], dtype=torch.int32), block_table=table,
            query_lens=news, seq_lens_host=[n for n, _ in rows])

    ids = torch.randint(0, TINY_VOCAB, (len(positions),), generator=g)
    return model, cache, meta, ids, torch.tensor(positions)


def _set_variants(model: Any, per_layer: list[dict[str, Any]]) -> None:
    for layer, variant in zip(model.model.layers, per_layer):
        attn = layer.self_attn
        attn.window = variant.get("window")
        attn.softcap = variant.get("softcap")
        sinks = variant.get("sinks")
        dtype = model.model.embed_tokens.weight.dtype
        attn.sinks = None if sinks is None else torch.nn.Parameter(sinks.to(dtype), requires_grad=False)


STEP_ROWS = [(300, 1), (129, 1), (140, 4), (60, 1), (200, 16)]  # past Mistral's window of 128, beside it, inside


@no_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("arch", "variants"), [
    ("mistral", None),  # its own window (tiny_models.MISTRAL_WINDOW) on every layer
    ("llama", [dict(window=20, sinks=_sinks(4, seed=2), softcap=4.0), dict()]),  # a window layer, a full one
    ("llama", [dict(sinks=_sinks(4, seed=3)), dict(window=7, softcap=2.0)]),
])
def test_the_compiled_step_with_attention_variants_is_the_python_layers_bit_for_bit(
        arch: str, variants: list[dict[str, Any]] | None, dtype: torch.dtype) -> None:
    from radixserve.model import cpu_step
    from radixserve.model.kv_cache import KVCache
    from radixserve.model.ops import CpuKernelOps

    model, cache, meta, ids, positions = _windowed_step(arch, dtype, STEP_ROWS, seed=len(arch))
    if variants is not None:
        _set_variants(model, variants)
    windows = [cpu_step.layer_window(model, i) for i in range(len(model.model.layers))]
    assert any(windows), "a layer with a window"
    python_cache = KVCache(cache.layout, cache.num_blocks, torch.device("cpu"))
    python_cache.data.copy_(cache.data)
    step = cpu_step.compiled_cpu_step(model, cache, TorchAttentionBackend(cpu_kernel=True), CpuKernelOps())
    assert step is not None
    with torch.inference_mode():
        got = step.forward(ids, positions, meta())
        want = model(ids, positions, python_cache, meta(), TorchAttentionBackend(cpu_kernel=True), CpuKernelOps())
        full_cache = KVCache(cache.layout, cache.num_blocks, torch.device("cpu"))
        full_cache.data.copy_(python_cache.data)
        full = _without_windows(model, lambda: model(ids, positions, full_cache, meta(),
                                                     TorchAttentionBackend(cpu_kernel=True), CpuKernelOps()))
    assert got is not None and got.isfinite().all()
    assert torch.equal(got, want)
    assert torch.equal(cache.data.nan_to_num(), python_cache.data.nan_to_num())
    assert not torch.equal(got, full)  # the windows changed the answer: the step applied them


def _without_windows(model: Any, run: Callable[[], torch.Tensor]) -> torch.Tensor:
    saved = [layer.self_attn.window for layer in model.model.layers]
    try:
        for layer in model.model.layers:
            layer.self_attn.window = None
        return run()
    finally:
        for layer, window in zip(model.model.layers, saved):
            layer.self_attn.window = window
