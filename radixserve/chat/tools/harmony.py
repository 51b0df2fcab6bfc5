"""Harmony calls (gpt-oss): a call is a message to `functions.NAME` in the commentary channel,

    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

the recipient written before or after the channel (`<|start|>assistant to=functions.f<|channel|>commentary
json<|message|>...`), `<|constrain|>json` optional, `<|call|>` often missing (it is an end-of-sequence token
of gpt-oss, which decoding drops). The gpt_oss reasoning parser (chat/reasoning.py) hands the answer over
with each call in the first form and everything else (analysis, final) already taken apart; without it the
reply's raw text is read: every message whose header names no function is content, markers included.

Every marker is a special token of gpt-oss's tokenizer, so replies are decoded with special tokens kept
(`needs_special_tokens`). A forced call (`required`, a named function) is constrained from the first token
to one call in the first form, without its `<|call|>`: that is an end-of-sequence token, which a grammar
may not name (the reply ends where the grammar does, with one). `auto` alone is never constrained, strict
tools or not: a reply that may think first writes markers (`<|end|>`, `<|start|>`) a free-text grammar
cannot admit, so calls are parsed, not enforced.

`auto` beside a JSON final answer (response_format, text.format; `answer_or_calls`, the base's) is
constrained from the first token, as that answer alone is: either calls in the forced form (a
commentary-channel message to `functions.NAME`) or the answer's bare JSON, with no channel header,
exactly what the JSON constraint writes for gpt-oss without tools. The two part at the first token
(`<|channel|>` or the JSON's first character); neither thinks first (analysis), as no constrained reply
does. The gpt_oss reasoning parser passes the bare JSON through as answer text, and this format reads
it as content (it holds no header), so the answer is content and the calls are calls.
"""

from __future__ import annotations

import dataclasses
import re

from radixserve.chat.tools.base import Reading, ToolCallFormat
from radixserve.chat.tools.grammar import CallShape
from radixserve.chat.tools.reader import Cursor, Waiting
from radixserve.chat.tools.types import ToolCall, ToolChoice, ToolSpec
from radixserve.structured import StructuredOutput

# harmony's markers, each a special token of gpt-oss's tokenizer (chat/reasoning.py reads them too)
START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL = (
    "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
HEADER_CHARS = 256  # a header that reaches no <|message|> within this is not a call's
_FUNCTION = re.compile(r"to=functions\.([A-Za-z0-9_.:\-]+)")


def harmony_call_text(name: str, arguments: str) -> str:
    """A call in the one form this format writes and the gpt_oss reasoning parser hands over."""
    return f"{CHANNEL}commentary to=functions.{name} {CONSTRAIN}json{MESSAGE}{arguments}{CALL}"


@dataclasses.dataclass(frozen=True)
class HarmonyFormat(ToolCallFormat):
    name: str = "harmony"
    needs_special_tokens: bool = True
    markers: tuple[str, ...] = (START, CHANNEL, CONSTRAIN, MESSAGE, CALL, END, RETURN)

    def read(self, c: Cursor) -> Reading:
        while (opener := (yield from c.content_until((START, CHANNEL)))) is not None:
            yield from self.block(c, opener, self._message(c))

    def _message(self, c: Cursor) -> Waiting:
        """A message header up to <|message|>: a call when it names a function, else it fails (content)."""
        start = c.pos
        while (at := c.text.find(MESSAGE, start)) < 0:
            if len(c.text) - start > HEADER_CHARS or any(m in c.text[start:] for m in (END, RETURN, CALL)):
                return False
            if not (yield from c.wait(len(c.text) - c.pos + 1)):
                return False
        header = c.text[start:at]
        found = _FUNCTION.search(header)
        if found is None or len(header) > HEADER_CHARS:
            return False
        c.pos = at + len(MESSAGE)
        index = c.open_call(found.group(1), c.text[start:c.pos])
        record = c.records[-1]
        if not (yield from c.skip_ws()):  # the reply ended after the header: no arguments (dropped when cut)
            c.settle(record, start, False)
            return True
        ok, record.arguments = yield from c.arguments_value(index)
        c.settle(record, start, ok)
        mark = c.pos
        if not ((yield from c.skip_ws()) and (yield from c.accept(CALL))):
            c.pos = mark
        return True

    def shape(self) -> CallShape:
        return CallShape(before=harmony_call_text("{name}", "")[:-len(CALL)], after="", separator=START + "assistant")

    def constraint(self, tools: list[ToolSpec], choice: ToolChoice, parallel: bool) -> StructuredOutput | None:
        if choice.mode == "auto":
            return None  # see the module docstring (beside a final answer: answer_or_calls)
        return super().constraint(tools, choice, parallel)

    def call_syntax(self) -> str:
        return ("To call a function, write a message to it in the commentary channel: <|start|>assistant"
                "<|channel|>commentary to=functions.<function-name> <|constrain|>json<|message|>"
                "<arguments-object><|call|>")

    def render_calls(self, calls: list[ToolCall]) -> str:
        return "".join(START + "assistant" + harmony_call_text(call.name, call.arguments) for call in calls)
