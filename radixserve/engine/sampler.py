"""Turns a step's logits into next tokens on the logits' device, for the whole batch at once.

One call samples every draw of a step: rows with different settings share one set of tensor ops
(per-row temperature, top-k, top-p, min-p and random number held in tensors), greedy draws are the
exact argmax, and only the token ids, a usable flag and the asked-for logprobs cross to the host,
through one copy (`SampleResult.start_copy`) that the engine waits on when it needs the ids. Nothing
here waits on the device while sampling, except on CPU where there is nothing to wait for.

Filtering, after the grammar masks and the penalties (below), in this order and each renormalizing
what it keeps: temperature; min-p (drop tokens less likely than min_p x the most likely); top-k;
top-p (the smallest most-likely-first set whose mass reaches top_p; the most likely token always
stays). Each keeps a prefix of the tokens sorted by probability, so one sorted view serves all
three. On CUDA that view is a full sort (no host decision); on CPU, where sorting the vocabulary is
slow, it is the top `CANDIDATES[0]` tokens, and the rows whose kept set does not close inside them
are redone with the next, wider top-k, and finally a full sort, so the result is exact (a nucleus
of thousands of tokens, as a flat distribution has, costs a top-4096 rather than a sort).

Randomness: a draw takes one uniform number u and picks the token where the kept prefix's cumulative
mass crosses u x its total (inverse CDF; a draw with no filter walks the vocabulary in its own order
instead, which needs no sort, whatever else shares the batch). u is a counter-based hash of (the
sample's 64-bit key, the position being drawn), computed on the host, so a seeded sample's tokens do
not depend on what else shares the batch, the device, or the step it runs in (the logits may still
differ in their last bits with batch composition, which can flip a near-tie). A seeded sample's key is
(seed + sample index) mod 2**64; an unseeded one's comes from the engine's generator.

Logits edits: a step's features (engine/features.py) hand the sampler `edits`, applied in order to
one copy of each draw's row before anything else. Masks come first: structured output's `StepMasks`
(engine/grammar/) and the token rules (engine/token_rules.py: min_tokens, bad_words,
allowed_token_ids) set the logits of the tokens a draw may not take to -inf, on the device; draws
they do not cover are untouched, and logprobs still come from the raw logits.

Penalties: a step's `StepPenalties` (engine/penalties.py) then change the penalised draws' rows, on
the device and in this order: logit_bias added, repetition_penalty on every token of the prompt or the
output, frequency and presence penalties on the output's counts (each sequence's tokens and counts
are kept on the device by the engine's `PenaltyBook`, so nothing waits for the host). Everything after
(the usable test, the greedy argmax, temperature and the filters) sees the penalised row; logprobs do
not. A penalty reads only its own row, tokens and counts, so a seeded draw stays independent of the
batch. A step with no penalised draw pays nothing for them. With no edit in a step, draws read the
logits rows as they are (forks sharing one); with any, every draw gets its own copy of its row first.

A logits row with NaN or +inf, or nothing finite, is unusable: its draw yields token 0 on the
device (so a step that consumes it stays in range) and `usable` False, and the engine fails that
request alone. Logprobs are log-softmax of the raw logits (before masks, penalties, temperature and
filtering).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from radixserve.core import TokenLogprob
from radixserve.model.device import to_device
from radixserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from radixserve.engine.features import LogitsEdit

CANDIDATES = (256, 4096)  # sorted candidates per row on CPU, widening, before a full sort
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class Draw:
    row: int  # the logits row it samples from (n > 1 forks share their parent's row)
    params: SamplingParams
    key: int  # the sample's 64-bit noise key
    position: int  # the position of the token being drawn


def _mix64(x: int) -> int:
    """SplitMix64's finalizer: a bijection on 64-bit integers that scatters every input bit."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def uniform(key: int, position: int) -> float:
    """The draw's random number in [0, 1 - 2**-23]: 53 bits of a hash of (key, position). The cap
    keeps u x total strictly below a float32 total, so the inverse CDF never runs off the end."""
    u = (_mix64(_mix64(key & _MASK64) ^ (position * 0x9E3779B97F4A7C15 & _MASK64)) >> 11) * 2.0**-53
    return min(u, 1.0 - 2.0**-23)


@dataclass
class SampleResult:
    """A step's draws on the device; `start_copy` then `host` bring them to Python."""

    token_ids: torch.Tensor  # [D] int64 (0 where unusable)
    usable: torch.Tensor  # [D] bool
    logprob_draws: list[int]  # draw indices that asked for logprobs, in order
    logprob_counts: list[int]  # how many alternatives each of them asked for
    logprobs: torch.Tensor | None = None  # [L, 1 + k]: the chosen token's, then the top k's
    top_ids: torch.Tensor | None = None  # [L, k]
    _host: tuple[torch.Tensor, ...] | None = None
    _event: torch.cuda.Event | None = None
    _lists: tuple[list[int], list[bool], dict[int, TokenLogprob]] | None = None

    def start_copy(self) -> None:
        """Start moving the results to (pinned) host memory without waiting for the device."""
        tensors = [self.token_ids, self.usable.long()]
        extra = [t for t in (self.logprobs, self.top_ids) if t is not None]
        if self.token_ids.device.type != "cuda":
            self._host = tuple(tensors + extra)
            return
        self._host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                           for t in tensors + extra)
        self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self._event.record()

    def host(self) -> tuple[list[int], list[bool], dict[int, TokenLogprob]]:
        """(token ids, usable flags, logprobs by draw index); waits for the copy (once)."""
        if self._lists is None:
            self._lists = self._to_lists()
        return self._lists

    def _to_lists(self) -> tuple[list[int], list[bool], dict[int, TokenLogprob]]:
        if self._host is None:
            self.start_copy()
        if self._event is not None:
            self._event.synchronize()
        assert self._host is not None
        ids, usable = self._host[0].tolist(), [bool(u) for u in self._host[1].tolist()]
        out: dict[int, TokenLogprob] = {}
        if self.logprobs is not None:
            lps = self._host[2].tolist()
            tops = self._host[3].tolist() if self.top_ids is not None else [[] for _ in lps]
            for draw, k, lp, top in zip(self.logprob_draws, self.logprob_counts, lps, tops):
                out[draw] = TokenLogprob(ids[draw], lp[0], tuple(zip(top[:k], lp[1:k + 1])))
        return ids, usable, out


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, draws: list[Draw], edits: Sequence[LogitsEdit] = ()) -> SampleResult:
        """Sample every draw; `edits` (masks, penalties: engine/features.py) change, in order, a copy
        of each draw's row first."""
        dev = logits.device
        raw = x = logits.float()
        raw_rows = rows = to_device([d.row for d in draws], torch.long, dev)
        if edits:
            # one logits row per draw (forks share a row, not a grammar state or token counts), a copy:
            # `raw` stays the model's for logprobs
            x = x[rows]
            for edit in edits:
                edit.apply(x)
            rows = torch.arange(len(draws), device=dev)
            draws = [replace(d, row=i) for i, d in enumerate(draws)]
        if x.numel():
            peak, argmax = x.max(dim=-1)  # NaN if any logit is NaN, +inf if any is +inf, -inf if all are
        else:
            peak, argmax = x.new_empty(0), x.new_empty(0, dtype=torch.long)
        usable = peak.isfinite()[rows]
        tokens = argmax[rows]
        drawn = [i for i, d in enumerate(draws) if not d.params.greedy]
        if drawn:
            which = to_device(drawn, torch.long, dev)
            tokens.index_copy_(0, which, self._draw(x, [draws[i] for i in drawn]))
        tokens = torch.where(usable, tokens, torch.zeros_like(tokens))
        asked = [i for i, d in enumerate(draws) if d.params.logprobs is not None]
        result = SampleResult(tokens, usable, asked, [draws[i].params.logprobs or 0 for i in asked])
        if asked:  # one top-k for all of them, as wide as the widest ask; each keeps its own count
            self._logprobs(raw, raw_rows, result, max(result.logprob_counts))
        return result

    @staticmethod
    def _logprobs(x: torch.Tensor, rows: torch.Tensor, result: SampleResult, top: int) -> None:
        which = to_device(result.logprob_draws, torch.long, x.device)
        lsm = torch.log_softmax(x[rows[which]], dim=-1)
        chosen = lsm.gather(1, result.token_ids[which, None])
        if top:
            values, ids = lsm.topk(top, dim=-1)
            result.logprobs, result.top_ids = torch.cat([chosen, values], dim=1), ids
        else:
            result.logprobs = chosen

    def _draw(self, x: torch.Tensor, draws: list[Draw]) -> torch.Tensor:
        dev, vocab = x.device, x.shape[-1]
        # one host tensor, one copy: row, temperature, top-k (vocab when off), top-p, min-p, u
        table = to_device([[d.row, d.params.temperature, d.params.top_k or vocab, d.params.top_p, d.params.min_p,
                             uniform(d.key, d.position)] for d in draws], torch.float64, dev)
        p = table.T
        rows, temperature, top_k, top_p, min_p, u = p[0].long(), p[1].float(), p[2].long(), p[3].float(), \
            p[4].float(), p[5]
        scaled = x[rows] / temperature[:, None]
        # An unfiltered draw always takes `pick_unfiltered` (vocabulary order) and a filtered one `pick`
        # (sorted order): the same u maps to different tokens in the two, so which one a draw takes must
        # not depend on what else shares its batch.
        is_plain = [d.params.top_p >= 1.0 and not d.params.top_k and not d.params.min_p for d in draws]
        if all(is_plain):
            return pick_unfiltered(scaled, u)
        if not any(is_plain):
            return self._pick_filtered(scaled, top_k, top_p, min_p, u)
        plain = to_device([i for i, p in enumerate(is_plain) if p], torch.long, dev)
        filtered = to_device([i for i, p in enumerate(is_plain) if not p], torch.long, dev)
        tokens = torch.empty(len(draws), dtype=torch.long, device=dev)
        tokens[plain] = pick_unfiltered(scaled[plain], u[plain])
        tokens[filtered] = self._pick_filtered(scaled[filtered], top_k[filtered], top_p[filtered], min_p[filtered],
                                               u[filtered])
        return tokens

    @staticmethod
    def _pick_filtered(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                       u: torch.Tensor) -> torch.Tensor:
        dev, vocab = scaled.device, scaled.shape[-1]
        log_z = scaled.logsumexp(dim=-1, keepdim=True)
        if dev.type == "cuda":
            return pick(scaled, log_z, top_k, top_p, min_p, u, vocab)[0]
        tokens = torch.empty(scaled.shape[0], dtype=torch.long, device=dev)
        todo = torch.arange(scaled.shape[0], device=dev)
        for width in [w for w in CANDIDATES if w < vocab] + [vocab]:
            got, exact = pick(scaled[todo], log_z[todo], top_k[todo], top_p[todo], min_p[todo], u[todo], width)
            tokens[todo[exact]] = got[exact]
            todo = todo[~exact]
            if not todo.numel():  # CPU: no device to wait for, so deciding on the host is free
                break
        return tokens


def pick_unfiltered(scaled: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Draw from softmax(scaled) itself: the inverse CDF in vocabulary order needs no sort."""
    weights = torch.softmax(scaled, dim=-1).cumsum(dim=-1)
    target = (u[:, None] * weights[:, -1:].double()).to(weights.dtype)
    return torch.searchsorted(weights, target, right=True).clamp(max=scaled.shape[-1] - 1).squeeze(1)


def pick(scaled: torch.Tensor, log_z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
         u: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw from each row's filtered distribution using its `width` most likely tokens: (token ids,
    whether the row's kept set was decided inside them, i.e. the draw is exact)."""
    vocab = scaled.shape[-1]
    if width >= vocab:
        values, ids = scaled.sort(dim=-1, descending=True)
    else:
        values, ids = scaled.topk(width, dim=-1)
    probs = (values - log_z).exp()  # sorted, most likely first
    rank = torch.arange(values.shape[-1], device=scaled.device)
    capped = (rank < top_k[:, None]) & (probs >= min_p[:, None] * probs[:, :1])  # min-p, then top-k
    capped_mass = torch.where(capped, probs, 0.0).sum(dim=-1, keepdim=True)
    open_ended = capped[:, -1]  # the min-p / top-k set may continue past the candidates
    uncapped = (top_k >= vocab) & (min_p == 0)  # then its mass is the whole distribution's
    norm = torch.where(open_ended[:, None] & uncapped[:, None], torch.ones_like(capped_mass), capped_mass)
    kept_probs = torch.where(capped, probs, 0.0) / norm
    kept = capped & (kept_probs.cumsum(dim=-1) - kept_probs < top_p[:, None])
    kept[:, 0] = True
    weights = torch.where(kept, probs, 0.0).cumsum(dim=-1)
    num_kept = kept.sum(dim=-1, keepdim=True)
    target = (u[:, None] * weights[:, -1:].double()).to(weights.dtype)
    index = torch.searchsorted(weights, target, right=True).minimum(num_kept - 1)
    exact = (width >= vocab) | (~kept[:, -1] & (~open_ended | uncapped))
    return ids.gather(1, index).squeeze(1), exact
