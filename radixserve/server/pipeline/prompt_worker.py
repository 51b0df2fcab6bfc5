"""Tokenizing large prompts off the event loop.

A near-context prompt takes ~10 ms to render and tokenize; a few hundred of them queued on the
event loop delay everything else (/health, every stream) by seconds. Prompts whose messages hold
more than INLINE_CHARS characters are tokenized on one worker thread instead; shorter ones inline,
where a thread hop would cost more than the work. Both kinds of prompt go through here: an OpenAI
request's messages (`chat_tokens`) and a session turn's history plus new messages (`append_messages`:
a user message, or tool results), the system tokens a Responses request's instructions render to,
a /v1/completions prompt's plain text (`encode`, as the engine's intake tokenizes a string), and a
request's `prediction` text (`encode_prediction`, as the engine's intake tokenizes a text prediction).

Owns: the worker thread and its own ChatFormatter over a deep copy of the tokenizer.

Invariants:
- The worker's tokenizer is used by the worker thread only, never by the event loop. HF fast
  tokenizers flip a flag on the Rust tokenizer between template text and message content
  (`split_special_tokens`); sharing one tokenizer between threads could fail with "Already
  borrowed" or, worse, tokenize a message's control strings as special tokens (a template injection).
- One worker. Its queue is ordered: a generation's work (the default) goes before any background
  work still waiting (`background_work()`: /v1/messages/count_tokens, which generates nothing), first
  come first served within each, so a flood of background work delays a generation's tokenizing by
  at most the one job already running (background work waits while generations keep the worker
  busy). With the generation caps in front of both (admission.py: count_tokens holds a slot too)
  the queue is bounded, and the tokens are the same as the inline path's (same template, same
  tokenizer).
- A job whose caller has gone (its awaiting task cancelled) before it starts is skipped.
- `close()` stops the thread after the job it is running, cancelling those still waiting; work
  submitted after that runs inline.
- A conversation the chat template raises on (its `raise_exception`: roles that must alternate, a
  system message where it takes none) is the client's: a 400 ApiError coded TEMPLATE_REFUSED naming
  `messages`, on every path that renders, never a 500.
"""

from __future__ import annotations

import asyncio
import copy
import heapq
import itertools
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, TypeVar

from jinja2.exceptions import TemplateError

from radixserve.chat.template import ChatFormatter, Message, TurnTokens, Variables
from radixserve.chat.tools import ToolSpec
from radixserve.engine.intake import prediction_ids, tokenize
from radixserve.server.validation import ApiError

INLINE_CHARS = 8192  # about 2k tokens, ~3 ms: below this the event loop tokenizes itself
GENERATION, BACKGROUND = 0, 1  # a job's rank in the queue: lower goes first
T = TypeVar("T")
# the rank of the work the current task submits; a context variable so that code shared by a
# generation and by count_tokens (plan.tokenize) need not pass it along
_RANK: ContextVar[int] = ContextVar("radixserve_prompt_rank", default=GENERATION)


@contextmanager
def background_work() -> Iterator[None]:
    """Work the current task submits inside this block waits behind every generation's."""
    token = _RANK.set(BACKGROUND)
    try:
        yield
    finally:
        _RANK.reset(token)


@dataclass(order=True)
class _Job:
    rank: int
    seq: int  # first come first served within a rank
    fn: Callable[..., Any] = field(compare=False)
    args: tuple[Any, ...] = field(compare=False)
    future: Future[Any] = field(compare=False)


class PromptWorker:
    def __init__(self, formatter: ChatFormatter) -> None:
        """Call before `formatter` is in use by anyone else (its tokenizer is copied)."""
        self.formatter = formatter
        self._own = ChatFormatter(copy.deepcopy(formatter.tokenizer), formatter.tool_format)
        self._jobs: list[_Job] = []  # a heap
        self._seq = itertools.count()
        self._ready = threading.Condition()
        self.closed = False
        threading.Thread(target=self._serve, name="radixserve-tokenize", daemon=True).start()

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on the worker thread, ranked by the submitting task's `_RANK`."""
        future: Future[T] = Future()
        with self._ready:
            if self.closed:
                raise RuntimeError("the prompt worker is closed")
            heapq.heappush(self._jobs, _Job(_RANK.get(), next(self._seq), fn, args, future))
            self._ready.notify()
        return await asyncio.wrap_future(future)  # cancelling the wait cancels the job if not started

    def _serve(self) -> None:
        while True:
            with self._ready:
                while not self._jobs and not self.closed:
                    self._ready.wait()
                if self.closed:
                    return
                job = heapq.heappop(self._jobs)
            if not job.future.set_running_or_notify_cancel():
                continue  # its caller has gone
            try:
                result = job.fn(*job.args)
            except BaseException as e:  # handed to the caller, as an executor does
                job.future.set_exception(e)
            else:
                job.future.set_result(result)

    async def chat_tokens(self, messages: list[Message], tools: list[ToolSpec] | None = None,
                          variables: Variables | None = None) -> tuple[list[int], list[int]]:
        """(the whole prompt ending in the generation prompt, the leading system messages' tokens);
        `tools` are rendered as the template renders them (the tool definitions count as characters too),
        with the template `variables`."""
        chars = _chars(messages) + sum(len(t.description) + len(str(t.parameters)) for t in tools or ())
        args = (messages, tools, variables) if variables else (messages, tools)
        if self.closed or chars <= INLINE_CHARS:
            return _chat_tokens(self.formatter, *args)
        return await self._off_loop(_chat_tokens, self._own, *args)

    async def append_messages(self, history: list[Message], messages: list[Message],
                              tools: list[ToolSpec] | None = None, variables: Variables | None = None) -> TurnTokens:
        """ChatFormatter.append_messages: rendering `history` costs as much as the new messages, so both count."""
        if self.closed or _chars(history) + _chars(messages) <= INLINE_CHARS:
            return _append(self.formatter, history, messages, tools, variables)
        return await self._off_loop(_append, self._own, history, messages, tools, variables)

    async def system_tokens(self, messages: list[Message], variables: Variables | None = None,
                            tools: list[ToolSpec] | None = None) -> list[int]:
        """ChatFormatter.system_tokens (a Responses request's instructions and tools, which may be long)."""
        chars = _chars(messages) + sum(len(t.description) + len(str(t.parameters)) for t in tools or ())
        if self.closed or chars <= INLINE_CHARS:
            return self.formatter.system_tokens(messages, tools, variables)
        return await self._off_loop(_system_tokens, self._own, messages, variables, tools)

    async def encode(self, text: str) -> list[int]:
        """A plain-text prompt's token ids, exactly as the engine's intake tokenizes a string (BOS
        where the model wants one)."""
        if self.closed or len(text) <= INLINE_CHARS:
            return tokenize(self.formatter.tokenizer, text)
        return await self._off_loop(tokenize, self._own.tokenizer, text)

    async def encode_prediction(self, text: str) -> list[int]:
        """A prediction's token ids (prediction.py): the text alone, no special tokens added and
        special-token text split as plain text, as the engine's intake tokenizes a text prediction."""
        if self.closed or len(text) <= INLINE_CHARS:
            return prediction_ids(self.formatter.tokenizer, text)
        return await self._off_loop(prediction_ids, self._own.tokenizer, text)

    def close(self) -> None:
        with self._ready:
            self.closed = True
            waiting, self._jobs = self._jobs, []
            self._ready.notify()
        for job in waiting:
            job.future.cancel()


TEMPLATE_REFUSED = "template_refused"  # the ApiError code of a conversation the chat template raises on


def _rendering(fn: Callable[..., T]) -> Callable[..., T]:
    """`fn`, its template's refusal raised as the client's 400 (see the module docstring)."""
    def render(*args: Any) -> T:
        try:
            return fn(*args)
        except TemplateError as e:
            raise ApiError(TEMPLATE_REFUSED, f"this model's chat template refuses the conversation: {e}",
                           param="messages") from None
    return render


@_rendering
def _chat_tokens(formatter: ChatFormatter, messages: list[Message], tools: list[ToolSpec] | None,
                 variables: Variables | None = None) -> tuple[list[int], list[int]]:
    return (formatter.prompt_tokens(messages, tools, variables),
            formatter.system_tokens(messages, tools, variables))


@_rendering
def _system_tokens(formatter: ChatFormatter, messages: list[Message], variables: Variables | None,
                   tools: list[ToolSpec] | None) -> list[int]:
    return formatter.system_tokens(messages, tools, variables)


@_rendering
def _append(formatter: ChatFormatter, history: list[Message], messages: list[Message],
            tools: list[ToolSpec] | None, variables: Variables | None = None) -> TurnTokens:
    """A plain user message (no tools) takes append_user, the path plain chat always took."""
    if tools is None and len(messages) == 1 and messages[0]["role"] == "user":
        if variables:
            return formatter.append_user(history, messages[0]["content"], variables=variables)
        return formatter.append_user(history, messages[0]["content"])
    return formatter.append_messages(history, messages, tools, variables)


def _chars(messages: list[Message]) -> int:
    """Characters to render: contents (an assistant's may be None beside its tool calls), earlier
    reasoning and call arguments."""
    return sum(len(m.get("content") or "") + len(m.get("reasoning_content") or "")
               + sum(len(str(c)) for c in m.get("tool_calls") or ()) for m in messages)
