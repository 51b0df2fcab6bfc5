"""The Mamba2 token mixer (the recurrent layers of Nemotron-H, Granite 4 and Falcon-H1) over the state cache, in torch.

Per token t of a sequence and head h, with the layer's state S_h [head_dim, state_size]:
    dt = clamp(softplus(dt_t + dt_bias), time_step_limit);  S_h <- exp(dt A_h) S_h + dt x_t B_t^T
    y_t = S_h C_t + D_h x_t
where x is the head's slice of the convolved inner channels, B and C (state_size each) are shared by
the heads of a group and A_h = -exp(A_log_h) is a per-head scalar decay. x, B and C first pass a
causal depthwise convolution (SiLU; model/causal_conv.py) whose last kernel - 1 inputs are the other
half of the state. y is gated by SiLU(z) and RMS-normed per group of heads (or normed first, or only
gated: `Mamba2Spec.output`), and projected back.

Each item of a step reads its sequence's state from its slot (`AttentionMetadata.state_slots`; an
item at position 0 starts from zeros) and leaves the state after its last token there. Where the C++
extension runs (`implementation` "cpp", set by the runner), every item of a step is one call of
`radixserve::mamba2_scan` (csrc/mamba2_scan.cpp): the recurrence token by token, whose results do not
depend on how a prompt was chunked. On CUDA it is one launch of the Triton scan (kernels/recurrent.py):
an item's whole chunks of 16 tokens in the chunked form below, on tensor cores, the rest token by
token. In torch, steps of one-token items run one batched update; a prefill item runs the chunked
form of the same scan (the state-space duality: within a chunk of `CHUNK` tokens the outputs are one
masked, decayed C B^T product, and the state passes from chunk to chunk), which equals the
token-by-token recurrence up to rounding (`recurrent_reference`, what the tests hold both to).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.model.attention import AttentionMetadata
from radixserve.model.causal_conv import CausalConv, RecurrentImplementation, decode_slots, step_items
from radixserve.model.spec import Mamba2Spec, ModelSpec
from radixserve.model.state_cache import StateCache

CHUNK = 64  # tokens per chunk of the prefill scan: its [chunk, chunk] products stay small and exact in fp32


class GroupedGatedRMSNorm(nn.Module):
    """y * SiLU(z), RMS-normed over each group's channels and weighted, in fp32; then the model's dtype.
    `gate_first` False: normed and weighted first, then gated (Falcon-H1's norm_before_gate)."""

    def __init__(self, dim: int, groups: int, eps: float, gate_first: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.groups, self.eps, self.gate_first = groups, eps, gate_first

    def forward(self, y: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        h = y.float() * F.silu(gate.float()) if self.gate_first else y.float()
        grouped = h.reshape(*h.shape[:-1], self.groups, -1)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * grouped.reshape(h.shape)
        return (out if self.gate_first else out * F.silu(gate.float())).to(dtype)


class Mamba2Mixer(nn.Module):
    def __init__(self, spec: ModelSpec, m: Mamba2Spec, state_index: int) -> None:
        super().__init__()
        self.m = m
        self.state_index = state_index
        hidden = spec.hidden_size
        self.in_proj = nn.Linear(hidden, m.inner_dim + m.conv_dim + m.num_heads, bias=m.proj_bias)
        self.conv1d = CausalConv(m.conv_dim, m.conv_kernel, m.conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(m.num_heads))
        self.A_log = nn.Parameter(torch.empty(m.num_heads))
        self.D = nn.Parameter(torch.empty(m.num_heads))
        self.norm = (None if m.output == "gate"
                     else GroupedGatedRMSNorm(m.inner_dim, m.groups, spec.rms_norm_eps, m.output == "gate_then_norm"))
        scales = m.projection_scales
        sections = (m.inner_dim, m.inner_dim, m.groups * m.state_size, m.groups * m.state_size, m.num_heads)
        # Falcon-H1's per-section multipliers of in_proj's output (its mup vector), made on the host (the
        # module is built on the meta device) and copied once to the weights' device and dtype; None: all 1
        self.projection_scale = (None if all(v == 1.0 for v in scales) else torch.cat(
            [torch.full((n,), v, device="cpu") for n, v in zip(sections, scales, strict=True)]))
        self.out_proj = nn.Linear(m.inner_dim, hidden, bias=m.proj_bias)
        self.implementation: RecurrentImplementation = "torch"  # the runner sets it

    def forward(self, x: torch.Tensor, states: StateCache | None, meta: AttentionMetadata) -> torch.Tensor:
        m, tokens = self.m, x.shape[0]
        projected = self.in_proj(x if m.input_scale == 1.0 else x * m.input_scale)
        if self.projection_scale is not None:
            if self.projection_scale.device != projected.device or self.projection_scale.dtype != projected.dtype:
                self.projection_scale = self.projection_scale.to(projected.device, projected.dtype)
            projected = projected * self.projection_scale
        gate, mixed, dt = projected.split([m.inner_dim, m.conv_dim, m.num_heads], dim=-1)
        fresh = [seq_len == n for n, seq_len in zip(meta.query_lens, meta.seq_lens_host)]  # items at position 0
        if states is None:  # a probe forward: no sequence owns a state, each item gets its own zeros
            conv = torch.zeros(meta.num_seqs, m.conv_kernel - 1, m.conv_dim, dtype=x.dtype, device=x.device)
            ssm = torch.zeros(meta.num_seqs, *m.state_shape, device=x.device)
            slots, fresh = list(range(meta.num_seqs)), [True] * meta.num_seqs
        else:
            conv, stored = states.conv[self.state_index], states.ssm[self.state_index]
            assert stored is not None, "a Mamba2 layer's slots hold an SSM state"
            ssm, slots = stored, meta.state_slots
        convolved = F.silu(self.conv1d(mixed, conv, slots, fresh, meta)).float()
        xs, b, c = convolved.split([m.inner_dim, m.groups * m.state_size, m.groups * m.state_size], dim=-1)
        xs = xs.reshape(tokens, m.num_heads, m.head_dim)
        per_group = m.num_heads // m.groups
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*m.time_step_limit)  # [T, H]
        decay = dt * -torch.exp(self.A_log.float())  # log of each step's decay, [T, H]
        if self.implementation != "torch":
            y = torch.empty(tokens, m.num_heads, m.head_dim, dtype=torch.float32, device=x.device)
            b, c = (t.reshape(tokens, m.groups, m.state_size).contiguous() for t in (b, c))
            if self.implementation == "cpp":
                torch.ops.radixserve.mamba2_scan(xs.contiguous(), dt.contiguous(), decay.contiguous(), b, c, ssm,
                                                 slots, meta.query_lens, [int(f) for f in fresh], y)
            else:
                from radixserve.kernels.recurrent import mamba2_scan

                mamba2_scan(xs.contiguous(), dt.contiguous(), decay.contiguous(), b, c, ssm,
                            step_items(meta, slots, fresh, x.device), y)
            return self._output(x, xs, y, gate)
        b = b.reshape(tokens, m.groups, m.state_size).repeat_interleave(per_group, dim=1)  # [T, H, N]
        c = c.reshape(tokens, m.groups, m.state_size).repeat_interleave(per_group, dim=1)
        if meta.all_decode:
            index, keep = decode_slots(slots, fresh, torch.float32, x.device)
            state = ssm[index] * (keep[:, None, None, None] * torch.exp(decay)[:, :, None, None])
            state = state + (dt[:, :, None] * xs)[..., None] * b[:, :, None, :]
            ssm[index] = state
            y = (state * c[:, :, None, :]).sum(-1)
        else:
            outs, first = [], 0
            for n, slot, zero in zip(meta.query_lens, slots, fresh):
                span = slice(first, first + n)
                start = torch.zeros_like(ssm[slot]) if zero else ssm[slot]
                out, ssm[slot] = chunked_scan(xs[span], dt[span], decay[span], b[span], c[span], start)
                outs.append(out)
                first += n
            y = torch.cat(outs)
        return self._output(x, xs, y, gate)

    def _output(self, x: torch.Tensor, xs: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """The scan's outputs y [T, H, P] with the D skip of xs, gated (and normed), projected back."""
        y = (y + self.D.float()[:, None] * xs).reshape(x.shape[0], self.m.inner_dim)
        h = (y * F.silu(gate.float())).to(x.dtype) if self.norm is None else self.norm(y, gate, x.dtype)
        return self.out_proj(h)


def chunked_scan(xs: torch.Tensor, dt: torch.Tensor, decay: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                 state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's scan over n tokens from `state` [H, P, N]: xs [n, H, P]; dt and decay (log
    decay, dt * A) [n, H]; b, c [n, H, N]; fp32. Returns (outputs S C [n, H, P] without the D skip,
    the state after the last token)."""
    outs = []
    for first in range(0, xs.shape[0], chunk):
        x_, dt_, b_, c_ = (t[first:first + chunk] for t in (xs, dt, b, c))
        cum = decay[first:first + chunk].cumsum(0)  # [L, H]
        gap = cum[:, None, :] - cum[None, :, :]  # [t, s, H]: log decay from s to t
        causal = torch.ones(gap.shape[:2], dtype=torch.bool, device=gap.device).tril()
        weights = torch.exp(gap.masked_fill(~causal[..., None], float("-inf")))
        scores = torch.einsum("thn,shn->tsh", c_, b_) * weights * dt_[None, :, :]
        inner = torch.einsum("tsh,shp->thp", scores, x_)
        carried = torch.einsum("thn,hpn->thp", c_, state) * torch.exp(cum)[..., None]
        outs.append(inner + carried)
        to_end = torch.exp(cum[-1][None, :] - cum) * dt_  # [L, H]: each token's weight in the final state
        state = state * torch.exp(cum[-1])[:, None, None] + torch.einsum("sh,shp,shn->hpn", to_end, x_, b_)
    return torch.cat(outs), state


def recurrent_reference(xs: torch.Tensor, dt: torch.Tensor, decay: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                        state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunked_scan` token by token: the recurrence as written in the module docstring."""
    outs = []
    for t in range(xs.shape[0]):
        state = state * torch.exp(decay[t])[:, None, None] + (dt[t][:, None] * xs[t])[..., None] * b[t][:, None, :]
        outs.append((state * c[t][:, None, :]).sum(-1))
    return torch.stack(outs), state
