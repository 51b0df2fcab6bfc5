"""Token rules a request sets on what may be sampled, as logits features (engine/features.py):
`min_tokens` (vLLM's: neither EOS, unless ignore_eos, nor a stop_token_ids id may be sampled before
the reply has that many tokens), `bad_words` (vLLM's: a banned token sequence is never completed: its
last token is masked wherever the tokens before it were just generated; a one-token word is always
masked) and `allowed_token_ids` (only these ids may be sampled).

Owns, per live request a rule applies to, what its draws need: the stop ids it masks, its banned
token sequences (tokenized by the intake: `bad_words_ids`), its allowed ids on the device.

Invariants:
- a rule is a mask: the masked logits are -inf on one copy of each draw's row (the sampler's), so
  logprobs still read the model's own row; a row that nothing is left in is unusable and fails its
  request alone, as any such row does;
- each rule decides a draw from the position it samples and the tokens before it (the request's
  params never change), so every rule allows drafts: a verifying draw's extra rows are masked at
  their own positions, after the drafts before them, and what verification keeps obeys the rule;
- bad_words reads the generated tokens before a draw: with overlap the one just before it may still
  be on the device, and is waited for (`SamplingStep.pending`), only when the request has a banned
  sequence longer than one token;
- nothing here runs while no live request has a rule (each feature is falsy): a step then costs
  what it did before the rules existed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from radixserve.core import PENDING_TOKEN, Request, Sequence
from radixserve.engine.features import LogitsFeature, SamplingStep
from radixserve.model.device import to_device
from radixserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from radixserve.engine.intake import ValidatedRequest


@dataclass(frozen=True)
class BannedTokens:
    """A step's banned (draw, token) pairs, flat: the logits of `tokens[j]` in row `draws[j]` are -inf."""

    draws: torch.Tensor
    tokens: torch.Tensor

    def apply(self, x: torch.Tensor) -> None:
        x.index_put_((self.draws, self.tokens), x.new_full((1,), float("-inf")))  # a fill: no host copy


@dataclass(frozen=True)
class AllowedTokens:
    """A step's allow-lists: in each group's rows every logit but its ids' is -inf."""

    groups: list[tuple[torch.Tensor, torch.Tensor]]  # (draw rows [r], allowed ids [a])

    def apply(self, x: torch.Tensor) -> None:
        for rows, ids in self.groups:
            where = (rows[:, None], ids[None, :])
            kept = x[where]
            x.index_fill_(0, rows, float("-inf"))
            x[where] = kept


def _ban(step: SamplingStep, pairs: list[tuple[int, int]], device: torch.device) -> None:
    """Add the (draw, token) pairs to the step's edits as one BannedTokens (none when empty)."""
    if pairs:
        step.edits.append(BannedTokens(to_device([d for d, _ in pairs], torch.long, device),
                                       to_device([t for _, t in pairs], torch.long, device)))


@dataclass(eq=False)
class MinTokens(LogitsFeature):
    """min_tokens: a draw at generated index g < min_tokens has its request's stop ids masked."""

    eos_token_ids: frozenset[int]
    device: torch.device
    _stops: dict[Request, list[int]] = field(default_factory=dict)

    allows_drafts = True

    def __bool__(self) -> bool:
        return bool(self._stops)

    def stop_ids(self, params: SamplingParams) -> list[int]:
        """What would end the reply on its own: EOS (unless ignored) and the stop ids."""
        eos = () if params.ignore_eos else sorted(self.eos_token_ids)
        return sorted({*eos, *params.stop_token_ids})

    def applies(self, params: SamplingParams) -> bool:
        return params.min_tokens > 0 and bool(params.stop_token_ids or not params.ignore_eos)

    def begin(self, req: Request, request: ValidatedRequest) -> None:
        self._stops[req] = self.stop_ids(req.params)

    def release(self, req: Request) -> None:
        self._stops.pop(req, None)

    def contribute(self, step: SamplingStep) -> None:
        if not self:
            return
        pairs: list[tuple[int, int]] = []
        for d, (seq, draw) in enumerate(zip(step.owners, step.draws)):
            stops = self._stops.get(seq.request)
            if stops is not None and draw.position - seq.num_prompt_tokens < draw.params.min_tokens:
                pairs += [(d, token) for token in stops]
        _ban(step, pairs, self.device)


@dataclass(eq=False)
class BadWords(LogitsFeature):
    """bad_words: a draw masks the last token of each banned sequence whose other tokens end the
    generated tokens before it."""

    device: torch.device
    _words: dict[Request, tuple[tuple[int, ...], ...]] = field(default_factory=dict)

    allows_drafts = True

    def __bool__(self) -> bool:
        return bool(self._words)

    def applies(self, params: SamplingParams) -> bool:
        return bool(params.bad_words)

    def begin(self, req: Request, request: ValidatedRequest) -> None:
        self._words[req] = request.bad_words_ids

    def release(self, req: Request) -> None:
        self._words.pop(req, None)

    def contribute(self, step: SamplingStep) -> None:
        if not self:
            return
        pairs: list[tuple[int, int]] = []
        for d, (seq, draw) in enumerate(zip(step.owners, step.draws)):
            words = self._words.get(seq.request)
            if words:
                pairs += [(d, token) for token in self._banned_at(seq, draw.position, words, step)]
        _ban(step, pairs, self.device)

    @staticmethod
    def _banned_at(seq: Sequence, position: int, words: tuple[tuple[int, ...], ...], step: SamplingStep) -> list[int]:
        """The last tokens of the `words` a draw of `seq` at `position` would complete."""
        longest = max(len(w) for w in words) - 1
        before = seq.token_ids[max(seq.num_prompt_tokens, position - longest):position]  # generated tokens only
        if before and before[-1] == PENDING_TOKEN:  # the previous step's token, still on the device
            pending = step.pending(seq)
            before[-1] = PENDING_TOKEN if pending is None else pending
        return [w[-1] for w in words
                if len(w) == 1 or (len(w) - 1 <= len(before) and tuple(before[len(before) - len(w) + 1:]) == w[:-1])]


@dataclass(eq=False)
class AllowedTokenIds(LogitsFeature):
    """allowed_token_ids: every draw of the request samples among its ids only."""

    device: torch.device
    _allowed: dict[Request, torch.Tensor] = field(default_factory=dict)

    allows_drafts = True

    def __bool__(self) -> bool:
        return bool(self._allowed)

    def applies(self, params: SamplingParams) -> bool:
        return params.allowed_token_ids is not None

    def begin(self, req: Request, request: ValidatedRequest) -> None:
        assert req.params.allowed_token_ids is not None
        self._allowed[req] = to_device(sorted(set(req.params.allowed_token_ids)), torch.long, self.device)

    def release(self, req: Request) -> None:
        self._allowed.pop(req, None)

    def contribute(self, step: SamplingStep) -> None:
        if not self:
            return
        rows: dict[Request, list[int]] = {}
        for d, seq in enumerate(step.owners):
            if seq.request in self._allowed:
                rows.setdefault(seq.request, []).append(d)
        if rows:
            step.edits.append(AllowedTokens([(to_device(draws, torch.long, self.device), self._allowed[req])
                                             for req, draws in rows.items()]))


def bad_words_ids(tokenizer: Any, words: list[str]) -> tuple[tuple[int, ...], ...]:
    """Each word's token sequences: the word (its leading spaces stripped), then the word after one
    space (a word in mid-text) unless that is only a space token before the bare word's tokens, which
    the bare sequence already bans. vLLM also drops a spaced form of another length (" fox" one token,
    "fox" two), which lets the mid-text word through; we ban it."""
    found: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if not bare:
            continue  # only spaces: nothing to ban
        found += [bare] if bare not in found else []
        if spaced and spaced[-len(bare):] != bare and spaced not in found:
            found.append(spaced)
    return tuple(found)
