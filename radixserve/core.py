"""The neutral core types every layer shares: requests and their sequences, the scheduled batch,
per-step observations, and what the engine hands back to callers. Imports nothing of the engine.

Sequence invariants: `num_computed <= len(token_ids) - 1` while running — the last token's K/V is
computed by the step that samples its successor; `PENDING_TOKEN`s (ids sampled by a step still in
flight, on the device until the scheduler commits them) are only at the end, at most two, and never
inserted into the tree (scheduler/pending.py); a verifying step's `num_drafts` unverified draft
tokens sit just before its pending slot, count as computed but not as resolved, and are never
inserted into the tree either (scheduler/drafts.py); `block_table` covers at least `num_computed` positions;
a sequence holds exactly one reference on each block of its table. A request with n samples
prefills one sequence and forks it into n when its prompt is done, so the prompt is computed once.
Only the scheduler writes a sequence, any field, its tokens included (tests/test_layering.py).

Batch invariants: a scheduled item owns a block for every position it writes this step, and the
block it writes first has one owner. `copies` lists every block copy the step needs before its
forward, in the order the scheduler decided them: copy-on-write copies on the device, write-backs
of evicted or swapped-out blocks to the host tier, load-backs from it, and (hybrid models) copies
between recurrent-state slots. The order matters: a
block freed by one copy may be the destination of a later one in the same step. A batch is read
before the next `schedule()` (the engine reads it while it launches that step): a decoding
sequence's one-token item is the same object from step to step (`Sequence.decode_item`), its
`start` moved on by the scheduler, so no item is built per decode.

Outputs: a streamed RequestOutput carries only what is new since the previous one (token ids and a
text delta that never splits a UTF-8 character); `finished` is True exactly once, on the last output
of a request.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from radixserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from radixserve.cache.radix_tree import RadixNode

PENDING_TOKEN = -1  # stands for a sampled id still on the device (overlap scheduling)


@dataclass
class Placement:
    """Where a request ran, for an engine client that spreads requests over replicas (scaleout/).
    `affinity`: a key (a chat session's id) whose requests should stay on one replica; `replica`: set
    by the client once the request has one. A single engine leaves `replica` None."""

    affinity: str | None = None
    replica: str | None = None


@dataclass
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (not recomputed)
    completion_tokens: int = 0
    host_cached_tokens: int = 0  # the part of cached_tokens loaded back from the host-memory tier
    speculation: DraftCounts | None = None  # drafts proposed and accepted (None: none, and no prediction)


# where a draft came from (scheduler/drafts.py), cheapest first
DRAFT_SOURCES = ("tree", "prediction", "lookup")


@dataclass
class DraftCounts:
    """A request's speculative decoding: tokens drafted (proposed) and accepted, in all and per source.
    `prediction_*` are OpenAI's `accepted_prediction_tokens` / `rejected_prediction_tokens`: the
    prediction's tokens that were drafted and kept, and the rest of the prediction."""

    proposed: int = 0
    accepted: int = 0
    by_source: dict[str, list[int]] = field(default_factory=dict)  # source -> [proposed, accepted]
    verify_steps: int = 0  # the request's steps that verified drafts
    prediction_tokens: int = 0  # the request's prediction, in tokens

    def add(self, source: str, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        self.verify_steps += 1
        pair = self.by_source.setdefault(source, [0, 0])
        pair[0] += proposed
        pair[1] += accepted

    def snapshot(self) -> DraftCounts:
        return DraftCounts(self.proposed, self.accepted, {k: list(v) for k, v in self.by_source.items()},
                           self.verify_steps, self.prediction_tokens)

    @property
    def prediction_accepted(self) -> int:
        return min(self.prediction_tokens, self.by_source.get("prediction", [0, 0])[1])

    @property
    def prediction_rejected(self) -> int:
        return self.prediction_tokens - self.prediction_accepted


@dataclass
class Timing:
    arrival: float = 0.0  # time.monotonic() when the request entered the engine
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    # inter-token latency: the gaps between consecutive hand-outs of new tokens after the first
    # (one per step while decoding), filled by the engine's OutputTracker
    last_token: float | None = None  # when tokens were last handed out
    itl_count: int = 0
    itl_total_s: float = 0.0
    itl_max_s: float = 0.0

    def add_token_time(self, now: float) -> None:
        """New tokens were handed out at `now` (time.monotonic())."""
        if self.last_token is not None:
            gap = max(0.0, now - self.last_token)
            self.itl_count += 1
            self.itl_total_s += gap
            self.itl_max_s = max(self.itl_max_s, gap)
        self.last_token = now

    @property
    def mean_itl_ms(self) -> float:
        return self.itl_total_s * 1000.0 / self.itl_count if self.itl_count else 0.0

    @property
    def max_itl_ms(self) -> float:
        return self.itl_max_s * 1000.0

    @property
    def queue_ms(self) -> float:
        return _ms(self.arrival, self.first_scheduled)

    @property
    def ttft_ms(self) -> float:
        return _ms(self.arrival, self.first_token)

    @property
    def total_ms(self) -> float:
        return _ms(self.arrival, self.finished)


def _ms(start: float, end: float | None) -> float:
    return 0.0 if end is None else max(0.0, (end - start) * 1000.0)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token's log-probability under the model, with the most likely alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass
class CompletionOutput:
    index: int  # which of the request's n samples
    token_ids: list[int] = field(default_factory=list)  # new tokens (streaming) or all (offline)
    text: str = ""  # text delta (streaming) or the whole text (offline)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    logprobs: list[TokenLogprob] | None = None  # one per token in token_ids when the request asked
    # why a "stop" finish stopped (vLLM's field): the stop string that matched, or the stop_token_ids id
    # that ended it; None for the model's EOS, a grammar's end, any other finish, and while running
    stop_reason: str | int | None = None


@dataclass
class RequestOutput:
    request_id: str
    outputs: list[CompletionOutput]
    usage: Usage
    timing: Timing
    finished: bool = False
    prompt_token_ids: list[int] = field(default_factory=list)
    # when the request asked (SamplingParams.prompt_logprobs): one entry per prompt token, None for the
    # first (nothing precedes it); carried by the request's first output only, None on the others
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None  # set (with finish_reason "error") when this request failed on its own
    # the error is the reply's own (its constraint could not be met): delivered as a reply that ends with
    # finish_reason "error", not raised as a failed request
    error_ends_reply: bool = False

    def tokens_per_s(self) -> float:
        """Decode speed after the first token, over the whole request."""
        t = self.timing
        if t.first_token is None or t.finished is None or self.usage.completion_tokens <= 1:
            return 0.0
        span = t.finished - t.first_token
        return (self.usage.completion_tokens - 1) / span if span > 0 else 0.0


_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    order: int = 0  # arrival order, the FCFS key
    timing: Timing = field(default_factory=Timing)
    cached_tokens: int = 0  # prompt tokens served from the cache at first admission
    host_cached_tokens: int = 0  # the part of cached_tokens loaded back from the host tier
    pinned_cached_tokens: int = 0  # the part of cached_tokens that pinned prefixes held (engine/pins.py)
    queued_at: float | None = None  # when the scheduler first queued it (its clock): what aging counts from
    sequences: list[Sequence] = field(default_factory=list)
    prediction_ids: tuple[int, ...] = ()  # SamplingParams.prediction, tokenized: a source of drafts
    drafts: DraftCounts = field(default_factory=DraftCounts)  # what speculative decoding did for it

    @property
    def finished(self) -> bool:
        return bool(self.sequences) and all(s.status is SequenceStatus.FINISHED for s in self.sequences)


@dataclass
class SpecState:
    """A sequence's speculation: how many tokens it drafts next (`k`, adapted to its acceptance: 0 while
    `cooldown` steps pass after drafts kept failing) and whether it expects drafts (`hot`)."""

    k: int = -1  # -1: not set yet (the engine's num_speculative_tokens)
    misses: int = 0  # verifications in a row that kept no draft
    cooldown: int = 0  # steps left before it drafts again
    # it expects drafts: until its first proposal, and while its verifications keep drafts (with
    # overlap, such a sequence waits for its pending token, since only a known token can be drafted after)
    hot: bool = True
    idle: int = 0  # with overlap: steps decoded without trying to draft since it last tried
    prediction_at: int = 0  # where in its prediction the output last left off (past its kept drafts)
    prediction_draft_at: int = 0  # where the prediction draft being verified starts


@dataclass(eq=False, slots=True)
class Sequence:
    request: Request
    index: int  # which of the request's n samples
    token_ids: list[int]
    num_prompt_tokens: int
    noise_key: int = 0  # 64-bit key of this sample's random numbers (engine/sampler.py)
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    locked_node: RadixNode | None = None
    num_cached: int = 0  # leading tokens this sequence has put into (or taken from) the tree
    # hybrid models: the recurrent-state slot holding its state after its `num_computed` tokens (-1: none)
    state_slot: int = -1
    # hybrid models, while drafts are verified: a copy of its state from before them (-1: none), see seq_cache.py
    state_backup: int = -1
    # hybrid models: a position its prefill stops at to checkpoint its state there (-1: none), see seq_cache.py
    checkpoint_at: int = -1
    # swapped out: the tree node ending at its computed tokens, whose path it pins in the host tier
    swapped_node: RadixNode | None = None
    finish_reason: str | None = None
    admitted_once: bool = False
    waiting_since: int | None = None  # scheduler step it entered the waiting queue; None while running
    running_since: float | None = None  # when it was last admitted (scheduler clock); None while waiting
    # set when the request still has to fork into n samples after this sequence's prompt
    pending_forks: int = 0
    # the pending last token reaches a length limit: the sequence ends when it is committed, so it is
    # not scheduled again
    final_token_pending: bool = False
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per generated token, when asked
    # unverified draft tokens just before the pending slot of a verifying step in flight (never cached)
    num_drafts: int = 0
    draft_source: str = ""  # where those drafts came from (DRAFT_SOURCES)
    spec: SpecState = field(default_factory=lambda: SpecState())
    # the request's length limit: its prompt and max_tokens, both fixed, summed once rather than at
    # every launch and commit (the engine's max_seq_len may cap it further: the scheduler checks both)
    length_limit: int = field(init=False, repr=False)
    # the scheduler's: its batch item while it decodes, the same object from step to step (core's Batch)
    decode_item: ScheduledSeq | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.length_limit = self.num_prompt_tokens + self.request.params.max_tokens

    @property
    def has_pending_token(self) -> bool:
        return bool(self.token_ids) and self.token_ids[-1] == PENDING_TOKEN

    @property
    def namespace(self) -> str:
        """The cache namespace it reads and writes (SamplingParams.cache_namespace)."""
        return self.request.params.cache_namespace

    @property
    def num_resolved(self) -> int:
        """Tokens that are final: known on the host and not an unverified draft."""
        return len(self.token_ids) - self.has_pending_token - self.num_drafts

    @property
    def num_generated(self) -> int:
        return self.num_resolved - self.num_prompt_tokens

    @property
    def generated_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:self.num_resolved]

    @property
    def remaining(self) -> int:
        """Tokens whose K/V must still be computed before the next sample."""
        return len(self.token_ids) - self.num_computed

    @property
    def is_prefill(self) -> bool:
        return self.remaining > 1

    @property
    def sort_key(self) -> tuple[int, int]:
        return (self.request.order, self.index)


class CopyKind(enum.Enum):
    DEVICE = "device"  # device block -> device block (copy-on-write)
    TO_HOST = "to_host"  # device block -> host block (write-back, swap-out)
    TO_DEVICE = "to_device"  # host block -> device block (load-back, swap-in)
    STATE = "state"  # recurrent-state slot -> slot (hybrid models: restoring or taking a checkpoint, forks)
    WINDOW_BLOCK = "window_block"  # window block -> window block (copy-on-write of a KV block's companion)


@dataclass(frozen=True, slots=True)
class BlockCopy:
    kind: CopyKind
    src: int
    dst: int


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # first position computed this step
    num_tokens: int
    # logits rows the chunk needs, from its last position back: 1, or 1 + the drafts it verifies
    logit_rows: int = 1

    @property
    def samples(self) -> bool:
        """Does this chunk reach the sequence's last token, so its logits give the next token?"""
        return self.start + self.num_tokens == len(self.seq.token_ids)


@dataclass
class Batch:
    items: list[ScheduledSeq] = field(default_factory=list)
    copies: list[BlockCopy] = field(default_factory=list)  # to run, in order, before the forward
    # --sliding-window-kv window-blocks: the window block of each KV block the step reads or writes in a window
    window_blocks: dict[int, int] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(i.num_tokens for i in self.items)


@dataclass(frozen=True, slots=True)
class StepInfo:
    """One engine step as observers see it (`LLMEngine.add_step_observer`): what ran, how long it
    took, and the pool at the step's peak (blocks allocated, nothing yet released). The used/cached
    split is None unless an observer asked for it (it costs a pass over every block table)."""

    step: int
    started: float  # time.monotonic()
    duration_s: float
    num_seqs: int
    prefill_tokens: int
    decode_tokens: int
    num_running: int
    num_waiting: int
    blocks_total: int
    blocks_free: int
    blocks_used: int | None  # held by live sequences
    blocks_cached: int | None  # held only by the radix tree (evictable)
    max_num_seqs: int = 0  # the batch's slots (EngineConfig.max_num_seqs); 0: unknown
    max_num_batched_tokens: int = 0  # the step's token budget; 0: unknown
    # tokens a grammar forced at this step's commit: appended without sampling, computed by the next
    # step in one extend (where they count among its prefill tokens)
    forced_tokens: int = 0
    draft_tokens: int = 0  # draft tokens this step verifies (counted in decode_tokens)
    # tokens the step's commit appended, and the draws that took them (with overlap, the previous
    # step's): their ratio is the tokens per sequence per step, above 1 where drafts were kept
    committed_tokens: int = 0
    committed_draws: int = 0

    @property
    def tokens_per_draw(self) -> float:
        return self.committed_tokens / self.committed_draws if self.committed_draws else 0.0

    @property
    def slot_utilization(self) -> float:
        """Sequences scheduled this step / max_num_seqs."""
        return self.num_seqs / self.max_num_seqs if self.max_num_seqs else 0.0

    @property
    def token_budget_utilization(self) -> float:
        """Tokens computed this step / max_num_batched_tokens."""
        tokens = self.prefill_tokens + self.decode_tokens
        return tokens / self.max_num_batched_tokens if self.max_num_batched_tokens else 0.0
