"""Turns logits rows into next tokens: greedy, temperature, top-k, top-p, seeded or not.

A row the sampler cannot draw from (the model produced NaN or +inf logits, or nothing finite) yields
None instead of a token, so the engine fails that one request and the rest of the batch goes on.
Greedy rows never touch a random generator. A seeded sequence samples from its own generator, so
its draws do not depend on which other requests share the batch (the logits themselves may differ
in the last bits with batch composition, which can flip a near-tie).
"""

from __future__ import annotations

import torch

from radixserve.sampling_params import SamplingParams


class Sampler:
    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator(device="cpu").manual_seed(seed)

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> list[int | None]:
        logits = logits.float()
        # one pass on the logits' device: a row's max is NaN if any logit is NaN, +inf if any is +inf,
        # -inf if all are; only these two numbers per row cross to the host for greedy rows
        if logits.numel():
            peak, argmax = logits.max(dim=-1)
        else:
            peak, argmax = logits.new_empty(0), logits.new_empty(0, dtype=torch.long)
        greedy, usable = argmax.tolist(), peak.isfinite().tolist()
        drawn = [i for i, p in enumerate(params) if usable[i] and not p.greedy]
        rows = dict(zip(drawn, logits[drawn].cpu())) if drawn else {}
        out: list[int | None] = []
        for i, p in enumerate(params):
            if not usable[i]:
                out.append(None)
            elif p.greedy:
                out.append(greedy[i])
            else:
                out.append(self._draw(self.probabilities(rows[i], p), generators[i] or self.generator))
        return out

    @staticmethod
    def _draw(probs: torch.Tensor, generator: torch.Generator) -> int | None:
        if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
            return None
        return int(torch.multinomial(probs, 1, generator=generator).item())

    @staticmethod
    def probabilities(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
        row = row / p.temperature
        if p.top_k and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # keep the smallest set whose mass reaches top_p (the first token always stays)
            drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
            probs /= probs.sum()
        return probs


def generator_for(params: SamplingParams, index: int) -> torch.Generator | None:
    """Seeded requests get their own generator per sample (sample i uses (seed + i) mod 2**64)."""
    seed = params.sample_seed(index)
    if seed is None or params.greedy:
        return None
    return torch.Generator(device="cpu").manual_seed(seed)
