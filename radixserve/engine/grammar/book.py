"""Each constrained sequence's matcher, the step's allowed-token masks, and forced tokens.

Owns: one llguidance matcher per live constrained sequence (keyed by seq_id; n > 1 forks get their
own, created from the request's compiled grammar when they first draw, before they generated
anything), the host bitmask buffers, and the constraint counters.

Invariants:
- a matcher has consumed exactly the sequence's generated tokens before the mask of its next draw
  is computed: tokens are consumed in order, by generated index, at most once (`_consume` is
  idempotent per index). With overlap the previous step's token is still on the device when the
  next step is launched: `masks` waits for that step's ids (the device meanwhile runs the forward
  just queued) and consumes the token early; the commit then finds it consumed;
- the stop test (`on_commit`) is called once per committed token, in order: it ends the sequence at
  the token that completed the grammar, and raises GrammarViolation at a token the grammar rejected;
- forced tokens follow the committed token at once; with overlap the sequence's next draw is already
  in flight and they replace it (its step's work for that row is dropped, which costs less than one
  step per forced token); never for a request that asked for logprobs (a forced token has none);
- constraints cover generated tokens only: a prefix-cache hit, a preemption (swap or recompute) or a
  resumption leave a matcher as it is, since the sequence's generated tokens do not change;
- masks are filled on the host into one of two buffers, alternately (a step's copy to the device may
  still be in flight while the next step fills the other), and only constrained rows are masked. A
  mask's work is bounded by the matcher's limits (engine/grammar/limits.py: step fuel and items); a
  matcher that hits one, or errs in any way, ends its request alone with finish_reason "error" and
  our message, and its grammar leaves the compiler's cache with the lexer memory it built;
- a constrained reply is checked at its end: one that stopped (EOS, a stop string or id) where its
  grammar is not complete ends with "error", never "stop" (`on_commit`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.torch
import torch

from radixserve.core import PENDING_TOKEN, Request, Sequence
from radixserve.engine.features import LogitsFeature, SamplingStep
from radixserve.engine.grammar.compiler import GrammarCompiler
from radixserve.errors import TokenRefused
from radixserve.sampling_params import SamplingParams
from radixserve.scheduler.step_results import TokenCommit

if TYPE_CHECKING:
    from radixserve.engine.grammar.compiler import CompiledGrammar
    from radixserve.engine.intake import ValidatedRequest

log = logging.getLogger(__name__)


class GrammarViolation(TokenRefused):
    """A committed token the sequence's grammar does not allow (its request ends with this message)."""


LIMIT_HIT = ("the constraint needed more than the engine's grammar limits allow at this point of the reply "
             "(see docs/structured_output.md)")
DEAD_END = "the grammar allows no token here (a dead end): the reply cannot be completed"


@dataclass
class SeqMatcher:
    matcher: Any  # llguidance.LLMatcher
    consumed: int = 0  # generated tokens the matcher took
    committed: int = 0  # generated tokens the stop test saw
    end: int | None = None  # the grammar was complete after this many generated tokens
    broken_at: int | None = None  # the matcher rejected the token with this generated index
    why: str = ""
    accepting: set[int] = field(default_factory=set)  # after these many generated tokens the grammar could end


@dataclass
class ConstraintStats:
    requests: int = 0  # constrained requests started
    mask_steps: int = 0  # steps that masked at least one row
    mask_rows: int = 0
    mask_s: float = 0.0  # host time filling masks (with overlap: while the device runs the forward)
    forced_tokens: int = 0  # tokens appended because the grammar allowed nothing else
    dead_ends: int = 0  # requests ended because their grammar allowed no token (or rejected one)


@dataclass
class StepMasks:
    """A step's masks: `draws` (device long) are the constrained draw indices, `bitmask` (device int32,
    one row per constrained draw, 32 tokens per word) their allowed tokens."""

    draws: torch.Tensor
    bitmask: torch.Tensor
    dead: dict[Request, str] = field(default_factory=dict)  # requests whose grammar allows no token here

    def apply(self, x: torch.Tensor) -> None:
        apply_token_bitmask(x, self)


def hit_a_limit(matcher: Any) -> bool:
    """Whether an errored matcher stopped at one of its limits (llguidance's words for them), not at a
    token its grammar rejects."""
    error = str(matcher.get_error()).lower()
    return any(word in error for word in ("too many", "limit", "fuel", "too large", "too complex"))


class ConstraintBook(LogitsFeature):
    """Structured output as a logits feature (engine/features.py): masks join a step's edits first,
    forced tokens rewrite its commits, and `stops` is the constraint's part of the stop test."""

    allows_drafts = False  # each draft position's mask would need the matcher advanced through the drafts

    def __init__(self, compiler: GrammarCompiler, vocab_size: int, device: torch.device, forced_tokens: bool) -> None:
        self.compiler, self.vocab_size, self.device = compiler, vocab_size, device
        self.forced_tokens = forced_tokens
        self.stats = ConstraintStats()
        self._grammars: dict[str, CompiledGrammar] = {}  # request id -> its compiled grammar
        self._matchers: dict[int, SeqMatcher] = {}  # seq_id -> its matcher
        self._buffers: list[torch.Tensor] = []
        self._flip = 0
        self._executor = llguidance.LLExecutor()

    def __bool__(self) -> bool:
        return bool(self._grammars)

    def applies(self, params: SamplingParams) -> bool:
        return params.structured is not None

    def begin(self, req: Request, request: ValidatedRequest) -> None:
        """A constrained request enters the engine with the grammar its check compiled (None: a request
        that crossed a process without it; compiled or found here)."""
        assert req.params.structured is not None
        grammar: CompiledGrammar | None = request.grammar
        self._grammars[req.request_id] = grammar or self.compiler.ensure(req.params.structured,
                                                                         req.params.cache_namespace)
        self.stats.requests += 1

    def release(self, req: Request) -> None:
        if self._grammars.pop(req.request_id, None) is not None:
            for seq in req.sequences:
                self._matchers.pop(seq.seq_id, None)

    def _state(self, seq: Sequence) -> SeqMatcher | None:
        state = self._matchers.get(seq.seq_id)
        if state is None:
            grammar = self._grammars.get(seq.request.request_id)
            if grammar is None:
                return None
            state = self._matchers[seq.seq_id] = SeqMatcher(grammar.matcher())
        return state

    @staticmethod
    def _consume(state: SeqMatcher, index: int, token: int) -> None:
        if index < state.consumed or state.broken_at is not None:
            return
        if index > state.consumed:  # a token it never saw (a bug): this request ends, not the engine
            log.error("a grammar matcher missed generated tokens %d..%d", state.consumed, index - 1)
            state.broken_at, state.why = index, "the grammar lost track of the reply (an engine bug; see the log)"
            return
        if not state.matcher.consume_token(token):
            state.broken_at = index
            state.why = LIMIT_HIT if hit_a_limit(state.matcher) else f"the grammar does not allow token {token} here"
        state.consumed += 1
        if state.end is None and state.matcher.is_stopped():
            state.end = state.consumed
        if state.matcher.is_accepting():
            state.accepting.add(state.consumed)

    # -- the feature's stages ------------------------------------------------------------------------
    def contribute(self, step: SamplingStep) -> None:
        masks = self.masks(step.owners, [draw.position for draw in step.draws], step.pending)
        if masks is not None:
            step.failed.update(masks.dead)
            step.edits.append(masks)

    def resolve(self, step: SamplingStep) -> None:
        """Each constrained draw's commit: its sampled token and the tokens its grammar forces after it
        (those replace a later draw of the sequence still in flight)."""
        if not self._grammars:
            return
        launch, commits = step.launch, step.commits
        for i, (seq, position, token) in enumerate(zip(launch.owners, launch.positions, step.ids)):
            if seq.request not in step.failed:
                tokens = self.tokens(seq, position, token)
                if len(tokens) > 1:
                    commits[i] = TokenCommit(tokens, commits[i].logprobs,
                                             replaces_in_flight=position < len(seq.token_ids) - 1)

    def stops(self, seq: Sequence, stopping: bool) -> bool:
        return self.on_commit(seq, stopping) if seq.request.params.structured is not None else False

    # -- a step's masks --------------------------------------------------------------------------
    def masks(self, owners: list[Sequence], positions: list[int],
              pending: Callable[[Sequence], int | None]) -> StepMasks | None:
        """The allowed tokens of every constrained draw of a launched step (owners[i] draws the token
        at positions[i]); `pending(seq)` is the id of a token of `seq` still on the device (waiting for
        it), for a draw whose previous token has not been committed yet."""
        if not self._grammars:
            return None
        rows = [(i, state) for i, seq in enumerate(owners) if (state := self._state(seq)) is not None]
        if not rows:
            return None
        started = time.perf_counter()
        bitmask = self._buffer(len(rows))[:len(rows)]
        to_fill: list[tuple[Any, int]] = []
        for row, (i, state) in enumerate(rows):
            seq, index = owners[i], positions[i] - owners[i].num_prompt_tokens
            if state.consumed < index:  # the token before this draw is still on the device (overlap)
                token = pending(seq)
                if token is not None:
                    self._consume(state, index - 1, token)
            if state.broken_at is not None or state.consumed != index:
                bitmask[row].fill_(-1)  # the request ends at its commit; the row just stays usable
            else:
                to_fill.append((state.matcher, row))
        if to_fill:  # on llguidance's threads, without the GIL
            llguidance.torch.fill_next_token_bitmask_par(self._executor, to_fill, bitmask)
        dead: dict[Request, str] = {}
        ends: list[tuple[int, str]] = [(row, LIMIT_HIT if hit_a_limit(matcher) else DEAD_END)
                                       for matcher, row in to_fill if matcher.is_error()]
        # (an errored matcher's mask allows EOS alone: never a reply's end)
        ends += [(row, DEAD_END) for row in (bitmask == 0).all(dim=1).nonzero().flatten().tolist()
                 if not rows[row][1].matcher.is_stopped()]
        for row, why in ends:
            bitmask[row].fill_(-1)
            state = rows[row][1]
            if state.broken_at is None:
                state.broken_at, state.why = state.consumed, why
            req = owners[rows[row][0]].request
            dead[req] = _naming_field(req, state.why)
        for req in (req for req, why in dead.items() if why.endswith(LIMIT_HIT)):
            self._limit_hit(req)
        self.stats.dead_ends += len(dead)
        self.stats.mask_steps += 1
        self.stats.mask_rows += len(rows)
        draws = torch.tensor([i for i, _ in rows], dtype=torch.long).to(self.device, non_blocking=True)
        masks = StepMasks(draws, bitmask.to(self.device, non_blocking=True), dead)
        self.stats.mask_s += time.perf_counter() - started
        return masks

    def _buffer(self, rows: int) -> torch.Tensor:
        """One of the two host bitmask buffers, alternately, with at least `rows` rows."""
        self._flip ^= 1
        while len(self._buffers) < 2:
            self._buffers.append(torch.empty(0, 0, dtype=torch.int32))
        buffer = self._buffers[self._flip]
        if buffer.shape[0] < rows:
            buffer = llguidance.torch.allocate_token_bitmask(max(rows, 2 * buffer.shape[0], 16), self.vocab_size)
            if self.device.type != "cuda" and buffer.is_pinned():
                buffer = buffer.clone(memory_format=torch.contiguous_format)
            self._buffers[self._flip] = buffer
        return buffer

    # -- committing ------------------------------------------------------------------------------
    def tokens(self, seq: Sequence, position: int, token: int) -> tuple[int, ...]:
        """What to commit for `seq`'s draw at `position`, which sampled `token`: the token itself, and
        the tokens the grammar forces after it. With a later draw of `seq` in flight, forced tokens
        replace it (TokenCommit.replaces_in_flight), and its own commit is then ignored."""
        state = self._state(seq)
        if state is None or position >= len(seq.token_ids) or seq.token_ids[position] != PENDING_TOKEN:
            return (token,)  # not constrained, or a draw an earlier commit's forced tokens made void
        self._consume(state, position - seq.num_prompt_tokens, token)
        if (not self.forced_tokens or state.end is not None or state.broken_at is not None
                or seq.request.params.logprobs is not None):
            return (token,)
        forced = tuple(state.matcher.compute_ff_tokens())
        for index, forced_token in enumerate(forced, start=position - seq.num_prompt_tokens + 1):
            self._consume(state, index, forced_token)
        self.stats.forced_tokens += len(forced)
        return (token, *forced)

    def draft_prefix(self, seq: Sequence, drafts: list[int]) -> int:
        """How many of `drafts` (proposed tokens after `seq`'s committed ones, as speculative decoding
        proposes them) the grammar accepts, in order; the matcher is left as it was. Not used yet: a
        constrained sequence does not draft (its `allows_drafts` is False), since each draft
        position's mask would need the matcher advanced through the drafts before it."""
        state = self._state(seq)
        if state is None or not drafts:
            return len(drafts)
        if state.broken_at is not None or state.end is not None:
            return 0
        return int(state.matcher.validate_tokens(drafts))

    def _limit_hit(self, req: Request) -> None:
        """`req`'s grammar hit a limit: it leaves the cache with the lexer memory it built."""
        grammar = self._grammars.get(req.request_id)
        if grammar is not None:
            self.compiler.evict(grammar.key)

    def violation(self, req: Request) -> str | None:
        """Why `req`'s grammar ended it, if it did, naming the parameter the constraint came from."""
        states = [self._matchers.get(seq.seq_id) for seq in req.sequences]
        why = next((s.why for s in states if s is not None and s.broken_at is not None), None)
        return None if why is None else _naming_field(req, why)

    def on_commit(self, seq: Sequence, stopping: bool) -> bool:
        """The stop test's part: one committed token of `seq`, after which the reply stops for another
        reason when `stopping` (EOS, a stop string or id); True when it completed the grammar. Raises
        GrammarViolation at a token the grammar rejected, and where the reply stops before its grammar
        is complete."""
        state = self._matchers.get(seq.seq_id)
        if state is None:
            return False
        state.committed += 1
        if state.broken_at is not None and state.committed > state.broken_at:
            self.stats.dead_ends += 1
            if state.why == LIMIT_HIT:
                self._limit_hit(seq.request)
            raise GrammarViolation(state.why)
        completed = state.end is not None and state.committed >= state.end
        if stopping and not completed and state.committed not in state.accepting:
            state.broken_at, state.why = state.committed - 1, \
                "the reply stopped before its constraint was complete (it would not parse)"
            self.stats.dead_ends += 1
            raise GrammarViolation(state.why)
        return completed


def _naming_field(req: Request, why: str) -> str:
    """`why`, after the API parameter the request's constraint came from (StructuredOutput.field)."""
    structured = req.params.structured
    return why if structured is None else f"{structured.field}: {why}"


def apply_token_bitmask(logits: torch.Tensor, masks: StepMasks) -> None:
    """Set the logits of tokens the grammar does not allow to -inf, in the constrained rows only."""
    rows, vocab = masks.bitmask.shape[0], logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((masks.bitmask[:, :, None] >> shifts) & 1).view(rows, -1)[:, :vocab].bool()
    constrained = logits.index_select(0, masks.draws).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, masks.draws, constrained)
