"""Mistral calls: `[TOOL_CALLS]` then a JSON list of call objects (`[{"name": "f", "arguments": {...}}]`,
an "id" key allowed), or in the newer syntax `[TOOL_CALLS]f[ARGS]{...}` (an optional `[CALL_ID]id` before
`[ARGS]`), one marker per call. Text before the marker is content.

`[TOOL_CALLS]` and `[ARGS]` are special tokens in Mistral tokenizers, so replies must be decoded with
special tokens kept (`needs_special_tokens`). A reply that lost its marker to such decoding is still read
when it starts with the list of calls; the [ARGS] syntax cannot be. `args_syntax` picks the syntax the
constraints write (the newer one when the template renders `[ARGS]`); the parser reads both.
"""

from __future__ import annotations

import dataclasses
import re

from radixserve.chat.tools.base import Reading, ToolCallFormat
from radixserve.chat.tools.grammar import CallShape
from radixserve.chat.tools.reader import Cursor, Waiting
from radixserve.chat.tools.types import ToolCall

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_NAME_CHAR = re.compile(r"[A-Za-z0-9_.:\-]")


@dataclasses.dataclass(frozen=True)
class MistralFormat(ToolCallFormat):
    name: str = "mistral"
    needs_special_tokens: bool = True
    markers: tuple[str, ...] = (TOOL_CALLS, ARGS, CALL_ID)
    args_syntax: bool = False

    def read(self, c: Cursor) -> Reading:
        # a reply decoded without special tokens has lost its [TOOL_CALLS]: a leading list of calls still is one
        if (yield from c.skip_ws()) and c.text[c.pos] == "[":
            yield from self.block(c, "", c.call_list())
        while (opener := (yield from c.content_until((TOOL_CALLS,)))) is not None:
            yield from self.block(c, opener, self._calls(c))

    def _calls(self, c: Cursor) -> Waiting:
        if not (yield from c.skip_ws()):
            return False
        if c.text[c.pos] == "[":
            return (yield from c.call_list())
        return (yield from self._named_call(c))

    def _named_call(self, c: Cursor) -> Waiting:
        """`name[ARGS]{...}` or `name[CALL_ID]id[ARGS]{...}`."""
        start = c.pos
        while (yield from c.wait()) and _NAME_CHAR.match(c.text[c.pos]):
            c.pos += 1
        name = c.text[start:c.pos]
        if not name:
            return False
        if (yield from c.accept(CALL_ID)):
            while (yield from c.wait()) and c.text[c.pos] != "[":
                c.pos += 1
        if not (yield from c.accept(ARGS)) or not (yield from c.skip_ws()):
            return False
        index = c.open_call(name, c.text[start:c.pos])
        record = c.records[-1]
        ok, record.arguments = yield from c.arguments_value(index)
        c.settle(record, start, ok)
        return True

    def shape(self) -> CallShape:
        if self.args_syntax:
            return CallShape(before=TOOL_CALLS + "{name}" + ARGS, after="", separator="")
        return CallShape(before='{"name": "{name}", "arguments": ', after="}", separator=", ",
                         open=TOOL_CALLS + "[", close="]")

    def trigger(self) -> str:
        return TOOL_CALLS

    def call_syntax(self) -> str:
        if self.args_syntax:
            return ("To call a function, write [TOOL_CALLS], its name, [ARGS] and its arguments as a JSON object: "
                    "[TOOL_CALLS]<function-name>[ARGS]<arguments-object>; repeat for several calls.")
        return ('To call functions, write [TOOL_CALLS] and then a JSON list of calls: [TOOL_CALLS][{"name": '
                '<function-name>, "arguments": <arguments-object>}, ...]')

    def render_calls(self, calls: list[ToolCall]) -> str:
        if self.args_syntax:
            return "".join(f"{TOOL_CALLS}{call.name}{ARGS}{call.arguments}" for call in calls)
        listed = ", ".join(f'{{"name": "{call.name}", "arguments": {call.arguments}}}' for call in calls)
        return f"{TOOL_CALLS}[{listed}]"
