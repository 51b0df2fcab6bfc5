"""The KV caches narrower than the model (`--kv-cache-dtype fp8`, radixserve/kernels/fp8_format.py, and
`fp16`, llama.cpp's layout) on CPU: the packed FP8 rows round-trip within e4m3's precision; a block
holds about twice bf16's tokens per byte in FP8, twice fp32's in fp16; and through every cache path
the engine's greedy tokens are those of a cold run on a fresh engine of the same cache dtype (the
cached bytes are reused as they are: warm hits, hits ending mid-block, forks, swap and the host tier's
load-back), within an agreement bound where K/V is recomputed (preemption by recompute), and close
to transformers' own. An fp16 cache is read in place by the C++ attention kernel and the compiled
step. Every engine checks its integrity after each step (conftest.py).
"""

from __future__ import annotations

import functools

import pytest
import torch
from test_engine import assert_clean, random_prompts, reference
from tiny_models import tiny_model_dir

from radixserve import LLM, SamplingParams
from radixserve.kernels import fp8_format
from radixserve.model.kv_cache import KVLayout, resolve_kv_dtype

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


NARROW = ["fp8", "fp16"]


def make(**kw: object) -> LLM:
    kw = {"block_size": 16, "num_blocks": 96, "max_num_batched_tokens": 64, "kv_cache_dtype": "fp8",
          "num_speculative_tokens": 0} | kw
    return LLM(model=str(tiny_model_dir("llama")), **kw)


@functools.cache
def cold(kv: str, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    """The greedy reply of a fresh engine with a `kv` cache to this prompt alone: the reference of every path."""
    out = make(kv_cache_dtype=kv).generate([list(prompt)],
                                           SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return out[0].outputs[0].token_ids


def replies(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def agreement(got: list[list[int]], want: list[list[int]]) -> float:
    pairs = [(a, b) for g, w in zip(got, want) for a, b in zip(g, w)]
    return sum(a == b for a, b in pairs) / len(pairs)


@pytest.mark.parametrize("magnitude", [1e-4, 1.0, 300.0, 1e6])
def test_packed_rows_round_trip_within_e4m3_precision(magnitude: float) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 64, generator=g) * magnitude
    x[0, 0] = 0.0  # an all-zero row
    x[1, 1, 5] = 40 * magnitude  # an outlier sets its row's scale alone
    rows = fp8_format.quantize(x)
    assert rows.dtype == torch.uint8 and rows.shape == (7, 3, fp8_format.row_width(64))
    back = fp8_format.dequantize(rows, torch.float32)
    assert torch.isfinite(back).all() and torch.equal(back[0, 0], torch.zeros(64))
    row_max = x.abs().amax(-1, keepdim=True)
    # 3 mantissa bits: half a step is 2^-4 of a value; the scale's bf16 rounding and e4m3's subnormals
    # add at most 2^-8 of the row's largest value
    assert ((back - x).abs() <= x.abs() * 2**-4 + row_max * 2**-8).all()
    strided = fp8_format.dequantize(rows.transpose(0, 1), torch.bfloat16)  # a gathered view, not contiguous
    assert torch.equal(strided, back.transpose(0, 1).to(torch.bfloat16))
    scratch = torch.empty(7, 3, 64, dtype=torch.int16)
    for dtype in fp8_format.DEQUANTIZE_INTO:  # the CPU's integer route: the same bits
        into = fp8_format.dequantize_into(rows, torch.empty(7, 3, 64, dtype=dtype), scratch)
        assert torch.equal(into, fp8_format.dequantize(rows, dtype))
    values = torch.arange(256, dtype=torch.uint8)
    values[values & 0x7F == 0x7F] = 0  # every e4m3 byte but its two NaNs, subnormals and -0 included
    scale = torch.tensor([0x80, 0x3F], dtype=torch.uint8)  # bfloat16 1.0, little-endian
    every_byte = torch.cat((values.view(2, 128), scale.expand(2, 2)), -1)
    got = fp8_format.dequantize_into(every_byte, torch.empty(2, 128), torch.empty(2, 128, dtype=torch.int16))
    assert torch.equal(got, fp8_format.dequantize(every_byte, torch.float32))
    assert torch.equal(got.view(torch.int32), fp8_format.dequantize(every_byte, torch.float32).view(torch.int32))


def test_a_block_holds_about_twice_bf16s_tokens() -> None:
    def per_token(dtype: torch.dtype, kv: str) -> int:
        return KVLayout(30, 3, 64, 16, dtype, kv).bytes_per_token

    assert per_token(torch.bfloat16, "auto") / per_token(torch.bfloat16, "fp8") >= 1.9
    assert per_token(torch.float32, "auto") / per_token(torch.float32, "fp8") >= 3.8
    assert per_token(torch.float32, "fp8") == per_token(torch.bfloat16, "fp8")  # the model dtype does not matter
    assert per_token(torch.float32, "auto") == 2 * per_token(torch.float32, "fp16") == 2 * per_token(torch.bfloat16, "fp16")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        KVLayout(30, 3, 64, 16, torch.float32, "int4")


def test_auto_keeps_a_quantized_gguf_files_cache_in_fp16_and_other_models_in_their_dtype() -> None:
    """llama.cpp's default for a GGUF file's K/V; `model` asks for the model's dtype whatever the weights."""
    assert resolve_kv_dtype("auto", gguf_quantized=True) == "fp16"
    assert resolve_kv_dtype("auto", gguf_quantized=False) == "model"
    assert resolve_kv_dtype("model", gguf_quantized=True) == "model"
    assert [resolve_kv_dtype(k, True) for k in ("fp16", "fp8")] == ["fp16", "fp8"]
    assert KVLayout(30, 3, 64, 16, torch.float32, "model").storage_dtype == torch.float32
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, model, fp16, fp8"):
        resolve_kv_dtype("f16", gguf_quantized=True)
    llm = LLM(model=str(tiny_model_dir("llama")), kv_cache_memory_mb=4.0)  # an fp32 directory: no GGUF weights
    assert llm.engine.runner.kv_cache_dtype == "model" and llm.engine.runner.kv_cache.data.dtype == torch.float32


@pytest.mark.parametrize("kv, least, storage", [("fp8", 3.5, torch.uint8), ("fp16", 1.95, torch.float16)])
def test_the_pool_gets_the_blocks_its_memory_holds(kv: str, least: float, storage: torch.dtype) -> None:
    auto, narrow = (LLM(model=str(tiny_model_dir("llama")), kv_cache_memory_mb=4.0, kv_cache_dtype=k)
                    for k in ("auto", kv))
    ratio = narrow.engine.pool.num_blocks / auto.engine.pool.num_blocks
    want = auto.engine.runner.kv_layout().bytes_per_block / narrow.engine.runner.kv_layout().bytes_per_block
    assert abs(ratio - want) < 0.05 and ratio > least  # the tiny model runs fp32 on CPU
    assert narrow.engine.runner.kv_cache.data.dtype == storage


def test_an_fp16_cache_is_read_in_place_by_the_kernel_and_the_compiled_step() -> None:
    """The C++ attention kernel reads fp16 rows where they lie (no gathered fp32 copy), in the Python
    layers and the compiled step alike, and both give the cold replies."""
    from radixserve.model.attention import reads_in_place

    llm = make(kv_cache_dtype="fp16")
    runner = llm.engine.runner
    assert runner.kv_cache is not None and reads_in_place(runner.kv_cache.k(0)) and runner.cpu_step is not None
    prompts = random_prompts([3, 33], seed=9)
    assert replies(llm, prompts) == [cold("fp16", tuple(p), GREEDY.max_tokens) for p in prompts]


@pytest.mark.parametrize("kv", NARROW)
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("eager", [False, True])
def test_warm_hits_and_hits_ending_mid_block_reuse_the_cold_bytes(kv: str, eager: bool, overlap: bool) -> None:
    llm = make(enforce_eager=eager, overlap=overlap, kv_cache_dtype=kv)
    base = random_prompts([60], seed=1)[0]
    prompts = random_prompts([1, 17, 40], seed=2) + [base]
    want = [cold(kv, tuple(p), GREEDY.max_tokens) for p in prompts]
    assert replies(llm, prompts) == want
    warm = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in warm] == want
    assert [o.usage.cached_tokens for o in warm] == [len(p) - 1 for p in prompts]
    branches = [base[:k] + random_prompts([9], seed=k)[0] for k in (5, 21, 47)]  # diverge mid-block
    outs = llm.generate(branches, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [cold(kv, tuple(b), GREEDY.max_tokens) for b in branches]
    assert all(o.usage.cached_tokens >= k for k, o in zip((5, 21, 47), outs))
    assert_clean(llm)


@pytest.mark.parametrize("kv", NARROW)
def test_forks_share_the_narrow_prompt(kv: str) -> None:
    llm = make(kv_cache_dtype=kv)
    prompt = random_prompts([37], seed=4)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, n=3, ignore_eos=True))[0]
    assert [c.token_ids for c in out.outputs] == [cold(kv, tuple(prompt), 10)] * 3
    assert llm.engine.stats().computed_tokens == len(prompt)
    assert_clean(llm)


@pytest.mark.parametrize("kv", NARROW)
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_in_a_tiny_pool(kv: str, mode: str) -> None:
    """Swap moves the narrow bytes (and FP8's scales) out and back as they are: the same tokens.
    Recompute rounds K/V computed again in other chunks, so it is held to agreement, not identity."""
    llm = make(num_blocks=8, max_num_batched_tokens=48, new_token_ratio=0.0, host_cache_mb=64.0,
               preemption_mode=mode, kv_cache_dtype=kv)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = random_prompts([40] * 6, seed=3)
    got = replies(llm, prompts, params)
    want = [cold(kv, tuple(p), params.max_tokens) for p in prompts]
    stats = llm.engine.stats()
    assert stats.preemptions > 0
    if mode == "swap":
        assert stats.swaps_out == stats.preemptions and stats.swaps_in == stats.swaps_out
        assert got == want
    else:
        assert agreement(got, want) >= 0.9, (got, want)
    assert_clean(llm)


@pytest.mark.parametrize("kv", NARROW)
def test_the_host_tier_loads_back_the_written_bytes(kv: str) -> None:
    llm = make(num_blocks=12, host_cache_mb=64.0, new_token_ratio=0.0, kv_cache_dtype=kv)
    first, second = random_prompts([70, 90], seed=21), random_prompts([110, 110], seed=22)
    want = [cold(kv, tuple(p), GREEDY.max_tokens) for p in first]
    assert replies(llm, first) == want
    for prompt in second:  # each takes 8 of the 12 blocks: together they push all of `first` out
        replies(llm, [prompt])
    assert llm.engine.stats().written_back_blocks > 0
    again = llm.generate(first, GREEDY)
    assert [o.outputs[0].token_ids for o in again] == want
    assert [o.usage.host_cached_tokens for o in again] == [len(p) - 1 for p in first]
    assert_clean(llm)


def test_each_next_token_mostly_agrees_with_transformers() -> None:
    """Teacher-forced: fed transformers' own greedy replies as prompts, the engine's most likely next
    token at each reply position is transformers' token at every position with the model-dtype
    cache, and at most positions with FP8 (the tiny random model's logits are nearly flat, so near
    ties flip; the embedded model's figures are in docs/kv_fp8.md); fp16 agrees everywhere too."""
    prompts = random_prompts([9, 30, 64, 100], seed=6)
    want = [reference("llama", tuple(p), GREEDY.max_tokens) for p in prompts]
    asks = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    agreeing = {}
    for kv in ("auto", "fp16", "fp8"):
        outs = make(kv_cache_dtype=kv, enable_prefix_cache=False).generate([p + w for p, w in zip(prompts, want)], asks)
        picks = [[lp.top[0][0] for lp in o.prompt_logprobs[len(p):] if lp is not None]
                 for p, o in zip(prompts, outs) if o.prompt_logprobs is not None]
        agreeing[kv] = agreement(picks, want)
    assert agreeing["auto"] == agreeing["fp16"] == 1.0 and agreeing["fp8"] >= 0.8, agreeing


def test_bad_values_are_refused() -> None:
    with pytest.raises(ValueError, match="kv-cache-dtype"):
        make(kv_cache_dtype="int4")


def test_the_bench_gives_the_fp8_bounded_pool_the_bounded_pools_bytes(tmp_path) -> None:
    """`radixserve bench run --workload bounded-pool --systems ...,radixserve-pool25-fp8`: the FP8 system
    gets as many blocks as the bounded pool's bytes hold, and hits at least as often."""
    import json

    from radixserve.cli import main

    rc = main(["bench", "run", "--smoke", "--model", str(tiny_model_dir("llama")), "--repeats", "1", "--workload",
               "bounded-pool", "--systems", "radixserve,radixserve-pool25,radixserve-pool25-fp8", "--out",
               str(tmp_path), "--no-micro", "--no-charts", "--no-progress"])
    assert rc == 0
    results = json.loads((tmp_path / "results.json").read_text())
    runs = results["results"]["bounded-pool"]
    bounded, fp8 = runs["radixserve-pool25"]["median"], runs["radixserve-pool25-fp8"]["median"]
    layout = {kv: KVLayout(2, 2, 16, 16, torch.float32, kv).bytes_per_block for kv in ("auto", "fp8")}
    assert fp8["pool_blocks"] == bounded["pool_blocks"] * layout["auto"] // layout["fp8"]
    assert fp8["hit_rate"] >= bounded["hit_rate"] and 0 <= fp8["belady_hit_rate"] <= 1
    assert runs["radixserve-pool25-fp8"]["repeats"][0]["engine"]["leaked_blocks"] == 0
