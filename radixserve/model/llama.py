"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache, in plain torch.

One forward call runs one flattened batch of T new tokens from many sequences; attention, including
writing the new K/V into the cache, is delegated to an AttentionBackend. q/k/v and gate/up
projections are each packed into one matmul; the loader fills the packed weights from the HF
checkpoint's separate tensors (`packed_shards` says where each one goes). Construction allocates
weights without initialising them: a model is only meaningful after the loader has filled every
parameter (it checks that it did).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from radixserve.model.attention import AttentionBackend, AttentionMetadata
from radixserve.model.kv_cache import KVCache
from radixserve.model.ops import ModelOps, TorchOps, rms_norm
from radixserve.model.rope import RotaryEmbedding
from radixserve.model.spec import ModelSpec

TORCH_OPS = TorchOps()


class RMSNorm(nn.Module):
    """Holds a norm's weight and eps; the ops apply it (fused with the residual add on the hot path)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size, self.kv_size = spec.q_size, spec.kv_size
        self.scale = spec.head_dim**-0.5
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.attention_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=spec.o_proj_bias)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None

    def forward(self, x: torch.Tensor, rope: Any, kv_cache: KVCache, meta: AttentionMetadata,
                backend: AttentionBackend, ops: ModelOps) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(tokens, self.num_heads, self.head_dim)
        k = k.reshape(tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim).contiguous()
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = ops.rotary(q, k, rope)
        out = backend.forward(q, k, v, kv_cache.k(self.layer), kv_cache.v(self.layer), meta, self.scale)
        return self.o_proj(out.reshape(tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor, ops: ModelOps) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, layer)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, x, residual, rope, kv_cache, meta, backend, ops) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (mlp output, residual stream before it); the next layer's norm adds them."""
        norm = self.input_layernorm
        h, residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        h = self.self_attn(h, rope, kv_cache, meta, backend, ops)
        norm = self.post_attention_layernorm
        h, residual = ops.add_rms_norm(h, residual, norm.weight, norm.eps)
        return self.mlp(h, ops), residual


class DecoderModel(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        device = torch.device(device)
        self.spec = spec
        # Built on the meta device then materialised uninitialised: random init would only be overwritten.
        with torch.device("meta"):
            self.model = DecoderModel(spec)
            tied = spec.tie_word_embeddings
            # a Linear, or after `cpu_linear.pack_for_cpu` a PackedLinear (a tied model's too)
            self.lm_head: nn.Module | None = None if tied else nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.to(dtype)
        self.to_empty(device=device)
        self.requires_grad_(False)
        self.rotary = RotaryEmbedding(spec.head_dim, spec.max_position_embeddings, spec.rope, device)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64: absolute position of each token in its sequence
        kv_cache: KVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        ops: ModelOps | None = None,
    ) -> torch.Tensor:  # [T, hidden] final-normed hidden states
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} must be [T]")
        ops = ops or TORCH_OPS
        x = self.model.embed_tokens(input_ids)
        rope = ops.prepare_rotary(self.rotary, positions, x.dtype)  # shared by every layer
        residual: torch.Tensor | None = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, rope, kv_cache, meta, backend, ops)
        norm = self.model.norm
        return ops.add_rms_norm(x, residual, norm.weight, norm.eps)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 (callers pass only the rows they sample from)."""
        if self.lm_head is None:
            return nn.functional.linear(hidden, self.model.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    def packed_shards(self) -> dict[str, tuple[str, int, int]]:
        """HF-name suffix -> (our parameter suffix, first row, row count) for the packed projections."""
        s = self.spec
        q, kv, inter = s.q_size, s.kv_size, s.intermediate_size
        return {
            "self_attn.q_proj": ("self_attn.qkv_proj", 0, q),
            "self_attn.k_proj": ("self_attn.qkv_proj", q, kv),
            "self_attn.v_proj": ("self_attn.qkv_proj", q + kv, kv),
            "mlp.gate_proj": ("mlp.gate_up_proj", 0, inter),
            "mlp.up_proj": ("mlp.gate_up_proj", inter, inter),
        }
