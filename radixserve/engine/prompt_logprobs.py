"""Prompt logprobs (SamplingParams.prompt_logprobs): the logprob of every prompt token after the first,
with the k most likely tokens at its position, for the requests that ask.

Token j's logprob comes from the logits at position j - 1, so a request that asks needs the logits of
every prompt position but the last. A cached prefix has K/V but no logits, so such a request takes no
cache hit: the scheduler computes its prompt in full (`scheduler/seq_cache.take_prefix`), and its
blocks are cached as usual for the requests that come after it. Each step then asks the forward for
the rows of the prompt positions it computes (`model/runner.RowLogprobs`, reduced on the device to
the target's logprob and the top k; the vocabulary-wide logits are never kept), and the host reads
them when the step resolves.

Owns, per asking request, the entries collected so far (`[None]` for the first token, then one per
position in order) and the next position a launched step will cover. Invariants: a position is asked
once (a sequence preempted by recompute computes its prompt again, and the positions already asked
are not asked again); entries are appended in position order, as steps resolve in launch order; a
request's entries are handed out once, complete (one per prompt token), with its first output after
the prompt is done, and dropped when it retires.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from radixserve.core import Batch, Request, RequestOutput, TokenLogprob
from radixserve.engine.features import LogitsFeature, SamplingStep
from radixserve.model.runner import RowLogprobs
from radixserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from radixserve.engine.intake import ValidatedRequest


@dataclass
class _Collecting:
    entries: list[TokenLogprob | None] = field(default_factory=lambda: [None])
    next_position: int = 0  # the first prompt position no launched step has asked for yet
    handed_out: bool = False


@dataclass
class PromptAsk:
    """One step's asks: the runner's `rows`, and whose entries they are, in row order."""

    rows: RowLogprobs
    owners: list[Request]


class PromptLogprobBook(LogitsFeature):
    """Prompt logprobs as a logits feature (engine/features.py): it asks the forward for its rows,
    collects them when the step resolves, and hands them out with a request's output."""

    allows_drafts = False  # as before the seam: drafts and prompt logprobs were never run together

    def __init__(self) -> None:
        self._requests: dict[Request, _Collecting] = {}

    def __bool__(self) -> bool:
        return bool(self._requests)

    def applies(self, params: SamplingParams) -> bool:
        return params.prompt_logprobs is not None

    def begin(self, req: Request, request: ValidatedRequest | None = None) -> None:
        """Start collecting for a request that asks (its params.prompt_logprobs is set)."""
        self._requests[req] = _Collecting()

    def ask_forward(self, step: SamplingStep) -> None:
        ask = self.ask(step.batch) if self else None
        if ask is not None:
            step.asked = ask.rows
            step.keep(ask)

    def resolve(self, step: SamplingStep) -> None:
        ask = step.part(PromptAsk)
        if ask is not None:
            self.collect(ask)

    def add_to_output(self, req: Request, out: RequestOutput) -> None:
        if req.params.prompt_logprobs is not None:
            out.prompt_logprobs = self.take(req)

    def ask(self, batch: Batch) -> PromptAsk | None:
        """The rows of `batch` whose logits give a prompt token's logprob not yet asked for (None when
        none), and the positions they cover marked as asked."""
        rows: list[int] = []
        targets: list[int] = []
        owners: list[Request] = []
        top = 0
        offset = 0
        for item in batch.items:
            state = self._requests.get(item.seq.request)
            if state is not None and item.seq.index == 0:  # the prompt is computed by sample 0, before forks
                prompt = item.seq.request.prompt_token_ids
                first = max(item.start, state.next_position)
                last = min(item.start + item.num_tokens, len(prompt) - 1)  # the last position predicts an output
                for position in range(first, last):
                    rows.append(offset + position - item.start)
                    targets.append(prompt[position + 1])
                    owners.append(item.seq.request)
                state.next_position = max(state.next_position, last)
                top = max(top, item.seq.request.params.prompt_logprobs or 0)
            offset += item.num_tokens
        return PromptAsk(RowLogprobs(rows, targets, top), owners) if rows else None

    def collect(self, ask: PromptAsk) -> None:
        """Take a resolved step's rows into their requests' entries. A row whose forward failed (NaN:
        its item failed on its own, and its request with it) ends its request's entries there, so
        they are never complete and never handed out."""
        asked = ask.rows
        assert asked.values is not None and asked.ids is not None, "the step's forward fills every ask"
        values, ids = asked.values.tolist(), asked.ids.tolist()
        for req, target, row_values, row_ids in zip(ask.owners, asked.targets, values, ids):
            state = self._requests.get(req)
            if math.isnan(row_values[0]):
                self._requests.pop(req, None)
            elif state is not None:
                k = req.params.prompt_logprobs or 0
                state.entries.append(TokenLogprob(target, row_values[0], tuple(zip(row_ids[:k], row_values[1:k + 1]))))

    def take(self, req: Request) -> list[TokenLogprob | None] | None:
        """The request's entries, once they are complete and not yet handed out; else None."""
        state = self._requests.get(req)
        if state is None or state.handed_out or len(state.entries) < len(req.prompt_token_ids):
            return None
        state.handed_out = True
        return state.entries

    def release(self, req: Request) -> None:
        self._requests.pop(req, None)
