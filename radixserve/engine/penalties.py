"""Presence, frequency and repetition penalties and logit_bias: each penalised sequence's tokens and
token counts, kept on the device, and their application to a step's logits (`apply_penalties`, which
the sampler calls right after the grammar masks).

Owns, per sequence of a penalised request (a row, taken at its first draw and given back when the
request retires): its generated-token counts, a [rows, vocab] float32 tensor, and its tokens in order,
prompt then output, a [rows, width] int64 tensor whose width grows with the longest penalised
sequence; and each penalised request's logit_bias as (token ids, biases) on the device. Rows and
width grow by doubling.

The formulas, per draw, in this order (x is the row after the grammar mask; counts are over the
sequence's generated tokens, as OpenAI counts them):
  logit_bias:  x[t] += bias[t]
  repetition:  for t in the prompt or generated (vLLM, transformers): x[t] / r if x[t] > 0 else x[t] * r
  frequency and presence:  x[t] -= frequency x count[t] + presence x [count[t] > 0]
Only tokens the sequence holds can be penalised, so a draw at position p gathers the logits of its
first p tokens (the token list, not the vocabulary: the cost is the sequence's length, not the
vocabulary's), penalises them and scatters them back; a token listed twice is written twice with the
same value. A -inf (masked) logit stays -inf and a finite one finite, so usability does not change.

Invariants:
- when a step's draws are sampled, a row holds every token its sequence had before the draw,
  committed or still in flight: `count_sampled` writes a step's sampled ids on the device right
  after sampling (into the counts, and into the token list at the draw's position, which the host
  knows), with no host wait, so with overlap the next step (launched before those ids reach the host)
  already sees them, the device running the two in order;
- what the host decides later is corrected at commit (`committed`), before the next launch: the
  tokens a grammar forces after a sampled one are counted and listed at their positions; a later draw
  they replace (void, still in flight: TokenCommit.replaces_in_flight) is uncounted, by its id on the
  device, and its place in the list is the first forced token's;
- a row is filled from the host's tokens when it is taken (at a first draw nothing is generated yet:
  an n > 1 fork starts as empty as its parent) and kept through preemption, swap or recompute alike:
  a sequence keeps its seq_id and its tokens. A penalised sequence does not draft (scheduler/drafts.py):
  the counts at each draft position would depend on the drafts before it being kept;
- nothing here runs while no penalised request is live (the book is falsy): such a step costs
  exactly what it did before penalties existed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from radixserve.core import PENDING_TOKEN, Request, Sequence
from radixserve.engine.features import LogitsFeature, SamplingStep
from radixserve.model.device import to_device
from radixserve.sampling_params import SamplingParams
from radixserve.scheduler.step_results import Launch, TokenCommit

if TYPE_CHECKING:
    from radixserve.engine.intake import ValidatedRequest

_FIRST_ROWS, _FIRST_WIDTH = 8, 256


@dataclass
class RequestBias:
    """A penalised request's logit_bias on the device (None: it has none), shared by its samples."""

    tokens: torch.Tensor | None = None  # [k] long
    values: torch.Tensor | None = None  # [k] float32


@dataclass(frozen=True)
class StepPenalties:
    """A step's penalised draws: `draws` [P] (indices into the step's draws) read book rows `slots`
    [P] and draw the tokens at `positions` [P] (each sees that many tokens, at most `width`). A part
    no draw of the step needs is None, and is skipped."""

    draws: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor
    width: int
    counts: torch.Tensor  # the book's [rows, vocab] counts, as of this step
    tokens: torch.Tensor  # the book's [rows, width] token lists
    repetition: torch.Tensor | None = None  # [P, 1] float32 (1 where off)
    frequency: torch.Tensor | None = None  # [P, 1] float32 (0 where off)
    presence: torch.Tensor | None = None  # [P, 1] float32
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (index in P, token, bias), flat

    def apply(self, x: torch.Tensor) -> None:
        apply_penalties(x, self)


@dataclass(eq=False)
class PenaltyBook(LogitsFeature):
    """The penalties as a logits feature (engine/features.py): its rows join a step's edits after the
    masks, and the sampled and committed tokens are counted as above."""

    vocab_size: int
    device: torch.device
    counts: torch.Tensor = field(init=False)
    tokens: torch.Tensor = field(init=False)
    _biases: dict[str, RequestBias] = field(default_factory=dict)  # live penalised requests by id
    _slots: dict[int, int] = field(default_factory=dict)  # seq_id -> its row
    _free: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.counts = torch.zeros(0, self.vocab_size, dtype=torch.float32, device=self.device)
        self.tokens = torch.zeros(0, _FIRST_WIDTH, dtype=torch.long, device=self.device)

    def __bool__(self) -> bool:
        return bool(self._biases)

    allows_drafts = False  # the counts at each draft position would depend on the drafts before it

    def applies(self, params: SamplingParams) -> bool:
        return params.has_penalties

    def begin(self, req: Request, request: ValidatedRequest | None = None) -> None:
        """A request whose params `has_penalties` enters the engine (its ids were checked by the intake)."""
        bias = req.params.logit_bias
        self._biases[req.request_id] = RequestBias(
            to_device(list(bias), torch.long, self.device), to_device(list(bias.values()), torch.float32, self.device)
        ) if bias else RequestBias()

    def release(self, req: Request) -> None:
        """The request retired: its samples' rows are free (a later taker overwrites what it reads)."""
        if self._biases.pop(req.request_id, None) is not None:
            for seq in req.sequences:
                slot = self._slots.pop(seq.seq_id, None)
                if slot is not None:
                    self._free.append(slot)

    # -- the feature's stages ------------------------------------------------------------------------
    def contribute(self, step: SamplingStep) -> None:
        penalties = self.step(step.owners, [draw.position for draw in step.draws]) if self else None
        if penalties is not None:
            step.edits.append(penalties)
            step.keep(penalties)

    def sampled(self, step: SamplingStep) -> None:
        penalties = step.part(StepPenalties)
        if penalties is not None and step.sampled is not None:  # on the device, before the next step samples
            self.count_sampled(penalties, step.sampled.token_ids)

    def after_commit(self, step: SamplingStep, voided: set[tuple[int, int]], later: SamplingStep | None) -> None:
        """Forced tokens counted, the draws they made void uncounted."""
        if self:
            in_flight = None if later is None or later.sampled is None else (later.launch, later.sampled.token_ids)
            self.committed(step.launch, step.commits, voided, in_flight)

    # -- a step ------------------------------------------------------------------------------------
    def step(self, owners: list[Sequence], positions: list[int]) -> StepPenalties | None:
        """The penalties of a launched step whose draw i samples `owners[i]`'s token at `positions[i]`;
        None when none of them is penalised. A sequence drawing for the first time takes its row here."""
        picked: list[tuple[int, int, int, SamplingParams, RequestBias]] = []
        for i, (seq, position) in enumerate(zip(owners, positions)):
            bias = self._biases.get(seq.request.request_id)
            if bias is not None:
                slot = self._slots.get(seq.seq_id)
                picked.append((i, self._take(seq) if slot is None else slot, position, seq.request.params, bias))
        if not picked:
            return None
        width = max(position for _, _, position, _, _ in picked)
        self._widen(width + 1)  # the draw's own id is written at its position
        # one host table, one copy: draw, row, position, repetition, frequency, presence
        table = to_device([[i, slot, position, p.repetition_penalty, p.frequency_penalty, p.presence_penalty]
                           for i, slot, position, p, _ in picked], torch.float64, self.device).T
        wants_repetition = any(p.repetition_penalty != 1.0 for *_, p, _ in picked)
        wants_counts = any(p.frequency_penalty or p.presence_penalty for *_, p, _ in picked)
        return StepPenalties(
            table[0].long(), table[1].long(), table[2].long(), width, self.counts, self.tokens,
            repetition=table[3].float()[:, None] if wants_repetition else None,
            frequency=table[4].float()[:, None] if wants_counts else None,
            presence=table[5].float()[:, None] if wants_counts else None,
            bias=self._step_bias([b for *_, b in picked]))

    def _step_bias(self, biases: list[RequestBias]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        rows = [(k, b.tokens, b.values) for k, b in enumerate(biases) if b.tokens is not None and b.values is not None]
        if not rows:
            return None
        sizes = [t.numel() for _, t, _ in rows]
        # repeat_interleave with the output size given never waits for the device
        where = torch.repeat_interleave(to_device([k for k, _, _ in rows], torch.long, self.device),
                                        to_device(sizes, torch.long, self.device), output_size=sum(sizes))
        return where, torch.cat([t for _, t, _ in rows]), torch.cat([v for _, _, v in rows])

    def count_sampled(self, step: StepPenalties, token_ids: torch.Tensor) -> None:
        """The step's draws sampled `token_ids` ([D], on the device): list and count the penalised ones'."""
        self._put(step.slots, step.positions, token_ids[step.draws], 1.0)

    def committed(self, launch: Launch, commits: list[TokenCommit], voided: set[tuple[int, int]],
                  later: tuple[Launch, torch.Tensor] | None) -> None:
        """A step's commits are done: list and count the tokens a grammar forced after a sampled one
        (the host's alone: the sampled one is on the device already), and uncount the draws of the
        step still in flight, `later` (its launch and sampled ids), that the scheduler made void:
        `voided` holds their (seq_id, position)."""
        slots: list[int] = []
        positions: list[int] = []
        tokens: list[int] = []
        for seq, position, commit in zip(launch.owners, launch.positions, commits):
            slot = self._slots.get(seq.seq_id)
            if slot is not None and len(commit.tokens) > 1:
                slots += [slot] * (len(commit.tokens) - 1)
                positions += range(position + 1, position + len(commit.tokens))
                tokens += commit.tokens[1:]
        if tokens:
            self._widen(max(positions) + 1)
            self._put(to_device(slots, torch.long, self.device), to_device(positions, torch.long, self.device),
                      to_device(tokens, torch.long, self.device), 1.0)
        if voided and later is not None:
            owners = later[0].owners
            draws = [j for j, (seq, position) in enumerate(zip(owners, later[0].positions))
                     if (seq.seq_id, position) in voided and seq.seq_id in self._slots]
            if draws:
                which = to_device(draws, torch.long, self.device)
                void_slots = to_device([self._slots[owners[j].seq_id] for j in draws], torch.long, self.device)
                self.counts.index_put_((void_slots, later[1][which]), self._amounts(len(draws), -1.0), accumulate=True)

    def counts_of(self, seq: Sequence) -> Counter[int] | None:
        """`seq`'s counted tokens as the device holds them (waits for it: tests and debugging only)."""
        slot = self._slots.get(seq.seq_id)
        if slot is None:
            return None
        row = self.counts[slot].cpu()
        return Counter({int(t): int(row[t]) for t in row.nonzero().flatten().tolist()})

    def tokens_of(self, seq: Sequence, length: int) -> list[int] | None:
        """`seq`'s first `length` listed tokens as the device holds them (tests and debugging only)."""
        slot = self._slots.get(seq.seq_id)
        return None if slot is None else [int(t) for t in self.tokens[slot, :length].tolist()]

    # -- rows --------------------------------------------------------------------------------------
    def _take(self, seq: Sequence) -> int:
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self._slots[seq.seq_id] = slot
        self.counts[slot].zero_()
        # the prompt, and what the host knows of the output: nothing at a first draw (an earlier token
        # still in flight would be a draw before it), listed anyway so a row always matches the host
        known = [t for t in seq.token_ids if t != PENDING_TOKEN]
        self._widen(len(known) + 1)
        self.tokens[slot, :len(known)] = to_device(known, torch.long, self.device)
        generated = known[seq.num_prompt_tokens:]
        if generated:
            self.counts.index_put_((to_device([slot] * len(generated), torch.long, self.device),
                                    to_device(generated, torch.long, self.device)),
                                   self._amounts(len(generated), 1.0), accumulate=True)
        return slot

    def _grow(self) -> None:
        rows = self.counts.shape[0]
        more = max(_FIRST_ROWS, rows)
        self.counts = torch.cat([self.counts, self.counts.new_zeros(more, self.vocab_size)])
        self.tokens = torch.cat([self.tokens, self.tokens.new_zeros(more, self.tokens.shape[1])])
        self._free += range(rows + more - 1, rows - 1, -1)  # lowest first off the end of the list

    def _widen(self, width: int) -> None:
        if width > self.tokens.shape[1]:
            wider = max(width, 2 * self.tokens.shape[1])
            self.tokens = torch.cat([self.tokens, self.tokens.new_zeros(self.tokens.shape[0], wider - self.tokens.shape[1])],
                                    dim=1)

    def _put(self, slots: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor, amount: float) -> None:
        """List `tokens` at `positions` of rows `slots`, and count them."""
        self.tokens.index_put_((slots, positions), tokens)
        self.counts.index_put_((slots, tokens), self._amounts(slots.numel(), amount), accumulate=True)

    def _amounts(self, n: int, amount: float) -> torch.Tensor:
        return torch.full((n,), amount, dtype=torch.float32, device=self.device)


def apply_penalties(x: torch.Tensor, step: StepPenalties) -> None:
    """Penalise, in place, the rows `step.draws` of `x` (one logits row per draw, grammar masks applied)."""
    if step.bias is not None:
        which, tokens, values = step.bias
        x.index_put_((step.draws[which], tokens), values, accumulate=True)
    if step.repetition is None and step.frequency is None:
        return
    listed = step.tokens.index_select(0, step.slots)[:, :step.width]
    # a draw sees only the tokens before its position; the columns after it repeat its first token
    # (a prompt token, which it sees anyway), so they write that token's own value again
    before = torch.arange(step.width, device=x.device) < step.positions[:, None]
    listed = torch.where(before, listed, listed[:, :1])
    rows = step.draws[:, None]
    y = x[rows, listed]
    if step.repetition is not None:
        r = step.repetition
        y = torch.where(y > 0, y / r, y * r)
    if step.frequency is not None and step.presence is not None:
        counts = step.counts.view(-1)[step.slots[:, None] * step.counts.shape[1] + listed]
        y = y - (counts * step.frequency + (counts > 0) * step.presence)
    x[rows, listed] = y
