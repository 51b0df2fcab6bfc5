"""Constraint grammars for formats that write a call's arguments one by one (GLM's key/value tags, Python
keyword arguments) instead of as one JSON object: grammar.py builds the calls around the arguments, and
this module puts per-argument rules where grammar.py puts the `%json` of the whole parameters object.

Invariants: the arguments a tool's rule admits are its declared properties, in the order the schema
lists them, every required one present, none twice, no undeclared one (even when the schema or
--open-json-objects admits those: leaving them out is always allowed); a value is whatever
`value_json` or the format's own typed rule admits for that property's schema, so it validates against
it. What such a sequence cannot express is not enforced: top-level combinators (`anyOf`, `oneOf`,
`allOf`, `not`, `if`), `minProperties`/`maxProperties`, `dependentRequired`, `patternProperties`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radixserve.chat.tools.grammar import arguments_rule
from radixserve.chat.tools.types import ToolSpec

_ARGS_RULE = re.compile(r"^args_(\d+): %json .*$", re.MULTILINE)
# keywords that say nothing about which values are valid
_ANNOTATIONS = frozenset({"type", "description", "title", "default", "examples", "$comment", "$defs", "definitions"})


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
    defs = {k: parameters[k] for k in ("$defs", "definitions") if k in parameters}
    out = []
    for key, schema in properties.items():
        # `true` (or a non-object) admits any value: the empty schema
        own = schema if isinstance(schema, dict) else {}
        out.append(Argument(str(key), {**own, **defs}, key in required))
    # a required key the schema declares no property for still has to be written: any value
    out += [Argument(key, dict(defs), True) for key in required if key not in properties]
    return out


def value_json(schema: dict[str, Any], open_objects: bool) -> str:
    """A `%json` lexeme for one value of `schema`, laid out and closed as grammar.py's arguments are."""
    return arguments_rule(schema, open_objects)


def is_plain_string(schema: dict[str, Any]) -> bool:
    """Whether `schema` admits every string and nothing else."""
    return schema.get("type") == "string" and set(schema) <= _ANNOTATIONS


def string_choices(schema: dict[str, Any]) -> list[str] | None:
    """The strings of a schema that is only an `enum` (or `const`) of strings; None for any other."""
    if not set(schema) <= _ANNOTATIONS | {"enum", "const"} or schema.get("type", "string") != "string":
        return None
    values = schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else None
    if not isinstance(values, list) or not values or not all(isinstance(v, str) for v in values):
        return None
    return list(dict.fromkeys(values))


def with_argument_rules(grammar: str, tools: list[ToolSpec], rules: Callable[[int, ToolSpec], list[str]]) -> str:
    """`grammar` (grammar.py's, where `args_i: %json ...` is tool i's arguments) with each of those rules
    replaced by `rules(i, tools[i])`: lines whose first defines `args_i`."""
    seen: set[int] = set()

    def replace(m: re.Match[str]) -> str:
        i = int(m.group(1))
        seen.add(i)
        lines = rules(i, tools[i])
        assert lines and lines[0].startswith(f"args_{i}:"), lines
        return "\n".join(lines)

    out = _ARGS_RULE.sub(replace, grammar)
    if seen != set(range(len(tools))):
        raise ValueError("the calls grammar has no arguments rule per tool: grammar.py's rule names changed")
    return out
