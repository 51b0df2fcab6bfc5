"""The Gated DeltaNet token mixer (Qwen3.5's linear-attention layers) over the state cache, in torch.

Per token t of a sequence, with the layer's state S [value_heads, key_dim, value_dim]:
    S <- S * exp(g_t);  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t
where q_t, k_t are L2-normed (q also scaled by key_dim^-1/2), g_t = -exp(A_log) softplus(a_t + dt_bias)
is the decay and beta_t = sigmoid(b_t) the write strength. q, k and v first pass a causal depthwise
convolution (kernel K, SiLU; model/causal_conv.py) whose last K-1 inputs are the other half of the state. Outputs are
normed per head, gated by SiLU(z) and projected back.

Each item of a step reads its sequence's state from its slot (`AttentionMetadata.state_slots`; an
item starting at position 0 starts from zeros instead) and leaves the state after its last token
there, so a slot always holds the state after the sequence's computed tokens. The recurrence runs
(`implementation`, set by the runner) in the C++ extension on CPU where it is loaded
(`radixserve::gated_delta_rule`, csrc/delta_rule.cpp), in Triton on CUDA (kernels/recurrent.py: a
prompt's whole 16-token chunks in the chunked WY form on tensor cores), each with every item and head
of a step in one call; otherwise in torch, one batched update for steps of
one-token items and token by token per item for prefill chunks (the reference both are tested against).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.model.attention import AttentionMetadata
from radixserve.model.causal_conv import CausalConv, RecurrentImplementation, decode_slots, step_items
from radixserve.model.spec import DeltaNetSpec, ModelSpec
from radixserve.model.state_cache import StateCache


class GatedRMSNorm(nn.Module):
    """RMS norm per head in fp32, weighted in the model's dtype, then gated by SiLU(z)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, spec: ModelSpec, d: DeltaNetSpec, state_index: int) -> None:
        super().__init__()
        self.d = d
        self.state_index = state_index
        hidden = spec.hidden_size
        if d.fused_projections:  # Qwen3-Next: per key head, its q, k, then its value heads' v and z; and b, a
            self.in_proj_qkvz = nn.Linear(hidden, d.conv_dim + d.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(hidden, 2 * d.num_value_heads, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(hidden, d.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(hidden, d.value_dim, bias=False)
            self.in_proj_b = nn.Linear(hidden, d.num_value_heads, bias=False)
            self.in_proj_a = nn.Linear(hidden, d.num_value_heads, bias=False)
        self.conv1d = CausalConv(d.conv_dim, d.conv_kernel)
        self.dt_bias = nn.Parameter(torch.empty(d.num_value_heads))
        self.A_log = nn.Parameter(torch.empty(d.num_value_heads))
        self.norm = GatedRMSNorm(d.value_head_dim, spec.rms_norm_eps)
        self.out_proj = nn.Linear(d.value_dim, hidden, bias=False)
        # the order out_proj takes its inputs in, where its weight's columns are not the value heads' order
        # (a GGUF file's, kept in its blocks: gguf_checkpoint.value_columns); None: as computed
        self.out_proj_inputs: torch.Tensor | None
        self.register_buffer("out_proj_inputs", None, persistent=False)
        self.implementation: RecurrentImplementation = "torch"  # the runner sets it

    def forward(self, x: torch.Tensor, states: StateCache | None, meta: AttentionMetadata) -> torch.Tensor:
        d, tokens = self.d, x.shape[0]
        mixed, z, b, a = self._project(x)
        beta = torch.sigmoid(b.float())
        decay = torch.exp(-torch.exp(self.A_log.float()) * F.softplus(a.float() + self.dt_bias.float()))
        fresh = [seq_len == n for n, seq_len in zip(meta.query_lens, meta.seq_lens_host)]  # items at position 0
        if states is None:  # a probe forward: no sequence owns a state, each item gets its own zeros
            conv = torch.zeros(meta.num_seqs, d.conv_kernel - 1, d.conv_dim, dtype=x.dtype, device=x.device)
            delta = torch.zeros(meta.num_seqs, d.num_value_heads, d.key_head_dim, d.value_head_dim, device=x.device)
            slots, fresh = list(range(meta.num_seqs)), [True] * meta.num_seqs
        else:
            conv, stored = states.conv[self.state_index], states.ssm[self.state_index]
            assert stored is not None, "a DeltaNet layer's slots hold a delta-rule state"
            delta, slots = stored, meta.state_slots
        q, k, v = self._qkv(F.silu(self.conv1d(mixed, conv, slots, fresh, meta)), tokens)
        out = torch.empty(tokens, d.num_value_heads, d.value_head_dim, dtype=torch.float32, device=x.device)
        if self.implementation == "cpp":
            torch.ops.radixserve.gated_delta_rule(q, k, v, beta, decay, delta, slots, meta.query_lens,
                                                  [int(f) for f in fresh], out)
        elif self.implementation == "triton":
            from radixserve.kernels.recurrent import gated_delta_rule

            gated_delta_rule(q, k, v, beta.contiguous(), decay.contiguous(), delta,
                             step_items(meta, slots, fresh, x.device), out)
        elif meta.all_decode:
            index, keep = decode_slots(slots, fresh, torch.float32, x.device)
            delta[index] = self._step(delta[index] * keep[:, None, None, None], q, k, v, beta, decay, out)
        else:
            first = 0
            for n, slot, zero in zip(meta.query_lens, slots, fresh):
                state = torch.zeros_like(delta[slot]) if zero else delta[slot].clone()
                for t in range(first, first + n):
                    state = self._step(state[None], q[t:t + 1], k[t:t + 1], v[t:t + 1], beta[t:t + 1],
                                       decay[t:t + 1], out[t:t + 1])[0]
                delta[slot] = state
                first += n
        h = self.norm(out.to(x.dtype), z).reshape(tokens, d.value_dim)
        if self.out_proj_inputs is not None:
            h = h.index_select(1, self.out_proj_inputs)
        return self.out_proj(h)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolution's inputs [T, C] (all heads' q, then k, then v), z [T, Hv, dv], b and a [T, Hv]."""
        d, tokens = self.d, x.shape[0]
        if not d.fused_projections:
            return (self.in_proj_qkv(x), self.in_proj_z(x).reshape(tokens, d.num_value_heads, d.value_head_dim),
                    self.in_proj_b(x), self.in_proj_a(x))
        per_key = d.num_value_heads // d.num_key_heads
        grouped = self.in_proj_qkvz(x).reshape(tokens, d.num_key_heads, -1)
        q, k, v, z = grouped.split([d.key_head_dim, d.key_head_dim, per_key * d.value_head_dim,
                                    per_key * d.value_head_dim], dim=-1)
        mixed = torch.cat([q.reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1)], dim=-1)
        b, a = self.in_proj_ba(x).reshape(tokens, d.num_key_heads, 2 * per_key).split(per_key, dim=-1)
        return (mixed, z.reshape(tokens, d.num_value_heads, d.value_head_dim), b.reshape(tokens, -1),
                a.reshape(tokens, -1))

    def _qkv(self, convolved: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split, L2-norm q and k (q also scaled), and repeat the key heads over the value heads; fp32."""
        d = self.d
        q, k, v = convolved.float().split([d.key_dim, d.key_dim, d.value_dim], dim=-1)
        q = _l2norm(q.reshape(n, d.num_key_heads, d.key_head_dim)) * d.key_head_dim ** -0.5
        k = _l2norm(k.reshape(n, d.num_key_heads, d.key_head_dim))
        repeat = d.num_value_heads // d.num_key_heads
        if repeat > 1:
            q, k = q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)
        return q.contiguous(), k.contiguous(), v.reshape(n, d.num_value_heads, d.value_head_dim).contiguous()

    @staticmethod
    def _step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
              decay: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """One token of B sequences: state [B, H, dk, dv]; q, k [B, H, dk]; v [B, H, dv]; beta, decay
        [B, H]. Writes o into `out` [B, H, dv]; returns the new state."""
        state = state * decay[..., None, None]
        remembered = (state * k[..., None]).sum(dim=-2)  # [B, H, dv]
        update = (v - remembered) * beta[..., None]
        state = state + k[..., None] * update[..., None, :]
        out.copy_((state * q[..., None]).sum(dim=-2))
        return state


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)
