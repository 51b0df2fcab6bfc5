"""Calls whose arguments are written one by one, key and value (GLM's tags, Python keyword arguments),
not as one JSON object: the JSON object the reading builds of them (`ArgumentsObject`), and the
formats' base (`KeyedArgumentsFormat`), whose grammars have the format's per-argument rules where
grammar.py puts the `%json` of the whole parameters object.

Invariants: a call's arguments go out as JSON object text piece by piece, one member per argument as
soon as its value is read, the "}" when the call ends, so the pieces join to the JSON text `parse`
reports. The arguments a tool's rules admit are its declared properties, in the order the schema lists
them, every required one present, none twice, no undeclared one (even when the schema or
--open-json-objects admits those: leaving them out is always allowed); each value is what the format's
rule for that property's schema admits, so it validates against it. What a fixed sequence of keys
cannot express is not enforced: top-level combinators (`anyOf`, `oneOf`, `allOf`, `not`, `if`),
`minProperties`/`maxProperties`, `dependentRequired`, `patternProperties`. Every grammar of calls a
format builds (`forced_grammar`: forced calls, the calls beside a final answer; its lazy grammar) has
these rules.
"""

from __future__ import annotations

import dataclasses
import json
import re
from abc import abstractmethod
from dataclasses import dataclass
from typing import Any

from radixserve.chat.tools.base import ToolCallFormat
from radixserve.chat.tools.grammar import arguments_rule
from radixserve.chat.tools.reader import Cursor, Record
from radixserve.chat.tools.types import ToolCallDelta, ToolSpec

_ARGS_RULE = re.compile(r"^args_(\d+): %json .*$", re.MULTILINE)
# keywords that say nothing about which values are valid
_ANNOTATIONS = frozenset({"type", "description", "title", "default", "examples", "$comment", "$defs", "definitions"})


# ---- reading

@dataclass
class ArgumentsObject:
    """The arguments of call `index` (committed on `cursor`, `record` its record), sent out as read."""

    cursor: Cursor
    index: int
    record: Record
    members: int = 0

    @classmethod
    def open(cls, c: Cursor, name: str) -> ArgumentsObject:
        """Commits a call to `name` whose arguments come next."""
        index = c.open_call(name, "")
        return cls(c, index, c.records[-1])

    def add(self, key: str, value: Any) -> None:
        member = json.dumps(key, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False,
                                                                         separators=(", ", ": "))
        self._send(("{" if self.members == 0 else ", ") + member)
        self.members += 1

    def close(self) -> None:
        self._send("}" if self.members else "{}")

    def _send(self, piece: str) -> None:
        self.cursor.out.append(ToolCallDelta(self.index, None, None, piece))
        self.record.arguments += piece


def no_constant(name: str) -> Any:
    """json.loads's `parse_constant`: NaN and Infinity are no JSON values."""
    raise ValueError(f"{name} is not JSON")


def arguments_dict(arguments: str) -> dict[str, Any] | None:
    """A call's JSON arguments text as the object it holds; None for any other text."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


# ---- constraining

@dataclass(frozen=True)
class Argument:
    """One declared property of a tool's parameters."""

    key: str
    schema: dict[str, Any]  # the property's schema, with the parameters' $defs so its references resolve
    required: bool


def arguments_of(parameters: dict[str, Any]) -> list[Argument]:
    properties = parameters.get("properties")
    properties = properties if isinstance(properties, dict) else {}
    listed = parameters.get("required")
    required = list(dict.fromkeys(str(k) for k in listed)) if isinstance(listed, list) else []
    defs: dict[str, Any] = {k: parameters[k] for k in ("$defs", "definitions") if k in parameters}
    out = []
    for key, schema in properties.items():
        # `true` (or a non-object) admits any value: the empty schema
        own = schema if isinstance(schema, dict) else {}
        out.append(Argument(str(key), {**own, **defs}, key in required))
    # a required key the schema declares no property for still has to be written: any value
    out += [Argument(key, dict(defs), True) for key in required if key not in properties]
    return out


def separated_rules(rule: str, items: list[tuple[str, bool]], separator: str) -> list[str]:
    """Rules whose first, `rule`, is `items` in order, those not required optional, `separator` (a Lark
    sequence) between those present. Each item is (a Lark sequence, required)."""
    n = len(items)
    lines = [f"{rule}: {rule}_first_0", f'{rule}_first_{n}: ""', f'{rule}_more_{n}: ""']
    for j, (item, required) in enumerate(items):
        more = f"{rule}_more_{j + 1}"
        skip_first, skip_more = ("", "") if required else (f" | {rule}_first_{j + 1}", f" | {more}")
        lines += [f"{rule}_first_{j}: {item} {more}{skip_first}", f"{rule}_more_{j}: {separator} {item} {more}{skip_more}"]
    return lines


def value_json(schema: dict[str, Any], open_objects: bool) -> str:
    """A `%json` lexeme for one value of `schema`, laid out and closed as grammar.py's arguments are."""
    return arguments_rule(schema, open_objects)


def is_plain(schema: dict[str, Any], kind: str) -> bool:
    """Whether `schema` admits every value of JSON type `kind` and nothing else."""
    return schema.get("type") == kind and set(schema) <= _ANNOTATIONS


def string_choices(schema: dict[str, Any]) -> list[str] | None:
    """The strings of a schema that is only an `enum` (or `const`) of strings; None for any other."""
    if not set(schema) <= _ANNOTATIONS | {"enum", "const"} or schema.get("type", "string") != "string":
        return None
    values = schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else None
    if not isinstance(values, list) or not values or not all(isinstance(v, str) for v in values):
        return None
    return list(dict.fromkeys(values))


@dataclasses.dataclass(frozen=True)
class KeyedArgumentsFormat(ToolCallFormat):
    """A format whose grammars write a call's arguments with `argument_rules` (its lazy grammar is
    built with `with_argument_rules` too)."""

    @abstractmethod
    def argument_rules(self, i: int, tool: ToolSpec) -> list[str]:
        """The rule `args_i` of `tool`'s arguments (the first line) and the rules it names."""

    def forced_grammar(self, tools: list[ToolSpec], parallel: bool, start: str = "start",
                       json_aligned: bool = False) -> str:
        return self.with_argument_rules(super().forced_grammar(tools, parallel, start, json_aligned), tools)

    def with_argument_rules(self, grammar: str, tools: list[ToolSpec]) -> str:
        """`grammar` (grammar.py's, where `args_i: %json ...` is tool i's arguments) with each of those
        rules replaced by `argument_rules(i, tools[i])`."""
        seen: set[int] = set()

        def replace(m: re.Match[str]) -> str:
            i = int(m.group(1))
            seen.add(i)
            lines = self.argument_rules(i, tools[i])
            assert lines and lines[0].startswith(f"args_{i}:"), lines
            return "\n".join(lines)

        out = _ARGS_RULE.sub(replace, grammar)
        if seen != set(range(len(tools))):
            raise ValueError("the calls grammar has no arguments rule per tool: grammar.py's rule names changed")
        return out
