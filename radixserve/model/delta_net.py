"""The Gated DeltaNet token mixer (Qwen3.5's linear-attention layers) over the state cache, in torch.

Per token t of a sequence, with the layer's state S [value_heads, key_dim, value_dim]:
    S <- S * exp(g_t);  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t
where q_t, k_t are L2-normed (q also scaled by key_dim^-1/2), g_t = -exp(A_log) softplus(a_t + dt_bias)
is the decay and beta_t = sigmoid(b_t) the write strength. q, k and v first pass a causal depthwise
convolution (kernel K, SiLU) whose last K-1 inputs are the other half of the state. Outputs are
normed per head, gated by SiLU(z) and projected back.

Each item of a step reads its sequence's state from its slot (`AttentionMetadata.state_slots`; an
item starting at position 0 starts from zeros instead) and leaves the state after its last token
there, so a slot always holds the state after the sequence's computed tokens. Steps of one-token
items run as one batched update; prefill chunks run per item, token by token (exact, and at the
tiny and CPU shapes this serves, cheap next to the projections).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.model.attention import AttentionMetadata
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


class DepthwiseConv(nn.Module):
    """Holds the convolution's weight [channels, 1, kernel] as checkpoints store it."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))


class GatedDeltaNet(nn.Module):
    def __init__(self, spec: ModelSpec, d: DeltaNetSpec, state_index: int) -> None:
        super().__init__()
        self.d = d
        self.state_index = state_index
        hidden = spec.hidden_size
        self.in_proj_qkv = nn.Linear(hidden, d.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, d.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, d.num_value_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, d.num_value_heads, bias=False)
        self.conv1d = DepthwiseConv(d.conv_dim, d.conv_kernel)
        self.dt_bias = nn.Parameter(torch.empty(d.num_value_heads))
        self.A_log = nn.Parameter(torch.empty(d.num_value_heads))
        self.norm = GatedRMSNorm(d.value_head_dim, spec.rms_norm_eps)
        self.out_proj = nn.Linear(d.value_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, states: StateCache | None, meta: AttentionMetadata) -> torch.Tensor:
        d, tokens = self.d, x.shape[0]
        mixed = self.in_proj_qkv(x)
        z = self.in_proj_z(x).reshape(tokens, d.num_value_heads, d.value_head_dim)
        beta = torch.sigmoid(self.in_proj_b(x).float())
        decay = torch.exp(-torch.exp(self.A_log.float()) * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float()))
        if states is None:  # a probe forward: no sequence owns a state
            conv = torch.zeros(1, d.conv_kernel - 1, d.conv_dim, dtype=x.dtype, device=x.device)
            delta = torch.zeros(1, d.num_value_heads, d.key_head_dim, d.value_head_dim, device=x.device)
            slots = [0] * meta.num_seqs
        else:
            conv, delta = states.conv[self.state_index], states.delta[self.state_index]
            slots = meta.state_slots
        out = torch.empty(tokens, d.num_value_heads, d.value_head_dim, dtype=torch.float32, device=x.device)
        if meta.all_decode:
            self._decode(mixed, beta, decay, conv, delta, slots, meta, out)
        else:
            first = 0
            for n, seq_len, slot in zip(meta.query_lens, meta.seq_lens_host, slots):
                rows = slice(first, first + n)
                fresh = seq_len == n  # the item starts at position 0: no state to read
                self._prefill(mixed[rows], beta[rows], decay[rows], conv, delta, slot, fresh, out[rows])
                first += n
        h = self.norm(out.to(x.dtype), z)
        return self.out_proj(h.reshape(tokens, d.value_dim))

    def _prefill(self, mixed: torch.Tensor, beta: torch.Tensor, decay: torch.Tensor, conv: torch.Tensor,
                 delta: torch.Tensor, slot: int, fresh: bool, out: torch.Tensor) -> None:
        d, n = self.d, mixed.shape[0]
        window = torch.cat([torch.zeros_like(conv[slot]) if fresh else conv[slot], mixed])  # [K-1+n, C]
        q, k, v = self._qkv(self._convolve(window), n)
        state = torch.zeros_like(delta[slot]) if fresh else delta[slot].clone()
        for t in range(n):
            state = self._step(state[None], q[t:t + 1], k[t:t + 1], v[t:t + 1], beta[t:t + 1], decay[t:t + 1],
                               out[t:t + 1])[0]
        conv[slot] = window[-(d.conv_kernel - 1):]
        delta[slot] = state

    def _decode(self, mixed: torch.Tensor, beta: torch.Tensor, decay: torch.Tensor, conv: torch.Tensor,
                delta: torch.Tensor, slots: list[int], meta: AttentionMetadata, out: torch.Tensor) -> None:
        """One token per item, all items at once: gather the slots' states, step, scatter them back."""
        index = torch.tensor(slots, dtype=torch.long).to(mixed.device, non_blocking=True)
        fresh = torch.tensor([s == 1 for s in meta.seq_lens_host]).to(mixed.device, non_blocking=True)
        keep = (~fresh).to(conv.dtype)
        windows = torch.cat([conv[index] * keep[:, None, None], mixed[:, None, :]], dim=1)  # [B, K, C]
        weight = self.conv1d.weight[:, 0, :].to(windows.dtype)  # [C, K]
        convolved = F.silu((windows * weight.t()[None]).sum(dim=1))  # [B, C]
        q, k, v = self._qkv(convolved, mixed.shape[0])
        state = delta[index] * (~fresh).float()[:, None, None, None]
        state = self._step(state, q, k, v, beta, decay, out)
        conv[index] = windows[:, 1:]
        delta[index] = state

    def _convolve(self, window: torch.Tensor) -> torch.Tensor:
        """[K-1+n, C] inputs -> [n, C] SiLU(causal depthwise convolution)."""
        weight = self.conv1d.weight.to(window.dtype)
        return F.silu(F.conv1d(window.t()[None], weight, groups=self.d.conv_dim)[0].t())

    def _qkv(self, convolved: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split, L2-norm q and k (q also scaled), and repeat the key heads over the value heads; fp32."""
        d = self.d
        q, k, v = convolved.float().split([d.key_dim, d.key_dim, d.value_dim], dim=-1)
        q = _l2norm(q.reshape(n, d.num_key_heads, d.key_head_dim)) * d.key_head_dim ** -0.5
        k = _l2norm(k.reshape(n, d.num_key_heads, d.key_head_dim))
        repeat = d.num_value_heads // d.num_key_heads
        if repeat > 1:
            q, k = q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)
        return q, k, v.reshape(n, d.num_value_heads, d.value_head_dim)

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
