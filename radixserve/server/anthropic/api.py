"""The Anthropic Messages API: POST /v1/messages (streaming and not) and POST /v1/messages/count_tokens,
for Anthropic's clients (`anthropic.Anthropic(base_url=..., api_key=...)`).

Stateless, as the OpenAI chat endpoint (openai_chat/): each request renders its whole conversation
with the chat template and the radix cache serves every prefix seen before, which the reply's usage
reports as `cache_read_input_tokens`. The request side (fields, messages, tools) is request.py's (an
Ask, planned by server/pipeline/), the reply side (content blocks, stop_reason, usage, stream
events) reply.py's; errors on these paths are in Anthropic's shape (api_errors.py).

Guards, as the chat endpoint's: the API key (Bearer or x-api-key) and Host/Origin by middleware, the
generation caps (`hold_generation`: 429/503) before anything is tokenized, the prompt limit and
shutdown (`plan.admit_prompt`), the engine's check of the request before a response starts (so a refusal
is a JSON error, never an opened stream), and the client going away aborts the engine request,
streaming or not. An error after the stream started is an `event: error` with Anthropic's body.
Refusals of the shared code that clients parse are reworded as Anthropic's (request.anthropic_refusals).

Keep-alive: a stream sends `ping` right after `message_start`, and again every PING_INTERVAL_S while
the engine has sent nothing (heartbeat.py) — during a long prefill, before the first output, the
first beat sends `message_start` itself (reply.py) — so clients and proxies that drop an idle
connection keep waiting for the first token.

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
from radixserve.server.anthropic import heartbeat
from radixserve.server.anthropic.cache_control import keep_marked_system
from radixserve.server.anthropic.reply import ReplyEvents, aborted, message_body, sse_event
from radixserve.server.anthropic.request import (
    MessagesRequest,
    anthropic_refusals,
    conversation_ask,
    parse_messages_request,
)
from radixserve.server.api_errors import anthropic_stream_error
from radixserve.server.callers import caller_of
from radixserve.server.http_util import EventStream, generation_body, respond
from radixserve.server.pipeline.plan import tokenize
from radixserve.server.pipeline.prompt_worker import background_work
from radixserve.server.state import ServerState

PING_INTERVAL_S = 5.0  # a quiet stream's keep-alive: a `ping` after this long without an event


async def create_message(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await generation_body(request)  # refusals raise here: a JSON error, never an opened stream
    req = await parse_messages_request(state, body, caller_of(request))
    created = await keep_marked_system(state, body, caller_of(request), req)  # cache_control: a pin
    mid = f"msg_{uuid.uuid4().hex}"
    return await respond(request.receive, req.plan.ask.stream, lambda: EventStream(_events(state, req, mid, created)),
                         lambda: _message(state, req, mid, created))


async def count_tokens(request: Request) -> Response:
    """{"input_tokens": N}: the length of the prompt the same /v1/messages request would have."""
    state: ServerState = request.app.state.server
    body = await generation_body(request)  # counting tokenizes as much as a generation
    _, ask = conversation_ask(state, body, caller_of(request))
    async with anthropic_refusals(state, ask):
        with background_work():
            tokenized = await tokenize(state, ask)
    return JSONResponse({"input_tokens": len(tokenized.prompts[0])})


async def _message(state: ServerState, req: MessagesRequest, mid: str, created: int) -> Response:
    reader = req.plan.reader(tools=False)  # its reasoning and answer; the answer's calls are read whole
    final: CompletionOutput | None = None
    last: RequestOutput | None = None
    async with aclosing(req.plan.stream(state)) as outputs:
        async for out in outputs:
            last = out
            for o in out.outputs:
                reader.feed(o.text, len(o.token_ids))
                final = o if o.finish_reason else final
    if last is None or final is None:
        raise aborted()
    reader.finish()
    return JSONResponse(message_body(mid, req.model, req.plan.ask.tools, reader.answer_text, final, last.usage,
                                     created, reader.reasoning_text, req.clamped, req.show_thinking))


async def _events(state: ServerState, req: MessagesRequest, mid: str, created: int) -> AsyncGenerator[str, None]:
    events = ReplyEvents(mid, req.model, req.plan.ask.tools, created=created, reader=req.plan.reader(),
                         clamped=req.clamped, show_thinking=req.show_thinking)
    try:
        async with aclosing(req.plan.stream(state)) as outputs, \
                aclosing(heartbeat.paced(outputs, PING_INTERVAL_S)) as paced:
            async for out in paced:
                for event in events.of(out) if out is not None else events.heartbeat(len(req.plan.tokens)):
                    yield event
        if not events.stopped:  # the engine's outputs ended without a finish
            raise aborted()
    except Exception as e:  # the stream has started: the error is an event, and the stream ends
        yield sse_event("error", anthropic_stream_error(e, state.metrics))


ROUTES = [
    Route("/v1/messages", create_message, methods=["POST"]),
    Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
]
