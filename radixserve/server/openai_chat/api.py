"""OpenAI-compatible endpoints: POST /v1/chat/completions (streaming and not) and GET /v1/models.

The body is read into an Ask and planned by request.py (the one pipeline: server/pipeline/); this module
streams the plan and shapes its replies and chunks. Stateless: each request renders the whole
conversation with the chat template; the radix cache still serves every prefix seen before. Unknown
top-level fields are ignored (clients send extras), but features this server does not implement
(audio) are refused with 400 rather than silently ignored. Tools (`tools`, `tool_choice`, tool
history messages, `message.tool_calls`, streamed `delta.tool_calls`) are
server/openai_chat/tools.py's. Structured output (`response_format`, `structured_outputs`,
`guided_*`) becomes SamplingParams.structured (server/pipeline/structured.py).
usage.prompt_tokens_details.cached_tokens reports the prefix-cache hit (only of prefixes the
caller's tenant cached, with the same `cache_salt` when the request sends one: server/callers.py),
and the extension field prompt_tokens_details.host_cached_tokens the part of it loaded back from the
host-memory tier (0 while the tier is off). `prediction` (OpenAI's Predicted Outputs) becomes draft
tokens for speculative decoding, never a change to the output; usage.completion_tokens_details
reports OpenAI's accepted_prediction_tokens / rejected_prediction_tokens and the extension
`speculation` (what was drafted and accepted, by source) on every reply
(server/pipeline/prediction.py).

Thinking models (chat/reasoning.py, read by Plan.reader): a reply's reasoning is the message's
`reasoning_content` (null when it wrote none; absent for models without a reasoning format) and,
streamed, `delta.reasoning_content` pieces, as vLLM, SGLang and DeepSeek send them; its answer is
`content`, read for tool calls. usage.completion_tokens_details.reasoning_tokens counts the tokens
generated inside the reasoning, over all choices.

`logprobs` / `top_logprobs` (server/pipeline/logprobs.py builds the bodies): a choice's logprobs list every
token it generated, one entry per completion token, from the raw model distribution. A stream
chunk's logprobs list the tokens the engine handed out with that chunk's delta; when tokens came
without text (held back: a partial UTF-8 character, or text that may start a stop string) they
still get a chunk, with empty content, so the chunks' logprobs together are exactly the
non-streamed ones. Chunks without tokens (role, finish) carry `logprobs: null`. n × max_tokens ×
(top_logprobs + 1) is bounded by --max-logprob-entries (a 400 beyond; an unset max_tokens is clamped
to fit), and a non-streamed body with many entries is built in a worker thread, off the event loop.
vLLM's `prompt_logprobs` (not with stream) adds a top-level list (server/completions/logprobs.py),
its prompt tokens × (k + 1) entries counted in the same bound.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from radixserve.core import CompletionOutput, RequestOutput, TokenLogprob
from radixserve.server.api_errors import openai_stream_error
from radixserve.server.completions.logprobs import prompt_logprobs_body
from radixserve.server.http_util import EventStream, dumps, respond, sse
from radixserve.server.openai_chat.beam import beam_choices, run_beam_search
from radixserve.server.openai_chat.request import ChatRequest, parse_chat_request
from radixserve.server.openai_chat.shapes import usage_body, usage_dict
from radixserve.server.openai_chat.tools import ChoiceDeltas, reply_message
from radixserve.server.pipeline.logprobs import OFFLOAD_ENTRIES, entries, logprobs_body
from radixserve.server.state import ServerState


async def chat_completions(request: Request) -> Response:
    state: ServerState = request.app.state.server
    req = await parse_chat_request(state, request)  # refusals raise here: a JSON error, never an opened stream
    whole = _beam_completion if req.beam is not None else _completion
    return await respond(request.receive, req.plan.ask.stream, lambda: EventStream(_stream_chunks(state, req)),
                         lambda: whole(state, req))


def _choice_logprobs(state: ServerState, req: ChatRequest, lps: list[TokenLogprob] | None) -> dict[str, Any] | None:
    """A choice's `logprobs`: None unless the request asked."""
    return None if req.plan.params.logprobs is None else logprobs_body(lps, state.token_texts())


def _chunk_logprobs(state: ServerState, req: ChatRequest, o: CompletionOutput) -> dict[str, Any] | None:
    """A stream chunk's `logprobs`: the tokens of this output, None when it has none."""
    return _choice_logprobs(state, req, o.logprobs) if o.token_ids else None


async def _completion(state: ServerState, req: ChatRequest) -> Response:
    rid, created = new_id(), int(time.time())
    n = req.plan.params.n
    readers = [req.plan.reader(tools=False) for _ in range(n)]  # each reply's reasoning and answer
    lps: list[list[TokenLogprob]] = [[] for _ in range(n)]
    finish: list[str | None] = [None] * n
    last: RequestOutput | None = None
    prompt_lps: list[TokenLogprob | None] | None = None  # carried by the first output only
    async with aclosing(req.plan.stream(state)) as outputs:
        async for out in outputs:
            last = out
            prompt_lps = out.prompt_logprobs if out.prompt_logprobs is not None else prompt_lps
            for o in out.outputs:
                readers[o.index].feed(o.text, len(o.token_ids))
                lps[o.index].extend(o.logprobs or ())
                finish[o.index] = o.finish_reason or finish[o.index]
    assert last is not None
    for reader in readers:
        reader.finish()
    usage = usage_body(last, sum(r.reasoning_tokens for r in readers))
    thinks = req.plan.ask.reasoning is not None  # then each message has reasoning_content

    def render() -> bytes:
        tools = req.plan.ask.tools  # a reply's calls become message.tool_calls
        replies = [reply_message(tools, readers[i].answer_text, finish[i] or "abort",
                                 readers[i].reasoning_text if thinks else None) for i in range(n)]
        choices = [{"index": i, "message": message, "logprobs": _choice_logprobs(state, req, lps[i]),
                    "finish_reason": reason} for i, (message, reason) in enumerate(replies)]
        body = {"id": rid, "object": "chat.completion", "created": created, "model": req.model,
                "choices": choices, "usage": usage}
        if req.plan.params.prompt_logprobs is not None:  # vLLM's extension: the prompt's, once, at the top level
            body["prompt_logprobs"] = prompt_logprobs_body(req.plan.tokens, prompt_lps,
                                                           req.plan.params.prompt_logprobs,
                                                           state.token_texts())
        return dumps(body).encode("utf-8")

    # Many logprobs make megabytes of JSON, seconds of Python: built in a worker thread, the event loop
    # (every other client, /health) is never held by one body (issue 24)
    large = entries(sum(len(x) for x in lps), req.plan.params.logprobs) \
        + entries(len(req.plan.tokens), req.plan.params.prompt_logprobs) > OFFLOAD_ENTRIES
    return Response(await asyncio.to_thread(render) if large else render(), media_type="application/json")


async def _beam_completion(state: ServerState, req: ChatRequest) -> Response:
    rid, created = new_id(), int(time.time())
    assert req.beam is not None
    out = await run_beam_search(state, req.plan.tokens, req.beam, req.plan.params.n, req.plan.system, req.plan.ask.priority)
    return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": req.model,
                         "choices": beam_choices(out), "usage": usage_dict(out.usage)})


async def _stream_chunks(state: ServerState, req: ChatRequest) -> AsyncGenerator[str, None]:
    rid, created = new_id(), int(time.time())

    def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
        body: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created,
                                "model": req.model, "choices": choices}
        if req.plan.ask.include_usage:
            body["usage"] = usage
        return sse(body)

    started: set[int] = set()
    deltas: dict[int, ChoiceDeltas] = {}  # per choice: its text, or content and tool-call fragments
    last: RequestOutput | None = None
    try:
        async with aclosing(req.plan.stream(state)) as outputs:
            async for out in outputs:
                last = out
                for o in out.outputs:
                    if o.index not in started:
                        started.add(o.index)
                        deltas[o.index] = ChoiceDeltas(req.plan.ask.tools, req.plan.reader())
                        yield chunk([{"index": o.index, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}])
                    # tokens without text still get a chunk when logprobs were asked (their entries, on the first)
                    for k, delta in enumerate(deltas[o.index].of(o, req.plan.params.logprobs is not None)):
                        yield chunk([{"index": o.index, "delta": delta, "finish_reason": None,
                                      "logprobs": _chunk_logprobs(state, req, o) if k == 0 else None}])
                    if o.finish_reason:
                        yield chunk([{"index": o.index, "delta": {}, "logprobs": None,
                                      "finish_reason": deltas[o.index].finish_reason(o.finish_reason)}])
    except Exception as e:  # the stream has started: the error is an event, then [DONE]
        yield sse(openai_stream_error(e, state.metrics))
    if req.plan.ask.include_usage and last is not None:
        yield chunk([], usage_body(last, sum(d.reasoning_tokens for d in deltas.values())))
    yield "data: [DONE]\n\n"


def new_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def _model_card(state: ServerState) -> dict[str, Any]:
    return {"id": state.model_name, "object": "model", "created": int(state.started_at), "owned_by": "radixserve",
            "max_model_len": state.require_engine().max_model_len}


async def list_models(request: Request) -> Response:
    state: ServerState = request.app.state.server
    return JSONResponse({"object": "list", "data": [_model_card(state)]})


async def retrieve_model(request: Request) -> Response:
    """GET /v1/models/{id}: this server's one model, or 404 (as OpenAI answers for an unknown id)."""
    state: ServerState = request.app.state.server
    model = request.path_params["model"]
    state.require_model(model)
    return JSONResponse(_model_card(state))


ROUTES = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model:path}", retrieve_model, methods=["GET"]),
]
