"""Turning what a caller sends into a prompt the engine accepts, or a clear RequestError.

A prompt is a string (tokenized with the model's tokenizer, BOS where the model wants one, as vLLM
does) or a list of integer token ids; it must be non-empty, inside the vocabulary, and leave room
for at least one generated token in the longest sequence the engine allows. A priority is an integer
(a bool is not one) with |priority| <= PRIORITY_LIMIT; lower runs first under `--policy priority`.
"""

from __future__ import annotations

from typing import Any

from radixserve.errors import PromptTooLongError, RequestError
from radixserve.sampling_params import SamplingParams

PRIORITY_LIMIT = 2**31  # |priority| at most this: any sane scheme fits, and keys stay small ints


def tokenize(tokenizer: Any, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestError("this model directory has no tokenizer: send token ids")
        return list(tokenizer.encode(prompt))
    if not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise RequestError("a prompt is a string or a list of integer token ids")
    return list(prompt)


def validate(token_ids: list[int], params: SamplingParams, vocab: int, max_seq_len: int) -> None:
    if not token_ids:
        raise RequestError("the prompt is empty")
    bad = [t for t in token_ids if not 0 <= t < vocab]
    if bad:
        raise RequestError(f"token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
    if len(token_ids) >= max_seq_len:
        raise PromptTooLongError(len(token_ids), params.max_tokens, max_seq_len)
    params.validate()


def validate_priority(priority: object) -> int:
    """The request's priority, or a RequestError naming what is wrong with it."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise RequestError(f"priority must be an integer, got {type(priority).__name__}")
    if abs(priority) > PRIORITY_LIMIT:
        raise RequestError(f"priority must be in [-2**31, 2**31], got {priority}")
    return priority
