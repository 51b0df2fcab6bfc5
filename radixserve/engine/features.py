"""The seam in the engine's step for per-request logits features: one protocol (`LogitsFeature`) that
grammar masks, penalties, prompt logprobs, draft verification and the token rules (min_tokens,
bad_words, allowed_token_ids) implement, the step they build and read together (`SamplingStep`), and
the ordered set the engine loops over (`LogitsFeatures`).

A feature's life with one request: `applies(params)` decides whether it keeps state for it; then
`begin` (the request is admitted), and `release` (it finished, was aborted or failed). Its part in
each step, stage by stage, always in the set's order:
  ask_forward   before the forward: extra outputs the forward computes (prompt-logprob rows);
  contribute    once the scheduler launched the step: extra sampler draws (a verifying draw's rows),
                logits edits (masks, penalties) and requests that fail here (a grammar's dead end);
  sampled       the step's ids are sampled, still on the device (penalty counts follow them there);
  resolve       the ids are on the host: rewrite the step's commits (forced tokens, verified drafts)
                and take what the forward asked for;
  after_commit  the scheduler committed the step (`voided`: later draws its commits replaced);
  stops         per committed token, in order: the feature's part of the stop test;
  add_to_output what the feature hands out with a request's output (prompt logprobs).

Invariants:
- the order of `LogitsFeatures.all` is the order of every stage: the verifier first (its extra draws
  exist before any mask is built over the draws), masks before penalties (the sampler applies
  `edits` in the order they were added, to one copy of each draw's row; logprobs read the raw row);
- a stage calls only the features that define it (`LogitsFeatures` finds them once, at build), so a
  stage none of the live features take part in costs one empty loop;
- which requests may draft is derived from the features: a request some feature applies to, whose
  `allows_drafts` is False, never drafts (`draft_vetoes`, handed to scheduler/drafts.py). A feature
  that allows drafts builds its edits for every draw of `SamplingStep.draws`, a verifying draw's
  extra rows included, at the position each one samples, so verification samples what the
  request's rules allow.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch

from radixserve.core import Batch, Request, RequestOutput, Sequence, TokenLogprob
from radixserve.engine.sampler import Draw, SampleResult
from radixserve.model.runner import RowLogprobs
from radixserve.sampling_params import SamplingParams
from radixserve.scheduler.step_results import Launch, TokenCommit

if TYPE_CHECKING:
    from radixserve.engine.intake import ValidatedRequest

# what a request whose logits row was unusable is told (engine.py re-exports it)
INVALID_LOGITS = "the model produced non-finite logits for this request"
STAGES = ("ask_forward", "contribute", "sampled", "resolve", "after_commit", "stops", "add_to_output")

PartT = TypeVar("PartT")
FeatureT = TypeVar("FeatureT")


class LogitsEdit(Protocol):
    """A change to a step's logits, in place: `x` holds one float row per sampler draw (a copy)."""

    def apply(self, x: torch.Tensor) -> None: ...


@dataclass
class SamplingStep:
    """One launched step as the features build and read it. Before the forward: the `batch`, and the
    rows `asked` of it. Once launched: the sampler's `draws`, the launch's own first, in order (draw i
    is launch draw i, the index every reader of the sampled ids uses), then the extra rows features
    add; `owners[d]` is the sequence draw d samples, `draws[d].position` the position it draws (a
    verifying draw's own row draws the first draft's position). Once resolved: the host's `ids`,
    `usable` flags and `logprobs` by draw, and one TokenCommit per launch draw in `commits`."""

    batch: Batch
    pending: Callable[[Sequence], int | None]  # an id of `seq` still on the device (waits for it)
    asked: RowLogprobs | None = None
    launch: Launch = field(default_factory=Launch)
    draws: list[Draw] = field(default_factory=list)
    owners: list[Sequence] = field(default_factory=list)
    failed: dict[Request, str] = field(default_factory=dict)
    edits: list[LogitsEdit] = field(default_factory=list)
    sampled: SampleResult | None = None
    ids: list[int] = field(default_factory=list)
    usable: list[bool] = field(default_factory=list)
    logprobs: dict[int, TokenLogprob] = field(default_factory=dict)
    commits: list[TokenCommit] = field(default_factory=list)
    _parts: dict[type, object] = field(default_factory=dict)

    def launched(self, launch: Launch, failed: dict[Request, str]) -> None:
        """The scheduler launched the step: one draw per launch draw, at the position it samples."""
        self.launch, self.failed, self.owners = launch, dict(failed), list(launch.owners)
        self.draws = [Draw(row, seq.request.params, seq.noise_key, position - k)
                      for seq, row, position, k in zip(launch.owners, launch.rows, launch.positions, launch.drafts)]

    def add_draw(self, seq: Sequence, draw: Draw) -> int:
        """An extra draw after the launch's own (a verifying draw's row); returns its index."""
        self.draws.append(draw)
        self.owners.append(seq)
        return len(self.draws) - 1

    def keep(self, part: object) -> None:
        """A feature's own part of this step (one per type), for its later stages."""
        self._parts[type(part)] = part

    def part(self, kind: type[PartT]) -> PartT | None:
        found = self._parts.get(kind)
        return found if isinstance(found, kind) else None

    def to_host(self) -> None:
        """Wait for the sampled ids; a draw whose row was unusable fails its request; each draw's
        commit is its sampled token (and logprob), until a feature's `resolve` rewrites it."""
        self.ids, self.usable, self.logprobs = self.sampled.host() if self.sampled is not None else ([], [], {})
        self.failed.update((seq.request, INVALID_LOGITS) for seq, ok in zip(self.launch.owners, self.usable) if not ok)
        self.commits = [TokenCommit((token,), (self.logprobs[i],) if i in self.logprobs else ())
                        for i, (_, token) in enumerate(zip(self.launch.owners, self.ids))]


class LogitsFeature(Protocol):
    """A per-request logits feature. Every hook but `applies` has a neutral default; a feature
    defines the stages it takes part in (the module docstring gives their order and meaning)."""

    allows_drafts: bool  # may a request this feature applies to draft (and be verified)?

    def applies(self, params: SamplingParams) -> bool:
        """Does this feature keep state for a request with `params` (then begin/release are called)?"""
        ...

    def begin(self, req: Request, request: ValidatedRequest) -> None:
        return None

    def ask_forward(self, step: SamplingStep) -> None:
        return None

    def contribute(self, step: SamplingStep) -> None:
        return None

    def sampled(self, step: SamplingStep) -> None:
        return None

    def resolve(self, step: SamplingStep) -> None:
        return None

    def after_commit(self, step: SamplingStep, voided: set[tuple[int, int]], later: SamplingStep | None) -> None:
        return None

    def stops(self, seq: Sequence, stopping: bool) -> bool:
        return False

    def add_to_output(self, req: Request, out: RequestOutput) -> None:
        return None

    def violation(self, req: Request) -> str | None:
        """Why this feature ended `req` (finish_reason "error"), if it did."""
        return None

    def release(self, req: Request) -> None:
        return None


def _takes_part(feature: LogitsFeature, stage: str) -> bool:
    return getattr(type(feature), stage) is not getattr(LogitsFeature, stage)


class LogitsFeatures:
    """The engine's features in stage order, and each stage's loop over those that define it."""

    def __init__(self, features: Iterable[LogitsFeature]) -> None:
        self.all = tuple(features)
        self._at = {stage: tuple(f for f in self.all if _takes_part(f, stage)) for stage in STAGES}

    def of_type(self, kind: type[FeatureT]) -> FeatureT:
        """The feature of type `kind` (for what only it answers: a grammar's counters, a book's rows)."""
        return next(f for f in self.all if isinstance(f, kind))

    def draft_vetoes(self) -> tuple[Callable[[SamplingParams], bool], ...]:
        """What keeps a request from drafting: each feature that applies to it and allows no drafts."""
        return tuple(f.applies for f in self.all if not f.allows_drafts)

    def begin(self, req: Request, request: ValidatedRequest) -> None:
        for feature in self.all:
            if feature.applies(req.params):
                feature.begin(req, request)

    def release(self, req: Request) -> None:
        for feature in self.all:
            if feature.applies(req.params):
                feature.release(req)

    def ask_forward(self, step: SamplingStep) -> None:
        for feature in self._at["ask_forward"]:
            feature.ask_forward(step)

    def contribute(self, step: SamplingStep) -> None:
        if step.draws:
            for feature in self._at["contribute"]:
                feature.contribute(step)

    def sampled(self, step: SamplingStep) -> None:
        for feature in self._at["sampled"]:
            feature.sampled(step)

    def resolve(self, step: SamplingStep) -> None:
        for feature in self._at["resolve"]:
            feature.resolve(step)

    def after_commit(self, step: SamplingStep, voided: set[tuple[int, int]], later: SamplingStep | None) -> None:
        for feature in self._at["after_commit"]:
            feature.after_commit(step, voided, later)

    def stops(self, seq: Sequence, stopping: bool) -> bool:
        """Every feature's part of the stop test sees the token (none is skipped once one stops)."""
        stopped = False
        for feature in self._at["stops"]:
            stopped = feature.stops(seq, stopping) or stopped
        return stopped

    def add_to_output(self, req: Request, out: RequestOutput) -> None:
        for feature in self._at["add_to_output"]:
            feature.add_to_output(req, out)

    def violation(self, req: Request) -> str | None:
        return next((why for f in self.all if f.applies(req.params) and (why := f.violation(req)) is not None), None)
