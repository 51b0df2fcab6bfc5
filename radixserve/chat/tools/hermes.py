"""Hermes-style calls (Qwen2.5, Qwen3, and the default): each call is a JSON object in its own tags,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

possibly several, after any text (which is the reply's content). A closing tag the reply never wrote is
forgiven; a block that holds no call object is content; a closing tag max_tokens cut is dropped.
"""

from __future__ import annotations

import dataclasses

from radixserve.chat.tools.base import Reading, ToolCallFormat
from radixserve.chat.tools.grammar import CallShape
from radixserve.chat.tools.reader import Cursor, Waiting
from radixserve.chat.tools.types import ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclasses.dataclass(frozen=True)
class HermesFormat(ToolCallFormat):
    name: str = "hermes"
    markers: tuple[str, ...] = (OPEN, CLOSE)

    def read(self, c: Cursor) -> Reading:
        while (opener := (yield from c.content_until((OPEN,)))) is not None:
            yield from self.block(c, opener, self._call(c))

    def _call(self, c: Cursor) -> Waiting:
        if not (yield from c.skip_ws()) or c.text[c.pos] != "{":
            return False
        if not (yield from c.call_object()):
            return False
        mark = c.pos
        if (yield from c.skip_ws()) and (yield from c.accept(CLOSE)):
            return True
        if not c.unfinished(mark, True):
            c.pos = mark  # no closing tag: what follows is content again
        return True

    def shape(self) -> CallShape:
        return CallShape(before=OPEN + '\n{"name": "{name}", "arguments": ', after="}\n" + CLOSE, separator="\n")

    def trigger(self) -> str:
        return OPEN

    def call_syntax(self) -> str:
        return ("To call a function, write a JSON object with its name and arguments between <tool_call> and "
                "</tool_call> tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <arguments-object>}\n"
                "</tool_call>\nWrite one block per call; several blocks call several functions.")

    def render_calls(self, calls: list[ToolCall]) -> str:
        return "\n".join(f'{OPEN}\n{{"name": "{call.name}", "arguments": {call.arguments}}}\n{CLOSE}' for call in calls)
