"""A POST /v1/chat/completions body read into an `Ask` (pipeline/ask.py) and planned.

Fields: `model` (the served one, else 404), `messages` (system/developer, user, assistant turns of
text or text parts; tool calling's history: openai_chat/tools.py), every sampling field of the table
under chat's names (radixserve/sampling_fields.py), `n` (1..--max-n), `stream`, `stream_options`,
`logprobs` / `top_logprobs` (0..20, only with logprobs true, as OpenAI and vLLM require), vLLM's
`prompt_logprobs` (not with stream), `priority`, `cache_salt`, `tools` / `tool_choice` /
`parallel_tool_calls`, the structured-output fields (pipeline/structured.py), `prediction`
(pipeline/prediction.py), `use_beam_search` with its fields (beam.py), and for thinking models
`reasoning_effort` and vLLM's `chat_template_kwargs` (template variables, pipeline/reasoning.py) and
an assistant message's `reasoning_content` (or `reasoning`: its earlier thinking, passed to the
template under --keep-reasoning-in-history). Unknown fields are ignored; `audio` is refused rather
than ignored.

Invariant: every refusal is an ApiError naming the field, raised before any response starts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from starlette.requests import Request

from radixserve.engine.beam_search import BeamSearchParams
from radixserve.sampling_fields import Api
from radixserve.sampling_params import MAX_LOGPROBS
from radixserve.server.auth import priority_bounds, request_key
from radixserve.server.callers import cache_salt_of, caller_of
from radixserve.server.completions.logprobs import prompt_logprobs_field
from radixserve.server.http_util import generation_body
from radixserve.server.openai_chat.beam import beam_fields
from radixserve.server.openai_chat.shapes import ROLES, stream_include_usage
from radixserve.server.openai_chat.tools import history_message, tool_request
from radixserve.server.pipeline.ask import Ask, ChatPrompt, LogprobBudget
from radixserve.server.pipeline.plan import Plan, namespace, plan
from radixserve.server.pipeline.prediction import with_prediction
from radixserve.server.pipeline.reasoning import history_reasoning, reasoning_of, template_variables, variables_for_effort
from radixserve.server.pipeline.sampling import read_sampling
from radixserve.server.pipeline.structured import structured_output
from radixserve.server.state import ServerState
from radixserve.server.validation import ApiError, get_bool, get_int, get_priority, get_str, refuse_unsupported

UNSUPPORTED = {"audio": None}  # tools: openai_chat/tools.py


@dataclass
class ChatRequest:
    model: str
    plan: Plan
    beam: BeamSearchParams | None = None  # use_beam_search (beam.py); then plan.params.n is the choices


async def parse_chat_request(state: ServerState, request: Request) -> ChatRequest:
    body = await generation_body(request)  # with its generation slot, before any tokenizing
    caller = caller_of(request)
    formatter, _ = state.require_chat()
    model = get_str(body, "model")
    assert model is not None
    state.require_model(model)
    refuse_unsupported(body, UNSUPPORTED)
    tools = tool_request(body, formatter.tool_format)
    top, stream = _logprobs(body), get_bool(body, "stream")
    sampling = with_prediction(replace(
        read_sampling(body, Api.CHAT), logprobs=top, structured=structured_output(body),
        prompt_logprobs=prompt_logprobs_field(body, stream)), body)  # vLLM's; the reply's top-level list
    beam = beam_fields(body, sampling)
    if beam is not None and tools is not None and tools.active:  # beams are never parsed for calls
        raise ApiError("invalid_field", "tools are not supported with use_beam_search", param="tools")
    variables = template_variables(state, body.get("chat_template_kwargs"),
                                   variables_for_effort(body.get("reasoning_effort"), "reasoning_effort"))
    ask = Ask(Api.CHAT, ChatPrompt(_messages(state, body)), sampling, caller.tenant, cache_salt_of(body), tools,
              n=beam.n if beam is not None else get_int(body, "n", minimum=1, maximum=state.config.max_n) or 1,
              priority=get_priority(body, priority_bounds(request_key(request.headers), state.config)),
              logprobs=LogprobBudget(top, (sampling.prompt_logprobs,)), stream=stream,
              include_usage=stream_include_usage(body, stream), engine_checks=beam is None, variables=variables,
              reasoning=reasoning_of(state) if beam is None else None)  # beams' text is not read
    try:
        planned = await plan(state, ask)
    except ApiError as e:  # the alias the body used, when it used the other one
        if e.param == "max_completion_tokens" and body.get("max_completion_tokens") is None:
            e.param = "max_tokens"
        raise
    return ChatRequest(model, planned, beam.params(planned.params, namespace(state, ask)) if beam else None)


def _logprobs(body: dict[str, Any]) -> int | None:
    """SamplingParams.logprobs for `logprobs` (bool) and `top_logprobs`: None when not asked."""
    asked = get_bool(body, "logprobs")
    top = get_int(body, "top_logprobs", minimum=0, maximum=MAX_LOGPROBS)
    if top is not None and not asked:
        raise ApiError("invalid_field", "'top_logprobs' is only allowed when 'logprobs' is true",
                       param="top_logprobs")
    return (top or 0) if asked else None


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


def _messages(state: ServerState, body: dict[str, Any]) -> list[dict[str, Any]]:
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
        if role == "tool" or m.get("tool_calls"):  # tool calling's history (tools.py)
            message = history_message(m, i, _content_text)
        else:
            if role not in ROLES:
                raise ApiError("invalid_field", f"messages[{i}].role must be one of {sorted(ROLES)}, got {role!r}",
                               param=f"messages[{i}].role")
            if "content" not in m or m["content"] is None:
                raise ApiError("missing_field", f"messages[{i}].content is required", param=f"messages[{i}].content")
            message = {"role": ROLES[role], "content": _content_text(m["content"], i)}
        if role == "assistant":  # its earlier thinking, as clients send it back (vLLM's name, then the newer one)
            key = "reasoning_content" if m.get("reasoning_content") is not None else "reasoning"
            message = history_reasoning(state, message, m.get(key), f"messages[{i}].{key}")
        out.append(message)
    return out
