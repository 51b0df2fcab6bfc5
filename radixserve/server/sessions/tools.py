"""Tool calling in chat sessions (REST and WebSocket): a session's tools, what one turn asks of them,
the tool results a turn answers calls with, and a turn's reply read for calls as it streams.

A session's tools are rendered into its first tokens (templates put tool definitions in the system
prompt, or the first user turn), and a session's tokens are never re-rendered. So its tools are set
at creation, or by the first turn of a session without messages; a later turn may repeat them, never
change them (400 naming `tools`). Each turn may pick its own `tool_choice` and `parallel_tool_calls`.

A turn's input is a user message (`content`) or the results of the previous reply's calls
(`tool_results`: [{tool_call_id, content}]), never both. A result must answer a call of the
session's last reply that no earlier result answered (400 otherwise); they become `tool` messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixserve.chat.reasoning import ReasoningDelta, ReplyStream
from radixserve.chat.tool_calls import ChatTools
from radixserve.chat.tools import ContentDelta, ToolChoice, ToolSpec
from radixserve.server.openai_chat.tools import finish_with_calls, tool_request
from radixserve.server.sessions.store import Session
from radixserve.server.state import ServerState
from radixserve.server.validation import ApiError, get_str

MAX_RESULTS = 64


def session_tools(state: ServerState, body: dict[str, Any]) -> tuple[ToolSpec, ...]:
    """The `tools` of a session.create frame or a POST /v1/sessions body (none: no tools)."""
    if body.get("tools") is None:
        return ()
    formatter, _ = state.require_chat()
    req = tool_request({"tools": body["tools"]}, formatter.tool_format)
    return req.tools if req is not None else ()


def turn_tools(state: ServerState, body: dict[str, Any], session: Session) -> ChatTools | None:
    """What a turn asks of tools: its own `tools` (for a session without messages; else they must be
    the session's), or the session's; its `tool_choice` (default auto with tools) and parallel calls."""
    formatter, _ = state.require_chat()
    fmt = formatter.tool_format
    req = tool_request(body, fmt, default_tools=session.tools)
    if req is None:
        return ChatTools(session.tools, ToolChoice("auto"), True, fmt) if session.tools else None
    if body.get("tools") is not None and req.tools != session.tools and session.messages:
        raise ApiError("invalid_field", "a session's tools are rendered into its first tokens, so they are set when it "
                       "is created (or by its first message) and cannot change; fork the session at message 0 or "
                       "create a new one with these tools", param="tools")
    return req


def turn_inputs(body: dict[str, Any], session: Session) -> list[dict[str, Any]]:
    """The template messages a turn appends: its user message, or its tool results as tool messages."""
    results = body.get("tool_results")
    if results is None:
        content = get_str(body, "content")
        assert content is not None
        return [{"role": "user", "content": content}]
    if "content" in body:
        raise ApiError("invalid_field", "send either 'content' (a user message) or 'tool_results', not both",
                       param="tool_results")
    if not isinstance(results, list) or not 0 < len(results) <= MAX_RESULTS:
        raise ApiError("invalid_field", f"'tool_results' must be a list of 1 to {MAX_RESULTS} "
                       "{\"tool_call_id\", \"content\"} objects", param="tool_results")
    open_calls = unanswered_calls(session)
    out: list[dict[str, Any]] = []
    for i, r in enumerate(results):
        where = f"tool_results[{i}]"
        if not isinstance(r, dict):
            raise ApiError("invalid_field", f"{where} must be an object", param=where)
        call_id = get_str(r, "tool_call_id")
        content = get_str(r, "content", allow_empty=True)
        if call_id not in open_calls:
            known = ", ".join(open_calls) or "none"
            raise ApiError("invalid_field", f"{where}.tool_call_id {call_id!r} is not an unanswered call of the "
                           f"session's last reply (unanswered: {known})", param=f"{where}.tool_call_id")
        open_calls.remove(call_id)
        out.append({"role": "tool", "tool_call_id": call_id, "content": content})
    return out


def unanswered_calls(session: Session) -> list[str]:
    """Ids of the calls of the session's last assistant reply that no later tool message answers."""
    answered: set[str] = set()
    for m in reversed(session.messages):
        if m.role == "tool" and m.tool_call_id is not None:
            answered.add(m.tool_call_id)
        elif m.role == "assistant":
            return [c["id"] for c in m.tool_calls or () if c["id"] not in answered]
        else:
            return []
    return []


@dataclass
class ReplyCalls:
    """One turn's reply read for calls (and, for a thinking model, its reasoning) as it streams: content
    deltas become `delta` events, reasoning pieces `delta` events with an empty `text` and the piece as
    `reasoning`, call fragments `tool_call` events; the reply kept is what those events said (content,
    reasoning, and calls with the ids the client was given), so a client answers the calls it saw.
    `reader` reads the reply (Plan.reader); without one, `tools` alone."""

    tools: ChatTools | None
    gen_id: str
    content: list[str] = field(default_factory=list)
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    reader: ReplyStream | None = None
    _ended: bool = False

    def __post_init__(self) -> None:
        if self.reader is None:
            active = self.tools is not None and self.tools.active
            self.reader = ReplyStream(None, self.tools.format.stream() if active and self.tools is not None else None)

    @property
    def reasoning(self) -> str:
        assert self.reader is not None
        return self.reader.reasoning_text

    @property
    def reasoning_tokens(self) -> int:
        assert self.reader is not None
        return self.reader.reasoning_tokens

    def events(self, text: str, final: bool, cut: bool = False, tokens: int = 0) -> list[dict[str, Any]]:
        """The events of the reply's next text (`tokens` of them; `final`: its end; `cut`: by max_tokens, so
        the call it was cut in is not content). Nothing after the end."""
        assert self.reader is not None
        if self._ended:
            return []
        items = self.reader.feed(text, tokens)
        if final:
            self._ended = True
            items += self.reader.finish(cut)
        out: list[dict[str, Any]] = []
        for d in items:
            if isinstance(d, ReasoningDelta):
                if d.text:
                    out.append({"type": "delta", "gen_id": self.gen_id, "text": "", "reasoning": d.text})
            elif isinstance(d, ContentDelta):
                if d.text:
                    self.content.append(d.text)
                    out.append({"type": "delta", "gen_id": self.gen_id, "text": d.text})
            elif d.index == 0 or self.tools is None or self.tools.parallel:
                frag: dict[str, Any] = {"type": "tool_call", "gen_id": self.gen_id, "index": d.index}
                if d.id is not None:
                    frag.update(id=d.id, name=d.name)
                    self.calls[d.index] = {"id": d.id, "type": "function",
                                           "function": {"name": d.name or "", "arguments": ""}}
                frag["arguments"] = d.arguments
                self.calls[d.index]["function"]["arguments"] += d.arguments
                out.append(frag)
        return out

    def reply(self, finish_reason: str) -> tuple[str, list[dict[str, Any]], str]:
        """(content, tool calls, finish_reason) of the whole reply, once `events` saw its end."""
        calls = [self.calls[i] for i in sorted(self.calls)]
        return "".join(self.content), calls, finish_with_calls(finish_reason, bool(calls))
