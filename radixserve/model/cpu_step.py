"""The compiled CPU step: every decoder layer of a step whose rows are all short, in one C++ call.

On CPU a batch-1 decode step of the embedded model is about 120 matmuls and a thousand small ops.
From Python each small op costs several microseconds of interpreter and binding time, more than its
arithmetic. `csrc/cpu_step.cpp` runs the whole layer stack in one `radixserve::short_step` call: the
matmuls, attention, the norm and SiLU-and-mul as the kernels the Python layers call too
(`BlockedLinear`, the torch backend's in-place attention, `CpuKernelOps`), and rotary and the cache
writes as plain loops with the same rounding, without changing a bit.

This module decides when a step may take it (the extension itself is built and loaded by
`cpu_extension`):
- the model's projections run the extension's kernel (`cpu_linear.BlockedLinear`, or a GGUF file's
  quantized blocks, `ggml_quants.QuantizedLinear`), the attention
  backend is torch's with the extension's in-place attention (`attention.reads_in_place`: a cache
  of fp32, bf16 or fp16 values, not FP8), the hot-path ops are `CpuKernelOps` (the extension's norm
  and SiLU-and-mul, which the step calls too), and the architecture has no q/k norm (Qwen3's);
- every row of the step has at most `SHORT_QUERY` new tokens (decodes, verifications of drafts).
Other steps, and every step under `--enforce-eager`, run the Python layers.

Each layer's attention (its scale, sliding window, attention sinks and logit softcap, read from its
attention module by `layer_scale`, `layer_window`, `layer_sinks` and `layer_softcap`) goes to the
kernel as the Python layers pass it to the backend.

Invariant: both paths give the same hidden states and cache writes bit for bit, in fp32 and bf16
(tests/model/test_cpu_compiled_step.py checks with `torch.equal`), so a token's result does not depend on
which path its step took, and greedy output stays transformers' token for token.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from radixserve.kernels.cpu_linear import BlockedLinear
from radixserve.kernels.ggml_quants import QuantizedLinear
from radixserve.model.attention import SHORT_QUERY, AttentionMetadata, TorchAttentionBackend, reads_in_place
from radixserve.model.decoder import MLP, CausalLM, DecoderLayer
from radixserve.model.kv_cache import KVCache
from radixserve.model.kv_fp8 import is_packed
from radixserve.model.ops import ModelOps

log = logging.getLogger(__name__)

# the projections `radixserve::linear` runs: fp32/bf16 blocks, or a GGUF file's quantized blocks
KERNEL_LINEARS = (BlockedLinear, QuantizedLinear)


def unsupported(model: CausalLM, kv_cache: KVCache, backend: object, ops: ModelOps) -> str | None:
    """Why this model and cache cannot take the C++ step, or None when they can."""
    if kv_cache.data.device.type != "cpu":
        return "not on CPU"
    if not isinstance(backend, TorchAttentionBackend):
        return "the attention backend is not torch's"
    if ops.name != "cpp":
        return "the norm and SiLU-and-mul are not the C++ extension's (model/ops.py CpuKernelOps)"
    if is_packed(kv_cache.data):
        return "the KV cache is FP8"
    if not backend.cpu_kernel or not reads_in_place(kv_cache.k(0)):
        return f"the attention kernel does not read this cache ({kv_cache.data.dtype}, head_dim {model.spec.head_dim})"
    if not model.spec.llama_shaped:
        return f"{model.spec.architecture}'s layers are not Llama's (pre-norm, SwiGLU, whole-head rotary, no q/k norm)"
    if not all(isinstance(m, KERNEL_LINEARS) for layer in decoder_layers(model) for m in _linears(layer)):
        return "the weights are not in the C++ kernel's layout"
    return None


def layer_scale(model: CausalLM, i: int) -> float:
    """Layer i's attention scale (its scores are scale * q.k)."""
    return float(getattr(model.model.layers[i].self_attn, "scale", model.spec.head_dim**-0.5))


def layer_window(model: CausalLM, i: int) -> int | None:
    """Layer i's sliding window (the keys a query sees, itself included), None for full attention."""
    return getattr(model.model.layers[i].self_attn, "window", None)


def layer_sinks(model: CausalLM, i: int) -> torch.Tensor | None:
    """Layer i's attention sinks (a logit per q head), or None."""
    return getattr(model.model.layers[i].self_attn, "sinks", None)


def layer_softcap(model: CausalLM, i: int) -> float | None:
    """Layer i's attention logit softcap, or None."""
    return getattr(model.model.layers[i].self_attn, "softcap", None)


def decoder_layers(model: CausalLM) -> list[DecoderLayer]:
    return [layer for layer in model.model.layers if isinstance(layer, DecoderLayer)]


def _linears(layer: DecoderLayer) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
    """A layer's projections in the C++ step's order: packed q/k/v, o, packed gate/up, down."""
    mlp = layer.mlp
    assert isinstance(mlp, MLP), "unsupported() refuses MoE layers"
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, mlp.gate_up_proj, mlp.down_proj


class CpuStep:
    """Runs a step of short rows through `radixserve::short_step`, holding what every call passes:
    the weights in layer order and each layer's cache."""

    def __init__(self, model: CausalLM, kv_cache: KVCache) -> None:
        spec = model.spec
        self.model = model
        self.weights: list[torch.Tensor] = []
        self.biases: list[torch.Tensor | None] = []
        for layer in decoder_layers(model):
            packed = [m for m in _linears(layer) if isinstance(m, KERNEL_LINEARS)]
            assert len(packed) == 4, "unsupported() first"
            qkv, o, gate_up, down = packed
            self.weights += [layer.input_layernorm.weight, qkv.weight, o.weight,
                             layer.post_attention_layernorm.weight, gate_up.weight, down.weight]
            self.biases += [m.bias for m in (qkv, o, gate_up, down)]
        self.k_caches = [kv_cache.k(i) for i in range(spec.num_layers)]
        self.v_caches = [kv_cache.v(i) for i in range(spec.num_layers)]
        self.shape = [spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate_size]
        self.eps = spec.rms_norm_eps
        # each layer's attention as its module passes it to the backend, in the kernel's terms: 0 for
        # no window and no softcap
        self.scales = [layer_scale(model, i) for i in range(spec.num_layers)]
        self.windows = [layer_window(model, i) or 0 for i in range(spec.num_layers)]
        self.sinks = [layer_sinks(model, i) for i in range(spec.num_layers)]
        self.softcaps = [float(layer_softcap(model, i) or 0.0) for i in range(spec.num_layers)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """The final-normed hidden states [T, hidden], as `CausalLM.forward` returns them, or
        None when a row is too long for the short path (the caller runs the Python layers)."""
        if any(n > SHORT_QUERY for n in meta.query_lens):
            return None
        embed = self.model.model.embed_tokens.weight
        # the activations' dtype: a GGUF model's embedding is a packed uint8 buffer
        cos, signed_sin = self.model.rotary.cos_sin(positions, self.model.model.norm.weight.dtype)
        return torch.ops.radixserve.short_step(
            input_ids, embed, cos, signed_sin, self.weights, self.biases, self.model.model.norm.weight,
            self.k_caches, self.v_caches, meta.slot_mapping, meta.block_table, meta.seq_lens_host, meta.query_lens,
            self.shape, self.eps, self.scales, self.windows, self.sinks, self.softcaps,
        )


def compiled_cpu_step(model: CausalLM, kv_cache: KVCache, backend: object, ops: ModelOps) -> CpuStep | None:
    """The C++ step for this model and cache, or None, with the reason logged, where it does not apply."""
    reason = unsupported(model, kv_cache, backend, ops)
    if reason is not None:
        log.info("CPU step: Python layers (%s)", reason)
        return None
    log.info("CPU step: compiled C++ layers for decode and verification steps")
    return CpuStep(model, kv_cache)
