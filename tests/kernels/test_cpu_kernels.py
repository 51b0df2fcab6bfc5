"""The C++ extension's CPU kernels (`kernels/csrc/`): the matmul (`radixserve::linear`) and the in-place
attention of short rows (`radixserve::paged_attention`) against float64 references, and the
invariants the engine relies on: a row's result never depends on the other rows of its step, on how
many rows ran, or on the thread count."""

from __future__ import annotations

import shutil

import pytest
import torch

from radixserve.kernels import cpu_extension
from radixserve.kernels.cpu_linear import BlockedLinear, packing_works
from radixserve.model.attention import AttentionMetadata, TorchAttentionBackend

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="no C++ compiler")


@pytest.fixture(scope="module", autouse=True)
def extension() -> None:
    cpu_extension.load_extension()


def _linear_case(rows: int, out: int, inp: int, dtype: torch.dtype, bias: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out, inp, generator=g).to(dtype)
    b = torch.randn(out, generator=g).to(dtype) if bias else None
    return torch.randn(rows, inp, generator=g).to(dtype), weight, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "out", "inp", "bias"), [
    (1, 64, 32, False), (3, 100, 37, True), (7, 960, 576, True), (53, 33, 20, False), (130, 48, 64, True)])
def test_linear_is_x_times_w_plus_b(dtype: torch.dtype, rows: int, out: int, inp: int, bias: bool) -> None:
    """To fp32 rounding against float64 (bf16: one rounding of the fp32 sum), any output width (the
    last block padded), any row count (tiles of 6 rows, chunks of 48)."""
    x, weight, b = _linear_case(rows, out, inp, dtype, bias, seed=rows + out)
    got = BlockedLinear(weight, b)(x)
    want = torch.nn.functional.linear(x.double(), weight.double(), None if b is None else b.double())
    assert got.shape == (rows, out) and got.dtype == dtype and got.is_contiguous()
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    else:  # each bf16 output is the fp32 result rounded once: within one bf16 ulp (2^-8 relative)
        assert ((got.double() - want).abs() <= want.abs() * 2**-8 + 1e-2).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_product_is_the_same_whatever_the_row_count_and_threads(dtype: torch.dtype) -> None:
    """Bit for bit: a row alone, among 2..5 (tails), 6 (a tile), 49 (past a chunk) or 512 (a prefill
    chunk), from a strided view, and on one thread or two."""
    x, weight, b = _linear_case(512, 3072 + 16 * 3, 576, dtype, True, seed=1)
    linear = BlockedLinear(weight, b)
    each = torch.cat([linear(x[i:i + 1]) for i in range(130)])
    for rows in (2, 5, 6, 7, 13, 48, 49, 130):  # every tile's tail, a chunk, past a chunk; every row compared
        assert torch.equal(linear(x[:rows]), each[:rows]), rows
    assert torch.equal(linear(x)[:130], each)  # a 512-row prefill chunk
    alone = each[7:8]
    wide = torch.cat([x, x], dim=1)[:, :576]  # not contiguous
    assert torch.equal(linear(wide[7:8]), alone)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(linear(x[7:19])[:1], alone)
    finally:
        torch.set_num_threads(threads)


def test_bad_linear_inputs_are_refused_with_a_reason() -> None:
    packed = torch.ops.radixserve.pack_linear(torch.randn(32, 8))
    with pytest.raises(RuntimeError, match="x \\[rows, in\\]"):
        torch.ops.radixserve.linear(torch.randn(2, 9), packed, None, 32)
    with pytest.raises(RuntimeError, match="do not match"):
        torch.ops.radixserve.linear(torch.randn(2, 8), packed, None, 48)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        torch.ops.radixserve.pack_linear(torch.randn(32, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="CPU tensors"):
        torch.ops.radixserve.linear(torch.randn(2, 8, device="meta"), packed, None, 32)
    assert packing_works(torch.float32, BlockedLinear) and not packing_works(torch.float16, BlockedLinear)


BLOCK = 16


def _attention_case(rows: list[tuple[int, int]], heads: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int,
                    block: int = BLOCK):
    """A paged cache of random K/V over shuffled blocks, NaN in the last block (which every table row
    pads with), and the q of a step where row b has rows[b] = (length, new tokens)."""
    g = torch.Generator().manual_seed(seed)
    blocks = sum(-(-n // block) for n, _ in rows) + 8
    k_cache = torch.randn(blocks, block, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(blocks, block, kv_heads, dim, generator=g).to(dtype)
    k_cache[-1] = v_cache[-1] = float("nan")
    order = torch.randperm(blocks - 1, generator=g).tolist()
    table = torch.full((len(rows), max(-(-n // block) for n, _ in rows) + 2), blocks - 1, dtype=torch.int32)
    for b, (n, _) in enumerate(rows):
        own = [order.pop() for _ in range(-(-n // block))]
        table[b, :len(own)] = torch.tensor(own, dtype=torch.int32)
    q = torch.randn(sum(new for _, new in rows), heads, dim, generator=g).to(dtype)
    return q, k_cache, v_cache, table


def _attention_reference(q, k_cache, v_cache, table, rows, scale):
    """softmax(q k^T * scale) v in float64, query by query and head by head, each query seeing its
    own row's keys up to its own position."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // k_cache.shape[2]
    token = 0
    for b, (n, new) in enumerate(rows):
        own = table[b, : -(-n // k_cache.shape[1])].long()
        keys = k_cache[own].reshape(-1, *k_cache.shape[2:])[:n].double()
        values = v_cache[own].reshape(-1, *v_cache.shape[2:])[:n].double()
        for i in range(new):
            last = n - new + i
            for h in range(q.shape[1]):
                weights = torch.softmax(keys[: last + 1, h // group] @ q[token + i, h].double() * scale, dim=0)
                out[token + i, h] = weights @ values[: last + 1, h // group]
        token += new
    return out


def _paged(q, k_cache, v_cache, table, rows, scale, max_query=16, window=0):
    out = torch.full_like(q, 7.0)
    torch.ops.radixserve.paged_attention(q, k_cache, v_cache, table, [n for n, _ in rows], [new for _, new in rows],
                                         scale, max_query, out, window)
    return out


MIXES = [
    [(1, 1)],  # a fresh one-token prompt
    [(37, 1), (600, 3), (20, 9), (16, 16)],  # a decode, verifications (one across three partitions), a short prompt
    [(257, 1), (256, 2), (300, 40), (5, 5)],  # partition edges; a long row the kernel leaves alone
    [(258, 3), (270, 16)],  # verifications whose first queries see none of the last partition's keys
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block"), [
    (9, 3, 64, 16), (4, 1, 16, 16), (8, 8, 128, 16), (2, 1, 256, 16), (4, 1, 512, 16), (6, 2, 32, 7),
    (5, 5, 80, 12)])
@pytest.mark.parametrize("rows", MIXES)
def test_paged_attention_is_causal_softmax_attention(dtype, heads, kv_heads, dim, block, rows) -> None:
    """Against float64 softmax attention: GQA 3:1, 4:1 and none, every head_dim kind (one to sixteen
    lanes of 16, and Gemma 4's thirty-two), blocks that do not divide a partition (7, 12), queries with nothing to see in a
    partition."""
    q, k_cache, v_cache, table = _attention_case(rows, heads, kv_heads, dim, dtype, seed=len(rows) + dim, block=block)
    got = _paged(q, k_cache, v_cache, table, rows, scale=dim**-0.5)
    want = _attention_reference(q, k_cache, v_cache, table, rows, dim**-0.5)
    token = 0
    for _, new in rows:
        part = slice(token, token + new)
        token += new
        if new > 16:  # left for the caller's long-row path
            assert (got[part] == 7.0).all()
            continue
        # fp32 sums of exactly widened values, the result rounded once to q's dtype
        tolerance = {torch.float32: 1e-5, torch.float16: 1e-3}.get(dtype, 1e-2)
        torch.testing.assert_close(got[part].double(), want[part], rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_rows_attention_depends_on_nothing_but_its_own_row(dtype: torch.dtype) -> None:
    """Bit for bit: a row alone or among others, on one thread or two, and a query decoded alone or
    as the last of a verification's queries (the same keys; other query heads share its pass)."""
    rows = [(37, 1), (600, 3), (20, 9), (513, 1)]
    q, k_cache, v_cache, table = _attention_case(rows, 9, 3, 64, dtype, seed=11)
    together = _paged(q, k_cache, v_cache, table, rows, 0.125)
    assert torch.equal(_paged(q[1:4], k_cache, v_cache, table[1:2], rows[1:2], 0.125), together[1:4])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(_paged(q, k_cache, v_cache, table, rows, 0.125), together)
    finally:
        torch.set_num_threads(threads)
    decode = _paged(q[3:4], k_cache, v_cache, table[1:2], [(600, 1)], 0.125)
    assert torch.equal(decode, together[3:4])


def test_a_prompt_chunk_beside_decodes_gives_the_bits_it_gives_alone() -> None:
    """Threads claim tasks dearest first (a 40-query chunk's before the decodes'): which thread takes
    which task, and in what order, changes no bit of any row, on one thread or two."""
    rows = [(37, 1), (1100, 40), (600, 1), (513, 3), (300, 1)]
    q, k_cache, v_cache, table = _attention_case(rows, 9, 3, 64, torch.float16, seed=13)
    together = _paged(q, k_cache, v_cache, table, rows, 0.125, max_query=64)
    assert torch.equal(_paged(q[1:41], k_cache, v_cache, table[1:2], rows[1:2], 0.125, max_query=64), together[1:41])
    assert torch.equal(_paged(q[41:42], k_cache, v_cache, table[2:3], rows[2:3], 0.125), together[41:42])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(_paged(q, k_cache, v_cache, table, rows, 0.125, max_query=64), together)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_querys_scores_do_not_depend_on_which_keys_are_reduced_together(dtype: torch.dtype) -> None:
    """The kernel sums q.k's lanes for four keys at once, from the first key any query of a pass
    sees. In a window of 6, without GQA (one pass takes the three queries of a verification), the
    verification's first query sees keys from 592 on and the decode's from 594, so the last query's
    keys are reduced in other groups of four, or alone, than the decode's: bit for bit the same."""
    q, k_cache, v_cache, table = _attention_case([(600, 3)], 4, 4, 64, dtype, seed=12)
    windowed = _paged(q, k_cache, v_cache, table, [(600, 3)], 0.125, window=6)
    assert torch.equal(_paged(q[2:3], k_cache, v_cache, table, [(600, 1)], 0.125, window=6), windowed[2:3])


def test_a_nan_key_poisons_the_queries_that_see_it_as_in_sdpa() -> None:
    """A NaN in a cached key is not skipped: the queries that see it answer NaN, as SDPA would (the
    sampler then fails that request alone), and the other rows are untouched."""
    rows = [(40, 3), (40, 1)]
    q, k_cache, v_cache, table = _attention_case(rows, 4, 2, 16, torch.float32, seed=9)
    k_cache[int(table[0, 2]), 6, 1] = float("nan")  # row 0's key 38 (block 2, slot 6), kv head 1
    got = _paged(q, k_cache, v_cache, table, rows, 0.25)
    # row 0's queries sit at 37, 38, 39: the first sees keys 0..37 only; heads 2 and 3 read kv head 1
    assert got[0].isfinite().all() and got[1:3, 2:].isnan().all() and got[1:3, :2].isfinite().all()
    assert got[3].isfinite().all()


def test_the_torch_backend_runs_the_kernel_for_short_rows_and_sdpa_for_long_ones() -> None:
    """With `cpu_kernel` the backend stores the new K/V, the kernel answers the short rows and SDPA
    the long row; both agree with the float64 reference."""
    rows = [(37, 1), (300, 40), (20, 9)]
    q, k_cache, v_cache, table = _attention_case(rows, 4, 2, 16, torch.float32, seed=5)
    g = torch.Generator().manual_seed(6)
    k_new = torch.randn(q.shape[0], 2, 16, generator=g)
    v_new = torch.randn(q.shape[0], 2, 16, generator=g)
    slots = torch.tensor([int(table[b, p // BLOCK]) * BLOCK + p % BLOCK
                          for b, (n, new) in enumerate(rows) for p in range(n - new, n)])
    news = [new for _, new in rows]
    meta = AttentionMetadata(slot_mapping=slots, cu_seqlens_q=torch.tensor([0, *news]).cumsum(0, dtype=torch.int32),
                             seq_lens=torch.tensor([n for n, _ in rows], dtype=torch.int32), block_table=table,
                             query_lens=news, seq_lens_host=[n for n, _ in rows])
    got = TorchAttentionBackend(cpu_kernel=True).forward(q, k_new, v_new, k_cache, v_cache, meta, 0.25)
    flat_k, flat_v = k_cache.view(-1, 2, 16), v_cache.view(-1, 2, 16)
    assert torch.equal(flat_k[slots], k_new) and torch.equal(flat_v[slots], v_new)
    want = _attention_reference(q, k_cache, v_cache, table, rows, 0.25)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_bad_attention_inputs_are_refused_with_a_reason() -> None:
    rows = [(20, 1)]
    q, k_cache, v_cache, table = _attention_case(rows, 4, 2, 16, torch.float32, seed=1)
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="new of 20 tokens"):
        torch.ops.radixserve.paged_attention(q, k_cache, v_cache, table, [20], [21], 0.1, 16, out)
    with pytest.raises(RuntimeError, match="exceed the table"):
        torch.ops.radixserve.paged_attention(q, k_cache, v_cache, table, [20 + BLOCK * 8], [1], 0.1, 16, out)
    with pytest.raises(RuntimeError, match="fp32, bf16 or fp16"):
        torch.ops.radixserve.paged_attention(q, k_cache.double(), v_cache.double(), table, [20], [1], 0.1, 16, out)
    with pytest.raises(RuntimeError, match="fp32, bf16 or fp16"):
        torch.ops.radixserve.paged_attention(q, k_cache, v_cache.half(), table, [20], [1], 0.1, 16, out)
    with pytest.raises(RuntimeError, match="not q's"):
        torch.ops.radixserve.paged_attention(torch.cat([q, q]), k_cache, v_cache, table, [20], [1], 0.1, 16,
                                             torch.cat([out, out]))
    with pytest.raises(RuntimeError, match="CPU tensors"):
        torch.ops.radixserve.paged_attention(q.to("meta"), k_cache, v_cache, table, [20], [1], 0.1, 16, out)
    bad = table.clone()
    bad[0, 1] = k_cache.shape[0]
    with pytest.raises(RuntimeError, match="names block"):
        torch.ops.radixserve.paged_attention(q, k_cache, v_cache, bad, [20], [1], 0.1, 16, out)
