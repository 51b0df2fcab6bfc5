"""Beam search: its parameters, its outputs, and the scoring of one prompt's beams, step by step.

`BeamSearch` is the whole algorithm for one prompt and knows nothing of the engine: each step it is
handed, for every running beam, the most likely next tokens with their log-probabilities (the
model's raw log-softmax) and it picks the survivors and the finished hypotheses. The drivers
(`beam_drivers.py`) turn every running beam into one engine request of one greedy token that asks
for those alternatives; the radix cache makes each such request a hit on all but its last token, so
the prompt is computed once and the beams share its blocks copy-on-write.

It reproduces transformers' `generate(num_beams=k, do_sample=False, early_stopping=True,
length_penalty=lp, max_new_tokens=m)` (transformers 5.x `_beam_search`), decision for decision:

- Candidates: every (running beam, next token) pair scored by the beam's summed log-probability
  plus the token's, in float32 as transformers adds them, ranked best first.
- Finished hypotheses: a candidate ending in an EOS token finishes only if it ranks among the top k
  candidates of the step (those ranked lower are dropped, as transformers drops them); at the step
  that reaches max_tokens, the top k candidates all finish. A finished hypothesis scores
  sum / generated_len ** lp, generated_len counting its last token (EOS included); the best k are kept.
- Survivors: the k best candidates that did not finish (their sum, no length penalty).
- Stop (`early_stopping=True`): as soon as k hypotheses are finished, or at max_tokens.
  transformers' "could a running beam still win" heuristic never binds in this mode (it compares
  only when all k are finished, and then the search has stopped), so it is not modelled.

Only the top k + |EOS| tokens of each beam can matter (at most |EOS| of them finish instead of
surviving), so that is all a beam step asks for; transformers' top `max(2, 1 + |EOS|) * k` over all
beams holds the same survivors and finishers. Ties between exactly equal scores may be broken
differently.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from radixserve.core import Usage

MAX_BEAM_WIDTH = 32


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int = 16
    length_penalty: float = 1.0  # finished score = sum of logprobs / generated_len ** length_penalty
    ignore_eos: bool = False  # the model's EOS tokens do not end a beam (stop_token_ids still do)
    stop_token_ids: list[int] = field(default_factory=list)  # end a beam like EOS (transformers' eos list)
    cache_namespace: str = ""  # every step's request reads and writes this cache namespace (SamplingParams')

    def __post_init__(self) -> None:
        def is_int(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        if not is_int(self.beam_width) or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}], got {self.beam_width!r}")
        if not is_int(self.max_tokens) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if isinstance(self.length_penalty, bool) or not isinstance(self.length_penalty, (int, float)) \
                or not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        if not isinstance(self.stop_token_ids, list) or not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of non-negative integers")

    def eos_set(self, model_eos: set[int] | frozenset[int]) -> frozenset[int]:
        """The tokens that end a beam: the model's EOS (unless ignore_eos) and stop_token_ids."""
        return frozenset(() if self.ignore_eos else model_eos) | frozenset(self.stop_token_ids)


@dataclass
class Beam:
    token_ids: list[int]  # generated tokens (a finished beam's EOS included)
    cum_logprob: float  # their summed log-probability, float32 as transformers sums it
    score: float = 0.0  # finished: cum_logprob / len(token_ids) ** length_penalty
    finish_reason: str | None = None  # "stop" (an EOS token) or "length" (max_tokens)
    text: str = ""


@dataclass
class BeamSearchOutput:
    """One prompt's result: its best beams, best first (at most beam_width of them)."""

    prompt_token_ids: list[int]
    beams: list[Beam]
    usage: Usage  # cached_tokens: the prompt's hit; completion_tokens: the returned beams' tokens together


Top = list[tuple[int, float]]  # a beam's most likely next tokens and their logprobs, most likely first


class BeamSearch:
    """One prompt's beams: `pending()` says what to ask the model, `advance()` takes its answers."""

    def __init__(self, prompt: list[int], params: BeamSearchParams, eos: frozenset[int]) -> None:
        self.prompt = prompt
        self.params = params
        self.eos = eos
        self.running: list[Beam] = [Beam([], 0.0)]  # transformers' k-1 other initial beams score -1e9: never chosen
        self.finished: list[Beam] = []
        self.done = False
        self.cached_tokens = 0  # the first step's prefix-cache hit: the prompt's

    @property
    def alternatives(self) -> int:
        """How many next tokens each running beam must report."""
        return self.params.beam_width + len(self.eos)

    def pending(self) -> list[list[int]]:
        """The token sequences (prompt + generated) whose next-token distributions the next step needs."""
        return [] if self.done else [self.prompt + b.token_ids for b in self.running]

    def advance(self, tops: list[Top]) -> None:
        """One step: `tops[i]` is running beam i's most likely next tokens (at least `alternatives`)."""
        k, lp = self.params.beam_width, self.params.length_penalty
        generated = len(self.running[0].token_ids) + 1  # every running beam has the same length
        last = generated >= self.params.max_tokens
        width = min(len(t) for t in tops)
        base = torch.tensor([b.cum_logprob for b in self.running], dtype=torch.float32)
        step = torch.tensor([[p for _, p in t[:width]] for t in tops], dtype=torch.float32)
        sums = (base[:, None] + step).tolist()  # float32 sums, exactly as transformers adds them
        ranked = sorted(((sums[i][j], i, tops[i][j][0]) for i in range(len(tops)) for j in range(width)),
                        key=lambda c: (-c[0], c[1], c[2]))
        survivors: list[Beam] = []
        ending: list[Beam] = []
        for rank, (total, i, token) in enumerate(ranked):
            ends = last or token in self.eos
            if ends and rank < k:
                ending.append(Beam(self.running[i].token_ids + [token], total,
                                   finish_reason="stop" if token in self.eos else "length"))
            elif not ends and len(survivors) < k:
                survivors.append(Beam(self.running[i].token_ids + [token], total))
            if rank >= k and len(survivors) >= k:
                break
        if ending:
            # the division as transformers does it: a float32 tensor by a Python float
            scores = torch.tensor([b.cum_logprob for b in ending], dtype=torch.float32) / (generated ** lp)
            for b, s in zip(ending, scores.tolist()):
                b.score = s
            self.finished = sorted(self.finished + ending, key=lambda b: -b.score)[:k]
        self.running = survivors
        self.done = last or len(self.finished) >= k or not survivors

    def output(self, tokenizer: object | None) -> BeamSearchOutput:
        for b in self.finished:
            if tokenizer is not None:
                b.text = str(tokenizer.decode(b.token_ids, skip_special_tokens=True))  # type: ignore[attr-defined]
        usage = Usage(len(self.prompt), self.cached_tokens, sum(len(b.token_ids) for b in self.finished))
        return BeamSearchOutput(list(self.prompt), list(self.finished), usage)
