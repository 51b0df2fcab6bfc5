"""Tokenizing large prompts off the event loop.

A near-context prompt takes ~10 ms to render and tokenize; a few hundred of them queued on the
event loop delay everything else (/health, every stream) by seconds. Prompts whose messages hold
more than INLINE_CHARS characters are tokenized on one worker thread instead; shorter ones inline,
where a thread hop would cost more than the work. Both kinds of prompt go through here: an OpenAI
request's messages (`chat_tokens`) and a session turn's history plus new message (`append_user`).

Owns: the worker thread and its own ChatFormatter over a deep copy of the tokenizer.

Invariants:
- The worker's tokenizer is used by the worker thread only, never by the event loop. HF fast
  tokenizers flip a flag on the Rust tokenizer between template text and message content
  (`split_special_tokens`); sharing one tokenizer between threads could fail with "Already
  borrowed" or, worse, tokenize a message's control strings as special tokens (a template injection).
- One worker, first come first served: with the generation caps in front (admission.py) its queue
  is bounded, and the tokens are the same as the inline path's (same template, same tokenizer).
- `close()` stops the thread; work submitted after that runs inline.
"""

from __future__ import annotations

import asyncio
import copy
from concurrent.futures import ThreadPoolExecutor

from radixserve.engine.chat_template import ChatFormatter, Message, TurnTokens

INLINE_CHARS = 8192  # about 2k tokens, ~3 ms: below this the event loop tokenizes itself


class PromptWorker:
    def __init__(self, formatter: ChatFormatter) -> None:
        """Call before `formatter` is in use by anyone else (its tokenizer is copied)."""
        self.formatter = formatter
        self._own = ChatFormatter(copy.deepcopy(formatter.tokenizer))
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(1, thread_name_prefix="radixserve-tokenize")

    async def chat_tokens(self, messages: list[Message]) -> tuple[list[int], list[int]]:
        """(the whole prompt ending in the generation prompt, the leading system messages' tokens)."""
        if self._pool is None or _chars(messages) <= INLINE_CHARS:
            return _chat_tokens(self.formatter, messages)
        return await asyncio.get_running_loop().run_in_executor(self._pool, _chat_tokens, self._own, messages)

    async def append_user(self, history: list[Message], content: str) -> TurnTokens:
        """ChatFormatter.append_user: rendering `history` costs as much as the new message, so both count."""
        if self._pool is None or _chars(history) + len(content) <= INLINE_CHARS:
            return self.formatter.append_user(history, content)
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._own.append_user, history, content)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def _chat_tokens(formatter: ChatFormatter, messages: list[Message]) -> tuple[list[int], list[int]]:
    return formatter.prompt_tokens(messages), formatter.system_tokens(messages)


def _chars(messages: list[Message]) -> int:
    return sum(len(m["content"]) for m in messages)
