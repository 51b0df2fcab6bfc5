"""Real English text as a deterministic stream of token ids, for building benchmark prompts.

The text comes from the MIT-licensed `chitchat-dataset` package (~7k human conversations, shipped
as one JSON file inside the package, so it loads offline; part of the bench extra, which the command
line checks for before it builds a workload: extra.py). Conversations are shuffled by the seed
and tokenized lazily; `take(n)` returns the next n tokens of that stream, so two calls never return
overlapping text and the same seed always yields the same ids. `conversation_texts` is the same
text before tokenizing, for workloads that write prompts as text (edit_texts.py).

Models without a tokenizer (the tiny random test models) get the text's UTF-8 bytes folded into the
vocabulary, which keeps the stream deterministic and text-shaped.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from functools import lru_cache
from importlib import resources


@lru_cache(maxsize=1)
def load_conversations() -> tuple[tuple[str, ...], ...]:
    """Every conversation as a tuple of its messages (consecutive utterances of one speaker joined),
    in the dataset's key order."""
    data = json.loads((resources.files("chitchat_dataset") / "dataset.json").read_text(encoding="utf-8"))
    convs = []
    for key in sorted(data):
        messages = tuple(" ".join(u["text"] for u in m).strip() for m in data[key]["messages"])
        messages = tuple(m for m in messages if m)
        if messages:
            convs.append(messages)
    return tuple(convs)


def byte_encoder(vocab_size: int) -> Callable[[str], list[int]]:
    if vocab_size < 2:
        raise ValueError("vocab_size must be at least 2")
    return lambda text: [b % vocab_size for b in text.encode("utf-8")]


def conversation_texts(seed: int) -> Iterator[str]:
    """Every conversation as text (one message a line), in the seed's order, cycled endlessly."""
    convs = load_conversations()
    epoch = 0
    while True:
        order = list(range(len(convs)))
        random.Random(f"{seed}:{epoch}").shuffle(order)
        for i in order:
            yield "\n".join(convs[i]) + "\n"
        epoch += 1


class TokenStream:
    """Endless, seed-determined stream of real-text tokens; conversations are cycled if exhausted."""

    def __init__(self, encode: Callable[[str], list[int]], seed: int) -> None:
        self._encode = encode
        self._seed = seed
        self._texts = conversation_texts(seed)
        self._buffer: list[int] = []

    def take(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError("cannot take a negative number of tokens")
        while len(self._buffer) < n:
            self._buffer.extend(self._encode(next(self._texts)))
        out, self._buffer = self._buffer[:n], self._buffer[n:]
        return out
