"""The Anthropic Messages API's request side: a /v1/messages or /v1/messages/count_tokens body read
into an `Ask` (server/pipeline/ask.py) of the chat template's messages and tools
(`conversation_ask`, shared by both, so count_tokens counts exactly the prompt a message would have)
and, for a message, its sampling, planned by the one pipeline (`parse_messages_request`). Every
field is checked before anything is tokenized; a bad one is a 400 naming it
(`messages[1].content[0].type`, `tool_choice.name`, ...).

Mapping (invariants):
- `system` (a string or text blocks) is the leading system message; `cache_control` on a system block
  asks for the system prompt to be pinned for a while (cache_control.py, after this parse); elsewhere
  it is accepted and changes nothing (every prefix is cached: docs/server.md).
- `messages` are `user` and `assistant` turns (consecutive turns of one role are allowed, as Anthropic
  merges them) and end with a `user` turn: a trailing assistant turn (a prefill) is refused.
- A user turn's `tool_result` blocks become `tool` messages, in order, before the turn's text (their
  content: a string or text blocks; `is_error` marks the text "Error: "); an assistant turn's
  `tool_use` blocks become its `tool_calls` (`input` as JSON text, ids kept). An assistant turn's
  `thinking` blocks (its earlier reasoning; their `signature` is not checked) become its
  `reasoning_content` under --keep-reasoning-in-history and are left out otherwise, and
  `redacted_thinking` blocks are left out (there is nothing to read in them). Blocks this text-only
  server cannot read (image, document, ...) are refused, never dropped.
- `tools` and `tool_choice` become ChatTools (tools.py).
- Sampling: the table's fields (radixserve/sampling_fields.py) under this API's names, with the
  other endpoints' ranges: `max_tokens` (required, as Anthropic requires), `temperature` (in [0, 2]
  like every API here, wider than Anthropic's own [0, 1]), `top_p`, `top_k`, `stop_sequences`, and as
  extensions every other row (`min_p`, `seed`, the penalties, `logit_bias`, `min_tokens`, `bad_words`,
  `allowed_token_ids`, `stop_token_ids`, and `ignore_eos`: the reply then ends only at `max_tokens` or
  a stop, its stop_reason "max_tokens" or "stop_sequence"); unknown fields are ignored; `metadata` is
  ignored; `cache_salt` (vLLM's field, sent through the SDKs' `extra_body`) narrows the cached prefixes
  the request may hit within its tenant (callers.py).
  `output_config.format` (`{"type": "json_schema", "schema"}`) constrains the reply to the schema
  (structured output; not with a forced tool choice).
- Thinking (template variables, pipeline/reasoning.py; in count_tokens too, which counts the same
  prompt): `thinking` `{"type": "enabled", "budget_tokens"}` (at least 1024 and below `max_tokens`, as
  Anthropic asks; not enforced: the model thinks as long as it does) sets `enable_thinking` true,
  `{"type": "disabled"}` false; `output_config.effort` ("low", "medium", "high") becomes
  `reasoning_effort`; `chat_template_kwargs` (vLLM's field, through `extra_body`) adds variables.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from radixserve.chat.template import Message
from radixserve.chat.tools import ToolCall
from radixserve.sampling_fields import Api, SamplingFields
from radixserve.server.anthropic.tools import tool_request
from radixserve.server.callers import cache_salt_of
from radixserve.server.pipeline.ask import Ask, ChatPrompt
from radixserve.server.pipeline.plan import Plan, plan
from radixserve.server.pipeline.reasoning import reasoning_of, template_variables
from radixserve.server.pipeline.sampling import read_sampling
from radixserve.server.state import ServerState
from radixserve.server.tenants import Caller
from radixserve.server.validation import ApiError, get_bool, get_str, refuse_unsupported
from radixserve.structured import StructuredOutput

UNSUPPORTED = {"mcp_servers": None, "container": None}  # features refused rather than ignored
# the blocks each role may send
BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}
MIN_THINKING_BUDGET = 1024  # Anthropic's least budget_tokens
EFFORTS = ("low", "medium", "high")  # output_config.effort values a template may read as reasoning_effort


@dataclass(frozen=True)
class MessagesRequest:
    model: str
    plan: Plan


async def parse_messages_request(state: ServerState, body: dict[str, Any], caller: Caller) -> MessagesRequest:
    sampling = read_sampling(body, Api.ANTHROPIC)
    if sampling.max_tokens is None:
        raise ApiError("missing_field", "missing required field 'max_tokens'", param="max_tokens")
    thinking_variables(body.get("thinking"), sampling.max_tokens)  # the budget against max_tokens, first
    stream = get_bool(body, "stream")
    sampling = replace(sampling, structured=_output_format(body.get("output_config")))
    model, ask = conversation_ask(state, body, caller)  # the checks above first: a bad field costs no tokenizing
    return MessagesRequest(model, await plan(state, replace(ask, sampling=sampling, stream=stream)))


def conversation_ask(state: ServerState, body: dict[str, Any], caller: Caller) -> tuple[str, Ask]:
    """`model`, `system`, `messages`, `tools`, `tool_choice` and `cache_salt` (vLLM's, the SDKs'
    extra_body) of a body, checked, as an Ask without sampling fields (count_tokens tokenizes just
    this, so it counts exactly the prompt a message would have)."""
    formatter, _ = state.require_chat()
    cache_salt = cache_salt_of(body)
    model = get_str(body, "model")
    assert model is not None
    state.require_model(model)
    refuse_unsupported(body, UNSUPPORTED)
    tools = tool_request(body, formatter.tool_format)
    config = body.get("output_config")
    effort = config.get("effort") if isinstance(config, dict) else None
    mapped = {**thinking_variables(body.get("thinking")),
              **({"reasoning_effort": effort} if effort in EFFORTS else {})}
    variables = template_variables(state, body.get("chat_template_kwargs"), mapped)
    messages = template_messages(body, state.config.keep_reasoning_in_history)
    return model, Ask(Api.ANTHROPIC, ChatPrompt(messages), SamplingFields(), caller.tenant, cache_salt, tools,
                      variables=variables, reasoning=reasoning_of(state))


def thinking_variables(thinking: Any, max_tokens: int | None = None) -> dict[str, Any]:
    """`thinking` as template variables; a 400 naming it for a shape Anthropic would refuse too."""
    if thinking is None:
        return {}
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind == "disabled":
        return {"enable_thinking": False}
    if kind != "enabled":
        raise ApiError("invalid_field", "'thinking' must be {\"type\": \"enabled\", \"budget_tokens\": N} or "
                       "{\"type\": \"disabled\"}", param="thinking")
    budget = thinking.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < MIN_THINKING_BUDGET:
        raise ApiError("invalid_field", f"'thinking.budget_tokens' must be an integer of at least {MIN_THINKING_BUDGET}",
                       param="thinking.budget_tokens")
    if max_tokens is not None and budget >= max_tokens:
        raise ApiError("invalid_field", "'thinking.budget_tokens' must be less than 'max_tokens'",
                       param="thinking.budget_tokens")
    return {"enable_thinking": True}


def _output_format(config: Any) -> StructuredOutput | None:
    fmt = config.get("format") if isinstance(config, dict) else None
    if config is not None and not isinstance(config, dict):
        raise ApiError("invalid_field", "'output_config' must be an object", param="output_config")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise ApiError("invalid_field", "'output_config.format' must be {\"type\": \"json_schema\", \"schema\": "
                       "{...}}", param="output_config.format")
    try:
        return StructuredOutput(json=fmt["schema"], field="output_config.format.schema")
    except ValueError as e:
        raise ApiError("invalid_field", str(e), param="output_config.format.schema") from None


# -- conversation ------------------------------------------------------------------------------

def template_messages(body: dict[str, Any], keep_reasoning: bool = False) -> list[Message]:
    """`system` and `messages` as the chat template's messages (OpenAI's roles and tool shapes);
    `keep_reasoning`: assistant turns' thinking blocks as their `reasoning_content`."""
    return _system(body.get("system")) + _messages(body.get("messages"), keep_reasoning)


def _system(raw: Any) -> list[Message]:
    if raw is None:
        return []
    blocks = [] if isinstance(raw, str) else _block_list(raw, "system")
    text = raw if isinstance(raw, str) else "".join(_text(b, f"system[{k}]") for k, b in enumerate(blocks))
    return [{"role": "system", "content": text}] if text else []


def _messages(raw: Any, keep_reasoning: bool) -> list[Message]:
    if raw is None:
        raise ApiError("missing_field", "missing required field 'messages'", param="messages")
    if not isinstance(raw, list) or not raw:
        raise ApiError("invalid_field", "'messages' must be a non-empty list", param="messages")
    out: list[Message] = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError("invalid_field", f"{where} must be an object", param=where)
        role = m.get("role")
        if not isinstance(role, str) or role not in BLOCKS:
            raise ApiError("invalid_field", f"{where}.role must be 'user' or 'assistant', got {role!r} (the system "
                           "prompt is the top-level 'system' field)", param=f"{where}.role")
        if "content" not in m or m["content"] is None:
            raise ApiError("missing_field", f"{where}.content is required", param=f"{where}.content")
        turn = _user_turn(m["content"], where) if role == "user" \
            else [_assistant_turn(m["content"], where, keep_reasoning)]
        _check_results_answer_calls(turn, out, where)
        out += turn
    if raw[-1].get("role") != "user":
        raise ApiError("unsupported", "the last message must be a user turn: continuing a final assistant message "
                       "(prefill) is not supported by this server", param=f"messages[{len(raw) - 1}].role")
    return out


def _check_results_answer_calls(turn: list[Message], before: list[Message], where: str) -> None:
    """Each tool_result answers a tool_use of the assistant turn just before it (Anthropic refuses
    others: a result the model never asked for would be rendered as if it had)."""
    last = next((m for m in reversed(before) if m["role"] == "assistant"), None)
    called = {c["id"] for c in last.get("tool_calls") or ()} if last is not None else set()
    for m in turn:
        if m["role"] == "tool" and m["tool_call_id"] not in called:
            raise ApiError("invalid_field", f"{where}.content: tool_result for tool_use_id {m['tool_call_id']!r}, "
                           "which the assistant turn before it did not call", param=f"{where}.content")


def _user_turn(content: Any, where: str) -> list[Message]:
    """Tool results first (as `tool` messages, as Anthropic asks them to come first), then the text."""
    results: list[Message] = []
    texts: list[str] = []
    for k, b in _blocks(content, where, "user"):
        at = f"{where}.content[{k}]"
        if b["type"] == "text":
            texts.append(_text(b, at))
        else:
            results.append(_tool_result(b, at))
    return results + ([{"role": "user", "content": "".join(texts)}] if texts else [])


def _assistant_turn(content: Any, where: str, keep_reasoning: bool) -> Message:
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    for k, b in _blocks(content, where, "assistant"):
        at = f"{where}.content[{k}]"
        if b["type"] == "text":
            texts.append(_text(b, at))
            continue
        if b["type"] == "redacted_thinking":
            continue
        if b["type"] == "thinking":
            if not isinstance(b.get("thinking"), str):
                raise ApiError("invalid_field", f"{at} must be {{\"type\": \"thinking\", \"thinking\": str, "
                               "\"signature\": str}", param=f"{at}.thinking")
            thoughts.append(b["thinking"])
            continue
        call_id, name, args = b.get("id"), b.get("name"), b.get("input")
        if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not name \
                or not isinstance(args, dict):
            raise ApiError("invalid_field", f"{at} must be {{\"type\": \"tool_use\", \"id\": str, \"name\": str, "
                           "\"input\": object}", param=at)
        calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False), call_id).openai_dict())
    thought = {"reasoning_content": "".join(thoughts)} if keep_reasoning and "".join(thoughts) else {}
    if not calls:
        return {"role": "assistant", "content": "".join(texts), **thought}
    return {"role": "assistant", "content": "".join(texts) or None, **thought, "tool_calls": calls}


def _tool_result(b: dict[str, Any], at: str) -> Message:
    call_id = b.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise ApiError("missing_field", f"{at}.tool_use_id is required", param=f"{at}.tool_use_id")
    content = b.get("content")
    if content is None or isinstance(content, str):
        text = content or ""
    else:
        text = "".join(_text(c, f"{at}.content[{k}]") for k, c in enumerate(_block_list(content, f"{at}.content")))
    is_error = b.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise ApiError("invalid_field", f"{at}.is_error must be a boolean", param=f"{at}.is_error")
    # templates have no slot for a failed call: the model is told in the result's text
    return {"role": "tool", "tool_call_id": call_id, "content": f"Error: {text}" if is_error else text}


def _blocks(content: Any, where: str, role: str) -> list[tuple[int, dict[str, Any]]]:
    """A turn's content blocks (a string is one text block) with their indexes, each of a type `role` may send."""
    if isinstance(content, str):
        return [(0, {"type": "text", "text": content})]
    blocks = _block_list(content, f"{where}.content")
    if not blocks:
        raise ApiError("invalid_field", f"{where}.content must not be empty", param=f"{where}.content")
    out = []
    for k, b in enumerate(blocks):
        kind = b.get("type")
        if kind not in BLOCKS[role]:
            at = f"{where}.content[{k}].type"
            raise ApiError("unsupported" if isinstance(kind, str) else "invalid_field",
                           f"{at}: {kind!r} blocks are not supported in a {role} turn by this server (text-only); "
                           f"send {' or '.join(map(repr, BLOCKS[role]))} blocks", param=at)
        out.append((k, b))
    return out


def _block_list(raw: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not all(isinstance(b, dict) for b in raw):
        raise ApiError("invalid_field", f"{where} must be a string or a list of content blocks", param=where)
    return raw


def _text(b: dict[str, Any], at: str) -> str:
    if b.get("type") != "text" or not isinstance(b.get("text"), str):
        raise ApiError("invalid_field", f"{at} must be a text block {{\"type\": \"text\", \"text\": str}}", param=at)
    return str(b["text"])
