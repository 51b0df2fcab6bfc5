"""The Anthropic Messages API's request side: a /v1/messages or /v1/messages/count_tokens body read
into an `Ask` (server/pipeline/ask.py) of the chat template's messages and tools
(`conversation_ask`, shared by both, so count_tokens counts exactly the prompt a message would have)
and, for a message, its sampling, planned by the one pipeline (`parse_messages_request`). Every
field is checked before anything is tokenized; a bad one is a 400 naming it
(`messages[1].content[0].type`, `tool_choice.name`, ...). Refusals of the shared code that clients
parse are reworded as Anthropic words them (`anthropic_refusals`, on both endpoints): a prompt past
the context is "prompt is too long: N tokens > M maximum" (M: the longest prompt this server takes),
a system message the chat template will not take where it stands is Anthropic's `Unexpected role
"system"` refusal (`SYSTEM_ROLE_REFUSED`), and any other refusal of the template a 400, never a 500.

Mapping (invariants):
- `system` (a string or text blocks) is the leading system message; `cache_control` on a system block
  asks for the system prompt to be pinned for a while (cache_control.py, after this parse); elsewhere
  it is accepted and changes nothing (every prefix is cached: docs/server.md).
- `messages` are `user` and `assistant` turns (consecutive turns of one role are allowed, as Anthropic
  merges them) and `system` messages (Anthropic's mid-conversation system messages: a string or text
  blocks, not empty). The last turn that is not a system message is a `user` turn: a trailing
  assistant turn (a prefill) is refused. A leading run of system messages joins the system prompt
  (after `system`, each part separated by a blank line), so a conversation keeps one system prompt
  (the cache_control pin, the tenant figures); a later one is a system message where it stands, for
  the chat template to render (most take one anywhere; one that refuses it: SYSTEM_ROLE_REFUSED).
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
  a stop, its stop_reason "max_tokens" or "stop_sequence"); unknown fields are ignored; `metadata` (an
  object; its `user_id` a string) is checked and ignored; `cache_salt` (vLLM's field, sent through the
  SDKs' `extra_body`) narrows the cached prefixes the request may hit within its tenant (callers.py).
  A `max_tokens` past the context is clamped to the room the prompt leaves (pipeline/sampling.py's
  CLAMPS_MAX_TOKENS), as Anthropic's clients expect; `MessagesRequest.clamped` tells the reply side,
  whose stop_reason is then "model_context_window_exceeded" when the reply runs into the clamp.
  Headers such as `anthropic-beta` and `anthropic-version` are not read: a beta changes nothing here
  unless it comes with a field this parse reads (an unsupported one is refused by its field).
- `thread` (the message-threads beta: the server holds the conversation and later turns send only
  their new messages) is refused with Anthropic's `thread_unsupported_request` error code, on which
  the SDK's tool runner resends the turn whole and stops threading: this server holds no
  conversation, the radix cache makes a resent history cost nothing to prefill.
  `output_config.format` (`{"type": "json_schema", "schema"}`) constrains the reply to the schema
  (structured output; beside tools under `auto` the reply is calls or that answer, a forced call wins:
  docs/structured_output.md).
- Thinking (template variables, pipeline/reasoning.py; in count_tokens too, which counts the same
  prompt): `thinking` `{"type": "enabled", "budget_tokens"}` (at least 1024 and below `max_tokens`, as
  Anthropic asks; not enforced: the model thinks as long as it does) sets `enable_thinking` true,
  `{"type": "disabled"}` false; `{"type": "adaptive"}` (the model decides whether and how long to
  think) and `{"type": "between_tools"}` set nothing, leaving the template's default (a thinking
  template thinks unless told not to); `display` "omitted" keeps the thinking blocks but empties them
  (reply.py), "summarized" (or none) shows them; `output_config.effort` ("low", "medium", "high")
  becomes `reasoning_effort`; `chat_template_kwargs` (vLLM's field, through `extra_body`) adds variables.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from radixserve.chat.template import Message
from radixserve.chat.tools import ToolCall
from radixserve.sampling_fields import Api, SamplingFields
from radixserve.server.anthropic.tools import tool_request
from radixserve.server.api_errors import DetailedApiError
from radixserve.server.callers import cache_salt_of
from radixserve.server.pipeline.ask import Ask, ChatPrompt
from radixserve.server.pipeline.plan import Plan, plan
from radixserve.server.pipeline.prompt_worker import TEMPLATE_REFUSED
from radixserve.server.pipeline.reasoning import reasoning_of, template_variables
from radixserve.server.pipeline.sampling import read_sampling
from radixserve.server.state import ServerState
from radixserve.server.tenants import Caller
from radixserve.server.validation import ApiError, get_bool, get_str, refuse_unsupported
from radixserve.structured import StructuredOutput

UNSUPPORTED = {"mcp_servers": None, "container": None}  # features refused rather than ignored
# the blocks each role may send
BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking", "redacted_thinking"),
          "system": ("text",)}
MIN_THINKING_BUDGET = 1024  # Anthropic's least budget_tokens
THINKING_TYPES = ("enabled", "disabled", "adaptive", "between_tools")
THINKING_DISPLAYS = ("summarized", "omitted")
EFFORTS = ("low", "medium", "high")  # output_config.effort values a template may read as reasoning_effort
SYSTEM_JOIN = "\n\n"  # between the parts of a system prompt that came as separate fields or messages
# Anthropic's own words for a system message it will not take in `messages`; clients that fall back to the
# top-level `system` field when refused recognise them
SYSTEM_ROLE_REFUSED = ('messages: Unexpected role "system". The Messages API accepts a top-level `system` parameter, '
                       'not "system" as an input message role.')
_PROMPT_LENGTH = re.compile(r"prompt of (\d+) tokens")  # how the pipeline's and the engine's refusals begin


@dataclass(frozen=True)
class MessagesRequest:
    model: str
    plan: Plan
    max_tokens: int  # the caller's; the plan's is clamped to the room the prompt leaves
    show_thinking: bool = True  # thinking blocks carry their text (`thinking.display` is not "omitted")

    @property
    def clamped(self) -> bool:
        """Whether the context leaves less room than the caller's max_tokens (the reply may run into it)."""
        return self.plan.params.max_tokens < self.max_tokens


@dataclass(frozen=True)
class Thinking:
    """A request's `thinking`: the template variables it sets and whether its blocks show their text."""

    variables: dict[str, Any] = field(default_factory=dict)
    shown: bool = True


async def parse_messages_request(state: ServerState, body: dict[str, Any], caller: Caller) -> MessagesRequest:
    if body.get("thread") is not None:
        raise DetailedApiError("unsupported", "'thread' is not supported: this server holds no conversation; send the "
                               "whole conversation in 'messages' without 'thread'",
                               {"error_code": "thread_unsupported_request"}, param="thread")
    sampling = read_sampling(body, Api.ANTHROPIC)
    max_tokens = sampling.max_tokens
    if max_tokens is None:
        raise ApiError("missing_field", "missing required field 'max_tokens'", param="max_tokens")
    thinking = read_thinking(body.get("thinking"), max_tokens)  # the budget against max_tokens, first
    stream = get_bool(body, "stream")
    sampling = replace(sampling, structured=_output_format(body.get("output_config")))
    model, ask = conversation_ask(state, body, caller)  # the checks above first: a bad field costs no tokenizing
    ask = replace(ask, sampling=sampling, stream=stream)
    async with anthropic_refusals(state, ask):
        planned = await plan(state, ask)
    return MessagesRequest(model, planned, max_tokens, thinking.shown)


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
    _check_metadata(body.get("metadata"))
    tools = tool_request(body, formatter.tool_format)
    config = body.get("output_config")
    effort = config.get("effort") if isinstance(config, dict) else None
    mapped = {**read_thinking(body.get("thinking")).variables,
              **({"reasoning_effort": effort} if effort in EFFORTS else {})}
    variables = template_variables(state, body.get("chat_template_kwargs"), mapped)
    messages = template_messages(body, state.config.keep_reasoning_in_history)
    return model, Ask(Api.ANTHROPIC, ChatPrompt(messages), SamplingFields(), caller.tenant, cache_salt, tools,
                      variables=variables, reasoning=reasoning_of(state))


def read_thinking(thinking: Any, max_tokens: int | None = None) -> Thinking:
    """`thinking` read (see the module docstring); a 400 naming it for a shape Anthropic would refuse too."""
    if thinking is None:
        return Thinking()
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if not isinstance(thinking, dict) or kind not in THINKING_TYPES:
        raise ApiError("invalid_field", "'thinking' must be {\"type\": \"enabled\", \"budget_tokens\": N}, "
                       "{\"type\": \"adaptive\"} or {\"type\": \"disabled\"}", param="thinking")
    display = thinking.get("display")
    if display is not None and display not in THINKING_DISPLAYS:
        raise ApiError("invalid_field", f"'thinking.display' must be one of {', '.join(THINKING_DISPLAYS)}, got "
                       f"{display!r}", param="thinking.display")
    shown = display != "omitted"
    if kind == "disabled":
        return Thinking({"enable_thinking": False}, shown)
    if kind != "enabled":  # the model decides: the template's default
        return Thinking({}, shown)
    budget = thinking.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < MIN_THINKING_BUDGET:
        raise ApiError("invalid_field", f"'thinking.budget_tokens' must be an integer of at least {MIN_THINKING_BUDGET}",
                       param="thinking.budget_tokens")
    if max_tokens is not None and budget >= max_tokens:
        raise ApiError("invalid_field", "'thinking.budget_tokens' must be less than 'max_tokens'",
                       param="thinking.budget_tokens")
    return Thinking({"enable_thinking": True}, shown)


def _check_metadata(raw: Any) -> None:
    """`metadata` is accepted and read no further, but checked: an object whose `user_id` is a string."""
    if raw is None:
        return
    if not isinstance(raw, dict):
        raise ApiError("invalid_field", "'metadata' must be an object such as {\"user_id\": \"...\"}", param="metadata")
    user = raw.get("user_id")
    if user is not None and not isinstance(user, str):
        raise ApiError("invalid_field", f"'metadata.user_id' must be a string, got {type(user).__name__}",
                       param="metadata.user_id")


@asynccontextmanager
async def anthropic_refusals(state: ServerState, ask: Ask) -> AsyncIterator[None]:
    """Refusals of the shared code that renders and admits `ask` (the block), in Anthropic's wording
    (see the module docstring)."""
    try:
        yield
    except ApiError as e:
        if e.code == TEMPLATE_REFUSED:
            raise await _template_refusal(state, ask, e) from None
        if e.code != "context_too_long":
            raise
        raise _prompt_too_long(state, e) from None


async def _template_refusal(state: ServerState, ask: Ask, error: ApiError) -> ApiError:
    """Why the chat template refused `ask`'s conversation: its system messages after the first
    message (SYSTEM_ROLE_REFUSED) when it renders without them, else the template's own words."""
    assert isinstance(ask.prompt, ChatPrompt)
    messages = ask.prompt.messages
    later = [k for k, m in enumerate(messages) if k > 0 and m["role"] == "system"]
    if later:
        rest = [m for k, m in enumerate(messages) if k not in later]
        tools = ask.tools.template_tools() if ask.tools is not None else None
        try:
            await state.require_prompts().chat_tokens(rest, tools, ask.variables)
        except ApiError as e:
            if e.code != TEMPLATE_REFUSED:
                raise
        else:
            return ApiError("unsupported", SYSTEM_ROLE_REFUSED, param=f"messages[{later[0]}].role")
    return ApiError("invalid_field", f"messages: {error.message}", param="messages")


def _prompt_too_long(state: ServerState, error: ApiError) -> ApiError:
    """A prompt refused for its length, in the words Anthropic's clients read (to compact the conversation)."""
    longest = state.require_engine().max_model_len - 1  # the engine leaves room for one token at least
    if state.config.max_prompt_tokens is not None:
        longest = min(longest, state.config.max_prompt_tokens)
    found = _PROMPT_LENGTH.search(error.message)
    said = f"{found[1]} tokens > {longest} maximum" if found else error.message
    return ApiError(error.code, f"prompt is too long: {said}", error.status, param=error.param)


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
    """`system` and `messages` as the chat template's messages (OpenAI's roles and tool shapes), the
    leading system messages joined to `system`; `keep_reasoning`: assistant turns' thinking blocks
    as their `reasoning_content`."""
    system = _system(body.get("system"))
    turns = _messages(body.get("messages"), keep_reasoning)
    lead = next(k for k, m in enumerate(turns) if m["role"] != "system")  # _messages: there is one
    parts = [text for text in (system, *(m["content"] for m in turns[:lead])) if text]
    return ([{"role": "system", "content": SYSTEM_JOIN.join(parts)}] if parts else []) + turns[lead:]


def _system(raw: Any) -> str:
    if raw is None:
        return ""
    blocks = [] if isinstance(raw, str) else _block_list(raw, "system")
    return raw if isinstance(raw, str) else "".join(_text(b, f"system[{k}]") for k, b in enumerate(blocks))


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
            raise ApiError("invalid_field", f"{where}.role must be 'user', 'assistant' or 'system', got {role!r}",
                           param=f"{where}.role")
        if "content" not in m or m["content"] is None:
            raise ApiError("missing_field", f"{where}.content is required", param=f"{where}.content")
        if role == "system":
            turn = [_system_turn(m["content"], where)]
        elif role == "user":
            turn = _user_turn(m["content"], where)
        else:
            turn = [_assistant_turn(m["content"], where, keep_reasoning)]
        _check_results_answer_calls(turn, out, where)
        out += turn
    last = next((k for k in range(len(raw) - 1, -1, -1) if raw[k].get("role") != "system"), None)
    if last is None:
        raise ApiError("invalid_field", "'messages' must hold a user turn, not only system messages", param="messages")
    if raw[last].get("role") != "user":
        raise ApiError("unsupported", "the last message must be a user turn: continuing a final assistant message "
                       "(prefill) is not supported by this server", param=f"messages[{last}].role")
    return out


def _system_turn(content: Any, where: str) -> Message:
    text = "".join(_text(b, f"{where}.content[{k}]") for k, b in _blocks(content, where, "system"))
    if not text:
        raise ApiError("invalid_field", f"{where}.content: a system message must not be empty", param=f"{where}.content")
    return {"role": "system", "content": text}


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
