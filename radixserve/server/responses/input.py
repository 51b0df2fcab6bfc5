"""A POST /v1/responses body read into `ResponsesAsk`: what to generate from, how, and what to keep.

Owns the Responses API's request fields. `input` is a string (one user message) or a non-empty list
of message items, `{"role", "content"}` with or without `"type": "message"`, whose content is a
string or a list of `input_text` / `output_text` parts (an assistant item the client sends back as
history carries `output_text`); roles as the chat endpoint takes them (`developer` is a system
message). `instructions` is this request's system message. Sampling fields are the table's
(radixserve/sampling_fields.py) under this API's names, so each is checked once wherever it arrives:
OpenAI's `temperature`, `top_p` and `max_output_tokens` (the reply's max_tokens), and as vLLM-style
extensions every other row (`top_k`, `seed`, penalties, `stop`, `min_tokens`, `bad_words`,
`allowed_token_ids`, `stop_token_ids`, `ignore_eos`, ...).

Invariant: a field this server cannot honour is a 400 naming it, never silently ignored — tools,
tool_choice other than none/auto, reasoning with an effort, background, conversation, prompt
templates, include, a non-text text.format, truncation "auto", top_logprobs, non-text content and
item types other than messages. Fields that change nothing here (user, service_tier,
prompt_cache_key, safety_identifier, stream_options, max_tool_calls) are accepted and ignored, and
so are unknown ones, as the chat endpoint does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixserve.sampling_fields import Api, SamplingFields
from radixserve.server.callers import cache_salt_of
from radixserve.server.openai_chat.shapes import ROLES
from radixserve.server.pipeline.sampling import read_sampling
from radixserve.server.state import ServerState
from radixserve.server.validation import ApiError, get_bool, get_priority, get_str, refuse_unsupported

TEXT_PARTS = ("input_text", "output_text", "text")
METADATA_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's limits
REFUSED = ("background", "conversation", "prompt")  # refused when set (not null / false)


@dataclass
class ResponsesAsk:
    model: str
    inputs: list[dict[str, str]]  # the new messages, as the chat template takes them
    instructions: str | None
    previous_id: str | None
    store: bool
    stream: bool
    sampling: SamplingFields
    priority: int = 0
    metadata: dict[str, str] = field(default_factory=dict)
    tool_choice: str = "auto"  # echoed; with no tools "auto" and "none" both mean a text reply
    parallel_tool_calls: bool = True  # echoed; nothing to call
    cache_salt: str | None = None  # narrows the cache it may hit within its tenant (callers.py)


def parse_ask(body: dict[str, Any], state: ServerState, priority_bounds: tuple[int, int]) -> ResponsesAsk:
    model = get_str(body, "model")
    assert model is not None
    state.require_model(model)
    _refuse_unsupported(body)
    if "input" not in body or body["input"] is None:
        raise ApiError("missing_field", "missing required field 'input'", param="input")
    sampling = read_sampling(body, Api.RESPONSES)
    return ResponsesAsk(
        model=model, inputs=input_messages(body["input"]),
        instructions=get_str(body, "instructions", required=False, allow_empty=True),
        previous_id=get_str(body, "previous_response_id", required=False),
        store=get_bool(body, "store", default=True), stream=get_bool(body, "stream"), sampling=sampling,
        priority=get_priority(body, priority_bounds), metadata=metadata(body.get("metadata")),
        tool_choice=_tool_choice(body.get("tool_choice")),
        parallel_tool_calls=get_bool(body, "parallel_tool_calls", default=True), cache_salt=cache_salt_of(body))


def _refuse_unsupported(body: dict[str, Any]) -> None:
    def refuse(param: str, what: str) -> None:
        raise ApiError("unsupported", f"{what} is not supported by this server", param=param)

    refuse_unsupported(body, dict.fromkeys(REFUSED, False))
    if body.get("tools"):  # an empty list offers nothing: accepted
        refuse("tools", "tool calling on /v1/responses ('tools')")
    if body.get("include"):
        refuse("include", "'include'")
    reasoning = body.get("reasoning")
    if reasoning is not None and (not isinstance(reasoning, dict) or reasoning.get("effort") not in (None, "none")
                                  or reasoning.get("summary") is not None):
        refuse("reasoning", "'reasoning' (this model has no reasoning effort to set)")
    text = body.get("text")
    if text is not None:
        fmt = text.get("format") if isinstance(text, dict) else "?"
        if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
            refuse("text.format", "a text.format other than {\"type\": \"text\"}")
        if text.get("verbosity") not in (None, "medium"):
            refuse("text.verbosity", "'text.verbosity'")
    if body.get("truncation") not in (None, "disabled"):
        refuse("truncation", "truncation other than \"disabled\"")
    if body.get("top_logprobs") not in (None, 0):
        refuse("top_logprobs", "'top_logprobs'")


def _tool_choice(value: Any) -> str:
    if value is None:
        return "auto"
    if value in ("auto", "none"):
        return str(value)
    raise ApiError("unsupported", "tool_choice other than \"auto\" or \"none\" is not supported by this server "
                   "(it offers no tools)", param="tool_choice")


def input_messages(raw: Any) -> list[dict[str, str]]:
    """`input` as chat-template messages."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise ApiError("invalid_field", "'input' must be a string or a non-empty list of message items", param="input")
    out: list[dict[str, str]] = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ApiError("invalid_field", f"{where} must be an object", param=where)
        if item.get("type", "message") != "message":
            raise ApiError("unsupported", f"{where}.type {item.get('type')!r} is not supported by this server "
                           "(only message items)", param=f"{where}.type")
        role = item.get("role")
        if role not in ROLES:
            raise ApiError("invalid_field", f"{where}.role must be one of {sorted(ROLES)}, got {role!r}",
                           param=f"{where}.role")
        out.append({"role": ROLES[role], "content": _content(item.get("content"), f"{where}.content")})
    return out


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError("invalid_field", f"{where} must be a string or a list of text parts", param=where)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise ApiError("invalid_field", f"{where}[{j}] must be an object", param=f"{where}[{j}]")
        if part.get("type") not in TEXT_PARTS:
            raise ApiError("unsupported", f"{where}[{j}].type {part.get('type')!r} is not supported by this server "
                           "(text parts only)", param=f"{where}[{j}].type")
        if not isinstance(part.get("text"), str):
            raise ApiError("invalid_field", f"{where}[{j}].text must be a string", param=f"{where}[{j}].text")
        texts.append(part["text"])
    return "".join(texts)


def metadata(value: Any) -> dict[str, str]:
    """OpenAI's `metadata`: at most 16 string pairs, keys up to 64 characters, values up to 512."""
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > METADATA_KEYS:
        raise ApiError("invalid_field", f"'metadata' must be an object of at most {METADATA_KEYS} entries",
                       param="metadata")
    for k, v in value.items():
        if len(k) > METADATA_KEY_CHARS or not isinstance(v, str) or len(v) > METADATA_VALUE_CHARS:
            raise ApiError("invalid_field", f"'metadata' keys are strings of at most {METADATA_KEY_CHARS} characters "
                           f"and values strings of at most {METADATA_VALUE_CHARS}", param="metadata")
    return dict(value)
