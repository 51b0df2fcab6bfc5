"""Granite 3.x and Phi-4-mini calls: a marker, then a JSON list of call objects,

    <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "add", ...}]

Granite writes nothing after the list; Phi-4-mini closes it with `<|/tool_call|>` (`closing`). Text before
the marker is content. The list is read as Mistral's is (`Cursor.call_list`): a list the reply never
closed keeps its calls, a closing marker the reply left out is forgiven, a marker followed by anything
but a list of calls is content.

The markers are special tokens of both families' tokenizers, so replies are decoded with special tokens
kept (`needs_special_tokens`); a reply that lost its marker to such decoding is still read when it
starts with the list of calls.
"""

from __future__ import annotations

import dataclasses

from radixserve.chat.tools.base import Reading, ToolCallFormat
from radixserve.chat.tools.grammar import CallShape
from radixserve.chat.tools.reader import Cursor, Waiting
from radixserve.chat.tools.types import ToolCall

TOOL_CALL, PHI_CLOSE = "<|tool_call|>", "<|/tool_call|>"


@dataclasses.dataclass(frozen=True)
class GraniteFormat(ToolCallFormat):
    name: str = "granite"
    needs_special_tokens: bool = True
    markers: tuple[str, ...] = (TOOL_CALL,)
    closing: str = ""  # what ends the list of calls ("" for Granite, PHI_CLOSE for Phi-4-mini)

    def read(self, c: Cursor) -> Reading:
        # decoded without special tokens the marker is gone: a leading list of calls still is one
        if (yield from c.skip_ws()) and c.text[c.pos] == "[":
            yield from self.block(c, "", self._calls(c))
        while (opener := (yield from c.content_until((TOOL_CALL,)))) is not None:
            yield from self.block(c, opener, self._calls(c))

    def _calls(self, c: Cursor) -> Waiting:
        if not (yield from c.skip_ws()) or c.text[c.pos] != "[" or not (yield from c.call_list()):
            return False
        if self.closing:
            mark = c.pos
            if not ((yield from c.skip_ws()) and (yield from c.accept(self.closing))) and not c.unfinished(mark, True):
                c.pos = mark  # no closing marker: what follows is content again
        return True

    def shape(self) -> CallShape:
        return CallShape(before='{"name": "{name}", "arguments": ', after="}", separator=", ", open=TOOL_CALL + "[",
                         close="]" + self.closing)

    def trigger(self) -> str:
        return TOOL_CALL

    def call_syntax(self) -> str:
        closed = f" and {self.closing}" if self.closing else ""
        return (f"To call functions, write {TOOL_CALL} and then a JSON list of calls{closed}: "
                f'{TOOL_CALL}[{{"name": <function-name>, "arguments": <arguments-object>}}, ...]{self.closing}')

    def render_calls(self, calls: list[ToolCall]) -> str:
        listed = ", ".join(f'{{"name": "{call.name}", "arguments": {call.arguments}}}' for call in calls)
        return f"{TOOL_CALL}[{listed}]{self.closing}"


PHI4_MINI = GraniteFormat(name="phi4_mini", markers=(TOOL_CALL, PHI_CLOSE), closing=PHI_CLOSE)
