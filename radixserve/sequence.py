"""A sequence: one sample's tokens, its KV blocks and how far its K/V has been computed.

Invariants: `num_computed <= len(token_ids) - 1` while running — the last token's K/V is computed by
the step that samples its successor; `block_table` covers at least `num_computed` positions; a
sequence holds exactly one reference on each block of its table. A request with n samples prefills
one sequence and forks it into n when its prompt is done, so the prompt is computed once.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from radixserve.outputs import Timing
from radixserve.radix_tree import RadixNode
from radixserve.sampling_params import SamplingParams

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
    sequences: list[Sequence] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return bool(self.sequences) and all(s.status is SequenceStatus.FINISHED for s in self.sequences)


@dataclass(eq=False)
class Sequence:
    request: Request
    index: int  # which of the request's n samples
    token_ids: list[int]
    num_prompt_tokens: int
    generator: torch.Generator | None = None
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    locked_node: RadixNode | None = None
    finish_reason: str | None = None
    admitted_once: bool = False
    waiting_since: int | None = None  # scheduler step of arrival while waiting; None once admitted
    # set when the request still has to fork into n samples after this sequence's prompt
    pending_forks: int = 0

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def generated_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

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
