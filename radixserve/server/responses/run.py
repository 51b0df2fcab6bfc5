"""One response's generation (`ResponseRun`): its checked engine request, the output items its reply
writes as the text arrives, and its stored entry settled once it ends.

`prepare` makes one: the prompt built from the conversation it continues (store.py: the exact-token
and truncation rules), planned by the one pipeline (server/pipeline/), then, for a response to keep,
one creation charged to the client address (rate_limit.py, as a session create is: owner secrets
are free to mint, and each stored response takes a place in the store that sessions compete for)
and its room in the store — every refusal an ApiError before anything starts. `deltas` runs it: the
reply read (its reasoning, its answer read for tool calls: Plan.reader) into output items
(events.OutputItems), a function_call item per call up to the calls allowed (only the first without
parallel calls, at most `max_tool_calls`: later ones are dropped), and with logprobs asked each
engine output's tokens given to the answer text it wrote (events.py says which tokens go where; a
final end token goes with none: no text holds it).

Invariant: a ResponseRun settles exactly once — its reply stored (completed / incomplete) or, when
it fails, is aborted or never starts, its entry removed (a foreground response: its client has the
error or is gone) or kept "failed" / "cancelled" with its error (a background one: its poller has no
other way to learn it) — so no stored response stays busy.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from radixserve.chat.reasoning import ReasoningDelta, ReplyPiece
from radixserve.chat.tools import ToolCallDelta
from radixserve.core import CompletionOutput, RequestOutput
from radixserve.sampling_fields import Api
from radixserve.server.admission import client_of
from radixserve.server.callers import caller_of
from radixserve.server.pipeline.ask import Ask, LogprobBudget, TokenPrompt
from radixserve.server.pipeline.logprobs import TokenTexts, logprobs_body
from radixserve.server.pipeline.plan import Plan, plan
from radixserve.server.pipeline.reasoning import reasoning_of
from radixserve.server.pipeline.stream import api_error_from
from radixserve.server.responses.events import ItemText, OutputItems, ResponseHead
from radixserve.server.responses.input import ResponsesAsk
from radixserve.server.responses.store import (
    Prompt,
    StoredResponse,
    build_prompt,
    close_entry,
    new_id,
    open_entry,
    previous_response,
    response_owner,
)
from radixserve.server.state import ServerState
from radixserve.server.validation import ApiError

ABORTED = "the generation was aborted (the server is shutting down)"


@dataclass
class ResponseRun:
    """One response's generation: its checked engine request, its stored entry and what it produced."""

    state: ServerState
    head: ResponseHead
    prompt: Prompt
    plan: Plan  # its one prompt, checked by the engine
    entry: StoredResponse | None  # None with store: false
    generated: list[int] = field(default_factory=list)
    finish: str | None = None
    last: RequestOutput | None = None
    body: dict[str, Any] | None = None  # the response object, once complete
    settled: bool = False
    cancelled: bool = False  # a background run its owner cancelled: settled "cancelled", not "failed"
    items: OutputItems = field(init=False)  # the reply's output items, as its text arrives
    texts: TokenTexts | None = field(init=False)  # how logprobs show tokens; None when not asked
    pending: list[dict[str, Any]] = field(default_factory=list)  # logprobs of tokens that wrote no text yet

    def __post_init__(self) -> None:
        self.items = OutputItems(self.head.item_id)
        self.reader = self.plan.reader()  # its reasoning, then its answer read for calls
        self.texts = self.state.token_texts() if self.plan.params.logprobs is not None else None

    def started(self) -> None:
        """A queued background run begins: its stored body says so."""
        if self.entry is not None and not self.settled:
            self.entry.body = self.head.body("in_progress")

    async def deltas(self) -> AsyncGenerator[ItemText, None]:
        """The reply's text as the engine hands it out, each piece with the output item it went to; the
        run is settled when this ends, however. Every failure is raised as an ApiError (an unexpected
        one logged once, here)."""
        try:
            async with aclosing(self.plan.stream(self.state, request_id=self.head.id)) as outputs:
                async for out in outputs:
                    self.last = out
                    for o in out.outputs[:1]:
                        self.generated += o.token_ids
                        self.finish = o.finish_reason or self.finish
                        if self.texts is not None:
                            self.pending += self._logprobs(o)
                        pieces = self.reader.feed(o.text, len(o.token_ids))
                        if o.finish_reason:
                            pieces += self.reader.finish(cut=o.finish_reason == "length")
                        for piece in pieces:
                            if (added := self._item(piece)) is not None:
                                yield added
                        if pieces:  # this output's tokens went with its text, or were reasoning or calls
                            self.pending = []
            if self.last is None or self.finish in (None, "abort"):  # the client is still here: the server aborted it
                raise ApiError("unavailable", ABORTED, 503)
        except Exception as e:
            err = api_error_from(e)
            self.settle(err)
            if err is e:
                raise
            raise err from e
        except BaseException:  # closed (the client left) or cancelled
            self.settle()
            raise
        self._complete()

    def _logprobs(self, o: CompletionOutput) -> list[dict[str, Any]]:
        """The logprob entries of an engine output's tokens, but a final end token's (no text has it)."""
        assert self.texts is not None
        lps = o.logprobs or []
        if o.finish_reason == "stop" and o.token_ids and o.token_ids[-1] in self.end_ids:
            lps = lps[:len(o.token_ids) - 1]
        return logprobs_body(lps, self.texts)["content"]

    @property
    def end_ids(self) -> tuple[int, ...]:
        """The tokens that end a reply: the model's and the request's stop tokens."""
        return tuple(self.state.require_engine().eos_token_ids) + tuple(self.plan.params.stop_token_ids)

    def _item(self, piece: ReplyPiece) -> ItemText | None:
        """Where a piece of the reply goes: a reasoning or message item, or a call's (the first call only
        without parallel calls, the first max_tool_calls)."""
        if isinstance(piece, ToolCallDelta):
            tools, most = self.plan.ask.tools, self.head.ask.max_tool_calls
            if (piece.index > 0 and tools is not None and not tools.parallel) or (most is not None
                                                                                    and piece.index >= most):
                return None
            if piece.id is not None:
                return self.items.call(piece.id, piece.name or "", piece.arguments)
            return self.items.add("function_call", piece.arguments)
        if isinstance(piece, ReasoningDelta):
            return self.items.add("reasoning", piece.text)
        if not piece.text:
            return None
        logprobs, self.pending = self.pending, []
        return self.items.add("message", piece.text, logprobs)

    def _complete(self) -> None:
        assert self.last is not None and self.finish is not None
        self.body = self.head.body("incomplete" if self.finish == "length" else "completed", self.items,
                                   self.last.usage, reasoning_tokens=self.reader.reasoning_tokens)
        if self.entry is not None:  # should this fail, the run is still unsettled: the entry goes
            formatter, store = self.state.require_chat()
            end_ids = self.end_ids
            reasoning = self.reader.reasoning_text if self.plan.ask.reasoning is not None else None
            calls = self.items.chat_calls()
            finish = "tool_calls" if calls and self.finish == "stop" else self.finish
            close_entry(store, formatter, self.entry, self.prompt, self.generated, end_ids, self.items.content,
                        finish, self.body, reasoning, calls)
        self.settled = True

    def settle(self, error: ApiError | None = None) -> None:
        """Unless it completed: a foreground response is not kept; a background one is kept "cancelled"
        (what it wrote) or "failed" with `error` (the server's abort when None). Idempotent."""
        if self.settled:
            return
        self.settled = True
        entry, store = self.entry, self.state.sessions
        if entry is None or store is None:
            return
        if not self.head.ask.background:
            store.remove(entry)
            return
        usage = self.last.usage if self.last is not None else None
        entry.keep(self.head.body("cancelled", self.items, usage, reasoning_tokens=self.reader.reasoning_tokens)
                   if self.cancelled else self.head.body("failed", error=error or ApiError("unavailable", ABORTED, 503)))
        entry.busy = None
        store.touch(entry)
        store.account(entry)

    def final(self) -> dict[str, Any]:
        assert self.body is not None, "read after the deltas ended"
        return self.body


async def prepare(state: ServerState, request: Request, ask: ResponsesAsk) -> ResponseRun:
    """The checked generation and, to keep, its entry in the store; refusals raise before anything starts."""
    _, store = state.require_chat()
    caller = caller_of(request)
    owner = response_owner(request.headers, caller)
    previous = previous_response(store, ask, owner)
    prompt = await build_prompt(state, ask, previous)  # long histories are tokenized off the event loop
    planned = await plan(state, Ask(Api.RESPONSES, TokenPrompt(prompt.tokens(), prompt.head[:prompt.system_len],
                                                               ask.instructions),
                                    ask.sampling, caller.tenant, ask.cache_salt, ask.tools, priority=ask.priority,
                                    logprobs=LogprobBudget(ask.sampling.logprobs),
                                    variables=ask.variables, reasoning=reasoning_of(state)))
    params = planned.params
    head = ResponseHead(new_id("resp"), new_id("msg"), int(time.time()), ask, params.temperature, params.top_p)
    entry = None
    if ask.store:
        state.limit_creation(client_of(request))  # after every check: a refused body costs no allowance
        entry = open_entry(store, head.id, owner, ask.instructions, prompt,
                           head.body("queued" if ask.background else "in_progress"), caller.tenant, ask.variables,
                           tuple(ask.tools.template_tools() or ()) if ask.tools is not None else ())
    return ResponseRun(state, head, prompt, planned, entry)
