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

`answer_or_calls_grammar` is the grammar of a reply that is either calls (as `calls_grammar` writes
them, from the first token) or a final answer, a JSON value of the request's schema
(`ChatTools.constraint`, chat/tool_calls.py, says when it is used). Its calls' literal text is cut where
JSON's own lexemes end (`json_aligned`): llguidance's lexer is greedy, so a call literal such as
llama3_json's `{"name": "f", "parameters": ` would swallow the `{"` an answer object starts with and
leave that answer no way on; cut into `{`, `"name"`, `: `, ... each piece ends where the answer's lexeme
does, and the two stay apart until the text itself tells them apart.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from radixserve.schema_objects import close_objects
from radixserve.structured import JSON_OPTIONS

# the lexemes of JSON in the engine's layout: a string, a separator, a bracket; anything else runs on
_JSON_PIECE = re.compile(r'"(?:[^"\\]|\\.)*"|: |, |[{}\[\]]|[^"{}\[\]:,]+|.', re.DOTALL)


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


def literal(text: str, special_ids: Mapping[str, int], json_aligned: bool = False) -> str:
    """`text` as a Lark sequence, the markers that are single tokens written as those tokens; with
    `json_aligned`, the text cut where JSON's lexemes end (see the module docstring)."""
    parts: list[str] = []
    rest = text

    def text_part(piece: str) -> None:
        pieces = _JSON_PIECE.findall(piece) if json_aligned else [piece]
        parts.extend(json.dumps(p) for p in pieces)

    while rest:
        hits = [(rest.find(m), m) for m in special_ids if m in rest]
        if not hits:
            text_part(rest)
            break
        at, marker = min(hits)
        if at:
            text_part(rest[:at])
        parts.append(f"<[{special_ids[marker]}]>")
        rest = rest[at + len(marker):]
    return " ".join(parts)


def arguments_rule(parameters: dict[str, Any], open_objects: bool = False) -> str:
    closed = parameters if open_objects else close_objects(parameters)
    schema = {**closed, "x-guidance": JSON_OPTIONS}  # the layout every JSON constraint has
    return "%json " + json.dumps(schema, ensure_ascii=False)


def calls_grammar(shape: CallShape, tools: list[Any], parallel: bool, special_ids: Mapping[str, int],
                  open_objects: bool = False, start: str = "start", json_aligned: bool = False) -> str:
    """One call of any of `tools` (or one or more when `parallel`), from the first token; `start` names the
    rule of the whole (another grammar may embed it), `json_aligned` cuts the literals as JSON's lexemes."""
    lines = _call_rules(shape, tools, special_ids, "", open_objects, json_aligned)
    lines.append(f"{start}: " + _list(shape, parallel, special_ids, "call", shape.open, json_aligned))
    return "\n".join(lines) + "\n"


def answer_or_calls_grammar(calls: str, answer_schema: Any, closed: bool) -> str:
    """Either a final answer, a JSON value of `answer_schema` (its objects closed when `closed`), or the
    calls of `calls`: a calls grammar whose whole is the rule `calls` (`calls_grammar(..., start="calls",
    json_aligned=True)`, with whatever rules a format adds)."""
    schema = close_objects(answer_schema) if closed else answer_schema
    answer = "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS}, ensure_ascii=False)
    return f"start: calls | answer\nanswer: {answer}\n{calls}"


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
                open_objects: bool, json_aligned: bool = False) -> list[str]:
    """`call: call_0 | ...` with one rule per tool (`first` ones with the trigger `strip` taken off)."""
    rule = "first" if strip else "call"
    lines = [f"{rule}: " + " | ".join(f"{rule}_{i}" for i in range(len(tools)))]
    for i, tool in enumerate(tools):
        before = shape.prefix(tool.name)[len(strip):]
        body = _seq(literal(before, special_ids, json_aligned), f"args_{i}",
                    literal(shape.after, special_ids, json_aligned))
        lines.append(f"{rule}_{i}: {body}")
        if not strip:
            lines.append(f"args_{i}: {arguments_rule(tool.parameters, open_objects)}")
    return lines


def _list(shape: CallShape, parallel: bool, special_ids: Mapping[str, int], call: str, open_text: str,
          json_aligned: bool = False) -> str:
    more = f"({_seq(literal(shape.separator, special_ids, json_aligned), call)})*" if parallel else ""
    return _seq(literal(open_text, special_ids, json_aligned), call, more,
                literal(shape.close, special_ids, json_aligned))


def _seq(*parts: str) -> str:
    return " ".join(p for p in parts if p)
