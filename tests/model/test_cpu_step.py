"""The CPU step's parts: threads sized from the cores a process may use, weights packed for oneDNN
(same products as `F.linear`), the block-granular gather of the torch attention backend against a
per-token reference, and the compiled decode step against the eager one and transformers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from radixserve.kernels.cpu_linear import PackedLinear, pack_for_cpu, packing_works
from radixserve.model import cpu_threads
from radixserve.model.attention import AttentionMetadata, TorchAttentionBackend
from radixserve.model.rope import RopeParams, RotaryEmbedding, apply_rotary


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_cgroup_quota_caps_the_threads(tmp_path: Path) -> None:
    affinity = len(os.sched_getaffinity(0))
    assert cpu_threads.cgroup_cpu_limit(tmp_path) is None  # nothing readable: unlimited
    assert cpu_threads.available_cores(tmp_path) == affinity
    _write(tmp_path / "cpu.max", "max 100000\n")
    assert cpu_threads.cgroup_cpu_limit(tmp_path) is None
    _write(tmp_path / "cpu.max", "50000 100000\n")  # half a core: one thread, never zero
    assert cpu_threads.cgroup_cpu_limit(tmp_path) == 0.5
    assert cpu_threads.available_cores(tmp_path) == 1
    _write(tmp_path / "cpu.max", f"{150000 * affinity} 100000\n")  # more quota than affinity: affinity wins
    assert cpu_threads.available_cores(tmp_path) == affinity
    v1 = tmp_path / "v1"
    _write(v1 / "cpu" / "cpu.cfs_quota_us", "100000\n")
    _write(v1 / "cpu" / "cpu.cfs_period_us", "100000\n")
    assert cpu_threads.cgroup_cpu_limit(v1) == 1.0 and cpu_threads.available_cores(v1) == 1
    _write(v1 / "cpu" / "cpu.cfs_quota_us", "-1\n")
    assert cpu_threads.cgroup_cpu_limit(v1) is None


def test_an_explicit_count_and_the_environment_win(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
        assert cpu_threads.configure_cpu_threads(1) == 1
        assert cpu_threads.configure_cpu_threads() == cpu_threads.available_cores()
        torch.set_num_threads(1)
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert cpu_threads.configure_cpu_threads() == 1  # left as the operator set it
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not packing_works(torch.float32), reason="this machine's oneDNN cannot pack fp32 linears")
@pytest.mark.parametrize("rows", [0, 1, 5, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_linear_computes_what_the_linear_did(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    linear = nn.Linear(48, 80, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(80, 48, generator=g))
        if bias:
            linear.bias.copy_(torch.randn(80, generator=g))
    x = torch.randn(rows, 48, generator=g)
    packed = PackedLinear(linear.weight, linear.bias)
    assert packed.weight.is_mkldnn and packed.weight.numel() == linear.weight.numel()
    torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not packing_works(torch.float32), reason="this machine's oneDNN cannot pack fp32 linears")
def test_packing_swaps_every_linear_and_unties_the_head_for_reading() -> None:
    model = nn.Module()
    model.block = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8, bias=False))
    embedding = nn.Embedding(32, 8)
    before = sum(p.numel() for p in model.parameters())
    assert pack_for_cpu(model, embedding.weight) == 3
    assert all(type(m) is not nn.Linear for m in model.modules())
    assert isinstance(model.lm_head, PackedLinear)
    # every weight counted once, and the packed head once more (it is a copy the embedding does not share)
    assert sum(p.numel() for p in model.parameters()) == before + embedding.weight.numel()
    x = torch.randn(3, 8)
    torch.testing.assert_close(model.lm_head(x), x @ embedding.weight.T, rtol=1e-5, atol=1e-5)


def _slot_reference(q, k_cache, v_cache, table, lens, scale):
    """Per-token gather, one sequence at a time: the plainest statement of paged decode attention."""
    bs = k_cache.shape[1]
    out = []
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        slots = table[b].long()[pos // bs] * bs + pos % bs
        keys = k_cache.view(-1, *k_cache.shape[2:])[slots].transpose(0, 1)
        vals = v_cache.view(-1, *v_cache.shape[2:])[slots].transpose(0, 1)
        out.append(torch.nn.functional.scaled_dot_product_attention(
            q[b:b + 1].transpose(0, 1), keys, vals, scale=scale, enable_gqa=True).transpose(0, 1))
    return torch.cat(out)


def _decode_case(lens: list[int]) -> tuple[torch.Tensor, ...]:
    """A decode step of rows of these lengths over a shuffled paged cache whose scratch block (the
    table's filler past each row's own blocks) holds NaN: q, new k, new v, k_cache, v_cache, table."""
    g = torch.Generator().manual_seed(len(lens))
    bs, heads, kv_heads, dim, blocks = 16, 4, 2, 8, 24
    k_cache = torch.randn(blocks, bs, kv_heads, dim, generator=g)
    v_cache = torch.randn(blocks, bs, kv_heads, dim, generator=g)
    width = max(-(-n // bs) for n in lens) + 1
    order = torch.randperm(blocks - 1, generator=g).tolist()
    table = torch.full((len(lens), width), blocks - 1, dtype=torch.int32)  # past its blocks: the scratch block
    for b, n in enumerate(lens):
        own = [order.pop() for _ in range(-(-n // bs))]
        table[b, :len(own)] = torch.tensor(own, dtype=torch.int32)
    k_cache[blocks - 1] = float("nan")
    v_cache[blocks - 1] = float("nan")
    q = torch.randn(len(lens), heads, dim, generator=g)
    k_new = torch.randn(len(lens), kv_heads, dim, generator=g)
    v_new = torch.randn(len(lens), kv_heads, dim, generator=g)
    return q, k_new, v_new, k_cache, v_cache, table


def _decode_meta(lens: list[int], table: torch.Tensor) -> AttentionMetadata:
    bs = 16
    slots = torch.tensor([int(table[b, (n - 1) // bs]) * bs + (n - 1) % bs for b, n in enumerate(lens)])
    return AttentionMetadata(slot_mapping=slots, cu_seqlens_q=torch.arange(len(lens) + 1, dtype=torch.int32),
                             seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=table,
                             query_lens=[1] * len(lens), seq_lens_host=list(lens))


@pytest.mark.parametrize("lens", [[37], [16, 16], [5, 33, 17], [1, 48, 48, 2]])
def test_block_gather_decode_matches_the_per_token_reference(lens: list[int]) -> None:
    """Rows of different lengths read their own blocks only; a stale NaN past a row's own blocks
    (another sequence's block, the scratch block) never reaches its output."""
    q, k_new, v_new, k_cache, v_cache, table = _decode_case(lens)
    got = TorchAttentionBackend().forward(q, k_new, v_new, k_cache, v_cache, _decode_meta(lens, table), 0.3)
    want = _slot_reference(q, k_cache, v_cache, table, lens, 0.3)
    assert got.isfinite().all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_one_backend_reuses_its_gather_buffers_without_mixing_calls() -> None:
    """The gather buffers live on between calls (layers, steps) and shrink and grow with them: each
    call still reads only its own cache, keys and values land apart, and an output never aliases a
    buffer that the next call overwrites."""
    backend = TorchAttentionBackend()
    layouts = [[1, 48, 48, 2], [37], [5, 33, 17], [16, 16], [1, 48, 48, 2]]
    runs = []
    for lens in layouts:
        q, k_new, v_new, k_cache, v_cache, table = _decode_case(lens)
        got = backend.forward(q, k_new, v_new, k_cache, v_cache, _decode_meta(lens, table), 0.3)
        runs.append((got, _slot_reference(q, k_cache, v_cache, table, lens, 0.3)))
    for got, want in runs:  # checked after every call has run
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not packing_works(torch.float32), reason="this machine's oneDNN cannot pack fp32 linears")
@pytest.mark.parametrize("shape", [(48, 32), (576, 1536), (3072, 576)])
def test_a_rows_product_does_not_depend_on_how_many_rows_ran(shape: tuple[int, int]) -> None:
    """Bit for bit: one row alone, padded (`MIN_ROWS`), or among up to 64, as a seeded sample or a
    greedy answer must not change with what else ran in the step."""
    g = torch.Generator().manual_seed(shape[0])
    packed = PackedLinear(torch.randn(*shape, generator=g), None)
    x = torch.randn(64, shape[1], generator=g)
    alone = packed(x[:1])
    for rows in (2, 3, 4, 5, 16, 64):
        assert torch.equal(packed(x[:rows])[:1], alone), rows


@pytest.mark.parametrize("rows", [[(37, 1), (20, 3), (48, 9)], [(9, 9), (16, 16)], [(40, 2), (64, 20), (5, 1)]])
def test_short_rows_share_one_call_and_match_the_per_token_reference(rows: list[tuple[int, int]]) -> None:
    """Decodes, verifications (a few new tokens after a cached prefix) and a prompt's last tokens run
    in one padded call, each query seeing its own prefix causally; a row longer than SHORT_QUERY
    (20 here) takes its own call, and both agree with the plainest per-token statement."""
    g = torch.Generator().manual_seed(sum(n for n, _ in rows))
    bs, heads, kv_heads, dim, blocks = 16, 4, 2, 8, 24
    k_cache = torch.randn(blocks, bs, kv_heads, dim, generator=g)
    v_cache = torch.randn(blocks, bs, kv_heads, dim, generator=g)
    width = max(-(-n // bs) for n, _ in rows) + 1
    order = torch.randperm(blocks - 1, generator=g).tolist()
    table = torch.full((len(rows), width), blocks - 1, dtype=torch.int32)
    for b, (n, _) in enumerate(rows):
        own = [order.pop() for _ in range(-(-n // bs))]
        table[b, :len(own)] = torch.tensor(own, dtype=torch.int32)
    k_cache[blocks - 1] = float("nan")
    v_cache[blocks - 1] = float("nan")
    news = [new for _, new in rows]
    tokens = sum(news)
    q = torch.randn(tokens, heads, dim, generator=g)
    k_new = torch.randn(tokens, kv_heads, dim, generator=g)
    v_new = torch.randn(tokens, kv_heads, dim, generator=g)
    slots = torch.tensor([int(table[b, p // bs]) * bs + p % bs for b, (n, new) in enumerate(rows)
                          for p in range(n - new, n)])
    cu = torch.tensor([0] + news, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    meta = AttentionMetadata(slot_mapping=slots, cu_seqlens_q=cu, seq_lens=torch.tensor([n for n, _ in rows]),
                             block_table=table, query_lens=news, seq_lens_host=[n for n, _ in rows])
    got = TorchAttentionBackend().forward(q, k_new, v_new, k_cache, v_cache, meta, 0.3)
    assert got.isfinite().all()
    for b, (n, new) in enumerate(rows):
        pos = torch.arange(n)
        cache_slots = table[b].long()[pos // bs] * bs + pos % bs
        keys = k_cache.view(-1, kv_heads, dim)[cache_slots].transpose(0, 1)
        vals = v_cache.view(-1, kv_heads, dim)[cache_slots].transpose(0, 1)
        sees = pos[None, :] <= torch.arange(n - new, n)[:, None]
        want = torch.nn.functional.scaled_dot_product_attention(
            q[cu[b]:cu[b + 1]].transpose(0, 1), keys, vals, attn_mask=sees, scale=0.3, enable_gqa=True)
        torch.testing.assert_close(got[cu[b]:cu[b + 1]], want.transpose(0, 1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_is_hfs_formula_bit_for_bit(dtype: torch.dtype) -> None:
    """The roll with a signed sin computes transformers' x * cos + cat(-x2, x1) * sin exactly."""
    g = torch.Generator().manual_seed(7)
    rotary = RotaryEmbedding(64, 4096, RopeParams(theta=100000.0), torch.device("cpu"))
    positions = torch.randint(0, 4096, (33,), generator=g)
    x = torch.randn(33, 9, 64, generator=g).to(dtype)
    cos, signed_sin = rotary.cos_sin(positions, dtype)
    half = rotary.get_buffer("sin_table")[positions]
    sin = torch.cat((half, half), dim=-1).to(dtype).unsqueeze(1)
    hf = x * cos + torch.cat((-x[..., 32:], x[..., :32]), dim=-1) * sin
    assert torch.equal(apply_rotary(x, cos, signed_sin), hf)
