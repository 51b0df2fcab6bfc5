"""Llama 3.1+ JSON calls: the reply is a call object `{"name": "f", "parameters": {...}}` ("arguments" is
read too), optionally after `<|python_tag|>`; several are separated by ";".

A reply is read as calls when it starts (after whitespace) with "{" or when `<|python_tag|>` appears
(text before it is content); a leading object that is not a call (a JSON answer) is content. The end
tokens a reply decoded with special tokens carries (<|eom_id|>, <|eot_id|>) are not content.

A call is itself a JSON object, so a final answer beside calls (`answer_or_calls`) may look like one:
an object with a string "name" and a "parameters" or "arguments" member is read as a call, whatever the
grammar let it be. A `json_object` answer therefore may not have a top-level "parameters" or
"arguments" member (`answer_schema`), so it never reads as a call. A JSON schema answer is taken as
sent: one whose top-level object declares "name" and "parameters" (or "arguments") is ambiguous, and
such an answer is read as a call (the parser cannot know which the model meant). Streamed, an answer
object comes out whole once it closes (until then it may still be a call).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from radixserve.chat.tools.base import Reading, ToolCallFormat
from radixserve.chat.tools.grammar import CallShape, literal
from radixserve.chat.tools.reader import Cursor, Waiting
from radixserve.chat.tools.types import ToolCall, ToolSpec
from radixserve.structured import StructuredOutput

PYTHON_TAG = "<|python_tag|>"
END_TOKENS = ("<|eom_id|>", "<|eot_id|>")
# free text may not start with "{": a reply that does is a call (it would be read as one)
_PROSE = r"PROSE: /\s*([^{\s](.|\n)*)?/"


@dataclasses.dataclass(frozen=True)
class Llama3JsonFormat(ToolCallFormat):
    name: str = "llama3_json"
    markers: tuple[str, ...] = (PYTHON_TAG,)

    def read(self, c: Cursor) -> Reading:
        if (yield from c.skip_ws()) and c.text[c.pos] == "{":
            yield from self.block(c, "", self._calls(c))
        while (opener := (yield from c.content_until((PYTHON_TAG, *END_TOKENS)))) is not None:
            if opener == PYTHON_TAG:
                yield from self.block(c, opener, self._calls(c))

    def _calls(self, c: Cursor) -> Waiting:
        """Call objects separated by ";" to where the text stops being calls."""
        while True:
            if not (yield from c.skip_ws()) or c.text[c.pos] != "{":
                return False
            if not (yield from c.call_object()):
                return False
            mark = c.pos
            while (yield from c.skip_ws()) and (yield from c.accept_any(END_TOKENS)):
                mark = c.pos
            if not ((yield from c.skip_ws()) and (yield from c.accept(";"))):
                c.pos = mark
                return True

    def shape(self) -> CallShape:
        return CallShape(before='{"name": "{name}", "parameters": ', after="}", separator="; ")

    def lazy_grammar(self, tools: list[ToolSpec], parallel: bool) -> str:
        calls = self.forced_grammar(tools, parallel, start="calls")
        tagged = f" | {literal(PYTHON_TAG, self.special_ids)} calls" if PYTHON_TAG in self.special_ids else ""
        return f"%llguidance {{}}\nstart: PROSE | calls{tagged}\n{_PROSE}\n{calls}"

    def answer_schema(self, answer: StructuredOutput) -> tuple[dict[str, Any], bool]:
        schema, closed = super().answer_schema(answer)
        if answer.kind == "json_object":  # never a call's members: see the module docstring
            return {**schema, "properties": {"parameters": False, "arguments": False}}, closed
        return schema, closed

    def call_syntax(self) -> str:
        return ('To call a function, answer with only a JSON object of the form {"name": <function-name>, '
                '"parameters": <arguments-object>}; several calls are separated by "; ".')

    def render_calls(self, calls: list[ToolCall]) -> str:
        return "; ".join(f'{{"name": "{call.name}", "parameters": {call.arguments}}}' for call in calls)
