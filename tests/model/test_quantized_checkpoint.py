"""Quantized checkpoints (`model.quantized_checkpoint`): each supported layout, written here from a tiny
random fp32 model by quantizing it as that format's own tools would (written from the formats' specs,
independently of the loader's unpacking), loads into exactly the weights its dequantization gives,
so greedy generation equals, token for token, the same model loaded from those dequantized tensors as
a plain checkpoint. On CPU the loader dequantizes at load; with kernels (forced here on CPU tensors,
under TRITON_INTERPRET=1) the linear layers run the Triton dequantize-GEMM, whose logits must match.
gpt-oss's MXFP4 experts likewise: dequantized at load on CPU, run by the fused MXFP4 MoE kernels with
kernels. Unsupported schemes are refused before any weight is read, with one line naming them.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import tiny_model_dir

from radixserve.kernels.mxfp4_format import Mxfp4Experts
from radixserve.model.attention import AttentionMetadata, TorchAttentionBackend
from radixserve.model.decoder import CausalLM
from radixserve.model.kv_cache import KVCache, KVLayout
from radixserve.model.loader import load_model, weight_files
from radixserve.model.moe import MoE
from radixserve.model.quantized_checkpoint import QuantLinear, load_quantized_weights, read_quantization
from radixserve.model.spec import load_spec

CPU = torch.device("cpu")
GROUP = 32
BLOCK = 4
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ packs column AWQ_ORDER[i] of each 8 into nibble i
FP4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]

Quantizer = Callable[[str, torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]


# ---------------------------------------------------------------- writers, one per layout


def _pack_nibbles(values: list[int]) -> int:
    word = 0
    for i, v in enumerate(values):
        assert 0 <= v <= 15
        word |= v << (4 * i)
    return word - (1 << 32) if word >= 1 << 31 else word  # as an int32


def _asymmetric(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> q [N, K] in 0..15, zeros [N, K/group] in 1..15, scales [N, K/group] (fp16 values)."""
    n, k = w.shape
    grouped = w.reshape(n, k // group, group)
    lo, hi = grouped.min(-1).values.clamp(max=0), grouped.max(-1).values.clamp(min=0)
    scales = ((hi - lo) / 15).clamp(min=1e-4).half().float()
    zeros = (-lo / scales).round().clamp(1, 15)  # >= 1: GPTQ v1 stores zero - 1
    q = (grouped / scales[..., None]).round() + zeros[..., None]
    return q.clamp(0, 15).reshape(n, k).long(), zeros.long(), scales


def _dequant_groups(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    return (q - zeros.repeat_interleave(group, 1)).float() * scales.repeat_interleave(group, 1)


def awq(name: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    q, zeros, scales = _asymmetric(w, GROUP)
    qt, zt = q.t(), zeros.t()  # AWQ stores [K, N]
    pack = lambda m: torch.tensor([[_pack_nibbles([int(m[r, 8 * j + AWQ_ORDER[i]]) for i in range(8)])
                                    for j in range(m.shape[1] // 8)] for r in range(m.shape[0])], dtype=torch.int32)
    prefix = name.removesuffix("weight")
    return ({f"{prefix}qweight": pack(qt), f"{prefix}qzeros": pack(zt), f"{prefix}scales": scales.t().half()},
            _dequant_groups(q, zeros, scales, GROUP))


def gptq(name: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    q, zeros, scales = _asymmetric(w, GROUP)
    n, k = w.shape
    qweight = torch.tensor([[_pack_nibbles([int(q[c, 8 * r + i]) for i in range(8)]) for c in range(n)]
                            for r in range(k // 8)], dtype=torch.int32)
    zt = zeros.t() - 1  # v1 (checkpoint_format gptq) stores zero - 1
    qzeros = torch.tensor([[_pack_nibbles([int(zt[g, 8 * j + i]) for i in range(8)]) for j in range(n // 8)]
                           for g in range(zt.shape[0])], dtype=torch.int32)
    prefix = name.removesuffix("weight")
    g_idx = torch.arange(k, dtype=torch.int32) // GROUP
    return ({f"{prefix}qweight": qweight, f"{prefix}qzeros": qzeros, f"{prefix}scales": scales.t().half(),
             f"{prefix}g_idx": g_idx}, _dequant_groups(q, zeros, scales, GROUP))


def pack_quantized(name: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """compressed-tensors pack-quantized, asymmetric groups: signed values and zero points, stored + 8."""
    q, zeros, scales = _asymmetric(w, GROUP)
    q_signed, z_signed = q - 8, zeros - 8
    n, k = w.shape
    packed = torch.tensor([[_pack_nibbles([int(q_signed[r, 8 * j + i]) + 8 for i in range(8)]) for j in range(k // 8)]
                           for r in range(n)], dtype=torch.int32)
    zero_point = torch.tensor([[_pack_nibbles([int(z_signed[8 * r + i, g]) + 8 for i in range(8)])
                                for g in range(z_signed.shape[1])] for r in range(n // 8)], dtype=torch.int32)
    return ({f"{name}_packed": packed, f"{name}_scale": scales.bfloat16(), f"{name}_zero_point": zero_point,
             f"{name}_shape": torch.tensor([n, k])},
            _dequant_groups(q_signed, z_signed, scales.bfloat16().float(), GROUP))


def _e4m3(w: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q = (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, q.float() * scale


def fp8_per_tensor(name: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    scale = w.abs().max() / 448
    q, deq = _e4m3(w, scale)
    prefix = name.removesuffix("weight")
    return {name: q, f"{name}_scale": scale.reshape(()), f"{prefix}input_scale": torch.tensor(0.01)}, deq


def fp8_per_channel(name: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    scale = (w.abs().amax(1, keepdim=True) / 448).bfloat16()  # stored in the model's dtype
    q, deq = _e4m3(w, scale.float())
    stored = {name: q, f"{name}_scale": scale}
    if name.endswith("k_proj.weight"):  # a calibrated FP8 KV cache's scales (kv_cache_scheme), read and dropped
        stored[name.replace("k_proj.weight", "k_scale")] = torch.tensor(0.05)
        stored[name.replace("k_proj.weight", "v_scale")] = torch.tensor(0.03)
    return stored, deq


FP8_BLOCK = (16, 32)


def fp8_block(name: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    bn, bk = FP8_BLOCK
    n, k = w.shape
    grid = torch.zeros(-(-n // bn), -(-k // bk))
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            grid[i, j] = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].abs().max() / 448
    full = grid.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    q, deq = _e4m3(w, full)
    return {name: q, f"{name}_scale_inv": grid}, deq


def ct_fp8_block(name: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    stored, deq = fp8_block(name, w)
    return {name: stored[name], f"{name}_scale": stored[f"{name}_scale_inv"]}, deq  # compressed-tensors' name


def pack_quantized_symmetric_channel(name: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """compressed-tensors pack-quantized, symmetric, one scale per row: no zero point stored."""
    scales = (w.abs().amax(1, keepdim=True) / 7.5).half().float()
    q_signed = (w / scales).round().clamp(-8, 7).long()
    n, k = w.shape
    packed = torch.tensor([[_pack_nibbles([int(q_signed[r, 8 * j + i]) + 8 for i in range(8)]) for j in range(k // 8)]
                           for r in range(n)], dtype=torch.int32)
    return ({f"{name}_packed": packed, f"{name}_scale": scales.half(), f"{name}_shape": torch.tensor([n, k])},
            q_signed.float() * scales)


def gptq_symmetric_v2(name: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """GPTQ sym=True in checkpoint_format gptq_v2: every zero 8, stored as is."""
    n, k = w.shape
    grouped = w.reshape(n, k // GROUP, GROUP)
    scales = (grouped.abs().amax(-1) / 7.5).half().float()
    q = ((grouped / scales[..., None]).round().clamp(-8, 7) + 8).reshape(n, k).long()
    qweight = torch.tensor([[_pack_nibbles([int(q[c, 8 * r + i]) for i in range(8)]) for c in range(n)]
                            for r in range(k // 8)], dtype=torch.int32)
    qzeros = torch.full((k // GROUP, n // 8), _pack_nibbles([8] * 8), dtype=torch.int32)
    prefix = name.removesuffix("weight")
    return ({f"{prefix}qweight": qweight, f"{prefix}qzeros": qzeros, f"{prefix}scales": scales.t().half()},
            _dequant_groups(q, torch.full_like(scales, 8).long(), scales, GROUP))


def _mxfp4(w_in_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An expert tensor [E, in, out] -> blocks [E, out, in/32, 16], scales [E, out, in/32], dequantized [E, in, out]."""
    w = w_in_out.transpose(1, 2)
    e, out, k = w.shape
    grouped = w.reshape(e, out, k // 32, 32)
    exponent = torch.ceil(torch.log2(grouped.abs().amax(-1).clamp(min=2.0**-120) / 6.0))
    lut = torch.tensor(FP4)
    scaled = grouped / torch.exp2(exponent)[..., None]
    codes = (scaled[..., None] - lut).abs().argmin(-1)  # the nearest e2m1 value
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    deq = (lut[codes] * torch.exp2(exponent)[..., None]).reshape(e, out, k)
    return blocks, (exponent + 127).to(torch.uint8), deq.transpose(1, 2).contiguous()


# ---------------------------------------------------------------- checkpoint builders


def _write(dir_: Path, base: Path, tensors: dict[str, torch.Tensor], quantization: dict | None) -> Path:
    dir_.mkdir(parents=True)
    config = json.loads((base / "config.json").read_text())
    if quantization is not None:
        config["quantization_config"] = quantization
    (dir_ / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dir_ / "model.safetensors"))
    return dir_


def quantized_llama(tmp: Path, quantize: Quantizer, quantization: dict) -> tuple[Path, Path]:
    """(quantized checkpoint, the plain checkpoint of its dequantized weights) of the tiny Llama."""
    base = tiny_model_dir("llama")
    plain = load_file(str(base / "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, tensor in plain.items():
        if name.endswith(".weight") and name.split(".")[-2] in LINEARS:
            stored, deq = quantize(name, tensor)
            quantized.update(stored)
            dequantized[name] = deq
        else:
            quantized[name] = dequantized[name] = tensor
    return (_write(tmp / "quantized", base, quantized, quantization),
            _write(tmp / "dequantized", base, dequantized, None))


def _ct(weights: dict, fmt: str, inputs: dict | None = None, kv_cache: dict | None = None) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"], "kv_cache_scheme": kv_cache,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs}}}


LAYOUTS: dict[str, tuple[Quantizer, dict]] = {
    "fp8-tensor": (fp8_per_tensor, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "static"}),
    "fp8-block": (fp8_block, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                              "weight_block_size": list(FP8_BLOCK)}),
    "ct-fp8-channel": (fp8_per_channel, _ct({"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
                                            "float-quantized", {"num_bits": 8, "type": "float", "strategy": "token",
                                                                "dynamic": True},
                                            {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False})),
    "awq": (awq, {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}),
    "gptq": (gptq, {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": False,
                    "checkpoint_format": "gptq"}),
    "ct-fp8-block": (ct_fp8_block, _ct({"num_bits": 8, "type": "float", "strategy": "block",
                                        "block_structure": list(FP8_BLOCK), "symmetric": True}, "float-quantized")),
    "gptq-sym-v2": (gptq_symmetric_v2, {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False,
                                        "sym": True, "checkpoint_format": "gptq_v2"}),
    "ct-int4-sym-channel": (pack_quantized_symmetric_channel, _ct({"num_bits": 4, "type": "int", "strategy": "channel",
                                                                   "symmetric": True}, "pack-quantized")),
    "ct-int4": (pack_quantized, _ct({"num_bits": 4, "type": "int", "strategy": "group", "group_size": GROUP,
                                     "symmetric": False}, "pack-quantized")),
}


def quantized_gpt_oss(tmp: Path) -> tuple[Path, Path]:
    base = tiny_model_dir("gpt_oss")
    plain = load_file(str(base / "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, tensor in plain.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales, deq = _mxfp4(tensor)
            quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
            dequantized[name] = deq
        else:
            quantized[name] = dequantized[name] = tensor
    quantization = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}
    return (_write(tmp / "quantized", base, quantized, quantization),
            _write(tmp / "dequantized", base, dequantized, None))


# ---------------------------------------------------------------- running a model


class Greedy:
    """One sequence through a paged KV cache (blocks in order), as the engine drives the model."""

    def __init__(self, model: CausalLM, blocks: int = 16) -> None:
        spec = model.spec
        self.model = model
        self.cache = KVCache(KVLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, BLOCK, torch.float32), blocks,
                             CPU)
        self.table = torch.arange(blocks, dtype=torch.int32)[None, :]
        self.length = 0

    @torch.inference_mode()
    def step(self, tokens: list[int]) -> torch.Tensor:
        start, self.length = self.length, self.length + len(tokens)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(start, self.length), cu_seqlens_q=torch.tensor([0, len(tokens)], dtype=torch.int32),
            seq_lens=torch.tensor([self.length], dtype=torch.int32), block_table=self.table,
            query_lens=[len(tokens)], seq_lens_host=[self.length])
        hidden = self.model(torch.tensor(tokens), torch.arange(start, self.length), self.cache, meta,
                            TorchAttentionBackend())
        return self.model.compute_logits(hidden)

    def generate(self, prompt: list[int], steps: int) -> list[int]:
        logits, out = self.step(prompt), []
        for _ in range(steps):
            out.append(int(logits[-1].argmax()))
            logits = self.step(out[-1:])
        return out


PROMPT = [5, 77, 301, 12, 450, 9, 133]


def _same_weights(a: CausalLM, b: CausalLM) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), f"{name} differs from the dequantized checkpoint's"


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cpu_dequantizes_at_load_to_the_dequantized_checkpoint(tmp_path, layout, caplog):
    quantized, dequantized = quantized_llama(tmp_path, *LAYOUTS[layout])
    with caplog.at_level(logging.INFO, logger="radixserve.model.quantized_checkpoint"):
        model, _ = load_model(quantized, torch.float32, CPU)
    assert "dequantized to torch.float32 at load (no CUDA" in caplog.text
    reference, _ = load_model(dequantized, torch.float32, CPU)
    _same_weights(model, reference)
    assert Greedy(model).generate(PROMPT, 8) == Greedy(reference).generate(PROMPT, 8)


def test_bfloat16_model_gets_the_dequantized_weights_rounded_once(tmp_path):
    quantized, dequantized = quantized_llama(tmp_path, *LAYOUTS["awq"])
    model, _ = load_model(quantized, torch.bfloat16, CPU)
    reference, _ = load_model(dequantized, torch.bfloat16, CPU)
    _same_weights(model, reference)


@pytest.mark.parametrize("layout", ["fp8-block", "fp8-tensor", "awq", "ct-int4", "ct-int4-sym-channel"])
def test_triton_path_matches_the_dequantized_model(tmp_path, layout):
    quantized, dequantized = quantized_llama(tmp_path, *LAYOUTS[layout])
    scheme = read_quantization(quantized)
    assert scheme is not None
    model = CausalLM(load_spec(quantized), torch.float32, CPU)
    load_quantized_weights(model, weight_files(quantized), scheme, use_kernels=True)
    model.eval()
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, QuantLinear) and isinstance(layer.mlp.down_proj, QuantLinear)
    reference, _ = load_model(dequantized, torch.float32, CPU)
    got, expected = Greedy(model).step(PROMPT), Greedy(reference).step(PROMPT)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)
    assert Greedy(model).generate(PROMPT, 3) == Greedy(reference).generate(PROMPT, 3)


def test_mxfp4_experts_dequantize_at_load_on_cpu(tmp_path, caplog):
    quantized, dequantized = quantized_gpt_oss(tmp_path)
    with caplog.at_level(logging.INFO, logger="radixserve.model.quantized_checkpoint"):
        model, _ = load_model(quantized, torch.float32, CPU)
    assert "quantized checkpoint (mxfp4): 4 weights dequantized to torch.float32 at load" in caplog.text
    reference, _ = load_model(dequantized, torch.float32, CPU)
    _same_weights(model, reference)
    assert Greedy(model).generate(PROMPT, 6) == Greedy(reference).generate(PROMPT, 6)


def test_mxfp4_experts_run_in_the_fused_mxfp4_kernels(tmp_path):
    quantized, dequantized = quantized_gpt_oss(tmp_path)
    scheme = read_quantization(quantized)
    assert scheme is not None
    model = CausalLM(load_spec(quantized), torch.float32, CPU)
    load_quantized_weights(model, weight_files(quantized), scheme, use_kernels=True)
    model.eval()
    moe = model.model.layers[0].mlp
    assert isinstance(moe, MoE) and isinstance(moe.packed, Mxfp4Experts) and moe.gate_up is None
    moe.pack(use_cpu_kernel=True)  # what the runner does after loading: MXFP4 experts stay as they are
    assert isinstance(moe.packed, Mxfp4Experts)
    reference, _ = load_model(dequantized, torch.float32, CPU)
    got, expected = Greedy(model).step(PROMPT), Greedy(reference).step(PROMPT)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)
    assert Greedy(model).generate(PROMPT, 3) == Greedy(reference).generate(PROMPT, 3)


REFUSED = [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes' is not supported"),
    ({"quant_method": "awq", "bits": 8, "group_size": 128}, "awq bits 8"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "awq version 'gemv'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}, "gptq desc_act true"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "gptq bits 3"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fp8 fmt 'e5m2'"),
    ({"quant_method": "fp8", "weight_block_size": [128, 100]}, "weight_block_size"),
    (_ct({"num_bits": 8, "type": "int", "strategy": "channel"}, "int-quantized"),
     "weights type 'int' num_bits 8 format 'int-quantized'"),
    (_ct({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "actorder": "group"},
         "pack-quantized"), "actorder 'group'"),
    (_ct({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}, "pack-quantized",
         {"num_bits": 8, "type": "int"}), "input_activations 'int' 8-bit"),
]


@pytest.mark.parametrize("quantization, message", REFUSED, ids=[m for _, m in REFUSED])
def test_unsupported_schemes_are_refused_before_any_weight(tmp_path, quantization, message):
    config = json.loads((tiny_model_dir("llama") / "config.json").read_text())
    config["quantization_config"] = quantization
    (tmp_path / "config.json").write_text(json.dumps(config))  # no weights at all: refused before reading any
    with pytest.raises(ValueError, match=message.replace("(", r"\(")) as err:
        load_model(tmp_path, torch.float32, CPU)
    assert "\n" not in str(err.value) and "supported quant_method" in str(err.value)


def test_act_order_g_idx_is_refused(tmp_path):
    def permuted(name: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        stored, deq = gptq(name, w)
        g_idx = stored[f"{name.removesuffix('weight')}g_idx"]
        stored[f"{name.removesuffix('weight')}g_idx"] = g_idx.flip(0)
        return stored, deq

    quantized, _ = quantized_llama(tmp_path, permuted, LAYOUTS["gptq"][1])
    with pytest.raises(ValueError, match="g_idx is permuted"):
        load_model(quantized, torch.float32, CPU)


def test_a_stray_or_missing_quantized_tensor_is_named(tmp_path):
    quantized, _ = quantized_llama(tmp_path, *LAYOUTS["awq"])
    tensors = load_file(str(quantized / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_proj.extra"] = torch.zeros(1)
    del tensors["model.layers.1.mlp.down_proj.qzeros"]
    save_file(tensors, str(quantized / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks model.layers.1.mlp.down_proj.qzeros"):
        load_model(quantized, torch.float32, CPU)
    del tensors["model.layers.1.mlp.down_proj.qweight"], tensors["model.layers.1.mlp.down_proj.scales"]
    save_file(tensors, str(quantized / "model.safetensors"))
    with pytest.raises(ValueError, match="does not use: model.layers.0.self_attn.q_proj.extra"):
        load_model(quantized, torch.float32, CPU)


def test_serve_refuses_an_unsupported_scheme_in_one_line(tmp_path):
    config = json.loads((tiny_model_dir("llama") / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "hqq", "nbits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(tiny_model_dir("llama") / "model.safetensors")
    proc = subprocess.run([sys.executable, "-m", "radixserve", "serve", "--model", str(tmp_path), "--port", "0"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0
    assert "quantization_config quant_method 'hqq' is not supported" in proc.stderr
    assert "Traceback" not in proc.stderr
