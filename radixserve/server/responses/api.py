"""OpenAI's Responses API: POST /v1/responses (streaming and not, in the foreground or the
background), GET and DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel.

A request is read by input.py and run by run.py (its prompt built from the conversation it continues
and its response kept by store.py — the exact-token, truncation and ownership rules are there — its
bodies and events made by events.py); the prompt is planned by the one pipeline (server/pipeline/).
The guards are the chat endpoint's, in the same order: the API key (middleware), a generation slot
(`hold_generation`) before any tokenizing, the prompt limit (`plan.admit_prompt`), the engine's one
check of the request, then, for a response to keep, one creation charged to the client address and
its room in the store — every refusal a JSON error before any response starts. A foreground client
that disconnects, streaming or not, aborts the engine request, and the response is not kept; a
background response (background.py) runs on without its client, holding its slot, until it ends or
is cancelled (the cancel route's rules are background.py's). GET `?stream=true&starting_after=N`
follows a running background stream's events again; any other stored response cannot be streamed
again (400).

Invariant: a ResponseRun settles exactly once (run.py), so no stored response stays busy.
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from radixserve.server.auth import priority_bounds, request_key
from radixserve.server.callers import caller_of
from radixserve.server.http_util import EventStream, dumps, generation_body, reply_unless_gone
from radixserve.server.pipeline.logprobs import OFFLOAD_ENTRIES
from radixserve.server.responses.background import BackgroundRun, cancel_response, launch
from radixserve.server.responses.events import logprob_entries, response_events
from radixserve.server.responses.input import parse_ask
from radixserve.server.responses.run import ResponseRun, prepare
from radixserve.server.responses.store import StoredResponse, find_response, response_owner
from radixserve.server.state import ServerState
from radixserve.server.validation import ApiError, get_int


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
    if ask.background:
        background = launch(run, request.scope)
        if background.log is not None:
            return EventStream(background.log.follow())
        assert run.entry is not None
        return JSONResponse(run.entry.body)  # queued: the task has not run yet
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
    return await _json(run.final())


async def _json(body: dict[str, Any]) -> Response:
    """A response object; built off the event loop when its logprobs make megabytes of JSON (as the chat
    endpoint builds its large bodies)."""
    if logprob_entries(body["output"]) <= OFFLOAD_ENTRIES:
        return JSONResponse(body)
    return Response(await asyncio.to_thread(lambda: dumps(body).encode("utf-8")), media_type="application/json")


def _found(request: Request) -> StoredResponse:
    state: ServerState = request.app.state.server
    _, store = state.require_chat()
    return find_response(store, request.path_params["response_id"], response_owner(request.headers,
                                                                                   caller_of(request)))


async def response_item(request: Request) -> Response:
    state: ServerState = request.app.state.server
    _, store = state.require_chat()
    stream = request.query_params.get("stream") not in (None, "false")
    found = _found(request)
    if request.method == "GET":
        return _replayed(request, found) if stream else await _json(found.body)
    if found.background is not None:  # nobody would read what it goes on writing
        await found.background.cancel()
    store.remove(found)  # a foreground generation in flight still answers its client, unkept (store.py)
    return JSONResponse({"id": found.id, "object": "response", "deleted": True})


def _replayed(request: Request, found: StoredResponse) -> Response:
    """A running background stream's events again, after `starting_after` (its sequence number)."""
    run = found.background
    log = run.log if isinstance(run, BackgroundRun) and run.running else None
    if log is None:
        raise ApiError("unsupported", "only a background response created with stream: true can be streamed "
                       "again, and only while it runs", param="stream")
    after = get_int({"starting_after": _int_or_text(request.query_params.get("starting_after"))}, "starting_after",
                    minimum=-1)
    return EventStream(log.follow(after + 1 if after is not None else 0))


def _int_or_text(value: str | None) -> int | str | None:
    """A query parameter as the integer it spells, else as sent (then refused as not an integer)."""
    try:
        return int(value) if value is not None else None
    except ValueError:
        return value


async def cancel(request: Request) -> Response:
    return await _json(await cancel_response(_found(request)))


ROUTES = [
    Route("/v1/responses", create_response, methods=["POST"]),
    Route("/v1/responses/{response_id}", response_item, methods=["GET", "DELETE"]),
    Route("/v1/responses/{response_id}/cancel", cancel, methods=["POST"]),
]
