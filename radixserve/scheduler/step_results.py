"""What a step hands back to the scheduler, and the rule that turns sampled tokens into a sequence's
tokens: the scheduler's one write path for generated tokens (`Scheduler.launched` / `commit`).

A launched step's sampling rows are described by a `Launch` (whose rows each draw reads, which slot it
fills, how many drafts it verifies). After sampling, the engine hands one `TokenCommit` per draw back.
A commit may carry several tokens: a grammar may force several, and speculative decoding verifies k
draft tokens in one step and keeps a prefix of them plus the token sampled after it. A verifying
draw's drafts are taken out first (`SequenceCache.roll_back` forgets the K/V of those not kept: the
kept ones' stands), then the commit's tokens are appended one by one, the kept drafts included, each
passed to the stop test and checked against the length limits; the first token that ends the
sequence ends the commit, and the tokens after it are never appended. The first fills the draw's
pending slot (`pending.py`), which must still be one: filling slots is this module's, like every
other write of a generated token.

The stop test (`StopTest`) is handed in by the engine: EOS, stop ids and stop strings (through its
detokenizer, which must see every committed token once, in order). It decides nothing about blocks,
queues or lengths; the scheduler does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from radixserve.core import PENDING_TOKEN, Request, Sequence, TokenLogprob

# called once per committed token, in order; True: the token ends the sequence ("stop")
StopTest = Callable[[Sequence, int], bool]


@dataclass
class Launch:
    """A launched step's draws: `owners[i]` samples from logits row `rows[i]` into the slot at
    `positions[i]` of its token_ids; a draw verifying `drafts[i]` > 0 draft tokens (the tokens just
    before its slot) also reads the rows after `rows[i]`, one per draft. `forks`: the samples of n > 1
    requests that joined this step."""

    owners: list[Sequence] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)
    forks: list[Sequence] = field(default_factory=list)

    def draw_of(self) -> dict[int, int]:
        """seq_id -> the index of its draw (where the next step reads its pending token)."""
        return {s.seq_id: i for i, s in enumerate(self.owners)}


@dataclass(frozen=True, slots=True)
class TokenCommit:
    """What a step decided for one draw of its `Launch`: commit `tokens` — the first fills the slot —
    each with its logprob when the request asked (`logprobs` then has one per token). A draw that
    verified `drafts` draft tokens (the tokens just before its slot) takes them out first; its
    `tokens` are the verified ones: the drafts it kept (a prefix), then the token sampled after them.
    Several tokens, or drafts, only where the draw's slot is its sequence's last (no later step of
    that sequence in flight: positions after it would move), or, for several tokens, where the commit
    `replaces_in_flight`: the later slot is dropped and its draw ignored when it commits (the step
    that drew it computed this slot's K/V, which stands)."""

    tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    drafts: int = 0
    # the sequence's later draw still in flight is void and these tokens take its place: a grammar's
    # forced tokens, known only once this draw's token is (with overlap, the next step is already out)
    replaces_in_flight: bool = False


@dataclass
class Committed:
    touched: list[Sequence] = field(default_factory=list)  # sequences that took at least one token
    tokens: int = 0  # tokens committed in all
    errors: list[Request] = field(default_factory=list)  # their stop test raised: ended with "error"


def append_tokens(seq: Sequence, position: int, commit: TokenCommit, stop: StopTest,
                  max_seq_len: int) -> tuple[int, str | None]:
    """Fill the slot at `position` and append the rest of the commit's tokens, stopping at the first
    that ends the sequence. Returns how many were committed and the finish reason, if any."""
    tokens, logprobs = commit.tokens, commit.logprobs
    assert len(tokens) == 1 or position == len(seq.token_ids) - 1, \
        "several tokens are committed only into a sequence's last slot"
    # the length limits, as a count of resolved tokens (every token up to a filled slot is resolved);
    # once per draw, so plain comparisons rather than min()
    limit = seq.length_limit
    if limit > max_seq_len:
        limit = max_seq_len
    taken = 0
    for token in tokens:
        if taken:
            seq.token_ids.append(token)
        else:  # the first token fills the slot, the others follow it
            assert seq.token_ids[position] == PENDING_TOKEN, "a slot is filled once, where its launch put it"
            seq.token_ids[position] = token
        if logprobs:
            seq.logprobs.append(logprobs[taken])
        taken += 1
        if stop(seq, token):
            return taken, "stop"
        if position + taken >= limit:
            return taken, "length"
    return taken, None
