"""The Anthropic Messages API's tools: `tools` ({name, description?, input_schema}) and `tool_choice`
as the engine's ChatTools, which the OpenAI endpoint's tool calling runs on (server/openai_chat/tools.py:
the same checks of a function, the same formats, constraints and parser).

Mapping (invariants): `auto` → auto, `any` → required, `tool` → named (its `name` must be among the
tools), `none` → none (the chat template then gets no tools and the reply is never parsed for calls);
`disable_parallel_tool_use: true` keeps at most one call. Without `tool_choice`, tools mean auto. Only
custom tools are taken: Anthropic's server tools (a `type` such as "web_search_…") are refused, and
`input_schema` is required, as Anthropic requires it; `cache_control` on a tool changes nothing.
"""

from __future__ import annotations

from typing import Any

from radixserve.chat.tool_calls import ChatTools
from radixserve.chat.tools import ToolCallFormat, ToolChoice, ToolSpec
from radixserve.server.openai_chat.tools import MAX_TOOLS, function_spec, unique_tools
from radixserve.server.validation import ApiError

TOOL_CHOICES = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}


def tool_request(body: dict[str, Any], fmt: ToolCallFormat) -> ChatTools | None:
    """`tools` and `tool_choice` as ChatTools; None when the body sends neither."""
    raw_tools, raw_choice = body.get("tools"), body.get("tool_choice")
    if raw_tools is None and raw_choice is None:
        return None
    specs = _tools(raw_tools)
    choice, parallel = _tool_choice(raw_choice, specs)
    return ChatTools(tuple(specs), choice, parallel, fmt)


def _tools(raw: Any) -> list[ToolSpec]:
    if raw is None:
        return []
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise ApiError("invalid_field", f"'tools' must be a list of at most {MAX_TOOLS} tools", param="tools")
    out = []
    for i, t in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise ApiError("invalid_field", f"{where} must be {{\"name\", \"description\", \"input_schema\"}}",
                           param=where)
        if t.get("type") not in (None, "custom"):
            raise ApiError("unsupported", f"{where}.type: {t['type']!r} tools (Anthropic's server tools) are not "
                           "supported; only custom tools {name, description, input_schema}", param=f"{where}.type")
        if not isinstance(t.get("input_schema"), dict):
            raise ApiError("missing_field" if "input_schema" not in t else "invalid_field",
                           f"{where}.input_schema is required: a JSON schema object", param=f"{where}.input_schema")
        out.append(function_spec(t, where, "input_schema"))
    return unique_tools(out, "tools")


def _tool_choice(raw: Any, tools: list[ToolSpec]) -> tuple[ToolChoice, bool]:
    """The engine's choice and whether parallel calls are allowed."""
    if raw is None:
        return ToolChoice("auto" if tools else "none"), True
    if not isinstance(raw, dict):
        raw = {}  # refused below, with the shape it should have
    kind = raw.get("type")
    if not isinstance(kind, str) or kind not in TOOL_CHOICES:
        raise ApiError("invalid_field", "'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\", "
                       "\"name\"?, \"disable_parallel_tool_use\"?}", param="tool_choice")
    disable = raw.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise ApiError("invalid_field", "'tool_choice.disable_parallel_tool_use' must be a boolean",
                       param="tool_choice.disable_parallel_tool_use")
    if kind in ("any", "tool") and not tools:
        raise ApiError("invalid_field", f"tool_choice {kind!r} needs at least one tool in 'tools'", param="tool_choice")
    name = None
    if kind == "tool":
        name = raw.get("name")
        if not isinstance(name, str) or name not in {t.name for t in tools}:
            given = ", ".join(t.name for t in tools)
            raise ApiError("invalid_field", f"'tool_choice.name' must name one of the tools ({given}), got {name!r}",
                           param="tool_choice.name")
    return ToolChoice(TOOL_CHOICES[kind], name), not disable
