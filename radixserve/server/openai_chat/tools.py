"""OpenAI tool calling on the server: the request's `tools`, `tool_choice`, `parallel_tool_calls`
and tool history messages in; `message.tool_calls` and streamed `delta.tool_calls` fragments out.
The chat endpoint (api.py), sessions (sessions/turns.py) and the WebSocket/REST frames share it.

Owns the API shape only. What a call looks like in text (Hermes `<tool_call>`, Llama JSON, Mistral
`[TOOL_CALLS]`), how it is parsed and constrained is the model's tool-call format
(chat/tools/), chosen once per (chat template, --tool-call-parser).

Invariants:
- `tool_choice` "none" (or no tools) is plain chat: the template gets no tools, the reply is text and
  is never parsed for calls. Any other `tool_choice` without tools is a 400 naming it (OpenAI's and
  vLLM's answer). Otherwise the template is rendered with the tools and every reply is
  parsed, each choice of `n` on its own.
- `required` and a named function carry the format's constraint (`SamplingParams.structured`), so
  the call parses and its arguments validate; `auto` carries one only where the format gives one
  (a function with `strict: true`: constrained once a call opens), or beside a JSON `response_format`:
  then the reply is that answer or calls, from its first token (chat/tool_calls.py says how every
  tool choice joins a structured output; pipeline/plan.py applies it for every API).
- A reply with calls has `finish_reason` "tool_calls" (when it ended normally) and `content` null
  unless the model also wrote text; with `parallel_tool_calls: false` only the first call is kept,
  streamed or not, so both agree (and the constraint of `required` / named allows only one call).
- A reply cut by max_tokens has `finish_reason` "length"; the call it was cut in is not in `content`
  (no tool-call markup) nor in `tool_calls`; streamed, its fragments went out before the cut.
- Streamed, the first fragment of a call carries its id, type and name; later ones argument pieces
  only; all argument pieces of a call joined equal the non-streamed `arguments`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from radixserve.chat.reasoning import ReasoningDelta, ReplyPiece, ReplyStream
from radixserve.chat.tool_calls import ChatTools
from radixserve.chat.tools import (
    ContentDelta,
    ToolCall,
    ToolCallFormat,
    ToolChoice,
    ToolSpec,
    tool_format,
)
from radixserve.core import CompletionOutput
from radixserve.server.validation import ApiError, get_bool

NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")  # OpenAI's function names, and MCP's namespaced ones
MAX_TOOLS = 128  # OpenAI's own cap on `tools`
CHOICES = ("none", "auto", "required")
LEGACY = ("functions", "function_call")
ContentText = Callable[[Any, int], str]  # a message's content (a string or text parts) as one string


def server_format(tokenizer: Any, override: str | None, open_objects: bool = False) -> ToolCallFormat:
    """The tool-call format of the served model: the one --tool-call-parser names, else its template's,
    bound to its tokenizer (worked out once, when the server starts); `open_objects` as the engine's JSON
    schemas have them (--open-json-objects)."""
    template = getattr(tokenizer, "chat_template", None)
    return tool_format(template if isinstance(template, str) else None, override, tokenizer, open_objects)


# -- request side ----------------------------------------------------------------------------

def tool_request(body: dict[str, Any], fmt: ToolCallFormat, prefix: str = "",
                 default_tools: tuple[ToolSpec, ...] = ()) -> ChatTools | None:
    """`tools` / `tool_choice` / `parallel_tool_calls` of a body (an OpenAI request, a chat frame, a
    session message); None when it asks nothing of tools. `default_tools` are the tools when the body
    names none (a session's). `prefix` goes before the param names errors give."""
    for name in LEGACY:
        if body.get(name) is not None:
            raise ApiError("unsupported", f"{name!r} is OpenAI's deprecated form of function calling; send 'tools' "
                           "and 'tool_choice' instead", param=prefix + name)
    raw_tools, raw_choice = body.get("tools"), body.get("tool_choice")
    parallel = get_bool(body, "parallel_tool_calls", default=True)
    if raw_tools is None and raw_choice is None:
        return None
    tools = parse_tools(raw_tools, prefix + "tools") if raw_tools is not None else list(default_tools)
    return ChatTools(tuple(tools), parse_tool_choice(raw_choice, tools, prefix + "tool_choice"), parallel, fmt)


def parse_tools(raw: Any, param: str = "tools") -> list[ToolSpec]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ApiError("invalid_field", f"{param!r} must be a list of tools", param=param)
    if len(raw) > MAX_TOOLS:
        raise ApiError("invalid_field", f"{param!r} takes at most {MAX_TOOLS} tools", param=param)
    out: list[ToolSpec] = []
    for i, t in enumerate(raw):
        where = f"{param}[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise ApiError("invalid_field", f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\", "
                           "\"description\", \"parameters\"}}}; only function tools are supported", param=where)
        out.append(function_spec(t["function"], f"{where}.function"))
    return unique_tools(out, param)


def unique_tools(specs: list[ToolSpec], param: str) -> list[ToolSpec]:
    """`specs`, unless two share a name (a 400 naming `param`)."""
    names = [s.name for s in specs]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ApiError("invalid_field", f"{param!r} names the function {dup!r} twice", param=param)
    return specs


def function_spec(f: dict[str, Any], where: str, schema_key: str = "parameters") -> ToolSpec:
    """One function tool `{name, description?, <schema_key>?, strict?}` (`schema_key`: OpenAI's
    "parameters", Anthropic's "input_schema"), checked; errors name `where` and the key."""
    name = f.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise ApiError("invalid_field", f"{where}.name must be 1-64 characters of a-z, A-Z, 0-9, '_', '-', '.' or ':'",
                       param=f"{where}.name")
    description = f.get("description") or ""
    if not isinstance(description, str):
        raise ApiError("invalid_field", f"{where}.description must be a string", param=f"{where}.description")
    parameters = f.get(schema_key)
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    _check_schema(parameters, f"{where}.{schema_key}")
    strict = f.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ApiError("invalid_field", f"{where}.strict must be a boolean", param=f"{where}.strict")
    return ToolSpec(name, description, parameters, bool(strict))


def _check_schema(schema: Any, where: str) -> None:
    """A function's `parameters` is a JSON schema object (its own errors name the path)."""
    import jsonschema

    if not isinstance(schema, dict):
        raise ApiError("invalid_field", f"{where} must be a JSON schema object", param=where)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.path)
        raise ApiError("invalid_field", f"{where}{path} is not a valid JSON schema: {e.message[:200]}",
                       param=where + path) from None


def parse_tool_choice(raw: Any, tools: list[ToolSpec], param: str = "tool_choice") -> ToolChoice:
    if raw is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(raw, str):
        if raw not in CHOICES:
            raise ApiError("invalid_field", f"{param!r} must be one of {list(CHOICES)} or {{\"type\": \"function\", "
                           f"\"function\": {{\"name\": ...}}}}, got {raw!r}", param=param)
        if raw != "none" and not tools:  # as OpenAI and vLLM: "none" alone is plain chat, the others ask for tools
            raise ApiError("invalid_field", f"{param!r} is {raw!r} but no tools were given; send 'tools' or "
                           "leave 'tool_choice' out", param=param)
        return ToolChoice(raw)
    fn = raw.get("function") if isinstance(raw, dict) and raw.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ApiError("invalid_field", f"{param!r} must be a string or {{\"type\": \"function\", \"function\": "
                       "{\"name\": ...}}", param=param)
    if name not in {t.name for t in tools}:
        given = ", ".join(t.name for t in tools) or "no tools"
        raise ApiError("invalid_field", f"{param!r} names the function {name!r}, which is not in 'tools' ({given})",
                       param=param)
    return ToolChoice("named", name)


def history_message(m: dict[str, Any], i: int, content_text: ContentText) -> dict[str, Any]:
    """A history message of tool calling in template form: an assistant message with `tool_calls`
    (its content may be null) or a `tool` message answering one."""
    role, where = m.get("role"), f"messages[{i}]"
    if role == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise ApiError("missing_field", f"{where}.tool_call_id is required on a tool message",
                           param=f"{where}.tool_call_id")
        if m.get("content") is None:
            raise ApiError("missing_field", f"{where}.content is required", param=f"{where}.content")
        return {"role": "tool", "tool_call_id": call_id, "content": content_text(m["content"], i)}
    if role != "assistant":
        raise ApiError("invalid_field", f"{where}.tool_calls is only allowed on assistant messages",
                       param=f"{where}.tool_calls")
    raw = m.get("tool_calls")
    if not isinstance(raw, list):
        raise ApiError("invalid_field", f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
    content = m.get("content")
    return {"role": "assistant", "content": None if content is None else content_text(content, i),
            "tool_calls": [_history_call(c, f"{where}.tool_calls[{k}]") for k, c in enumerate(raw)]}


def _history_call(c: Any, where: str) -> dict[str, Any]:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ApiError("invalid_field", f"{where} must be {{\"id\", \"type\": \"function\", \"function\": "
                       "{\"name\", \"arguments\"}}", param=where)
    args = fn.get("arguments", "{}")
    if isinstance(args, dict):  # some clients send the object itself; the API's form is its JSON text
        args = json.dumps(args, ensure_ascii=False)
    if not isinstance(args, str):
        raise ApiError("invalid_field", f"{where}.function.arguments must be a JSON string",
                       param=f"{where}.function.arguments")
    call_id = c.get("id")
    if call_id is not None and not isinstance(call_id, str):
        raise ApiError("invalid_field", f"{where}.id must be a string", param=f"{where}.id")
    return {"id": call_id or "", "type": "function", "function": {"name": fn["name"], "arguments": args}}


# -- reply side ------------------------------------------------------------------------------

def call_json(c: ToolCall) -> dict[str, Any]:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


def finish_with_calls(finish: str, called: bool) -> str:
    """OpenAI's finish_reason: "tool_calls" for a reply that ended normally after calling."""
    return "tool_calls" if called and finish == "stop" else finish


def reply_message(tools: ChatTools | None, text: str, finish: str,
                  reasoning: str | None = None) -> tuple[dict[str, Any], str]:
    """A whole choice's `message` and `finish_reason`: `text` is its answer (the reply without its
    reasoning), `reasoning` its reasoning (None: the model has no reasoning format, so the message has no
    `reasoning_content`; "" for a reply without reasoning, null in the message). With tools the content
    is the parser's (text outside calls, its ends' whitespace dropped), as the streamed deltas give it."""
    thought = {} if reasoning is None else {"reasoning_content": reasoning or None}
    if tools is None or not tools.active:
        return {"role": "assistant", "content": text, **thought}, finish
    parsed = tools.parse(text, cut=finish == "length")
    if not parsed.calls:
        return {"role": "assistant", "content": parsed.content, **thought}, finish
    return ({"role": "assistant", "content": parsed.content or None, **thought,
             "tool_calls": [call_json(c) for c in parsed.calls]}, finish_with_calls(finish, True))


class ChoiceDeltas:
    """The `delta`s of one streamed choice: its reasoning as `reasoning_content` (with a reasoning
    format), its answer as content or, with tools, split by the format's stream parser into content
    and `tool_calls` fragments. `reader` reads the reply (Plan.reader); without one, `tools` alone."""

    def __init__(self, tools: ChatTools | None, reader: ReplyStream | None = None) -> None:
        self.parallel = tools.parallel if tools is not None else True
        active = tools is not None and tools.active
        self.reader = reader if reader is not None else ReplyStream(None, tools.format.stream() if active and tools
                                                                     else None)

    @property
    def called(self) -> bool:
        return self.reader.called

    @property
    def reasoning_tokens(self) -> int:
        return self.reader.reasoning_tokens

    def of(self, o: CompletionOutput, with_logprobs: bool) -> list[dict[str, Any]]:
        """The deltas of one engine output (its finish included: text the parser held back comes out).
        Tokens without any delta still get an empty content delta when logprobs were asked (their entries)."""
        items = self.reader.feed(o.text, len(o.token_ids))
        if o.finish_reason:
            items += self.reader.finish(cut=o.finish_reason == "length")
        out = self._fragments(items)
        if not out and o.token_ids and with_logprobs:
            out = [{"content": ""}]
        return out

    def finish_reason(self, finish: str) -> str:
        return finish_with_calls(finish, self.called)

    def _fragments(self, items: list[ReplyPiece]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for d in items:
            if isinstance(d, ContentDelta | ReasoningDelta):
                key = "content" if isinstance(d, ContentDelta) else "reasoning_content"
                if not d.text:
                    continue
                if out and key in out[-1]:  # one chunk for adjacent text
                    out[-1][key] += d.text
                else:
                    out.append({key: d.text})
                continue
            if d.index > 0 and not self.parallel:
                continue
            frag: dict[str, Any] = {"index": d.index}
            if d.id is not None:
                frag["id"], frag["type"] = d.id, "function"
            fn: dict[str, Any] = {"name": d.name} if d.name is not None else {}
            fn["arguments"] = d.arguments
            frag["function"] = fn
            out.append({"tool_calls": [frag]})
        return out
