"""The values tool calling passes around: the tools a request offers (`ToolSpec`), how it lets the model
use them (`ToolChoice`), the calls a reply makes (`ToolCall`, `ParsedReply`) and the pieces a streamed
reply is cut into (`ContentDelta`, `ToolCallDelta`).

Invariants: every value is frozen; a call's `arguments` is JSON text exactly as OpenAI carries it; a call
id is "call_" and 24 hex digits, fresh per call. `from_openai` constructors raise ValueError naming the API
path of what is wrong, so the server can answer 400 with it.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field
from typing import Any

CHOICE_MODES = ("none", "auto", "required", "named")
# OpenAI allows [a-zA-Z0-9_-]{1,64}; dots and colons are what MCP-style namespaced tools add. Nothing else,
# so a name can be rendered into a prompt or a grammar as it is.
_NAME = re.compile(r"[A-Za-z0-9_.:\-]{1,64}")


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _empty_parameters() -> dict[str, Any]:
    return {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolSpec:
    """One OpenAI function tool."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=_empty_parameters)
    strict: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ValueError(f"function.name: {self.name!r} is not 1 to 64 characters of a-z, A-Z, 0-9, _, -, . or :")
        if not isinstance(self.parameters, dict):
            raise ValueError(f"function.parameters of {self.name}: a JSON schema object, got "
                             f"{type(self.parameters).__name__}")

    def openai_dict(self) -> dict[str, Any]:
        """{"type": "function", "function": {...}}: what chat templates and the API carry."""
        function: dict[str, Any] = {"name": self.name, "description": self.description, "parameters": self.parameters}
        if self.strict:
            function["strict"] = True
        return {"type": "function", "function": function}

    @classmethod
    def from_openai(cls, tool: Any, path: str = "tools[0]") -> ToolSpec:
        """An OpenAI `tools` entry ({"type": "function", "function": {...}}); ValueError names `path`."""
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(
                tool.get("function"), dict):
            raise ValueError(f"{path}: expected {{\"type\": \"function\", \"function\": {{...}}}}")
        fn = tool["function"]
        parameters = fn.get("parameters")
        if parameters is None:
            parameters = _empty_parameters()
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise ValueError(f"{path}.function.description: a string")
        try:
            return cls(fn.get("name"), description, parameters, bool(fn.get("strict") or False))
        except ValueError as e:
            raise ValueError(f"{path}.{e}") from None


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none" | "auto" | "required" | "named"
    name: str | None = None  # the function, when mode == "named"

    def __post_init__(self) -> None:
        if self.mode not in CHOICE_MODES:
            raise ValueError(f"tool_choice: one of {', '.join(CHOICE_MODES)}, got {self.mode!r}")
        if (self.mode == "named") != (self.name is not None):
            raise ValueError("tool_choice: a function name goes with mode 'named' and only with it")

    @classmethod
    def from_openai(cls, value: Any, tools: list[ToolSpec]) -> ToolChoice:
        """OpenAI's `tool_choice` (absent: "auto" with tools, "none" without); a named function must be offered."""
        if value is None:
            return cls("auto" if tools else "none")
        if isinstance(value, str):
            if value not in ("none", "auto", "required"):
                raise ValueError(f"tool_choice: 'none', 'auto', 'required' or a named function, got {value!r}")
            if value == "required" and not tools:
                raise ValueError("tool_choice: 'required' needs at least one tool in tools")
            return cls(value)
        fn = value.get("function") if isinstance(value, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise ValueError('tool_choice: expected {"type": "function", "function": {"name": ...}}')
        if name not in {t.name for t in tools}:
            raise ValueError(f"tool_choice.function.name: {name!r} is not among the tools")
        return cls("named", name)

    def offered(self, tools: list[ToolSpec]) -> list[ToolSpec]:
        """The tools a reply may call under this choice."""
        if self.mode == "none":
            return []
        return [t for t in tools if t.name == self.name] if self.mode == "named" else list(tools)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=new_call_id)

    def openai_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedReply:
    content: str  # the text outside tool calls, stripped; "" when none
    calls: list[ToolCall]


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    index: int  # 0, 1, ... per call in this reply
    id: str | None  # on the first fragment of a call only
    name: str | None  # on the first fragment of a call only
    arguments: str  # a piece of the JSON arguments text ("" allowed on the first fragment)


ReplyDelta = ContentDelta | ToolCallDelta
