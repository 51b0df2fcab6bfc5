"""TritonAttentionBackend against TorchAttentionBackend, and the engine end to end on each.

Runs under TRITON_INTERPRET=1 (tests/conftest.py) on CPU. A step is built the way the model runner
builds it: sequences in order, each with its block table, new tokens' slots, and totals; both
backends start from identical caches, must write the same K/V and return the same attention.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from radixserve.model.attention import (
    AttentionMetadata,
    TorchAttentionBackend,
    make_backend,
)
from radixserve.model.triton_backend import TritonAttentionBackend

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def make_step(gen, query_lens, prefix_lens, block_size, num_blocks, hq, hkv, d, dtype):
    """q/k/v for the new tokens, a shared random cache and metadata; tables use shuffled blocks."""
    totals = [n + p for n, p in zip(query_lens, prefix_lens)]
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-t // block_size))] for t in totals]
    width = max(len(t) for t in tables)
    slots = [tables[b][p // block_size] * block_size + p % block_size
             for b, (n, p) in enumerate(zip(query_lens, prefix_lens)) for p in range(p, p + n)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        cu_seqlens_q=torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32),
        seq_lens=torch.tensor(totals, dtype=torch.int32),
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        query_lens=list(query_lens),
        seq_lens_host=totals,
    )
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, hq, d, generator=gen).to(dtype)
    k = torch.randn(num_tokens, hkv, d, generator=gen).to(dtype)
    v = torch.randn(num_tokens, hkv, d, generator=gen).to(dtype)
    cache = torch.randn(2, num_blocks, block_size, hkv, d, generator=gen).to(dtype)
    return q, k, v, cache, meta


@pytest.mark.parametrize("query_lens,prefix_lens,dtype", [
    ([1, 9, 1, 16], [40, 23, 15, 0], torch.float32),  # decodes, a chunk over a cached prefix, a fresh prefill
    ([1, 1, 1], [16, 0, 70], torch.float32),  # all decodes: the split-K decode kernel
    ([12, 1], [20, 31], torch.bfloat16),
])
def test_triton_backend_matches_torch_backend(query_lens, prefix_lens, dtype):
    gen = torch.Generator().manual_seed(sum(query_lens) * 131 + sum(prefix_lens))
    q, k, v, cache, meta = make_step(gen, query_lens, prefix_lens, 16, 24, 8, 2, 64, dtype)
    torch_cache, triton_cache = cache.clone(), cache.clone()
    expected = TorchAttentionBackend().forward(q, k, v, torch_cache[0], torch_cache[1], meta, 0.125)
    backend = make_backend("triton", torch.device("cpu"))
    assert isinstance(backend, TritonAttentionBackend) and backend.name == "triton"
    got = backend.forward(q, k, v, triton_cache[0], triton_cache[1], meta, 0.125)
    assert torch.equal(triton_cache, torch_cache), "store_kv wrote different K/V than the torch backend"
    assert got.dtype == q.dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_backend_matches_torch_backend_on_an_fp8_cache(dtype):
    """Both backends write the same FP8 bytes and scales, and attend to the same dequantized K/V."""
    from radixserve.kernels import fp8_format

    gen = torch.Generator().manual_seed(29)
    q, k, v, cache, meta = make_step(gen, [1, 9, 1, 16], [40, 23, 15, 0], 16, 24, 8, 2, 64, dtype)
    packed = fp8_format.quantize(cache)
    torch_cache, triton_cache = packed.clone(), packed.clone()
    expected = TorchAttentionBackend().forward(q, k, v, torch_cache[0], torch_cache[1], meta, 0.125)
    got = make_backend("triton", torch.device("cpu")).forward(q, k, v, triton_cache[0], triton_cache[1], meta, 0.125)
    assert torch.equal(triton_cache, torch_cache), "store_kv wrote different FP8 rows than the torch backend"
    assert got.dtype == q.dtype
    torch.testing.assert_close(got.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_auto_picks_torch_on_cpu():
    assert make_backend("auto", torch.device("cpu")).name == "torch"


def test_engine_gives_same_greedy_tokens_on_triton_and_torch():
    from tiny_models import tiny_model_dir

    from radixserve import LLM, SamplingParams

    path = str(tiny_model_dir("llama"))
    g = torch.Generator().manual_seed(3)
    # 33 tokens: a prefill longer than two blocks; 16: exactly one block; 5 and 1: ragged and tiny
    prompts = [torch.randint(4, 500, (n,), generator=g).tolist() for n in (33, 16, 5, 1)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    warm_params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    tokens, warm = {}, {}
    for backend in ("torch", "triton"):
        # a 32-token budget splits the 55 prompt tokens into chunks batched with decodes
        llm = LLM(model=path, attention_backend=backend, device="cpu", dtype="float32", block_size=16,
                  num_blocks=32, max_num_batched_tokens=32)
        assert llm.engine.runner.backend.name == backend
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        # again, now hitting the prefix cache: short extends over cached blocks (2 tokens keep it cheap)
        warm_outs = llm.generate(prompts, warm_params)
        assert warm_outs[0].usage.cached_tokens >= 32, "the warm pass should reuse the 33-token prompt's blocks"
        warm[backend] = [o.outputs[0].token_ids for o in warm_outs]
    assert all(len(t) == 8 for t in tokens["torch"])
    assert tokens["triton"] == tokens["torch"]
    assert warm["triton"] == warm["torch"] == [t[:2] for t in tokens["torch"]]


def test_engine_gives_same_greedy_tokens_on_triton_and_torch_with_an_fp8_cache():
    from tiny_models import tiny_model_dir

    from radixserve import LLM, SamplingParams

    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(4, 500, (n,), generator=g).tolist() for n in (33, 5)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(model=str(tiny_model_dir("llama")), attention_backend=backend, kv_cache_dtype="fp8", block_size=16,
                  num_blocks=32, max_num_batched_tokens=32)
        assert llm.engine.runner.kv_cache is not None and llm.engine.runner.kv_cache.data.dtype == torch.uint8
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert tokens["triton"] == tokens["torch"]


def test_launches_are_planned_once_per_step_not_per_layer(monkeypatch) -> None:
    """Argument checks run once per step: every layer of a forward reuses the first layer's plans."""
    from tiny_models import tiny_model_dir

    from radixserve import LLM, SamplingParams, kernels

    calls: dict[str, int] = {"store": 0, "decode": 0, "extend": 0}
    for name, module, attr in (("store", kernels.kv_store, "plan_store_kv"), ("decode", kernels.decode, "plan_decode"),
                               ("extend", kernels.extend, "plan_extend")):
        real = getattr(module, attr)

        def counted(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(module, attr, counted)
    llm = LLM(model=str(tiny_model_dir("llama")), attention_backend="triton", num_blocks=32, enforce_eager=True)
    steps = []
    llm.engine.add_step_observer(steps.append)
    llm.generate([[5, 6, 7, 8, 9]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert llm.engine.spec.num_layers > 1
    assert calls["store"] == len(steps) == 4  # one prefill step, three decode steps
    assert calls["extend"] == 1 and calls["decode"] == 3


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "gpt_oss"])
def test_triton_engine_runs_windows_sinks_and_softcaps_like_transformers(arch: str) -> None:
    """The families whose layers differ (sliding and full, per-layer rope, softcaps, sinks) on the
    Triton kernels and fused ops, greedy, token for token with transformers; prompts cross the window."""
    from tiny_models import hf_model, tiny_model_dir

    from radixserve import LLM, SamplingParams

    def reference(prompt: list[int]) -> list[int]:
        out = hf_model(tiny_model_dir(arch)).generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6,
                                                      do_sample=False, eos_token_id=None, pad_token_id=0)
        return out[0, len(prompt):].tolist()

    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(4, 500, (n,), generator=g).tolist() for n in (21, 13)]
    llm = LLM(model=str(tiny_model_dir(arch)), attention_backend="triton", device="cpu", dtype="float32",
              block_size=16, num_blocks=32, max_num_batched_tokens=16)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [reference(p) for p in prompts]
