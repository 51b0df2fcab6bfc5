"""Lark (llguidance's dialect) for tool calls: a format describes one call as literal text around the
arguments, and this module builds the grammars `ToolCallFormat.constraint` returns from that description.

Invariants: arguments are `%json` of the tool's own `parameters` with the engine's JSON layout (no free
whitespace, ", " and ": " separators), so a constrained call is what the format's parser reads and its
arguments validate against the tool's schema; its objects are closed (radixserve/schema_objects.py: only
declared properties, unless the schema says otherwise) unless `open_objects`, the server's
--open-json-objects, as the `json` constraints are. Without `parallel`, a grammar allows one call and
then only the end of the reply. A marker the tokenizer has as one added token is written as
that token (`<[id]>`); llguidance treats every added token as special, so the spelled-out text would never
match it and the model would be pushed to spell it in pieces. `lazy` grammars leave text free until the
model writes the trigger, then constrain the calls, which end the reply.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from radixserve.schema_objects import close_objects
from radixserve.structured import JSON_OPTIONS


@dataclass(frozen=True)
class CallShape:
    """One call's text around its arguments, for every tool: `before(name)` args `after`; a list of calls
    is `open` call (`separator` call)* `close`."""

    before: str  # with "{name}" where the tool name goes (as JSON string content)
    after: str
    separator: str
    open: str = ""
    close: str = ""

    def prefix(self, name: str) -> str:
        return self.before.replace("{name}", json.dumps(name, ensure_ascii=False)[1:-1])


def literal(text: str, special_ids: Mapping[str, int]) -> str:
    """`text` as a Lark sequence, the markers that are single tokens written as those tokens."""
    parts: list[str] = []
    rest = text
    while rest:
        hits = [(rest.find(m), m) for m in special_ids if m in rest]
        if not hits:
            parts.append(json.dumps(rest))
            break
        at, marker = min(hits)
        if at:
            parts.append(json.dumps(rest[:at]))
        parts.append(f"<[{special_ids[marker]}]>")
        rest = rest[at + len(marker):]
    return " ".join(parts)


def arguments_rule(parameters: dict[str, Any], open_objects: bool = False) -> str:
    closed = parameters if open_objects else close_objects(parameters)
    schema = {**closed, "x-guidance": JSON_OPTIONS}  # the layout every JSON constraint has
    return "%json " + json.dumps(schema, ensure_ascii=False)


def calls_grammar(shape: CallShape, tools: list[Any], parallel: bool, special_ids: Mapping[str, int],
                  open_objects: bool = False) -> str:
    """One call of any of `tools` (or one or more when `parallel`), from the first token."""
    lines = _call_rules(shape, tools, special_ids, "", open_objects)
    lines.append("start: " + _list(shape, parallel, special_ids, "call", shape.open))
    return "\n".join(lines) + "\n"


def lazy_calls_grammar(shape: CallShape, trigger: str, tools: list[Any], parallel: bool,
                       special_ids: Mapping[str, int], open_objects: bool = False) -> str:
    """Free text; once the model writes `trigger`, calls as in `calls_grammar`, which end the reply."""
    opens_list = shape.open.startswith(trigger) and bool(shape.open)
    if not opens_list and not shape.prefix("x").startswith(trigger):
        raise ValueError(f"the trigger {trigger!r} does not start a call")
    lines = ["%llguidance {}", "TEXT: /(.|\\n)*/", "start: TEXT | tagged"]
    lines += _call_rules(shape, tools, special_ids, "", open_objects)
    if opens_list:
        rest = _list(shape, parallel, special_ids, "call", shape.open[len(trigger):])
    else:
        lines += _call_rules(shape, tools, special_ids, trigger, open_objects)
        more = f" ({_seq(literal(shape.separator, special_ids), 'call')})*" if parallel else ""
        rest = _seq("first", more.strip(), literal(shape.close, special_ids))
    if trigger in special_ids:
        lines.append(f"tagged: TEXT <[{special_ids[trigger]}]> {rest}")
    else:
        lines += [f"head[lazy]: TEXT {json.dumps(trigger)}", f"tagged: head {rest}"]
    return "\n".join(lines) + "\n"


def _call_rules(shape: CallShape, tools: list[Any], special_ids: Mapping[str, int], strip: str,
                open_objects: bool) -> list[str]:
    """`call: call_0 | ...` with one rule per tool (`first` ones with the trigger `strip` taken off)."""
    rule = "first" if strip else "call"
    lines = [f"{rule}: " + " | ".join(f"{rule}_{i}" for i in range(len(tools)))]
    for i, tool in enumerate(tools):
        before = shape.prefix(tool.name)[len(strip):]
        body = _seq(literal(before, special_ids), f"args_{i}", literal(shape.after, special_ids))
        lines.append(f"{rule}_{i}: {body}")
        if not strip:
            lines.append(f"args_{i}: {arguments_rule(tool.parameters, open_objects)}")
    return lines


def _list(shape: CallShape, parallel: bool, special_ids: Mapping[str, int], call: str, open_text: str) -> str:
    more = f"({_seq(literal(shape.separator, special_ids), call)})*" if parallel else ""
    return _seq(literal(open_text, special_ids), call, more, literal(shape.close, special_ids))


def _seq(*parts: str) -> str:
    return " ".join(p for p in parts if p)
