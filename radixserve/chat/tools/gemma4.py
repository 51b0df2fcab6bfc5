"""Gemma 4 calls: the function's name after `call:`, its arguments as an object of bare keys and values
in Gemma's own notation, each call in its tags, several calls one after another,

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|><|tool_call>call:now{}<tool_call|>

A value is a string between two `<|"|>` marks (as written, no escapes: a string cannot hold the mark),
a number, true, false or null (None and nil read as null too: a template renders Python's None so), an
object `{key:value,...}` of bare keys (or keys between marks) or an array `[value,...]`. A model
slipping into JSON is read too (a key or a string in JSON quotes); any other bare text is the string
it is. Whitespace between the parts is free; a trailing comma is forgiven. Text before, between and
after calls is content. A call is committed once its name and "{" are whole; each
argument goes out once its value is whole, the object's "}" with the call's own. A call whose
arguments are broken is content when read whole; cut by max_tokens before its "}" it is dropped, after
it the call stands (its closing tag may be missing).

The marks are special tokens of Gemma 4's tokenizer; replies are decoded with special tokens kept
(`needs_special_tokens`) so the parser sees them.

Constraints write the declared arguments in schema order, "," between them, each value in this
notation as the property's schema types it, recursively through objects (their declared properties),
arrays (their items), enums and consts, `anyOf`/`oneOf` branches and `$ref`s into the parameters'
`$defs`; numbers through the JSON number grammar (the same text); a schema that names no type admits
any value. So a forced call parses and its arguments validate, within what keyed_arguments.py enforces
and with these gaps: a string's pattern and format, an array's length and uniqueness, and
`oneOf`'s exclusivity are not enforced; a key that is not a bare name (holding whitespace, ":", ",", a
bracket or a mark) is written between marks.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Generator
from typing import Any

from radixserve.chat.tools.base import Reading
from radixserve.chat.tools.grammar import CallShape, literal
from radixserve.chat.tools.keyed_arguments import (
    ArgumentsObject,
    KeyedArgumentsFormat,
    arguments_dict,
    arguments_of,
    no_constant,
    separated_rules,
    value_json,
)
from radixserve.chat.tools.reader import Cursor, Waiting
from radixserve.chat.tools.types import ToolCall, ToolSpec

OPEN, CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
CALL = "call:"
_NAME_CHAR = re.compile(r"[\w.:\-]")
_BARE_KEY = re.compile(r"[^\s:,{}\[\]<>]+")
_SCALAR_END = ",}]"
_NULLS = ("null", "None", "none", "nil")
_MAX_DEPTH = 32  # nesting a value may have: deeper is no call (a reply cannot exhaust the parser's stack)
_SIMPLE_TYPES = ("integer", "number", "boolean", "null")


def gemma_scalar(text: str) -> Any:
    """A bare value's text as the value it stands for: a number, true, false, null, a JSON-quoted string's
    content, else the text."""
    if text in ("true", "false"):
        return text == "true"
    if text in _NULLS:
        return None
    try:
        value = json.loads(text, parse_constant=no_constant)
    except ValueError:
        return text
    return value if isinstance(value, (int, float, str)) else text  # a JSON-quoted string is that string


def gemma_value_text(value: Any) -> str:
    """A JSON value in Gemma's notation (what `gemma_value` reads back)."""
    if isinstance(value, str):
        return QUOTE + value + QUOTE
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, dict):
        return "{" + ",".join(gemma_key_text(str(k)) + ":" + gemma_value_text(v) for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(gemma_value_text(v) for v in value) + "]"
    return json.dumps(value)


def gemma_key_text(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) and QUOTE not in key else QUOTE + key + QUOTE


def gemma_value(text: str) -> Any:
    """A whole value's text as the value; ValueError if it is not one."""
    c = Cursor(text=text, final=True)
    reading = _value(c, 0)
    try:
        while True:
            next(reading)
    except StopIteration as done:
        ok, value = done.value
    if not ok or text[c.pos:].strip():
        raise ValueError(f"not a Gemma value: {text!r}")
    return value


@dataclasses.dataclass(frozen=True)
class Gemma4Format(KeyedArgumentsFormat):
    name: str = "gemma4"
    needs_special_tokens: bool = True
    markers: tuple[str, ...] = (OPEN, CLOSE, QUOTE)

    # ---- reading
    def read(self, c: Cursor) -> Reading:
        while (opener := (yield from c.content_until((OPEN,)))) is not None:
            yield from self.block(c, opener, self._call(c))

    def _call(self, c: Cursor) -> Waiting:
        start = c.pos
        if not ((yield from c.skip_ws()) and (yield from c.accept(CALL))):
            return False
        at = c.pos
        while (yield from c.wait()) and _NAME_CHAR.match(c.text[c.pos]):
            c.pos += 1
        name = c.text[at:c.pos]
        if not name or not ((yield from c.skip_ws()) and (yield from c.accept("{"))):
            return False
        arguments = ArgumentsObject.open(c, name)
        ok = yield from _members(c, arguments.add, 1)
        if ok:
            arguments.close()
            mark = c.pos
            if (yield from c.skip_ws()) and not (yield from c.accept(CLOSE)):
                tail = c.text[c.pos:]
                # cut in the closing tag: consumed; any other text: the tag is missing, that text is content
                c.pos = len(c.text) if c.final and c.cut and CLOSE.startswith(tail) else mark
        c.settle(arguments.record, start, ok)
        return True

    # ---- constraining
    def shape(self) -> CallShape:
        return CallShape(before=OPEN + CALL + "{name}", after=CLOSE, separator="")

    def trigger(self) -> str:
        return OPEN

    def lazy_grammar(self, tools: list[ToolSpec], parallel: bool) -> str:
        return self.with_argument_rules(super().lazy_grammar(tools, parallel), tools)

    def argument_rules(self, i: int, tool: ToolSpec) -> list[str]:
        return _Rules(self, f"g{i}").arguments(f"args_{i}", tool.parameters)

    # ---- prompting
    def call_syntax(self) -> str:
        return (f"To call a function, write {OPEN}{CALL}<function-name>{{<argument>:<value>,...}}{CLOSE}, keys bare, "
                f"strings between {QUOTE} marks, numbers, true, false and null as they are, objects as "
                f"{{key:value,...}} and lists as [value,...], e.g. {OPEN}{CALL}get_weather{{city:{QUOTE}Paris{QUOTE},"
                f"days:3}}{CLOSE}. Several calls go one after another.")

    def render_calls(self, calls: list[ToolCall]) -> str:
        return "".join(_call_text(call) for call in calls)


def _call_text(call: ToolCall) -> str:
    arguments = arguments_dict(call.arguments)
    if arguments is None:  # not an object: shown as sent, for the model to see what it was
        return f"{OPEN}{CALL}{call.name}{{{call.arguments}}}{CLOSE}"
    return f"{OPEN}{CALL}{call.name}{gemma_value_text(arguments)}{CLOSE}"


# ---- reading values

def _value(c: Cursor, depth: int) -> Generator[None, None, tuple[bool, Any]]:
    """The value at pos (after whitespace); (False, None) when it is broken or the reply ends in it."""
    if depth > _MAX_DEPTH or not (yield from c.skip_ws()):
        return False, None
    if (yield from c.accept(QUOTE)):
        text = yield from c.until(QUOTE)
        return text is not None, text
    if c.final and QUOTE.startswith(c.text[c.pos:]):  # the reply ended inside what may be a mark
        return False, None
    if c.text[c.pos] in "{[":
        opener = c.text[c.pos]
        c.pos += 1
        if opener == "{":
            members: dict[str, Any] = {}
            return (yield from _members(c, members.__setitem__, depth + 1)), members
        items: list[Any] = []
        return (yield from _items(c, items, depth + 1)), items
    start = c.pos
    while True:
        while c.pos < len(c.text) and c.text[c.pos] not in _SCALAR_END and not c.text.startswith(QUOTE, c.pos):
            c.pos += 1
        if c.pos < len(c.text) or c.final:
            break
        yield
    text = c.text[start:c.pos].strip()  # at the end of a reply, whatever it holds must end there
    return bool(text), gemma_scalar(text)


def _members(c: Cursor, add: Callable[[str, Any], None], depth: int) -> Waiting:
    """`key:value, ...}` after a "{", each pair passed to `add` once its value is whole."""
    count = 0
    while True:
        if not (yield from c.skip_ws()):
            return False
        if (yield from c.accept("}")):
            return True
        if count and not ((yield from c.accept(",")) and (yield from c.skip_ws())):
            return False
        if (yield from c.accept("}")):  # after a trailing comma
            return True
        if (yield from c.accept(QUOTE)):
            key = yield from c.until(QUOTE)
        elif (yield from c.accept('"')):  # a JSON-quoted key, as a model may slip into JSON
            key = yield from c.until('"')
        else:
            at = c.pos
            while (yield from c.wait()) and _BARE_KEY.match(c.text[c.pos]):
                c.pos += 1
            key = c.text[at:c.pos] or None
        if key is None or not ((yield from c.skip_ws()) and (yield from c.accept(":"))):
            return False
        ok, value = yield from _value(c, depth)
        if not ok:
            return False
        add(key, value)
        count += 1


def _items(c: Cursor, items: list[Any], depth: int) -> Waiting:
    """`value, ...]` after a "["."""
    while True:
        if not (yield from c.skip_ws()):
            return False
        if (yield from c.accept("]")):
            return True
        if items and not (yield from c.accept(",")):
            return False
        if not (yield from c.skip_ws()):
            return False
        if (yield from c.accept("]")):  # after a trailing comma
            return True
        ok, value = yield from _value(c, depth)
        if not ok:
            return False
        items.append(value)


# ---- constraining

class _Rules:
    """The Lark rules of values in Gemma's notation for one tool's arguments, named `{prefix}_{n}`."""

    def __init__(self, fmt: Gemma4Format, prefix: str) -> None:
        self.fmt, self.prefix = fmt, prefix
        self.lines: list[str] = []
        self.count = 0
        self.any_rule = ""

    def arguments(self, rule: str, parameters: dict[str, Any]) -> list[str]:
        """`rule`: `{` the declared arguments `}`, and every rule it names."""
        items = [(f"{self._literal(gemma_key_text(a.key) + ':')} {self.value(a.schema, a.schema)}", a.required)
                 for a in arguments_of(parameters)]
        body = self._new()
        self.lines += separated_rules(body, items, self._literal(","))
        return [f"{rule}: {self._literal('{')} {body} {self._literal('}')}", *self.lines]

    def value(self, schema: Any, root: dict[str, Any]) -> str:
        """The name of a rule for one value of `schema` (refs resolved in `root`)."""
        schema = self._resolved(schema, root)
        if not isinstance(schema, dict) or schema is True:
            return self._any()
        if "const" in schema or "enum" in schema:
            values = [schema["const"]] if "const" in schema else schema["enum"]
            return self._rule(" | ".join(self._literal(gemma_value_text(v)) for v in values) or '""')
        branches = schema.get("anyOf") or schema.get("oneOf")
        if isinstance(branches, list) and branches:
            rest = {k: v for k, v in schema.items() if k not in ("anyOf", "oneOf")}
            return self._rule(" | ".join(self.value({**rest, **self._resolved(b, root)}, root) for b in branches))
        kinds = schema.get("type")
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not isinstance(kinds, list) or not kinds:
            return self._any()
        return self._rule(" | ".join(self._typed(str(kind), schema, root) for kind in kinds))

    def _typed(self, kind: str, schema: dict[str, Any], root: dict[str, Any]) -> str:
        if kind == "string":
            return self._string(schema)
        if kind == "null":
            return self._rule(self._literal("null"))
        if kind == "boolean":
            return self._rule(f"{self._literal('true')} | {self._literal('false')}")
        if kind in ("integer", "number"):
            bounds = {k: v for k, v in schema.items()
                      if k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")}
            return self._rule(value_json({"type": kind, **bounds}, False))
        if kind == "array":
            item = self.value(schema.get("items", True), root)
            more = self._new()
            self.lines.append(f"{more}: ({self._literal(',')} {item})*")
            return self._rule(f"{self._literal('[')} ({item} {more})? {self._literal(']')}")
        if kind == "object":
            if not isinstance(schema.get("properties"), dict) and not schema.get("required"):
                return self._any()
            name = self._new()
            self.lines += self._nested(name, {**schema, **{k: root[k] for k in ("$defs", "definitions") if k in root}})
            return name
        raise ValueError(f"unknown JSON type {kind!r} in a tool's parameters")

    def _nested(self, rule: str, schema: dict[str, Any]) -> list[str]:
        inner = _Rules(self.fmt, f"{self.prefix}_{self.count}")
        self.count += 1
        return inner.arguments(rule, schema)

    def _string(self, schema: dict[str, Any] | None = None) -> str:
        """A string between marks: any text without the mark, of the schema's minLength to maxLength."""
        schema = schema or {}
        least = schema.get("minLength", 0) if isinstance(schema.get("minLength"), int) else 0
        most = schema.get("maxLength") if isinstance(schema.get("maxLength"), int) else None
        name = self._new()
        mark = self._literal(QUOTE)
        quote = re.escape(QUOTE)
        if QUOTE in self.fmt.special_ids:  # the mark is a token: the text may not spell it either
            count = f"{{{max(least, 1)},{'' if most is None else most}}}"
            optional = "?" if least == 0 else ""
            if most == 0:
                self.lines.append(f"{name}: {mark} {mark}")
            else:
                self.lines += [f"{name}: {mark} {name.upper()}_TEXT{optional} {mark}",
                               f"{name.upper()}_TEXT: /(.|\\n){count}/ & ~/(.|\\n)*{quote}(.|\\n)*/"]
        else:  # the mark is text: a lexeme that ends at its first occurrence
            count = f"{{{least},{'' if most is None else most}}}"
            self.lines += [f"{name}: {mark} {name}_text",
                           f"{name}_text[lazy]: /(.|\\n){count}{quote}/ & ~/(.|\\n)*{quote}(.|\\n)+/"]
        return name

    def _any(self) -> str:
        """Any value in Gemma's notation (objects of bare keys), for a schema that says nothing."""
        if not self.any_rule:
            self.any_rule = name = self._new()
            key, value = f"{name}_key", f"{name}_member"
            self.lines += [
                f"{name}: {self._string()} | {value_json({'type': 'number'}, False)} | {self._literal('true')} | "
                f"{self._literal('false')} | {self._literal('null')} | {name}_object | {name}_array",
                f"{key}: /[A-Za-z_][A-Za-z0-9_.\\-]*/",
                f"{value}: {key} {self._literal(':')} {name}",
                f"{name}_object: {self._literal('{')} ({value} ({self._literal(',')} {value})*)? {self._literal('}')}",
                f"{name}_array: {self._literal('[')} ({name} ({self._literal(',')} {name})*)? {self._literal(']')}",
            ]
        return self.any_rule

    def _resolved(self, schema: Any, root: dict[str, Any]) -> Any:
        """`schema` with a local `$ref` (into root's $defs or definitions) followed, up to a few hops."""
        for _ in range(8):
            if not isinstance(schema, dict) or not isinstance(schema.get("$ref"), str):
                return schema
            ref = schema["$ref"]
            target: Any = root
            for part in ref.removeprefix("#/").split("/") if ref.startswith("#/") else [None]:
                target = target.get(part) if isinstance(target, dict) and part is not None else None
            if not isinstance(target, dict):
                raise ValueError(f"a tool's parameters refer to {ref!r}, which they do not define")
            schema = {**{k: v for k, v in schema.items() if k != "$ref"}, **target}
        raise ValueError("a tool's parameters refer in a loop")

    def _rule(self, body: str) -> str:
        name = self._new()
        self.lines.append(f"{name}: {body}")
        return name

    def _new(self) -> str:
        name = f"{self.prefix}_{self.count}"
        self.count += 1
        return name

    def _literal(self, text: str) -> str:
        return literal(text, self.fmt.special_ids)
