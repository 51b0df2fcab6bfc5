"""GLM-4.5/4.6 calls (and GLM-4-0414 templates with the same markup): the function's name after the
opening tag, then one key/value pair of tags per argument,

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

A value is the JSON it holds when it parses as JSON (3, true, [1, 2], {"a": 1}, "quoted"), else the string
it is, as written (GLM writes strings bare); NaN and Infinity stay strings, JSON has no such values. The
arguments are the JSON object of those pairs in the order written. Text before a call is content; the
whitespace between tags is free. A call is committed once its name is whole; each pair goes out once its
value is closed, the object's "}" with the closing tag (or the end of a reply that forgot it). A call
whose pairs are broken (a key without a value, a value never closed) is content when read whole; cut by
max_tokens before its closing tag it is dropped (more pairs may have been coming). Anything but a pair or
the closing tag after the pairs ends the call there, as a missing closing tag: what follows is content.

The tags are added tokens of GLM's tokenizers; replies are decoded with special tokens kept
(`needs_special_tokens`) so a tokenizer that makes them special does not drop them.

Constraints write the arguments as pairs (keyed_arguments.py): the declared keys in schema order, each
value as the property's schema types it: a plain string bare (any text that does not read as JSON, nor
holds the closing tag) or JSON-quoted, a string enum as its bare values, anything else as its JSON. So a
forced call parses and its arguments validate against the tool's parameters, within what
keyed_arguments.py enforces, with one gap: a JSON value whose strings hold the text `</arg_value>` is
admitted and would not read back.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Generator
from typing import Any

from radixserve.chat.tools.base import Reading
from radixserve.chat.tools.grammar import CallShape, literal
from radixserve.chat.tools.keyed_arguments import (
    Argument,
    ArgumentsObject,
    KeyedArgumentsFormat,
    arguments_dict,
    arguments_of,
    is_plain,
    no_constant,
    string_choices,
    value_json,
)
from radixserve.chat.tools.reader import Cursor, Waiting
from radixserve.chat.tools.types import ToolCall, ToolSpec

OPEN, CLOSE = "<tool_call>", "</tool_call>"
KEY, KEY_END, VALUE, VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
_NAME_CHAR = re.compile(r"[A-Za-z0-9_.:\-]")
# a bare string value: its text must not read as JSON, so it may not start with what opens a JSON value
# (or with whitespace, which JSON skips) nor be a JSON literal
_BARE_FIRST = r'[^\s"\[{\-0-9]'
_LITERALS = r"(true|false|null)\s*"


def glm_value(text: str) -> Any:
    """An <arg_value>'s text as the value it stands for."""
    try:
        return json.loads(text, parse_constant=no_constant)
    except ValueError:
        return text


def glm_value_text(value: Any) -> str:
    """A value as GLM writes it: a string bare when that reads back as the same string, else JSON (with
    "</" written "<\\/", so no closing tag is in it)."""
    if isinstance(value, str) and VALUE_END not in value and glm_value(value) == value:
        return value
    return json.dumps(value, ensure_ascii=False).replace("</", "<\\/")


@dataclasses.dataclass(frozen=True)
class Glm4Format(KeyedArgumentsFormat):
    name: str = "glm4"
    needs_special_tokens: bool = True
    markers: tuple[str, ...] = (OPEN, CLOSE, KEY, KEY_END, VALUE, VALUE_END)

    # ---- reading
    def read(self, c: Cursor) -> Reading:
        while (opener := (yield from c.content_until((OPEN,)))) is not None:
            yield from self.block(c, opener, self._call(c))

    def _call(self, c: Cursor) -> Waiting:
        start = c.pos
        if not (yield from c.skip_ws()):
            return False
        at = c.pos
        while (yield from c.wait()) and _NAME_CHAR.match(c.text[c.pos]):
            c.pos += 1
        name = c.text[at:c.pos]
        ended = c.pos == len(c.text)  # the reply ended right after the name
        if not name or (ended and c.cut) or not (ended or c.text[c.pos].isspace() or c.text[c.pos] == "<"):
            return False
        arguments = ArgumentsObject.open(c, name)
        ok = True
        while True:
            mark = c.pos
            if not (yield from c.skip_ws()):
                ok = not c.cut  # ended after its pairs: forgiven, unless cut (more pairs may have been coming)
                break
            if (yield from c.accept(CLOSE)):
                break
            if not (yield from c.accept(KEY)):
                tail = c.text[c.pos:]
                if c.final and c.cut and (CLOSE.startswith(tail) or KEY.startswith(tail)):
                    ok = CLOSE.startswith(tail)  # cut in the closing tag the call is whole, in a key's it is not
                    c.pos = len(c.text)
                else:
                    c.pos = mark  # not a pair: the closing tag is missing, what follows is content
                break
            pair = yield from self._pair(c)
            if pair is None:
                ok = False
                break
            arguments.add(*pair)
        if ok:
            arguments.close()
        c.settle(arguments.record, start, ok)
        return True

    def _pair(self, c: Cursor) -> Generator[None, None, tuple[str, Any] | None]:
        """After <arg_key>: the pair's key and value; None when it is broken."""
        key = yield from c.until(KEY_END)
        if key is None or not (yield from c.skip_ws()) or not (yield from c.accept(VALUE)):
            return None
        value = yield from c.until(VALUE_END)
        return None if value is None else (key.strip(), glm_value(value))

    # ---- constraining
    def shape(self) -> CallShape:
        return CallShape(before=OPEN + "{name}\n", after=CLOSE, separator="\n")

    def trigger(self) -> str:
        return OPEN

    def lazy_grammar(self, tools: list[ToolSpec], parallel: bool) -> str:
        return self.with_argument_rules(super().lazy_grammar(tools, parallel), tools)

    def argument_rules(self, i: int, tool: ToolSpec) -> list[str]:
        arguments = arguments_of(tool.parameters)
        body = " ".join(f"pair_{i}_{j}" + ("" if a.required else "?") for j, a in enumerate(arguments)) or '""'
        newline = literal("\n", self.special_ids)
        lines = [f"args_{i}: {body}"]
        for j, argument in enumerate(arguments):
            opening = literal(f"{KEY}{argument.key}{KEY_END}\n{VALUE}", self.special_ids)
            lines.append(f"pair_{i}_{j}: {opening} value_{i}_{j} {newline}")
            lines += self._value_rules(f"value_{i}_{j}", argument)
        return lines

    def _value_rules(self, rule: str, argument: Argument) -> list[str]:
        """`rule`: one value of the argument's schema and the closing </arg_value>."""
        schema = argument.schema
        close = literal(VALUE_END, self.special_ids)
        choices = string_choices(schema)
        if choices is not None:
            alternatives = " | ".join(literal(glm_value_text(v), self.special_ids) for v in choices)
            return [f"{rule}: ({alternatives}) {close}"]
        lines = [f"{rule}_json: {value_json(schema, self.open_objects)}"]
        if not is_plain(schema, "string"):
            return [f"{rule}: {rule}_json {close}", *lines]
        # a bare string, or a JSON-quoted one (what a bare one cannot be: "-5", " x", "true")
        end = re.escape(VALUE_END).replace("/", "\\/")
        if VALUE_END in self.special_ids:  # the closing tag is a token: the text may not spell it either
            bare = rule.upper() + "_BARE"
            lines += [f"{bare}: /{_BARE_FIRST}(.|\\n)*/ & ~/{_LITERALS}/ & ~/(.|\\n)*{end}(.|\\n)*/"]
            return [f"{rule}: {bare}? {close} | {rule}_json {close}", *lines]
        # the closing tag is text: a lexeme that ends at its first occurrence
        lines += [f"{rule}_bare[lazy]: /({_BARE_FIRST}(.|\\n)*)?{end}/ & ~/{_LITERALS}{end}/"]
        return [f"{rule}: {rule}_bare | {rule}_json {close}", *lines]

    # ---- prompting
    def call_syntax(self) -> str:
        return ("To call a function, write its name after <tool_call>, then each argument as a key and a value in "
                "tags, and close the call with </tool_call>:\n<tool_call><function-name>\n<arg_key><name></arg_key>\n"
                "<arg_value><value></arg_value>\n</tool_call>\nA value is written as JSON unless it is a string. "
                "Write one block per call; several blocks call several functions.")

    def render_calls(self, calls: list[ToolCall]) -> str:
        return "\n".join(_call_text(call) for call in calls)


def _call_text(call: ToolCall) -> str:
    arguments = arguments_dict(call.arguments)
    if arguments is None:  # not an object: shown as sent, for the model to see what it was
        return f"{OPEN}{call.name}\n{call.arguments}\n{CLOSE}"
    pairs = "".join(f"{KEY}{k}{KEY_END}\n{VALUE}{glm_value_text(v)}{VALUE_END}\n" for k, v in arguments.items())
    return f"{OPEN}{call.name}\n{pairs}{CLOSE}"

