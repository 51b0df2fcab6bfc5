"""OpenAI's Responses API: POST /v1/responses (streaming and not), GET and DELETE /v1/responses/{id}.

A request is read by input.py, its prompt built from the conversation it continues and its response
kept by store.py (the exact-token and ownership rules are there), its bodies and events made by
events.py; the prompt is planned by the one pipeline (server/pipeline/). The guards are the chat
endpoint's, in the same order: the API key (middleware), a generation slot (`hold_generation`)
before any tokenizing, the prompt limit (`plan.admit_prompt`), the engine's one check of the
request, then, for a response to keep, one creation charged to the client address (rate_limit.py, as
a session create is: owner secrets are free to mint, and each stored response takes a place in the
store that sessions compete for) and its room in the store — every refusal a JSON error before any
response starts. A client that disconnects, streaming or not, aborts the engine request, and the
response is not kept.

Invariant: a ResponseRun settles exactly once — its reply stored (completed / incomplete) or its
entry removed (failed, aborted, or never started because the client left first) — so no stored
response stays busy.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from radixserve.chat.reasoning import ReasoningDelta, ReplyPiece
from radixserve.chat.tools import ToolCallDelta
from radixserve.core import RequestOutput
from radixserve.sampling_fields import Api
from radixserve.server.admission import client_of
from radixserve.server.auth import priority_bounds, request_key
from radixserve.server.callers import caller_of
from radixserve.server.http_util import EventStream, generation_body, reply_unless_gone
from radixserve.server.pipeline.ask import Ask, TokenPrompt
from radixserve.server.pipeline.plan import Plan, plan
from radixserve.server.pipeline.reasoning import reasoning_of
from radixserve.server.responses.events import ItemText, OutputItems, ResponseHead, response_events
from radixserve.server.responses.input import ResponsesAsk, parse_ask
from radixserve.server.responses.store import (
    Prompt,
    StoredResponse,
    build_prompt,
    close_entry,
    find_response,
    new_id,
    open_entry,
    previous_response,
    response_owner,
)
from radixserve.server.state import ServerState
from radixserve.server.validation import ApiError


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
    items: OutputItems = field(init=False)  # the reply's output items, as its text arrives

    def __post_init__(self) -> None:
        self.items = OutputItems(self.head.item_id)
        self.reader = self.plan.reader()  # its reasoning, then its answer read for calls

    async def deltas(self) -> AsyncGenerator[ItemText, None]:
        """The reply's text as the engine hands it out, each piece with the output item it went to; the
        run is settled when this ends, however."""
        try:
            async with aclosing(self.plan.stream(self.state, request_id=self.head.id)) as outputs:
                async for out in outputs:
                    self.last = out
                    for o in out.outputs[:1]:
                        self.generated += o.token_ids
                        self.finish = o.finish_reason or self.finish
                        pieces = self.reader.feed(o.text, len(o.token_ids))
                        if o.finish_reason:
                            pieces += self.reader.finish(cut=o.finish_reason == "length")
                        for piece in pieces:
                            if (added := self._item(piece)) is not None:
                                yield added
            if self.last is None or self.finish in (None, "abort"):  # the client is still here: the server aborted it
                raise ApiError("unavailable", "the generation was aborted (the server is shutting down)", 503)
        except BaseException:
            self.settle()
            raise
        self._complete()

    def _item(self, piece: ReplyPiece) -> ItemText | None:
        """Where a piece of the reply goes: a reasoning or message item, or a call's (the first call only
        without parallel calls)."""
        if isinstance(piece, ToolCallDelta):
            tools = self.plan.ask.tools
            if piece.index > 0 and tools is not None and not tools.parallel:
                return None
            if piece.id is not None:
                return self.items.call(piece.id, piece.name or "", piece.arguments)
            return self.items.add("function_call", piece.arguments)
        return self.items.add("reasoning" if isinstance(piece, ReasoningDelta) else "message", piece.text)

    def _complete(self) -> None:
        assert self.last is not None and self.finish is not None
        self.body = self.head.body("incomplete" if self.finish == "length" else "completed", self.items,
                                   self.last.usage, reasoning_tokens=self.reader.reasoning_tokens)
        if self.entry is not None:  # should this fail, the run is still unsettled: the entry goes
            formatter, store = self.state.require_chat()
            end_ids = tuple(self.state.require_engine().eos_token_ids) + tuple(self.plan.params.stop_token_ids)
            reasoning = self.reader.reasoning_text if self.plan.ask.reasoning is not None else None
            calls = self.items.chat_calls()
            finish = "tool_calls" if calls and self.finish == "stop" else self.finish
            close_entry(store, formatter, self.entry, self.prompt, self.generated, end_ids, self.items.content,
                        finish, self.body, reasoning, calls)
        self.settled = True

    def settle(self) -> None:
        """Unless it completed: the response is not kept. Idempotent."""
        if not self.settled:
            self.settled = True
            if self.entry is not None and self.state.sessions is not None:
                self.state.sessions.remove(self.entry)

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
                                    variables=ask.variables, reasoning=reasoning_of(state)))
    params = planned.params
    head = ResponseHead(new_id("resp"), new_id("msg"), int(time.time()), ask, params.temperature, params.top_p)
    entry = None
    if ask.store:
        state.limit_creation(client_of(request))  # after every check: a refused body costs no allowance
        entry = open_entry(store, head.id, owner, ask.instructions, prompt, head.body("in_progress"), caller.tenant,
                           ask.variables, tuple(ask.tools.template_tools() or ()) if ask.tools is not None else ())
    return ResponseRun(state, head, prompt, planned, entry)


class _ResponseStream(EventStream):
    """The run is settled when the response ends, even if the client left before the events began."""

    def __init__(self, run: ResponseRun) -> None:
        super().__init__(response_events(run.head, run.deltas(), run.final, run.state.metrics))
        self.run = run

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.run.settle()


async def create_response(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await generation_body(request)
    state.require_chat()
    ask = parse_ask(body, state, priority_bounds(request_key(request.headers), state.config))
    run = await prepare(state, request, ask)
    if ask.stream:
        return _ResponseStream(run)
    try:
        return await reply_unless_gone(request.receive, _whole(run))
    finally:
        run.settle()


async def _whole(run: ResponseRun) -> Response:
    async with aclosing(run.deltas()) as deltas:
        async for _ in deltas:
            pass
    return JSONResponse(run.final())


async def response_item(request: Request) -> Response:
    state: ServerState = request.app.state.server
    _, store = state.require_chat()
    if request.query_params.get("stream") not in (None, "false"):
        raise ApiError("unsupported", "streaming a stored response again is not supported by this server",
                       param="stream")
    found = find_response(store, request.path_params["response_id"], response_owner(request.headers,
                                                                                     caller_of(request)))
    if request.method == "GET":
        return JSONResponse(found.body)
    store.remove(found)  # a generation in flight still answers its client, unkept (store.py)
    return JSONResponse({"id": found.id, "object": "response", "deleted": True})


ROUTES = [
    Route("/v1/responses", create_response, methods=["POST"]),
    Route("/v1/responses/{response_id}", response_item, methods=["GET", "DELETE"]),
]
