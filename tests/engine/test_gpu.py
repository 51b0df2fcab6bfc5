"""Greedy equality on a CUDA device (skipped without one; scripts/gpu_check.sh runs it on a GPU).

fp32: the engine on CUDA (Triton attention, fused kernels, CUDA graphs on and off, overlap
scheduling on and off) equals transformers token for token on the tiny models of every
architecture, through the cache paths of tests/engine/test_engine.py and the host tier's of
tests/engine/test_host_tier.py. bf16: the Triton path with graphs
equals the torch backend's eager path. Sampling on the device: a seeded request is the same alone
and in a mixed batch with overlap on and off, and the full-sort path's frequencies follow the
filtered distribution. FP8 KV cache: the kernels write the torch format's bytes and read them as the
reference does, and the engine on them is the same with CUDA graphs on and off.
"""

from __future__ import annotations

import pytest
import torch
from test_engine import ARCHS, GREEDY, random_prompts, reference, seeded_runs
from test_sampler import reference as filtered_reference
from test_sampler import total_variation, tv_bound
from tiny_models import tiny_model_dir

from radixserve import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
PATHS = [pytest.param(eager, overlap, id=f"{'eager' if eager else 'graphs'}-{'overlap' if overlap else 'sync'}")
         for eager in (False, True) for overlap in (True, False)]


def cuda_llm(arch: str, **kw) -> LLM:
    kw = {"block_size": 16, "num_blocks": 96, "max_num_batched_tokens": 64, "device": "cuda", "max_num_seqs": 16,
          "new_token_ratio": 0.0} | kw  # no growth reserve: the tiny-pool tests must preempt
    return LLM(model=str(tiny_model_dir(arch)), **kw)


def check(arch: str, llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list:
    outs = llm.generate(prompts, params)
    for p, o in zip(prompts, outs):
        for c in o.outputs:
            assert c.token_ids == reference(arch, tuple(p), params.max_tokens), f"prompt of {len(p)} tokens diverged"
    llm.engine.check_integrity()
    assert llm.engine.leaked_blocks() == 0
    return outs


@pytest.mark.parametrize("eager, overlap", PATHS)
@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_cold_warm_and_mid_block_hits_match_transformers(arch: str, eager: bool, overlap: bool) -> None:
    llm = cuda_llm(arch, dtype="float32", enforce_eager=eager, overlap=overlap)
    assert llm.engine.runner.uses_cuda_graphs != eager
    prompts = random_prompts([1, 15, 16, 17, 40, 90])
    check(arch, llm, prompts)
    check(arch, llm, prompts)  # warm
    base = random_prompts([60], seed=1)[0]
    check(arch, llm, [base[:k] + random_prompts([9], seed=k)[0] for k in (5, 21, 33, 47)])


@pytest.mark.parametrize("eager, overlap", PATHS)
@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_host_tier_write_back_load_back_and_swap_match_transformers(arch: str, eager: bool, overlap: bool) -> None:
    """The host tier on CUDA: pinned host blocks, copies queued on the stream ahead of the forward."""
    llm = cuda_llm(arch, dtype="float32", num_blocks=12, host_cache_mb=64, enforce_eager=eager, overlap=overlap)
    assert llm.engine.runner.host_cache is not None and llm.engine.runner.host_cache.data.is_pinned()
    first = random_prompts([70, 90], seed=21)
    check(arch, llm, first)
    for prompt in random_prompts([110, 110], seed=22):
        check(arch, llm, [prompt])
    again = check(arch, llm, first)
    assert [o.usage.host_cached_tokens for o in again] == [len(p) - 1 for p in first]
    for prompt in random_prompts([110, 110], seed=22):  # `first` back out to the host tier
        check(arch, llm, [prompt])
    check(arch, llm, [first[1][:k] + random_prompts([9], seed=k)[0] for k in (5, 21, 33, 47)])  # loads ending mid-block
    swap = cuda_llm(arch, dtype="float32", num_blocks=8, max_num_batched_tokens=48, host_cache_mb=64,
                    preemption_mode="swap", enforce_eager=eager, overlap=overlap)
    check(arch, swap, random_prompts([40] * 6, seed=3), SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    st = swap.engine.stats()
    assert st.swaps_out > 0 and st.swaps_in == st.swaps_out and st.load_s > 0


@pytest.mark.parametrize("eager, overlap", PATHS)
def test_fp32_preemption_and_forks_match_transformers(eager: bool, overlap: bool) -> None:
    llm = cuda_llm("llama", dtype="float32", num_blocks=8, max_num_batched_tokens=48, enforce_eager=eager,
                   overlap=overlap)
    check("llama", llm, random_prompts([40] * 6, seed=3), SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert llm.engine.stats().preemptions > 0
    out = cuda_llm("qwen2", dtype="float32", enforce_eager=eager, overlap=overlap).generate(
        [random_prompts([37], seed=4)[0]], SamplingParams(temperature=0.0, max_tokens=10, n=3, ignore_eos=True))[0]
    expected = reference("qwen2", tuple(random_prompts([37], seed=4)[0]), 10)
    assert [c.token_ids for c in out.outputs] == [expected] * 3


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_graphs_equal_eager_and_stay_close_to_the_torch_backend(arch: str) -> None:
    """bf16 with graphs vs without on the same kernels: identical. Against the torch backend (other
    attention arithmetic, unfused elementwise ops) bf16 logits differ in their last bits, and these tiny
    models' bf16 logits tie often (spacing 0.125 at magnitude ~20), so greedy paths may part after a
    tie: the first token of every prompt must agree, and most tokens overall."""
    prompts = random_prompts([1, 15, 16, 17, 40, 90, 33, 5], seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    fast = cuda_llm(arch, dtype="bfloat16", attention_backend="triton")
    assert fast.engine.runner.uses_cuda_graphs and fast.engine.runner.ops.name == "triton"
    got = [o.outputs[0].token_ids for o in fast.generate(prompts, params)]
    eager = cuda_llm(arch, dtype="bfloat16", attention_backend="triton", enforce_eager=True)
    assert [o.outputs[0].token_ids for o in eager.generate(prompts, params)] == got
    torch_backend = cuda_llm(arch, dtype="bfloat16", attention_backend="torch", enforce_eager=True)
    want = [o.outputs[0].token_ids for o in torch_backend.generate(prompts, params)]
    assert [g[0] for g in got] == [w[0] for w in want]
    agree = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(g)) for g, w in zip(got, want)]
    print(f"\n{arch}: bf16 triton+graphs vs torch backend, tokens before the first difference: {agree}")
    assert sum(agree) >= 0.6 * sum(len(w) for w in want)


def test_kv_pool_is_sized_from_device_memory() -> None:
    from radixserve.config import EngineConfig
    from radixserve.engine.engine import LLMEngine
    from radixserve_bench.step_shapes import shape_dir

    engine = LLMEngine(EngineConfig(model=str(shape_dir("llama-3.2-1b")), load_format="dummy", device="cuda",
                                    max_num_seqs=64))
    free, total = torch.cuda.mem_get_info()
    kv_bytes = engine.pool.num_blocks * engine.runner.kv_layout().bytes_per_block
    decoder = engine.runner.decoder
    assert decoder is not None and len(decoder.graphs) == len(decoder.sizes)
    print(f"\nKV pool {engine.pool.num_blocks} blocks = {kv_bytes / 2**30:.1f} GiB; device in use "
          f"{(total - free) / total:.3f} of {total / 2**30:.1f} GiB; {len(decoder.graphs)} graphs captured in "
          f"{decoder.capture_seconds:.1f} s using {decoder.graph_bytes / 2**20:.0f} MiB")
    assert kv_bytes > 0.5 * total  # a 1B model leaves most of an 80 GB device to the pool
    assert (total - free) <= 0.92 * total  # the utilization target (0.90) holds, to allocator slack
    del engine


def test_a_seeded_request_is_the_same_alone_and_in_a_mixed_batch_on_cuda() -> None:
    runs = seeded_runs(lambda overlap: cuda_llm("llama", dtype="float32", overlap=overlap))
    assert all(r == runs[0] for r in runs) and runs[0][0] != runs[0][1]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(min_p=0.05, top_k=30)],
                         ids=["top-p", "min-p+top-k"])
def test_device_sampling_follows_the_filtered_distribution(params: SamplingParams) -> None:
    """The CUDA path (one full sort, no host decision) against the float64 reference of test_sampler."""
    from radixserve.engine.sampler import Draw, Sampler

    logits = torch.randn(3000, generator=torch.Generator().manual_seed(3)) * 2
    draws = [Draw(0, params, 77, p) for p in range(30000)]
    ids, usable, _ = Sampler(torch.device("cuda")).sample(logits[None].cuda(), draws).host()
    assert all(usable)
    ref = filtered_reference(logits, params)
    observed = torch.bincount(torch.tensor(ids), minlength=logits.numel()).double() / len(ids)
    assert observed[ref.order[ref.kept:]].sum() == 0
    assert total_variation(observed, ref.probs) < tv_bound(ref.probs, len(ids))


@pytest.mark.parametrize("eager, overlap", PATHS)
def test_speculative_verification_on_the_gpu_matches_transformers(eager: bool, overlap: bool) -> None:
    """Regenerated replies draft from the tree: the verifying extends (Triton) keep nearly every draft
    and the output equals transformers'; one-token decodes keep their CUDA graphs."""
    llm = cuda_llm("llama", dtype="float32", enforce_eager=eager, overlap=overlap)
    prompts = random_prompts([21, 37, 8])
    for _ in range(2):
        check("llama", llm, prompts)
    stats = llm.engine.stats()
    assert stats.spec_accepted["tree"] >= 2 * GREEDY.max_tokens and stats.tokens_per_draw > 1.3


def test_fp8_store_writes_the_torch_format_and_attention_reads_it() -> None:
    """On the GPU (native e4m3 conversions), `store_kv` writes kernels/fp8_format.quantize's bytes bit
    for bit and decode/extend attend as the torch reference does on the dequantized cache."""
    from radixserve import kernels
    from radixserve.kernels import fp8_format
    from radixserve.kernels.reference import paged_decode_attention_reference, paged_extend_attention_reference

    gen = torch.Generator().manual_seed(31)
    blocks, bs, hkv, hq, d = 8, 16, 2, 8, 128
    k = (torch.randn(5, hkv, d, generator=gen) * torch.logspace(-5, 3, 5)[:, None, None]).bfloat16().cuda()
    slots = torch.tensor([0, 17, 33, 60, 127]).cuda()
    cache = torch.zeros(2, blocks, bs, hkv, fp8_format.row_width(d), dtype=torch.uint8, device="cuda")
    kernels.store_kv(k, k, cache[0], cache[1], slots)
    want = fp8_format.quantize(k.cpu())
    assert torch.equal(cache[0].view(-1, hkv, fp8_format.row_width(d))[slots].cpu(), want)
    cache = fp8_format.quantize(torch.randn(2, blocks, bs, hkv, d, generator=gen)).cuda()
    plain = fp8_format.dequantize(cache.cpu(), torch.bfloat16).cuda()
    table = torch.arange(blocks, dtype=torch.int32, device="cuda").view(2, 4)
    lens = torch.tensor([50, 64], dtype=torch.int32, device="cuda")
    q = torch.randn(2, hq, d, generator=gen).bfloat16().cuda()
    got = kernels.paged_decode_attention(q, cache[0], cache[1], table, lens, d**-0.5)
    ref = paged_decode_attention_reference(q, plain[0], plain[1], table, lens, d**-0.5)
    torch.testing.assert_close(got.float(), ref.float(), atol=3e-2, rtol=3e-2)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda")
    got = kernels.paged_extend_attention(q, cache[0], cache[1], table, cu, lens, d**-0.5)
    ref = paged_extend_attention_reference(q, plain[0], plain[1], table, cu, lens, d**-0.5)
    torch.testing.assert_close(got.float(), ref.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fp8_kv_cache_graphs_equal_eager_and_follow_the_torch_backend(arch: str) -> None:
    """The engine with `kv_cache_dtype="fp8"` on the Triton kernels: CUDA graphs change nothing, and the
    first token of every prompt agrees with the torch backend's FP8 path."""
    prompts = random_prompts([1, 16, 17, 40, 90], seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    replies = {}
    for backend, eager in (("triton", False), ("triton", True), ("torch", True)):
        llm = cuda_llm(arch, dtype="bfloat16", attention_backend=backend, enforce_eager=eager, kv_cache_dtype="fp8")
        replies[(backend, eager)] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        llm.engine.check_integrity()
        assert llm.engine.leaked_blocks() == 0
    assert replies[("triton", False)] == replies[("triton", True)]
    assert [r[0] for r in replies[("triton", True)]] == [r[0] for r in replies[("torch", True)]]


@pytest.mark.parametrize("arch", ["gemma3", "gemma4", "gpt_oss"])
def test_window_blocks_on_cuda_match_transformers(arch: str) -> None:
    """fp32 on CUDA: the sliding layers' K/V in window blocks the Triton kernels read in place (the
    default layout), decode steps replayed from CUDA graphs over the window view's static buffers; cold
    in chunks, a multi-turn hit mid-block and prompts arriving together, each also with every step eager."""
    for eager in (False, True):
        llm = cuda_llm(arch, dtype="float32", max_num_batched_tokens=16, enforce_eager=eager)
        decoder = llm.engine.runner.decoder
        assert llm.engine.cache.windows is not None and llm.engine.runner.uses_cuda_graphs == (not eager)
        assert eager or decoder is not None and decoder.window is not None and decoder.graphs
        base = random_prompts([40])[0]
        first = check(arch, llm, [base])[0]
        turn2 = base + first.outputs[0].token_ids + random_prompts([9])[0]
        assert check(arch, llm, [turn2])[0].usage.cached_tokens == len(base) + len(first.outputs[0].token_ids) - 1
        system = random_prompts([33])[0]
        check(arch, llm, [system + random_prompts([5 + k])[0] for k in range(4)])


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next", "lfm2", "nemotron_h", "falcon_h1"])
def test_hybrids_on_the_triton_recurrent_kernels_match_transformers(arch: str) -> None:
    """fp32 on CUDA: the recurrent layers in kernels/recurrent.py (every item of a step in one launch),
    decode steps replayed from CUDA graphs over the kernels' item table in static buffers; cold in
    chunks, a multi-turn hit resuming at the reply's end, and prompts arriving together (3 rows padded
    to 4), each also with every step eager."""
    from radixserve.model.causal_conv import CausalConv
    from radixserve.model.delta_net import GatedDeltaNet
    from radixserve.model.mamba2 import Mamba2Mixer

    for eager in (False, True):
        llm = cuda_llm(arch, dtype="float32", max_num_batched_tokens=16, enforce_eager=eager)
        recurrent = [m for m in llm.engine.runner.model.modules() if isinstance(m, (GatedDeltaNet, Mamba2Mixer, CausalConv))]
        assert recurrent and {m.implementation for m in recurrent} == {"triton"}
        decoder = llm.engine.runner.decoder
        assert llm.engine.runner.uses_cuda_graphs == (not eager)
        assert eager or decoder is not None and decoder.recurrent is not None and decoder.graphs
        base = random_prompts([40])[0]
        first = check(arch, llm, [base])[0]
        turn2 = base + first.outputs[0].token_ids + random_prompts([9])[0]
        assert check(arch, llm, [turn2])[0].usage.cached_tokens > len(base)
        system = random_prompts([33])[0]
        check(arch, llm, [system + random_prompts([5 + k])[0] for k in range(3)])
