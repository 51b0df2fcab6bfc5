"""The compiled CPU step (`model/cpu_step.py`, `kernels/csrc/cpu_step.cpp`): bit for bit the Python
layers' hidden states and cache writes on every short-row mix, taken by the engine where it applies,
never where it does not, and the engine still runs when the extension cannot be built
(`model/cpu_extension.py`)."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys

import pytest
import torch
from tiny_models import TINY_VOCAB, hf_model, tiny_model_dir

from radixserve import LLM
from radixserve.kernels import cpu_extension
from radixserve.kernels.cpu_linear import BlockedLinear, PackedLinear, pack_for_cpu
from radixserve.model import cpu_step
from radixserve.model.attention import AttentionMetadata, TorchAttentionBackend
from radixserve.model.kv_cache import KVCache, KVLayout
from radixserve.model.loader import load_model
from radixserve.model.ops import CpuKernelOps, TorchOps
from radixserve.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="no C++ compiler")
BLOCK = 16
BLOCKS = 24


def _packed(arch: str, dtype: torch.dtype = torch.float32, kind: type = BlockedLinear):
    cpu_extension.load_extension()
    model, spec = load_model(tiny_model_dir(arch), dtype, torch.device("cpu"))
    pack_for_cpu(model, model.model.embed_tokens.weight if model.lm_head is None else None, kind)
    return model, spec


def _step(rows: list[tuple[int, int]], spec, dtype: torch.dtype, seed: int, kv_cache_dtype: str = "model"):
    """A cache of random K/V over shuffled blocks (NaN in the scratch block every row's table pads
    with), and the metadata and inputs of a step where row b has rows[b] = (length, new tokens)."""
    g = torch.Generator().manual_seed(seed)
    layout = KVLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, BLOCK, dtype, kv_cache_dtype)
    cache = KVCache(layout, BLOCKS - 1, torch.device("cpu"))
    cache.data.copy_(torch.randn(cache.data.shape, generator=g))
    cache.data[:, :, cache.scratch_block] = float("nan")
    width = max(-(-n // BLOCK) for n, _ in rows) + 1
    order = torch.randperm(BLOCKS - 1, generator=g).tolist()
    table = torch.full((len(rows), width), cache.scratch_block, dtype=torch.int32)
    for b, (n, _) in enumerate(rows):
        own = [order.pop() for _ in range(-(-n // BLOCK))]
        table[b, : len(own)] = torch.tensor(own, dtype=torch.int32)
    positions = [p for n, new in rows for p in range(n - new, n)]
    rows_of = [b for b, (_, new) in enumerate(rows) for _ in range(new)]
    slots = torch.tensor([int(table[b, p // BLOCK]) * BLOCK + p % BLOCK for b, p in zip(rows_of, positions)])
    news = [new for _, new in rows]

    def meta() -> AttentionMetadata:  # a fresh one per forward: plans are cached on it
        return AttentionMetadata(
            slot_mapping=slots, cu_seqlens_q=torch.tensor([0] + news).cumsum(0, dtype=torch.int32),
            seq_lens=torch.tensor([n for n, _ in rows], dtype=torch.int32), block_table=table,
            query_lens=news, seq_lens_host=[n for n, _ in rows])

    ids = torch.randint(0, TINY_VOCAB, (len(positions),), generator=g)
    return cache, meta, ids, torch.tensor(positions)


MIXES = [
    [(37, 1)],  # batch 1
    [(20, 1), (5, 1), (48, 1)],  # three decodes
    [(16, 1), (33, 1), (1, 1), (64, 1), (17, 1)],  # five decodes, one a fresh one-token prompt
    [(37, 1), (20, 3), (48, 9)],  # verifications of drafts beside a decode
    [(9, 9), (16, 16)],  # whole short prompts
]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", MIXES)
def test_the_compiled_step_is_the_python_layers_bit_for_bit(arch: str, dtype: torch.dtype,
                                                            rows: list[tuple[int, int]]) -> None:
    """The same hidden states and the same cache afterwards (every layer stored its K/V at the step's
    slots, nothing else written), with biases (llama, qwen2), a tied head (qwen2), GQA 2:1 and 4:1."""
    model, spec = _packed(arch, dtype)
    _assert_the_step_is_the_python_layers(model, spec, rows, dtype)


def _assert_the_step_is_the_python_layers(model, spec, rows: list[tuple[int, int]], dtype: torch.dtype,
                                          kv_cache_dtype: str = "model") -> None:
    cache, meta, ids, positions = _step(rows, spec, dtype, seed=len(rows), kv_cache_dtype=kv_cache_dtype)
    python_cache = KVCache(cache.layout, cache.num_blocks, torch.device("cpu"))
    python_cache.data.copy_(cache.data)
    step = cpu_step.compiled_cpu_step(model, cache, TorchAttentionBackend(cpu_kernel=True), CpuKernelOps())
    assert step is not None
    with torch.inference_mode():
        got = step.forward(ids, positions, meta())
        want = model(ids, positions, python_cache, meta(), TorchAttentionBackend(cpu_kernel=True), CpuKernelOps())
    assert got is not None and got.dtype == dtype and got.isfinite().all()
    assert torch.equal(got, want)
    assert torch.equal(cache.data.nan_to_num(), python_cache.data.nan_to_num())


def _quantized(arch: str, type_name: str):
    """A tiny model whose projections and embedding are GGUF blocks of `type_name` (gguf's quantizer),
    as a GGUF file's model holds them."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from radixserve.kernels.ggml_quants import QuantizedEmbedding, QuantizedLinear, pack_ggml

    cpu_extension.load_extension()
    model, spec = load_model(tiny_model_dir(arch), torch.float32, torch.device("cpu"))

    def packed(weight: torch.Tensor) -> torch.Tensor:
        return pack_ggml([(type_name, quantize(weight.detach().numpy(), GGMLQuantizationType[type_name]))],
                         weight.shape[1])

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, QuantizedLinear(packed(child.weight), child.out_features, child.in_features,
                                                      child.bias))
    embed = model.model.embed_tokens.weight
    model.model.embed_tokens = QuantizedEmbedding(packed(embed), *embed.shape)
    return model, spec


@pytest.mark.parametrize("arch,type_name", [("llama", "Q4_1"), ("qwen2", "Q8_0"), ("mistral", "Q4_0")])
@pytest.mark.parametrize("rows", MIXES[1:4])
def test_the_compiled_step_runs_gguf_blocks_as_the_python_layers_do(arch: str, type_name: str,
                                                                     rows: list[tuple[int, int]]) -> None:
    model, spec = _quantized(arch, type_name)
    _assert_the_step_is_the_python_layers(model, spec, rows, torch.float32)


@pytest.mark.parametrize("rows", MIXES)
def test_the_compiled_step_rounds_k_and_v_into_an_fp16_cache_as_the_python_layers_do(
        rows: list[tuple[int, int]]) -> None:
    """A GGUF file's default cache (fp16 K/V beside fp32 activations): the step's own fp32 -> fp16
    stores give the bits of the Python layers' index_copy_."""
    model, spec = _quantized("llama", "Q4_1")
    _assert_the_step_is_the_python_layers(model, spec, rows, torch.float32, kv_cache_dtype="fp16")


def test_a_long_row_leaves_the_step_to_the_python_layers() -> None:
    model, spec = _packed("llama")
    cache, meta, ids, positions = _step([(37, 1), (40, 20)], spec, torch.float32, seed=3)
    step = cpu_step.compiled_cpu_step(model, cache, TorchAttentionBackend(cpu_kernel=True), CpuKernelOps())
    assert step is not None
    before = cache.data.clone()
    with torch.inference_mode():
        assert step.forward(ids, positions, meta()) is None
    assert torch.equal(cache.data.nan_to_num(), before.nan_to_num())  # nothing ran


def test_what_the_compiled_step_cannot_take_is_named() -> None:
    model, spec = _packed("llama")
    backend = TorchAttentionBackend(cpu_kernel=True)
    fp8 = KVCache(KVLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, BLOCK, torch.float32, "fp8"), 4,
                  torch.device("cpu"))
    assert cpu_step.unsupported(model, fp8, backend, CpuKernelOps()) == "the KV cache is FP8"
    plain = KVCache(KVLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, BLOCK, torch.float32), 4,
                    torch.device("cpu"))
    assert cpu_step.unsupported(model, plain, backend, CpuKernelOps()) is None
    assert cpu_step.unsupported(model, plain, object(), CpuKernelOps()) == "the attention backend is not torch's"
    assert cpu_step.unsupported(model, plain, backend, TorchOps()) == \
        "the norm and SiLU-and-mul are not the C++ extension's (model/ops.py CpuKernelOps)"
    assert cpu_step.unsupported(model, plain, TorchAttentionBackend(), CpuKernelOps()) == \
        "the attention kernel does not read this cache (torch.float32, head_dim 16)"
    double = KVCache(KVLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, BLOCK, torch.float64), 4,
                     torch.device("cpu"))
    assert cpu_step.unsupported(model, double, backend, CpuKernelOps()) == \
        "the attention kernel does not read this cache (torch.float64, head_dim 16)"
    half = KVCache(KVLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, BLOCK, torch.float32, "fp16"), 4,
                   torch.device("cpu"))
    assert cpu_step.unsupported(model, half, backend, CpuKernelOps()) is None  # --kv-cache-dtype fp16 is read in place
    qwen3, _ = _packed("qwen3")
    assert "Qwen3ForCausalLM's layers are not Llama's" in cpu_step.unsupported(qwen3, plain, backend, CpuKernelOps())
    unpacked, _ = load_model(tiny_model_dir("llama"), torch.float32, torch.device("cpu"))
    assert cpu_step.unsupported(unpacked, plain, backend, CpuKernelOps()) == "the weights are not in the C++ kernel's layout"
    if torch.backends.mkldnn.is_available():
        onednn, _ = _packed("llama", kind=PackedLinear)
        assert cpu_step.unsupported(onednn, plain, backend, CpuKernelOps()) == "the weights are not in the C++ kernel's layout"


def _greedy(llm: LLM, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params)]


def test_the_engine_decodes_with_it_and_matches_transformers_and_enforce_eager(caplog) -> None:
    path = str(tiny_model_dir("llama"))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, TINY_VOCAB, (n,), generator=g).tolist() for n in (7, 29, 40)]
    with caplog.at_level(logging.INFO, logger="radixserve.model.cpu_step"):
        compiled = LLM(model=path, num_speculative_tokens=0)
    assert "CPU step: compiled C++ layers" in caplog.text
    step = compiled.engine.runner.cpu_step
    assert step is not None
    taken: list[bool] = []
    step_forward = step.forward

    def counted(*args):
        hidden = step_forward(*args)
        taken.append(hidden is not None)
        return hidden

    step.forward = counted  # type: ignore[method-assign]
    got = _greedy(compiled, prompts, 12)
    assert taken.count(True) >= 11  # every decode step took it
    eager = LLM(model=path, num_speculative_tokens=0, enforce_eager=True)
    assert eager.engine.runner.cpu_step is None
    assert _greedy(eager, prompts, 12) == got
    hf = hf_model(tiny_model_dir("llama"))
    for prompt, tokens in zip(prompts, got):
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
        assert tokens == want[0, len(prompt):].tolist()


def test_an_engine_without_the_extension_runs_onednn_and_the_python_layers(monkeypatch, caplog, request) -> None:
    def no_compiler() -> cpu_extension.Extension:
        raise RuntimeError("Error building extension 'radixserve_cpu': g++: not found")

    monkeypatch.setattr(cpu_extension, "load_extension", no_compiler)
    cpu_extension.loaded_or_explained.cache_clear()  # its answer is once per process: ask again, and after
    request.addfinalizer(cpu_extension.loaded_or_explained.cache_clear)
    with caplog.at_level(logging.WARNING, logger="radixserve.kernels.cpu_extension"):
        llm = LLM(model=str(tiny_model_dir("llama")), num_speculative_tokens=0)
    assert llm.engine.runner.cpu_step is None
    assert "could not be built" in caplog.text and "g++: not found" in caplog.text
    if torch.backends.mkldnn.is_available():
        assert isinstance(llm.engine.runner.model.lm_head, PackedLinear)
    assert len(_greedy(llm, [[5, 6, 7, 8]], 4)[0]) == 4


def test_a_build_lock_left_by_a_killed_builder_does_not_block_a_start(tmp_path) -> None:
    """torch's build lock is a plain file: a builder killed mid-build leaves it behind, and torch
    then waits on it forever. Under our own lock (which dies with its holder) it is known stale. The
    fresh process also loads what is built, from another checkout's copy of the same sources, without
    building again."""
    directory = cpu_extension.load_extension().directory
    (directory / "lock").touch()
    other_checkout = tmp_path / "csrc"
    shutil.copytree(cpu_extension.SOURCE_DIRECTORY, other_checkout)
    script = ("from pathlib import Path; from radixserve.kernels import cpu_extension; "
              f"print(cpu_extension.load_extension(Path({str(other_checkout)!r})).built)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False" and not (directory / "lock").exists()
