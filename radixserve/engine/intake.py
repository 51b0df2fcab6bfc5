"""The engine's intake: the one place a request's prompt, sampling parameters and priority are
checked, turning what a caller sends into a `ValidatedRequest` or a clear RequestError.

A prompt is a string (tokenized with the model's tokenizer, BOS where the model wants one, as vLLM
does) or a list of integer token ids; it must be non-empty, inside the vocabulary, and leave room
for at least one generated token in the longest sequence the engine allows. A priority is an integer
(a bool is not one) with |priority| <= PRIORITY_LIMIT; lower runs first under `--policy priority`.
Every token id a request names (logit_bias, stop_token_ids, allowed_token_ids, and bad_words as the
model's tokenizer splits them: `bad_words_ids`) must be inside the vocabulary; the error names the
field.

Invariants:
- a request is checked once, by `Intake.check`, on the caller's thread before anything is queued
  (`LLMEngine.add_request`, `AsyncEngine.generate`, the server through its engine client); what
  passes travels as a ValidatedRequest, which `LLMEngine.add_validated` and
  `AsyncEngine.generate_validated` queue without checking it again. Only `Intake.check` makes one.
- a ValidatedRequest names the limits it was checked against; an engine with tighter limits (a
  replica whose pool is smaller than the one the ingress asked about) checks it again in `admit`, so
  no request is queued past a limit it was not checked for.
- a constrained ValidatedRequest holds its compiled grammar from the check on, so the engine never
  looks it up again (it may have left the grammar cache since); the grammar does not cross a process
  (a Ray replica), where `admit` compiles it into that engine's cache, off the event loop
  (`needs_compile` tells the caller to hand `admit` a worker thread).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from radixserve.engine.grammar import CompiledGrammar, GrammarCompiler
from radixserve.engine.token_rules import bad_words_ids
from radixserve.errors import FieldError, PromptTooLongError, RequestError
from radixserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from radixserve.engine.engine import LLMEngine

PRIORITY_LIMIT = 2**31  # |priority| at most this: any sane scheme fits, and keys stay small ints


@dataclass(frozen=True)
class Limits:
    vocab: int
    max_seq_len: int  # the longest sequence (prompt + generated) the engine runs

    def within(self, other: Limits) -> bool:
        """Whatever passed these limits also passes `other`."""
        return self.vocab <= other.vocab and self.max_seq_len <= other.max_seq_len


@dataclass(frozen=True)
class ValidatedRequest:
    """A request `Intake.check` accepted: its token ids, parameters and priority, ready to queue."""

    token_ids: list[int]
    params: SamplingParams
    priority: int
    limits: Limits
    prediction_ids: tuple[int, ...] = ()  # params.prediction, tokenized (a source of drafts)
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # params.bad_words, tokenized (engine/token_rules.py)
    grammar: CompiledGrammar | None = field(default=None, compare=False, repr=False)  # params.structured's

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (to a replica) without the grammar: a matcher lives in one process."""
        return {**self.__dict__, "grammar": None}


class Intake:
    def __init__(self, tokenizer: Any, limits: Limits, grammars: GrammarCompiler | None = None) -> None:
        self.tokenizer, self.limits, self.grammars = tokenizer, limits, grammars

    @classmethod
    def of(cls, engine: LLMEngine) -> Intake:
        return cls(engine.tokenizer, Limits(engine.spec.vocab_size, engine.max_seq_len), engine.grammars)

    def check(self, prompt: str | list[int], params: SamplingParams, priority: object = 0) -> ValidatedRequest:
        """The request, checked; RequestError (a ValueError) naming what is wrong otherwise. A
        structured-output constraint is compiled here (ConstraintError if it cannot be), so the
        engine finds it in its grammar cache."""
        token_ids = tokenize(self.tokenizer, prompt)
        validate(token_ids, params, self.limits.vocab, self.limits.max_seq_len)
        grammar = None
        if params.structured is not None:
            if self.grammars is None:
                raise RequestError("this engine cannot constrain output (structured output is not available)")
            grammar = self.grammars.compile(params.structured, namespace=params.cache_namespace)
        return ValidatedRequest(token_ids, params, validate_priority(priority), self.limits,
                                self._prediction_ids(params), self._bad_words_ids(params), grammar)

    def _bad_words_ids(self, params: SamplingParams) -> tuple[tuple[int, ...], ...]:
        """The banned token sequences of params.bad_words, inside the vocabulary."""
        if not params.bad_words:
            return ()
        if self.tokenizer is None:
            raise FieldError("bad_words", "this model directory has no tokenizer: bad_words cannot be tokenized")
        words = bad_words_ids(self.tokenizer, params.bad_words)
        _inside("bad_words", sorted({t for word in words for t in word}), self.limits.vocab)
        return words

    def _prediction_ids(self, params: SamplingParams) -> tuple[int, ...]:
        """The prediction as token ids: text is tokenized as output is (no BOS); ids outside the
        vocabulary are refused."""
        prediction = params.prediction
        if prediction is None:
            return ()
        if isinstance(prediction, str):
            if self.tokenizer is None:
                raise FieldError("prediction", "this model directory has no tokenizer: send the prediction as token ids")
            return tuple(prediction_ids(self.tokenizer, prediction))
        if any(t >= self.limits.vocab for t in prediction):
            raise FieldError("prediction", f"prediction token ids must be in [0, {self.limits.vocab})")
        return tuple(prediction)

    def admit(self, request: ValidatedRequest) -> ValidatedRequest:
        """`request` as this engine may queue it: as it is when its limits fit within these (always,
        for one checked here), else checked again against these; a constraint whose grammar did not
        come with it (it crossed a process) compiled into this engine's grammar cache."""
        if not request.limits.within(self.limits):
            return self.check(request.token_ids, request.params, request.priority)  # tokenizes the prediction again
        structured = request.params.structured
        if self.needs_compile(request) and structured is not None and self.grammars is not None:
            return replace(request, grammar=self.grammars.ensure(structured, request.params.cache_namespace))
        return request

    def needs_compile(self, request: ValidatedRequest) -> bool:
        """Whether `admit` may compile (or check again): then it belongs on a worker thread."""
        structured = request.params.structured is not None and request.grammar is None and self.grammars is not None
        return structured or not request.limits.within(self.limits)


def tokenize(tokenizer: Any, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestError("this model directory has no tokenizer: send token ids")
        return list(tokenizer.encode(prompt))
    if not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise RequestError("a prompt is a string or a list of integer token ids")
    return list(prompt)


def prediction_ids(tokenizer: Any, text: str) -> list[int]:
    """A text prediction's token ids: the text alone, no special tokens added, special-token text
    tokenized as the plain text it is (as message content is)."""
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])


def validate(token_ids: list[int], params: SamplingParams, vocab: int, max_seq_len: int) -> None:
    if not token_ids:
        raise RequestError("the prompt is empty")
    if min(token_ids) < 0 or max(token_ids) >= vocab:  # in C: the list is built only for the message
        bad = [t for t in token_ids if not 0 <= t < vocab]
        raise RequestError(f"token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
    if len(token_ids) >= max_seq_len:
        raise PromptTooLongError(len(token_ids), params.max_tokens, max_seq_len)
    params.validate()
    _inside("logit_bias", params.logit_bias, vocab)
    _inside("stop_token_ids", params.stop_token_ids, vocab)
    _inside("allowed_token_ids", params.allowed_token_ids or (), vocab)


def _inside(name: str, ids: Iterable[int], vocab: int) -> None:
    """FieldError naming `name` when any of `ids` is outside the vocabulary."""
    outside = sorted(t for t in ids if t >= vocab)
    if outside:
        raise FieldError(name, f"{name} names token ids outside the vocabulary [0, {vocab}): {outside[:5]}")


def validate_priority(priority: object) -> int:
    """The request's priority, or a RequestError naming what is wrong with it."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise RequestError(f"priority must be an integer, got {type(priority).__name__}")
    if abs(priority) > PRIORITY_LIMIT:
        raise RequestError(f"priority must be in [-2**31, 2**31], got {priority}")
    return priority
