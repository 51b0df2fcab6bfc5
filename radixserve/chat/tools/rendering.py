"""Tools in chat templates: conversations with tools, assistant `tool_calls` and `tool` results shaped for
a template that renders tools itself (`template_message`, call arguments as objects) or written into plain
contents for one that does not (`as_contents`), and the guard that keeps tool data rendered as template
text from carrying control tokens (`ControlText`). chat/template.py is their one user.

Invariants: both shapings are idempotent (shaping a shaped conversation changes nothing), so a formatter
may shape before rendering twice; `as_contents` puts every tool-related text into message contents, which
are tokenized as plain text.
"""

from __future__ import annotations

import json
import re
from typing import Any

from radixserve.chat.tools.base import ToolCallFormat, arguments_object
from radixserve.chat.tools.types import ToolCall, ToolSpec

Message = dict[str, Any]


class ControlText:
    """The tokenizer's control-token strings, to refuse tool data a template would render as markup."""

    def __init__(self, tokenizer: Any) -> None:
        try:
            added = list(tokenizer.get_added_vocab())
        except (AttributeError, NotImplementedError):
            added = []
        controls = {t for t in [*getattr(tokenizer, "all_special_tokens", []), *added] if t}
        self._pattern = re.compile("|".join(map(re.escape, sorted(controls, key=len, reverse=True)))) \
            if controls else None

    def refuse_in(self, messages: list[Message], tools: list[ToolSpec]) -> None:
        """ValueError naming the first tool, call or result id holding a control-token string."""
        if self._pattern is None:
            return
        strings = [(f"tools[{i}].function", json.dumps(t.openai_dict()["function"], ensure_ascii=False))
                   for i, t in enumerate(tools)]
        for i, m in enumerate(messages):
            if m.get("tool_call_id") is not None:
                strings.append((f"messages[{i}].tool_call_id", str(m["tool_call_id"])))
            for j, call in enumerate(m.get("tool_calls") or []):
                strings.append((f"messages[{i}].tool_calls[{j}]", json.dumps(call, ensure_ascii=False)))
        for path, text in strings:
            if found := self._pattern.search(text):
                raise ValueError(f"{path} contains the control token {found.group()!r}, which the chat template "
                                 "would render as markup")


def template_message(m: Message) -> Message:
    """A message as templates that render tools expect it: call arguments as objects, not JSON text."""
    calls = m.get("tool_calls")
    if not calls:
        return m
    shaped = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            call = {**call, "function": {**fn, "arguments": arguments_object(fn["arguments"])}}
        shaped.append(call)
    return {**m, "tool_calls": shaped}


def as_contents(messages: list[Message], tools: list[ToolSpec], fmt: ToolCallFormat) -> list[Message]:
    """Tools, calls and results written into plain contents, for a template that knows nothing of tools."""
    out: list[Message] = []
    if tools:
        preamble = fmt.system_prompt(tools)
        if messages and messages[0].get("role") == "system" and not str(messages[0].get("content") or "").startswith(
                preamble):
            first = str(messages[0].get("content") or "")
            out.append({"role": "system", "content": preamble + ("\n\n" + first if first else "")})
            messages = messages[1:]
        elif not (messages and messages[0].get("role") == "system"):
            out.append({"role": "system", "content": preamble})
    for m in messages:
        role = m.get("role")
        if m.get("tool_calls"):
            calls = [ToolCall(c["function"]["name"], _arguments_text(c["function"].get("arguments")), c.get("id") or "")
                     for c in m["tool_calls"]]
            text = str(m.get("content") or "")
            out.append({"role": "assistant", "content": (text + "\n" if text else "") + fmt.render_calls(calls)})
        elif role == "tool" and fmt.name == "hermes":
            block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("role") == "user" and out[-1].get("tool_results"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + block}
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
        elif role == "tool":
            out.append({"role": "tool", "content": str(m.get("content") or "")})
        else:
            out.append(m)
    return [{k: v for k, v in m.items() if k != "tool_results"} for m in out]


def _arguments_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False,
                                                                    separators=(", ", ": "))
