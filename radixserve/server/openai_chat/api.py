"""OpenAI-compatible endpoints: POST /v1/chat/completions (streaming and not) and GET /v1/models.

Stateless: each request renders the whole conversation with the chat template; the radix cache still
serves every prefix seen before. Unknown top-level fields are ignored (clients send extras), but
features this server does not implement (audio) are refused with 400 rather than
silently ignored. Tools (`tools`, `tool_choice`, tool history messages, `message.tool_calls`,
streamed `delta.tool_calls`) are server/openai_tools.py's. Structured output (`response_format`,
`structured_outputs`, `guided_*`) becomes SamplingParams.structured (server/structured_api.py).
usage.prompt_tokens_details.cached_tokens reports the prefix-cache hit (only of prefixes the caller's
tenant cached, with the same `cache_salt` when the request sends one: server/callers.py), and the extension field
prompt_tokens_details.host_cached_tokens the part of it loaded back from the host-memory tier (0
while the tier is off). `prediction` (OpenAI's Predicted Outputs) becomes draft tokens for
speculative decoding, never a change to the output; usage.completion_tokens_details reports OpenAI's
accepted_prediction_tokens / rejected_prediction_tokens and the extension `speculation` (what was
drafted and accepted, by source) on every reply (server/speculation_api.py).

`logprobs` / `top_logprobs` (server/logprobs.py builds the bodies): a choice's logprobs list every
token it generated, one entry per completion token, from the raw model distribution. A stream
chunk's logprobs list the tokens the engine handed out with that chunk's delta; when tokens came
without text (held back: a partial UTF-8 character, or text that may start a stop string) they
still get a chunk, with empty content, so the chunks' logprobs together are exactly the
non-streamed ones. Chunks without tokens (role, finish) carry `logprobs: null`. n × max_tokens ×
(top_logprobs + 1) is bounded by --max-logprob-entries (a 400 beyond; an unset max_tokens is clamped
to fit), and a non-streamed body with many entries is built in a worker thread, off the event loop.
vLLM's `prompt_logprobs` (not with stream) adds a top-level list (server/completion_logprobs.py),
its prompt tokens × (k + 1) entries counted in the same bound.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from radixserve.chat.tool_calls import ChatTools
from radixserve.core import CompletionOutput, RequestOutput, TokenLogprob, Usage
from radixserve.engine.beam_search import BeamSearchParams
from radixserve.engine.intake import ValidatedRequest
from radixserve.sampling_params import MAX_LOGPROBS, SamplingParams
from radixserve.server.admission import hold_generation
from radixserve.server.api_errors import openai_stream_error
from radixserve.server.auth import priority_bounds, request_key
from radixserve.server.beam_api import BeamAsk, beam_choices, beam_fields, run_beam_search
from radixserve.server.callers import cache_salt_of, caller_of, namespace_for
from radixserve.server.completion_logprobs import prompt_logprobs_body, prompt_logprobs_field
from radixserve.server.generation import SystemPromptRef, admit_prompt, check_request, stream_request
from radixserve.server.http_util import ClientGone, EventStream, dumps, read_json_object, sse, until_done_or_gone
from radixserve.server.logprobs import OFFLOAD_ENTRIES, cap_logprob_entries, entries, logprobs_body
from radixserve.server.openai_tools import (
    ChoiceDeltas,
    history_message,
    reply_message,
    tool_constraint,
    tool_request,
)
from radixserve.server.sampling_fields import build_sampling_params, sampling_values
from radixserve.server.speculation_api import completion_tokens_details, tokenize_prediction, with_prediction
from radixserve.server.state import ServerState
from radixserve.server.structured_api import compile_off_loop, structured_output
from radixserve.server.tenants import Caller
from radixserve.server.validation import ApiError, get_bool, get_int, get_priority, get_str, refuse_unsupported

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
UNSUPPORTED = {"audio": None}  # tools: server/openai_tools.py


@dataclass
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    prompt: list[int]
    system: SystemPromptRef
    priority: int = 0  # lower runs first under --policy priority (vLLM's field); fcfs, cache-aware and sjf ignore it
    beam: BeamSearchParams | None = None  # use_beam_search (server/beam_api.py); then params.n is the choices
    checked: ValidatedRequest | None = None  # what the engine's intake made of it (None for a beam search)
    tools: ChatTools | None = None  # tools / tool_choice (server/openai_tools.py)


def _content_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError("invalid_field", f"messages[{i}].content: only text parts are supported",
                               param=f"messages[{i}].content")
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError("invalid_field", f"messages[{i}].content must be a string or a list of text parts",
                   param=f"messages[{i}].content")


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    raw = body.get("messages")
    if raw is None:
        raise ApiError("missing_field", "missing required field 'messages'", param="messages")
    if not isinstance(raw, list) or not raw:
        raise ApiError("invalid_field", "'messages' must be a non-empty list", param="messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise ApiError("invalid_field", f"messages[{i}] must be an object", param=f"messages[{i}]")
        role = m.get("role")
        if role == "tool" or m.get("tool_calls"):  # tool calling's history (openai_tools.py)
            out.append(history_message(m, i, _content_text))
            continue
        if role not in ROLES:
            raise ApiError("invalid_field", f"messages[{i}].role must be one of {sorted(ROLES)}, got {role!r}",
                           param=f"messages[{i}].role")
        if "content" not in m or m["content"] is None:
            raise ApiError("missing_field", f"messages[{i}].content is required", param=f"messages[{i}].content")
        out.append({"role": ROLES[role], "content": _content_text(m["content"], i)})
    return out


def _logprobs(body: dict[str, Any]) -> int | None:
    """SamplingParams.logprobs for OpenAI's `logprobs` (bool) and `top_logprobs` (0..20, only with
    logprobs true, as OpenAI and vLLM require): None when not asked."""
    asked = get_bool(body, "logprobs")
    top = get_int(body, "top_logprobs", minimum=0, maximum=MAX_LOGPROBS)
    if top is not None and not asked:
        raise ApiError("invalid_field", "'top_logprobs' is only allowed when 'logprobs' is true",
                       param="top_logprobs")
    return (top or 0) if asked else None


async def parse_chat_request(state: ServerState, body: dict[str, Any], priority_bounds: tuple[int, int],
                             caller: Caller) -> ChatRequest:
    formatter, _ = state.require_chat()
    engine = state.require_engine()
    model = get_str(body, "model")
    assert model is not None
    state.require_model(model)
    refuse_unsupported(body, UNSUPPORTED)
    namespace = namespace_for(caller, cache_salt_of(body), state.config)  # the caller's tenant, its cache_salt
    structured = structured_output(body)
    tools = tool_request(body, formatter.tool_format)
    structured = tool_constraint(tools, structured)  # required/named (or strict tools): the call's
    messages = _messages(body)
    max_tokens = get_int(body, "max_completion_tokens", minimum=1)
    if max_tokens is None:
        max_tokens = get_int(body, "max_tokens", minimum=1)
    top, stream = _logprobs(body), get_bool(body, "stream")
    sampling = with_prediction({
        **sampling_values(body), "max_tokens": max_tokens, "logprobs": top, "structured": structured,
        "prompt_logprobs": prompt_logprobs_field(body, stream),  # vLLM's; the response's top-level list
        "skip_special_tokens": not (tools is not None and tools.keeps_special_tokens),
    }, body)
    beam: BeamAsk | None = beam_fields(body)
    if beam is not None and tools is not None and tools.active:  # beams are never parsed for calls
        raise ApiError("invalid_field", "tools are not supported with use_beam_search", param="tools")
    n = beam.n if beam is not None else get_int(body, "n", minimum=1, maximum=state.config.max_n) or 1
    include_usage = stream_include_usage(body, stream)
    priority = get_priority(body, priority_bounds)
    template_tools = tools.template_tools() if tools is not None else None
    prompt, system_tokens = await state.require_prompts().chat_tokens(messages, template_tools)  # large: off the loop
    admit_prompt(state, len(prompt))
    sampling = await tokenize_prediction(state, sampling)  # a long one off the loop, as the prompt
    # bounded before anything runs, the prompt's logprobs first; an unset max_tokens then defaults to
    # what fits (server/logprobs.py)
    fits = cap_logprob_entries(n, max_tokens, top, state.config.max_logprob_entries,
                               spent=entries(len(prompt), sampling["prompt_logprobs"]))
    params = build_sampling_params({k: v for k, v in sampling.items() if v is not None}, prompt_len=len(prompt),
                                   max_model_len=engine.max_model_len, default_max_tokens=fits, n=n)
    params.cache_namespace = namespace
    # a beam search is checked by its driver, with the parameters of its steps
    await compile_off_loop(state, params.structured, namespace)  # the check below then finds it compiled
    checked = check_request(engine, prompt, params, priority) if beam is None else None
    first_system = next((m["content"] for m in messages if m["role"] == "system"), None)
    system = SystemPromptRef.of(system_tokens, first_system, formatter.implicit_prefix_len, caller.tenant)
    return ChatRequest(model, messages, params, stream, include_usage, prompt, system, priority,
                       beam.params(params.max_tokens, namespace) if beam is not None else None, checked, tools)


def stream_include_usage(body: dict[str, Any], stream: bool) -> bool:
    """`stream_options.include_usage`; `stream_options` is only allowed with `stream: true` (as OpenAI
    answers: 400 otherwise)."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise ApiError("invalid_field", "'stream_options' is only allowed when 'stream' is true", param="stream_options")
    if not isinstance(options, dict):
        raise ApiError("invalid_field", "'stream_options' must be an object", param="stream_options")
    return get_bool(options, "include_usage")


def usage_body(out: RequestOutput) -> dict[str, Any]:
    return usage_dict(out.usage)


def usage_dict(u: Usage) -> dict[str, Any]:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            # host_cached_tokens is our extension: the part of cached_tokens loaded back from the host tier
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens, "host_cached_tokens": u.host_cached_tokens},
            # OpenAI's prediction counts, and our extension `speculation` (server/speculation_api.py)
            "completion_tokens_details": completion_tokens_details(u)}


async def chat_completions(request: Request) -> Response:
    state: ServerState = request.app.state.server
    # refusals raise here, before any response starts: a JSON error with its status, never a stream
    body = await read_json_object(request, state.config.max_message_bytes)
    hold_generation(request, state.generations, state.config)  # 429/503 over a cap, before tokenizing
    req = await parse_chat_request(state, body, priority_bounds(request_key(request.headers), state.config),
                                   caller_of(request))
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if req.stream:
        return EventStream(_stream_chunks(state, req, rid, created))
    try:
        run = _beam_completion if req.beam is not None else _completion
        return await until_done_or_gone(request.receive, run(state, req, rid, created))
    except ClientGone:
        return Response(status_code=499)  # nobody reads it; the engine request was aborted


def _choice_logprobs(state: ServerState, req: ChatRequest, lps: list[TokenLogprob] | None) -> dict[str, Any] | None:
    """A choice's `logprobs`: None unless the request asked."""
    return None if req.params.logprobs is None else logprobs_body(lps, state.token_texts())


def _chunk_logprobs(state: ServerState, req: ChatRequest, o: CompletionOutput) -> dict[str, Any] | None:
    """A stream chunk's `logprobs`: the tokens of this output, None when it has none."""
    return _choice_logprobs(state, req, o.logprobs) if o.token_ids else None


async def _completion(state: ServerState, req: ChatRequest, rid: str, created: int) -> Response:
    n = req.params.n
    texts: list[list[str]] = [[] for _ in range(n)]
    lps: list[list[TokenLogprob]] = [[] for _ in range(n)]
    finish: list[str | None] = [None] * n
    last: RequestOutput | None = None
    prompt_lps: list[TokenLogprob | None] | None = None  # carried by the first output only
    assert req.checked is not None
    async with aclosing(stream_request(state, req.checked, req.system, "openai")) as outputs:
        async for out in outputs:
            last = out
            prompt_lps = out.prompt_logprobs if out.prompt_logprobs is not None else prompt_lps
            for o in out.outputs:
                texts[o.index].append(o.text)
                lps[o.index].extend(o.logprobs or ())
                finish[o.index] = o.finish_reason or finish[o.index]
    assert last is not None
    usage = usage_body(last)

    def render() -> bytes:
        replies = [reply_message(req.tools, "".join(texts[i]), finish[i] or "abort") for i in range(n)]  # tool calls
        choices = [{"index": i, "message": message, "logprobs": _choice_logprobs(state, req, lps[i]),
                    "finish_reason": reason} for i, (message, reason) in enumerate(replies)]
        body = {"id": rid, "object": "chat.completion", "created": created, "model": req.model,
                "choices": choices, "usage": usage}
        if req.params.prompt_logprobs is not None:  # vLLM's extension: the prompt's, once, at the top level
            body["prompt_logprobs"] = prompt_logprobs_body(req.prompt, prompt_lps, req.params.prompt_logprobs,
                                                           state.token_texts())
        return dumps(body).encode("utf-8")

    # Many logprobs make megabytes of JSON, seconds of Python: built in a worker thread, the event loop
    # (every other client, /health) is never held by one body (issue 24)
    large = entries(sum(len(x) for x in lps), req.params.logprobs) \
        + entries(len(req.prompt), req.params.prompt_logprobs) > OFFLOAD_ENTRIES
    return Response(await asyncio.to_thread(render) if large else render(), media_type="application/json")


async def _beam_completion(state: ServerState, req: ChatRequest, rid: str, created: int) -> Response:
    assert req.beam is not None
    out = await run_beam_search(state, req.prompt, req.beam, req.params.n, req.system, req.priority)
    return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": req.model,
                         "choices": beam_choices(out), "usage": usage_dict(out.usage)})


async def _stream_chunks(state: ServerState, req: ChatRequest, rid: str, created: int) -> AsyncGenerator[str, None]:
    def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
        body: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created,
                                "model": req.model, "choices": choices}
        if req.include_usage:
            body["usage"] = usage
        return sse(body)

    started: set[int] = set()
    deltas: dict[int, ChoiceDeltas] = {}  # per choice: its text, or content and tool-call fragments
    last: RequestOutput | None = None
    try:
        assert req.checked is not None
        async with aclosing(stream_request(state, req.checked, req.system, "openai")) as outputs:
            async for out in outputs:
                last = out
                for o in out.outputs:
                    if o.index not in started:
                        started.add(o.index)
                        deltas[o.index] = ChoiceDeltas(req.tools)
                        yield chunk([{"index": o.index, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}])
                    # tokens without text still get a chunk when logprobs were asked (their entries, on the first)
                    for k, delta in enumerate(deltas[o.index].of(o, req.params.logprobs is not None)):
                        yield chunk([{"index": o.index, "delta": delta, "finish_reason": None,
                                      "logprobs": _chunk_logprobs(state, req, o) if k == 0 else None}])
                    if o.finish_reason:
                        yield chunk([{"index": o.index, "delta": {}, "logprobs": None,
                                      "finish_reason": deltas[o.index].finish_reason(o.finish_reason)}])
    except Exception as e:  # the stream has started: the error is an event, then [DONE]
        yield sse(openai_stream_error(e, state.metrics))
    if req.include_usage and last is not None:
        yield chunk([], usage_body(last))
    yield "data: [DONE]\n\n"


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
