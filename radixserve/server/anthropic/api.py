"""The Anthropic Messages API: POST /v1/messages (streaming and not) and POST /v1/messages/count_tokens,
for Anthropic's clients (`anthropic.Anthropic(base_url=..., api_key=...)`).

Stateless, as the OpenAI chat endpoint (openai_api.py): each request renders its whole conversation
with the chat template and the radix cache serves every prefix seen before, which the reply's usage
reports as `cache_read_input_tokens`. The request side (fields, messages, tools) is
anthropic_request.py's, the reply side (content blocks, stop_reason, usage, stream events)
anthropic_reply.py's; errors on these paths are in Anthropic's shape (api_errors.py).

Guards, as the chat endpoint's: the API key (Bearer or x-api-key) and Host/Origin by middleware, the
generation caps (`hold_generation`: 429/503) before anything is tokenized, the prompt limit and
shutdown (`admit_prompt`), the engine's check of the request before a response starts (so a refusal
is a JSON error, never an opened stream), and the client going away aborts the engine request,
streaming or not. An error after the stream started is an `event: error` with Anthropic's body.

count_tokens generates nothing but tokenizes as much as a generation: it holds a generation slot
while it counts (the same caps, 429/503), and its tokenizing is background work on the prompt
worker (prompt_worker.background_work), so a flood of counts never queues ahead of a generation's.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from radixserve.core import CompletionOutput, RequestOutput
from radixserve.server.admission import hold_generation
from radixserve.server.anthropic_reply import ReplyEvents, aborted, message_body, sse_event
from radixserve.server.anthropic_request import MessagesRequest, parse_messages_request, render_conversation
from radixserve.server.api_errors import anthropic_stream_error
from radixserve.server.cache_control import keep_marked_system
from radixserve.server.callers import caller_of
from radixserve.server.generation import stream_request
from radixserve.server.http_util import ClientGone, EventStream, read_json_object, until_done_or_gone
from radixserve.server.prompt_worker import background_work
from radixserve.server.state import ServerState

API = "anthropic"  # the `api` label of the server's request metrics


async def create_message(request: Request) -> Response:
    state: ServerState = request.app.state.server
    # refusals raise here, before any response starts: a JSON error with its status, never a stream
    body = await read_json_object(request, state.config.max_message_bytes)
    hold_generation(request, state.generations, state.config)  # 429/503 over a cap, before tokenizing
    req = await parse_messages_request(state, body, caller_of(request))
    created = await keep_marked_system(state, body, caller_of(request), req)  # cache_control: a pin
    mid = f"msg_{uuid.uuid4().hex}"
    if req.stream:
        return EventStream(_events(state, req, mid, created))
    try:
        return await until_done_or_gone(request.receive, _message(state, req, mid, created))
    except ClientGone:
        return Response(status_code=499)  # nobody reads it; the engine request was aborted


async def count_tokens(request: Request) -> Response:
    """{"input_tokens": N}: the length of the prompt the same /v1/messages request would have."""
    state: ServerState = request.app.state.server
    body = await read_json_object(request, state.config.max_message_bytes)
    hold_generation(request, state.generations, state.config)  # 429/503 over a cap, before tokenizing
    with background_work():
        conversation = await render_conversation(state, body, caller_of(request).tenant)
    return JSONResponse({"input_tokens": len(conversation.prompt)})


async def _message(state: ServerState, req: MessagesRequest, mid: str, created: int) -> Response:
    texts: list[str] = []
    final: CompletionOutput | None = None
    last: RequestOutput | None = None
    conv = req.conversation
    async with aclosing(stream_request(state, req.checked, conv.system, API)) as outputs:
        async for out in outputs:
            last = out
            for o in out.outputs:
                texts.append(o.text)
                final = o if o.finish_reason else final
    if last is None or final is None:
        raise aborted()
    return JSONResponse(message_body(mid, conv.model, conv.tools, "".join(texts), final, last.usage, created))


async def _events(state: ServerState, req: MessagesRequest, mid: str, created: int) -> AsyncGenerator[str, None]:
    conv = req.conversation
    events = ReplyEvents(mid, conv.model, conv.tools, created=created)
    try:
        async with aclosing(stream_request(state, req.checked, conv.system, API)) as outputs:
            async for out in outputs:
                for event in events.of(out):
                    yield event
        if not events.stopped:  # the engine's outputs ended without a finish
            raise aborted()
    except Exception as e:  # the stream has started: the error is an event, and the stream ends
        yield sse_event("error", anthropic_stream_error(e, state.metrics))


ROUTES = [
    Route("/v1/messages", create_message, methods=["POST"]),
    Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
]
