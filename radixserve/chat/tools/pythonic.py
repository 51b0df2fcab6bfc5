"""Pythonic calls (Llama 3.2, Llama 4, Gemma prompted for them): the reply is a Python list of calls with
literal keyword arguments,

    [get_weather(city="Paris", days=3), get_time()]

Values are Python literals (numbers, strings in either quotes, True/False/None, lists, tuples, dicts),
JSON's spellings read too (true, null, "\\/"): a value is read as JSON when it is JSON, else as a Python
literal in which true, false and null stand for True, False and None; one that is neither, or that JSON
cannot hold (a set, bytes, a complex number), makes the call invalid. Llama 4 may wrap the list in
`<|python_start|>`...`<|python_end|>`, Llama 3.x put `<|python_tag|>` before it; text before such a
marker is content. No template announces this format reliably, so only `--tool-call-parser pythonic`
chooses it.

A reply is read as calls when it starts (after whitespace) with "[" and a name and "(": a list that
is not calls ("[1, 2]", "[Note] ...") is content. A call is committed once its "(" has arrived; each
argument goes out once its value is whole, the object's "}" with the ")". A list the reply never closed
keeps its calls; cut by max_tokens inside a call, that call is dropped.

Constraints write the calls as the model would, one keyword argument per declared property
(keyed_arguments.py), booleans as True/False, null as None, every other value as its JSON (a JSON
number or string is a Python literal too; inside lists and objects, JSON's true/false/null are read as
JSON), so a forced call parses and its arguments validate, within what keyed_arguments.py enforces. A
property name no keyword can be (one holding whitespace, "=", a bracket, a quote or a comma) is written
as it is and does not read back.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from collections.abc import Generator
from typing import Any

from radixserve.chat.tools.base import Reading
from radixserve.chat.tools.grammar import CallShape, literal
from radixserve.chat.tools.keyed_arguments import (
    ArgumentsObject,
    KeyedArgumentsFormat,
    arguments_dict,
    arguments_of,
    is_plain,
    no_constant,
    separated_rules,
    value_json,
)
from radixserve.chat.tools.reader import Cursor, Waiting
from radixserve.chat.tools.types import ToolCall, ToolSpec

PYTHON_START, PYTHON_END, PYTHON_TAG = "<|python_start|>", "<|python_end|>", "<|python_tag|>"
_NAME_CHAR = re.compile(r"[A-Za-z0-9_.:\-]")
# a keyword is an identifier; anything but Python's syntax is read, for property names that are not
_KEY_CHAR = re.compile(r"[^\s=(),\[\]{}'\"]")
# free text may not start with "[": a reply that does is calls (it would be read as them)
_PROSE = r"PROSE: /\s*([^\[\s](.|\n)*)?/"


def python_value(text: str) -> Any:
    """A keyword argument's value text as JSON data; ValueError if it is no literal JSON can hold."""
    try:
        return json.loads(text, parse_constant=no_constant)
    except ValueError:
        pass
    try:
        value = ast.literal_eval(_JsonNames().visit(ast.parse(text, mode="eval")))
        json.dumps(value, allow_nan=False)  # a set, bytes, complex: no JSON value
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError) as e:
        raise ValueError(f"{text!r} is not a literal JSON can hold") from e
    return value


class _JsonNames(ast.NodeTransformer):
    """JSON's true, false and null where Python has True, False and None (a value may mix the two)."""

    def visit_Name(self, node: ast.Name) -> ast.AST:  # noqa: N802 (NodeTransformer's naming)
        names = {"true": True, "false": False, "null": None}
        return ast.copy_location(ast.Constant(names[node.id]), node) if node.id in names else node


def python_literal(value: Any) -> str:
    """JSON data as a Python literal."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{python_literal(k)}: {python_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(python_literal(v) for v in value) + "]"
    if isinstance(value, bool) or value is None:
        return repr(value)
    return json.dumps(value, ensure_ascii=False)  # numbers; strings in double quotes, JSON escapes read alike


@dataclasses.dataclass(frozen=True)
class PythonicFormat(KeyedArgumentsFormat):
    name: str = "pythonic"
    markers: tuple[str, ...] = (PYTHON_START, PYTHON_END, PYTHON_TAG)

    # ---- reading
    def read(self, c: Cursor) -> Reading:
        if (yield from c.skip_ws()) and c.text[c.pos] == "[":
            # a block with no marker, but a reply cut in "[name" was a call, never text: as `block` with one
            start, calls = c.pos, c.calls
            if not (yield from self._list(c)) and c.calls == calls and not c.unfinished(start, True):
                c.pos = start
        while (opener := (yield from c.content_until((PYTHON_START, PYTHON_TAG)))) is not None:
            yield from self.block(c, opener, self._tagged(c))

    def _tagged(self, c: Cursor) -> Waiting:
        if not (yield from c.skip_ws()) or c.text[c.pos] != "[":
            return False
        return (yield from self._list(c))

    def _list(self, c: Cursor) -> Waiting:
        """A list of calls at pos (text[pos] is "["), and <|python_end|> after it."""
        c.pos += 1
        while True:
            if not (yield from c.skip_ws()):
                return False
            committed = c.calls
            if not (yield from self._call(c)):
                return c.calls > committed  # a call made invalid ends the list; one never begun fails it
            mark = c.pos
            if not (yield from c.skip_ws()):
                return True  # a list the reply never closed: its calls stand
            if c.text[c.pos] == ",":
                c.pos += 1
                continue
            if c.text[c.pos] == "]":
                c.pos += 1
                mark = c.pos
                if not ((yield from c.skip_ws()) and (yield from c.accept(PYTHON_END))):
                    c.pos = mark
            else:
                c.pos = mark
            return True

    def _call(self, c: Cursor) -> Waiting:
        """`name(key=value, ...)` at pos; False if it is no call, or if its arguments were invalid (it stands
        committed, invalid)."""
        start = c.pos
        while (yield from c.wait()) and _NAME_CHAR.match(c.text[c.pos]):
            c.pos += 1
        name = c.text[start:c.pos]
        if not name or not (yield from c.accept("(")):
            return False
        arguments = ArgumentsObject.open(c, name)
        ok = yield from self._arguments(c, arguments)
        if ok:
            arguments.close()
        c.settle(arguments.record, start, ok)
        return ok

    def _arguments(self, c: Cursor, arguments: ArgumentsObject) -> Waiting:
        """`key=value, ...)` after the "(", each added to `arguments`; a trailing comma allowed."""
        while True:
            if not (yield from c.skip_ws()):
                return False
            if c.text[c.pos] == ")":
                c.pos += 1
                return True
            if arguments.members and not ((yield from c.accept(",")) and (yield from c.skip_ws())):
                return False
            if c.text[c.pos] == ")":
                continue
            if not (yield from self._argument(c, arguments)):
                return False

    def _argument(self, c: Cursor, arguments: ArgumentsObject) -> Waiting:
        """`key=value` at pos, added to `arguments`."""
        at = c.pos
        while (yield from c.wait()) and _KEY_CHAR.match(c.text[c.pos]):
            c.pos += 1
        key = c.text[at:c.pos]
        if not key or not ((yield from c.skip_ws()) and (yield from c.accept("="))) or not (yield from c.skip_ws()):
            return False
        text = yield from _literal_text(c)
        if text is None:
            return False
        try:
            arguments.add(key, python_value(text))
        except ValueError:
            return False
        return True

    # ---- constraining
    def shape(self) -> CallShape:
        return CallShape(before="{name}(", after=")", separator=", ", open="[", close="]")

    def lazy_grammar(self, tools: list[ToolSpec], parallel: bool) -> str:
        """Free text that does not start with "[", or calls from the first token."""
        calls = self.forced_grammar(tools, parallel, start="calls")
        return f"%llguidance {{}}\nstart: PROSE | calls\n{_PROSE}\n{calls}"

    def argument_rules(self, i: int, tool: ToolSpec) -> list[str]:
        """`args_i`: the declared properties as `key=value`, ", " between those present."""
        arguments = arguments_of(tool.parameters)
        items = [(f"{literal(a.key + '=', self.special_ids)} value_{i}_{j}", a.required) for j, a in enumerate(arguments)]
        lines = [f"args_{i}: kw_{i}", *separated_rules(f"kw_{i}", items, literal(", ", self.special_ids))]
        return lines + [f"value_{i}_{j}: {self._value_rule(a.schema)}" for j, a in enumerate(arguments)]

    def _value_rule(self, schema: dict[str, Any]) -> str:
        if is_plain(schema, "boolean"):
            return '"True" | "False"'
        if is_plain(schema, "null"):
            return '"None"'
        return value_json(schema, self.open_objects)

    # ---- prompting
    def call_syntax(self) -> str:
        return ("To call functions, answer with only a Python list of calls with keyword arguments: "
                '[<function-name>(<argument>=<value>, ...), ...], values written as Python literals, e.g. '
                '[get_weather(city="Paris", days=3)].')

    def render_calls(self, calls: list[ToolCall]) -> str:
        return "[" + ", ".join(_call_text(call) for call in calls) + "]"


def _call_text(call: ToolCall) -> str:
    arguments = arguments_dict(call.arguments)
    if arguments is None:  # not an object: shown as sent, for the model to see what it was
        return f"{call.name}({call.arguments})"
    return f"{call.name}(" + ", ".join(f"{k}={python_literal(v)}" for k, v in arguments.items()) + ")"


def _literal_text(c: Cursor) -> Generator[None, None, str | None]:
    """The text of the Python literal at pos, up to the "," or ")" that ends it (not consumed); None
    when the reply ends first."""
    start, depth, quote, escape = c.pos, 0, "", False
    while True:
        while c.pos < len(c.text):
            ch = c.text[c.pos]
            if quote:
                if escape:
                    escape = False
                elif ch == "\\":
                    escape = True
                elif ch == quote:
                    quote = ""
            elif ch in "\"'":
                quote = ch
            elif ch in "([{":
                depth += 1
            elif ch in ")]}":
                if depth == 0:
                    return c.text[start:c.pos].strip()
                depth -= 1
            elif ch == "," and depth == 0:
                return c.text[start:c.pos].strip()
            c.pos += 1
        if c.final:
            c.starved = True
            return None
        yield
