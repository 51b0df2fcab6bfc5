"""Incremental detokenization (never a split character, stop strings never leak), with the embedded
model's real tokenizer. The sampler's maths is tested in test_sampler.py."""

from __future__ import annotations

import functools

import pytest

from radixserve.engine.detokenizer import IncrementalDetokenizer
from radixserve.model.embedded import embedded_model_dir
from radixserve.model.loader import load_tokenizer


@functools.lru_cache(maxsize=1)
def tokenizer():
    return load_tokenizer(embedded_model_dir())


def stream(text: str, stop: list[str]) -> tuple[list[str], IncrementalDetokenizer]:
    d = IncrementalDetokenizer(tokenizer(), stop)
    deltas = []
    for t in tokenizer().encode(text):
        d.add([t])
        deltas.append(d.delta(final=False))
        if d.stopped:
            break
    deltas.append(d.delta(final=True))
    return deltas, d


@pytest.mark.parametrize("text", ["Hello, world! 你好，世界 🙂🚀 café", "  spaced   out\n\ncode: `x = 1`  "])
def test_streamed_deltas_rebuild_the_text_without_broken_characters(text: str) -> None:
    deltas, _ = stream(text, [])
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_stop_string_truncates_and_never_leaks() -> None:
    deltas, d = stream("The answer is 42. END of story, more words here.", ["END", "zzz"])
    assert d.stopped
    assert "".join(deltas) == "The answer is 42. "
    assert not any("E" in x for x in deltas)
    assert d.stop_match == "END"  # what the engine reports as the output's stop_reason


def test_the_matched_stop_string_is_the_earliest_in_the_text() -> None:
    _, d = stream("The answer is 42. END of story, more words here.", ["story", "END"])
    assert d.stopped and d.stop_match == "END"
    _, d = stream("The answer is 42.", ["zzz"])
    assert not d.stopped and d.stop_match is None


def test_ids_beyond_the_tokenizer_decode_to_nothing() -> None:
    """A model's vocabulary may exceed its tokenizer's (padded embeddings; `bench step`'s Llama shapes
    carry SmolLM2's tokenizer under a 128256-row vocabulary): such ids add no text and raise nothing."""
    size = len(tokenizer())
    hello = tokenizer().encode("Hello")
    d = IncrementalDetokenizer(tokenizer(), [])
    for t in [hello[0], size, size + 1000, 128255, *hello[1:]]:
        d.add([t])
    assert d.delta(final=True) == "Hello"
