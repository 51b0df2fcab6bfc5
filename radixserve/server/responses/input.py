"""A POST /v1/responses body read into `ResponsesAsk`: what to generate from, how, and what to keep.

Owns the Responses API's request fields. `input` is a string (one user message) or a non-empty list
of items: message items, `{"role", "content"}` with or without `"type": "message"`, whose content is
a string or a list of `input_text` / `output_text` parts (an assistant item the client sends back as
history carries `output_text`), roles as the chat endpoint takes them (`developer` is a system
message); and what a previous response's output held, sent back as history: a `function_call` item
is a call of the assistant message it follows (or of an assistant turn of its own), a
`function_call_output` item the `tool` message answering it, and a `reasoning` item the thinking of
the assistant message or call after it: its `content` (reasoning_text parts, else its summary's text)
reaches the template as that message's `reasoning_content` under --keep-reasoning-in-history and is
left out otherwise; one without text (no content, an empty summary) is skipped wherever it stands.
`instructions` is this request's system message. `reasoning.effort` becomes the template variable
`reasoning_effort` (gpt-oss's template reads it; "none" also sets `enable_thinking` false),
`reasoning.summary` is accepted (no summaries are written: reasoning items carry the reasoning itself
in `content`), and `chat_template_kwargs` (vLLM's extension) adds template variables
(pipeline/reasoning.py). `tools` are function tools in the Responses shape (`{"type": "function",
"name", "description", "parameters", "strict"}`), `tool_choice` "auto", "none", "required" or
`{"type": "function", "name"}`, `parallel_tool_calls`, and `max_tool_calls` (at most that many
function_call items in the response: later calls are dropped as without parallel calls, one allowed
call constrains a forced reply to one, none is tool_choice "none"); they become the engine's
ChatTools, which chat completions' tool calling runs on (the model's call format, its constraints and
parser).

`text.format` `{"type": "json_schema", "name", "schema", "strict", "description"}` or `{"type":
"json_object"}` is the reply's structured output, read by the chat endpoint's `response_format`
reader (pipeline/structured.py: the same checks; errors and the constraint name `text.format...`),
and joins the tools' constraint in the pipeline (plan.with_tools); `text` is echoed in the response.
`include: ["message.output_text.logprobs"]` asks each output_text part (and each streamed text delta)
for its tokens' logprobs, with `top_logprobs` (0..20) alternatives each, bounded by
--max-logprob-entries like the chat endpoint's; `top_logprobs` alone is echoed and asks nothing.
`background: true` (with `store`, as OpenAI requires) runs the generation without its client
(background.py); `truncation` "auto" drops the oldest turns of a conversation that does not fit the
context (store.build_prompt), "disabled" (the default) refuses it.
Sampling fields are the table's (radixserve/sampling_fields.py) under this API's names, so each is
checked once wherever it arrives: OpenAI's `temperature`, `top_p` and `max_output_tokens` (the reply's
max_tokens), and as vLLM-style extensions every other row (`top_k`, `seed`, penalties, `stop`,
`min_tokens`, `bad_words`, `allowed_token_ids`, `stop_token_ids`, `ignore_eos`, ...).

Invariant: a field this server cannot honour is a 400 naming it, never silently ignored — tools other
than functions (OpenAI's hosted tools), conversation, prompt templates, include values other than
"message.output_text.logprobs" and "reasoning.encrypted_content" (which asks for nothing this server
has: its reasoning items are not encrypted), a text.format other than text / json_object /
json_schema, text.verbosity other than "medium", non-text content and other item types. Fields that
change nothing here (user, service_tier, prompt_cache_key, safety_identifier, stream_options) are
accepted and ignored, and so are unknown ones, as the chat endpoint does.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from radixserve.chat.tool_calls import ChatTools
from radixserve.chat.tools import ToolCallFormat, ToolChoice, ToolSpec
from radixserve.sampling_fields import Api, SamplingFields
from radixserve.sampling_params import MAX_LOGPROBS
from radixserve.server.callers import cache_salt_of
from radixserve.server.openai_chat.shapes import ROLES
from radixserve.server.openai_chat.tools import MAX_TOOLS, function_spec, unique_tools
from radixserve.server.pipeline.reasoning import history_reasoning, template_variables, variables_for_effort
from radixserve.server.pipeline.sampling import read_sampling
from radixserve.server.pipeline.structured import structured_output
from radixserve.server.state import ServerState
from radixserve.server.validation import ApiError, get_bool, get_int, get_priority, get_str, refuse_unsupported
from radixserve.structured import StructuredOutput

TEXT_PARTS = ("input_text", "output_text", "text")
SUMMARIES = ("auto", "concise", "detailed")  # reasoning.summary: accepted, no summary is written
LOGPROBS = "message.output_text.logprobs"
# `include` values: the output text's logprobs, and one that asks for nothing this server has
INCLUDABLE = (LOGPROBS, "reasoning.encrypted_content")
METADATA_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's limits
REFUSED = ("conversation", "prompt")  # refused when set (not null / false)
TRUNCATIONS = ("auto", "disabled")
SCHEMA_FORMAT_KEYS = ("name", "schema", "strict", "description")  # a json_schema text.format's, as echoed
PLAIN_TEXT: dict[str, Any] = {"format": {"type": "text"}, "verbosity": "medium"}  # `text` unset, as echoed


@dataclass
class ResponsesAsk:
    model: str
    inputs: list[dict[str, Any]]  # the new messages, as the chat template takes them
    instructions: str | None
    previous_id: str | None
    store: bool
    stream: bool
    sampling: SamplingFields
    priority: int = 0
    metadata: dict[str, str] = field(default_factory=dict)
    tool_choice: Any = "auto"  # echoed as sent
    parallel_tool_calls: bool = True  # echoed
    tools: ChatTools | None = None  # the function tools offered and how the reply may call them
    cache_salt: str | None = None  # narrows the cache it may hit within its tenant (callers.py)
    variables: dict[str, Any] = field(default_factory=dict)  # the template's (pipeline/reasoning.py)
    effort: str | None = None  # reasoning.effort and .summary, echoed
    summary: str | None = None
    text: dict[str, Any] = field(default_factory=lambda: dict(PLAIN_TEXT))  # `text`, echoed (its format normalized)
    top_logprobs: int | None = None  # echoed; the logprobs asked are sampling.logprobs (None: not included)
    max_tool_calls: int | None = None  # at most this many function_call items (None: no bound); echoed
    background: bool = False  # run without the client (background.py); only with store
    truncation: str = "disabled"  # "auto": drop the oldest turns that do not fit the context (store.py)


def parse_ask(body: dict[str, Any], state: ServerState, priority_bounds: tuple[int, int]) -> ResponsesAsk:
    model = get_str(body, "model")
    assert model is not None
    state.require_model(model)
    _refuse_unsupported(body)
    if "input" not in body or body["input"] is None:
        raise ApiError("missing_field", "missing required field 'input'", param="input")
    structured, text = text_format(body.get("text"))
    top = get_int(body, "top_logprobs", minimum=0, maximum=MAX_LOGPROBS)
    sampling = replace(read_sampling(body, Api.RESPONSES), structured=structured,
                       logprobs=(top or 0) if LOGPROBS in (body.get("include") or ()) else None)
    reasoning = body.get("reasoning") or {}
    formatter, _ = state.require_chat()
    parallel = get_bool(body, "parallel_tool_calls", default=True)
    max_calls = get_int(body, "max_tool_calls", minimum=0)
    store, background = get_bool(body, "store", default=True), get_bool(body, "background")
    if background and not store:  # a background response is polled by its id: it must be kept
        raise ApiError("invalid_field", "background: true requires store: true (a background response is "
                       "retrieved by its id)", param="background")
    truncation = body.get("truncation") if body.get("truncation") is not None else "disabled"
    if truncation not in TRUNCATIONS:
        raise ApiError("invalid_field", f"'truncation' must be one of {', '.join(TRUNCATIONS)}, got {truncation!r}",
                       param="truncation")
    return ResponsesAsk(
        model=model, inputs=input_messages(body["input"], state),
        instructions=get_str(body, "instructions", required=False, allow_empty=True),
        previous_id=get_str(body, "previous_response_id", required=False),
        store=store, stream=get_bool(body, "stream"), sampling=sampling,
        priority=get_priority(body, priority_bounds), metadata=metadata(body.get("metadata")),
        tool_choice=body.get("tool_choice") if body.get("tool_choice") is not None else "auto",
        tools=tool_request(body.get("tools"), body.get("tool_choice"), parallel, formatter.tool_format, max_calls),
        parallel_tool_calls=parallel, cache_salt=cache_salt_of(body),
        variables=template_variables(state, body.get("chat_template_kwargs"),
                                     variables_for_effort(reasoning.get("effort"), "reasoning.effort")),
        effort=reasoning.get("effort"), summary=reasoning.get("summary"), text=text, top_logprobs=top,
        max_tool_calls=max_calls, background=background, truncation=truncation)


def _refuse_unsupported(body: dict[str, Any]) -> None:
    def refuse(param: str, what: str) -> None:
        raise ApiError("unsupported", f"{what} is not supported by this server", param=param)

    refuse_unsupported(body, dict.fromkeys(REFUSED, False))
    include = body.get("include")
    if include is not None and not (isinstance(include, list) and all(isinstance(x, str) for x in include)):
        raise ApiError("invalid_field", "'include' must be a list of strings", param="include")
    if include and any(x not in INCLUDABLE for x in include):
        refuse("include", f"'include' other than {list(INCLUDABLE)}")
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise ApiError("invalid_field", "'reasoning' must be an object {\"effort\", \"summary\"}", param="reasoning")
    if reasoning is not None and reasoning.get("summary") not in (None, *SUMMARIES):
        raise ApiError("invalid_field", f"'reasoning.summary' must be one of {', '.join(SUMMARIES)}",
                       param="reasoning.summary")


def text_format(text: Any) -> tuple[StructuredOutput | None, dict[str, Any]]:
    """`text` as the reply's structured output (None: free text) and the `text` object the response echoes.
    The format is read by the chat endpoint's `response_format` reader: Responses' flat json_schema is
    its nested one without the `json_schema` level, so its refusals and the constraint's field are
    renamed to the path this body used."""
    if text is None:
        return None, dict(PLAIN_TEXT)
    if not isinstance(text, dict):
        raise ApiError("invalid_field", "'text' must be an object {\"format\", \"verbosity\"}", param="text")
    if text.get("verbosity") not in (None, "medium"):
        raise ApiError("unsupported", "'text.verbosity' other than \"medium\" is not supported by this server",
                       param="text.verbosity")
    fmt = text.get("format")
    if fmt is None:
        return None, dict(PLAIN_TEXT)
    if not isinstance(fmt, dict):
        raise ApiError("invalid_field", "'text.format' must be an object with a 'type'", param="text.format")
    kind = fmt.get("type")
    spec = {k: fmt[k] for k in SCHEMA_FORMAT_KEYS if fmt.get(k) is not None}
    nested = {"type": kind, "json_schema": spec} if kind == "json_schema" else {"type": kind}
    try:
        structured = structured_output({"response_format": nested})
    except ApiError as e:
        e.message, e.param = _text_path(e.message), _text_path(e.param)
        raise
    echo = {"type": kind, **spec, "strict": fmt.get("strict")} if kind == "json_schema" else {"type": kind}
    out = replace(structured, field=_text_path(structured.field)) if structured is not None else None
    return out, {"format": echo, "verbosity": "medium"}


def _text_path(path: Any) -> Any:
    """A `response_format` path of the chat endpoint's reader as this API names it."""
    if not isinstance(path, str):
        return path
    return path.replace("response_format.json_schema", "text.format").replace("response_format", "text.format")


def tool_request(raw_tools: Any, raw_choice: Any, parallel: bool, fmt: ToolCallFormat,
                 max_calls: int | None = None) -> ChatTools | None:
    """`tools` and `tool_choice` as ChatTools; None when no tools are offered (then only "auto" and "none"
    may be chosen). `max_calls` (max_tool_calls): one is a single call (not parallel), none is "none"
    (a 400 with a choice that forces a call)."""
    specs: list[ToolSpec] = []
    if raw_tools is not None:
        if not isinstance(raw_tools, list) or len(raw_tools) > MAX_TOOLS:
            raise ApiError("invalid_field", f"'tools' must be a list of at most {MAX_TOOLS} tools", param="tools")
        for i, t in enumerate(raw_tools):
            where = f"tools[{i}]"
            if not isinstance(t, dict):
                raise ApiError("invalid_field", f"{where} must be a function tool {{\"type\": \"function\", "
                               "\"name\", \"parameters\"}", param=where)
            if t.get("type") != "function":
                raise ApiError("unsupported", f"{where}.type {t.get('type')!r}: only function tools are supported "
                               "by this server", param=f"{where}.type")
            specs.append(function_spec(t, where))
        unique_tools(specs, "tools")
    choice = _tool_choice(raw_choice, specs)
    if max_calls == 0 and specs:
        if choice.mode in ("required", "named"):
            raise ApiError("invalid_field", f"max_tool_calls 0 allows no call, which tool_choice {choice.mode!r} "
                           "requires", param="max_tool_calls")
        choice = ToolChoice("none")
    single = max_calls is not None and max_calls <= 1  # a forced reply's grammar then writes one call
    return ChatTools(tuple(specs), choice, parallel and not single, fmt) if specs else None


def _tool_choice(value: Any, tools: list[ToolSpec]) -> ToolChoice:
    if value is None or value == "auto":
        return ToolChoice("auto" if tools else "none")
    if value == "none":
        return ToolChoice("none")
    if value == "required":
        if not tools:
            raise ApiError("invalid_field", "tool_choice \"required\" needs at least one tool in 'tools'",
                           param="tool_choice")
        return ToolChoice("required")
    if isinstance(value, dict) and value.get("type") == "function":
        name = value.get("name")
        if not isinstance(name, str) or name not in {t.name for t in tools}:
            given = ", ".join(t.name for t in tools) or "no tools"
            raise ApiError("invalid_field", f"'tool_choice.name' must name one of the tools ({given}), got {name!r}",
                           param="tool_choice.name")
        return ToolChoice("named", name)
    raise ApiError("unsupported", "tool_choice must be \"auto\", \"none\", \"required\" or {\"type\": "
                   "\"function\", \"name\"} on this server", param="tool_choice")


def input_messages(raw: Any, state: ServerState) -> list[dict[str, Any]]:
    """`input` as chat-template messages (see the module docstring)."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise ApiError("invalid_field", "'input' must be a string or a non-empty list of message items", param="input")
    out: list[dict[str, Any]] = []
    thought: tuple[str, str] | None = None  # a reasoning item waiting for its assistant turn, and where it was
    calls_join = False  # a function_call item now joins the last message (an assistant's, or its calls)
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ApiError("invalid_field", f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "reasoning":
            text = _reasoning_text(item, where)
            if not text:  # nothing to replay (as a client sends back an item it got without content): skipped
                continue
            thought = (thought[0] + text if thought is not None else text, where)
            calls_join = False
            continue
        if kind == "function_call":
            call = _function_call(item, where)
            if calls_join and thought is None:
                out[-1] = {**out[-1], "tool_calls": [*(out[-1].get("tool_calls") or ()), call]}
                continue
            message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call]}
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str) or not item["call_id"]:
                raise ApiError("invalid_field", f"{where}.call_id must be the call_id of the function_call it "
                               "answers", param=f"{where}.call_id")
            message = {"role": "tool", "tool_call_id": item["call_id"],
                       "content": _output(item.get("output"), f"{where}.output")}
        elif kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise ApiError("invalid_field", f"{where}.role must be one of {sorted(ROLES)}, got {role!r}",
                               param=f"{where}.role")
            message = {"role": ROLES[role], "content": _content(item.get("content"), f"{where}.content")}
        else:
            raise ApiError("unsupported", f"{where}.type {kind!r} is not supported by this server (message, "
                           "reasoning, function_call and function_call_output items)", param=f"{where}.type")
        if thought is not None:
            if message["role"] != "assistant":
                raise ApiError("invalid_field", f"{thought[1]}: a reasoning item must come before the assistant "
                               "message or call it belongs to", param=thought[1])
            message = history_reasoning(state, message, thought[0], thought[1])
            thought = None
        calls_join = message["role"] == "assistant"
        out.append(message)
    if thought is not None:
        raise ApiError("invalid_field", f"{thought[1]}: a reasoning item must come before the assistant message or "
                       "call it belongs to", param=thought[1])
    return out


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A function_call item as a template message's call (OpenAI's chat shape)."""
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
    if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not name \
            or not isinstance(arguments, str):
        raise ApiError("invalid_field", f"{where} must be {{\"type\": \"function_call\", \"call_id\": str, "
                       "\"name\": str, \"arguments\": str}", param=where)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _output(output: Any, where: str) -> str:
    """A function_call_output's `output`: a string or input_text parts."""
    if isinstance(output, str):
        return output
    return _content(output, where)


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """A reasoning item's text: its reasoning_text parts, else its summary's summary_text parts."""
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key)
        if parts is None or parts == []:
            continue
        if not isinstance(parts, list) or not all(isinstance(p, dict) and p.get("type") == kind
                                                  and isinstance(p.get("text"), str) for p in parts):
            raise ApiError("invalid_field", f"{where}.{key} must be a list of {{\"type\": \"{kind}\", \"text\"}} "
                           "parts", param=f"{where}.{key}")
        return "".join(p["text"] for p in parts)
    return ""


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
