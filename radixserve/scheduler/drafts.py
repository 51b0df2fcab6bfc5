"""Speculative drafts: which tokens a decoding sequence proposes to verify in its next step, and how
many it may propose (its `SpecState`, adapted to what its verifications kept).

Sources, in this order; the first that yields a draft wins:
- "prediction": the request's Predicted Output (`Request.prediction_ids`), which its caller gave for
  this very reply (so it goes first, and `accepted_prediction_tokens` counts what it drafted): the
  continuation of the output's last n-gram (3 tokens, down to 2) where it occurs in the prediction, at
  the first occurrence at or after where the output last left the prediction (`SpecState.prediction_at`,
  moved past each kept prediction draft), so the two stay aligned through repeated lines;
- "tree": the sequence's tokens so far are a path of the radix tree that continues (a regenerated
  reply, a question asked again, a fork re-running a turn, a sibling sample ahead of it): the cached
  continuation, following the most recently used branch at each fork;
- "lookup": prompt lookup, as transformers' `prompt_lookup_num_tokens`: the continuation of the
  sequence's last n-gram (n from LOOKUP_NGRAM down to 2) at its most recent earlier occurrence in the
  prompt or the output.

Who drafts: a decoding sequence whose last token is known on the host (the verifying step feeds it),
whose request no veto forbids drafts (`vetoes`: the engine derives them from its logits features,
engine/features.py, each feature that allows no drafts vetoing the requests it applies to: a grammar,
whose masks at draft positions would depend on the drafts, penalties, whose counts would, prompt
logprobs), and only in a step with at most `max_batch` decoding
sequences (above it the step stops being memory-bound and drafts cost what they save). Rows: while
recent verifications kept fewer than PAYING_RATE of their drafts (`kept_rate`, over about the last
RATE_HORIZON draft tokens of every sequence; 0 at start), a step's drafts together fill at most what
its decodes and prompt chunks leave of `max_rows`, the knee of the device's cost curve; past the knee
a draft row costs about what a decode does and pays only if mostly kept. Drafts kept at that rate
lift the cap (the batch cap still holds). A step's room is shared out one draft token at a time,
those sequences with the most tokens left first (`shares`): the first draft token of a sequence is
the likeliest kept, and sequences started together finish with the slowest, so rows that let one
sequence run ahead shorten nothing (in running order the first sequence took every row). A draft is
cut so that it and the token sampled after it stay within the request's max_tokens and the engine's
longest sequence.

k: starts at `num_speculative_tokens`; after a verification that kept every draft it grows by 2
(to the cap), after one that kept a < k it becomes a + 1; after MISS_LIMIT verifications in a row
kept nothing the sequence drafts nothing for 2**misses steps (at most MAX_COOLDOWN), then tries again.
These functions read the tree and write only the sequence's `spec` state (the scheduler calls them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from weakref import WeakKeyDictionary

import numpy as np

from radixserve.cache.radix_tree import RadixTree
from radixserve.core import Request, Sequence
from radixserve.sampling_params import SamplingParams

LOOKUP_NGRAM = 3  # the longest n-gram prompt lookup matches first
MISS_LIMIT = 2
MAX_COOLDOWN = 64
PAYING_RATE = 0.5  # kept fraction of recent drafts above which a step drafts past the rows knee
RATE_HORIZON = 32  # draft tokens: about how far back `kept_rate` looks
PREDICTION_RETRY = 8  # with overlap, a request with a prediction tries to draft again this often
DraftVeto = Callable[[SamplingParams], bool]  # True: a request with these params never drafts


@dataclass
class Draft:
    tokens: list[int]
    source: str


class DraftProposer:
    def __init__(self, tree: RadixTree | None, num_tokens: int, max_batch: int, max_seq_len: int,
                 max_rows: int | None = None) -> None:
        self.tree = tree
        self.num_tokens = num_tokens  # 0: speculation off
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.max_rows = max_rows  # None: no knee
        self.kept_rate = 0.0  # the fraction of recent draft tokens kept, every sequence's (see the docstring)
        self.vetoes: tuple[DraftVeto, ...] = ()
        # each request's verdict, taken once: a veto is the engine's code, which a step must not call
        # per sequence (tests/engine/test_step_crossings.py), and a request's params never change
        self._vetoed: WeakKeyDictionary[Request, bool] = WeakKeyDictionary()

    def forbid_drafts(self, vetoes: Iterable[DraftVeto]) -> None:
        """Set the vetoes (the engine's, from its features, once at start): configuration, not state."""
        self.vetoes = tuple(vetoes)
        self._vetoed.clear()

    def room(self, decodes: int, prompt_rows: Callable[[int], int]) -> int:
        """How many draft tokens a step with `decodes` decoding sequences may verify between them (0: it
        drafts nothing). `prompt_rows(limit)`: the step's rows of prompt, counted up to `limit`, asked
        only where the knee applies. A query."""
        if self.num_tokens == 0 or decodes > self.max_batch:
            return 0
        if self.max_rows is None or self.kept_rate >= PAYING_RATE:
            return decodes * self.num_tokens
        left = self.max_rows - decodes
        return max(0, left - prompt_rows(left)) if left > 0 else 0

    def shares(self, decodes: list[Sequence], room: int) -> dict[Sequence, int]:
        """How many of a step's `room` draft tokens each decoding sequence may propose: one token at a
        time to each in turn, the sequences with the most tokens left first, until the room or every
        sequence's k runs out. A sequence drafts only after a token known on the host, and not before
        its forks (they copy its tokens, which must not hold unverified drafts). Counts down the
        cool-downs of those it passes over (writes `seq.spec`, as `propose` would)."""
        takers: list[tuple[Sequence, int]] = []
        for seq in decodes:
            if seq.pending_forks or seq.has_pending_token or not self.eligible(seq):
                continue
            spec = seq.spec
            if spec.cooldown > 0:
                spec.cooldown -= 1
                continue
            most = self._most_drafts(seq)
            if most > 0:
                takers.append((seq, most))
        if sum(most for _, most in takers) <= room:
            return dict(takers)
        takers.sort(key=lambda taker: taker[0].length_limit - len(taker[0].token_ids), reverse=True)
        given = [0] * len(takers)
        while room > 0:  # some taker has more to take: the room is less than their sum
            for i, (_, most) in enumerate(takers):
                if room > 0 and given[i] < most:
                    given[i] += 1
                    room -= 1
        return {seq: n for (seq, _), n in zip(takers, given) if n}

    def _most_drafts(self, seq: Sequence) -> int:
        """The most draft tokens `seq` may propose now: its k, and room for the drafts and the token
        sampled after them within its max_tokens and the engine's longest sequence. A query."""
        length = len(seq.token_ids)
        k = seq.spec.k if seq.spec.k >= 0 else self.num_tokens
        return min(k, seq.length_limit - length - 1, self.max_seq_len - length - 1)

    @property
    def enabled(self) -> bool:
        return self.num_tokens > 0

    def eligible(self, seq: Sequence) -> bool:
        """May `seq` draft at all (whatever its state)? A query."""
        if self.num_tokens == 0:
            return False
        req = seq.request
        vetoed = self._vetoed.get(req)
        if vetoed is None:
            vetoed = self._vetoed[req] = any(veto(req.params) for veto in self.vetoes)
        return not vetoed

    def waits_for_token(self, seq: Sequence) -> bool:
        """With overlap, should `seq` wait a step for its pending token (drafts follow only a known
        token) rather than decode on without a draft? At its first decode (to try) and while its
        verifications keep drafts; a request with a prediction also every PREDICTION_RETRY steps (its
        output may meet the prediction again). Writes `seq.spec` (counts down the cool-down and the
        steps since it last tried)."""
        if not self.eligible(seq):
            return False
        spec = seq.spec
        if spec.cooldown > 0:
            spec.cooldown -= 1
            return False
        if spec.hot:
            return True
        if seq.request.prediction_ids:
            spec.idle += 1
            if spec.idle >= PREDICTION_RETRY:
                spec.idle = 0
                return True
        return False

    def propose(self, seq: Sequence, budget: int) -> Draft | None:
        """Up to min(k, budget) draft tokens to follow `seq`'s last token, or None. Counts down a
        cool-down (writes `seq.spec`)."""
        spec = seq.spec
        if spec.k < 0:
            spec.k = self.num_tokens
        if spec.cooldown > 0:
            spec.cooldown -= 1
            return None
        tokens = seq.token_ids
        limit = min(self._most_drafts(seq), budget)
        if limit <= 0:
            return None
        prediction = seq.request.prediction_ids
        if prediction:
            at = from_prediction(tokens[seq.num_prompt_tokens:], prediction, spec.prediction_at)
            if at is not None and at < len(prediction):
                spec.prediction_draft_at = at
                return Draft(list(prediction[at:at + limit]), "prediction")
        if self.tree is not None:
            drafted = self.tree.continuation(tokens, limit, seq.namespace)
            if drafted:
                return Draft(drafted, "tree")
        drafted = prompt_lookup(tokens, limit)
        if drafted:
            return Draft(drafted, "lookup")
        spec.hot = False  # nothing to draft: with overlap it decodes on without waiting for its tokens
        return None

    def verified(self, seq: Sequence, proposed: int, kept: int) -> None:
        """A verification of `proposed` drafts (from `seq.draft_source`) kept `kept`: adapt `seq`'s k,
        and move its place in the prediction past what it kept (writes `seq.spec`)."""
        self.kept_rate += (kept / proposed - self.kept_rate) * min(1.0, proposed / RATE_HORIZON)
        spec = seq.spec
        spec.hot = kept > 0
        if seq.draft_source == "prediction":
            spec.prediction_at = spec.prediction_draft_at + kept
        if kept == proposed:
            spec.k = min(self.num_tokens, spec.k + 2)
        else:
            spec.k = max(1, kept + 1)
        if kept:
            spec.misses = 0
            return
        spec.misses += 1
        if spec.misses >= MISS_LIMIT:
            spec.cooldown = min(MAX_COOLDOWN, 2 ** spec.misses)


def _ngram_starts(haystack: np.ndarray, needle: np.ndarray, end: int) -> np.ndarray:
    """Start positions i < end - len(needle) + 1 where haystack[i:i+len(needle)] == needle."""
    n = len(needle)
    starts = np.flatnonzero(haystack[:max(0, end - n + 1)] == needle[0])
    for j in range(1, n):
        starts = starts[haystack[starts + j] == needle[j]]
    return starts


def prompt_lookup(tokens: list[int], limit: int, max_n: int = LOOKUP_NGRAM) -> list[int]:
    """The tokens after the most recent earlier occurrence of `tokens`' last n-gram (longest n first,
    down to 2), at most `limit` of them."""
    size = len(tokens)
    if size < 3:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, size - 1), 1, -1):
        # an occurrence must end before the last token, so that something follows it
        starts = _ngram_starts(arr, arr[size - n:], size - 1)
        if starts.size:
            at = int(starts[-1]) + n
            return [int(t) for t in arr[at:at + limit]]
    return []


def from_prediction(generated: list[int], prediction: tuple[int, ...], cursor: int,
                    max_n: int = LOOKUP_NGRAM) -> int | None:
    """Where in the prediction the output goes on: at its start while nothing is generated, else
    after the output's last n-gram (longest n first, down to 2; 1 for the output's first token) where
    it occurs in the prediction, at the first occurrence ending at or after `cursor` (where the output
    last left the prediction), or else the last one before it; None where nothing matches."""
    if not generated:
        return 0
    pred = np.asarray(prediction, dtype=np.int64)
    # a single token is too weak a match, except for the output's first token
    shortest = 1 if len(generated) == 1 else 2
    for n in range(min(max_n, len(generated)), shortest - 1, -1):
        starts = _ngram_starts(pred, np.asarray(generated[-n:], dtype=np.int64), len(pred) - 1)
        ends = starts + n
        ahead = ends[ends >= cursor]
        if ahead.size:
            return int(ahead[0])
        if ends.size:
            return int(ends[-1])
    return None
