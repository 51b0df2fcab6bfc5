"""What a request asks its generated text to match: a JSON schema, any JSON object, a regular
expression, one of a list of strings, or a grammar. Neutral (every layer may import it): the engine
compiles it (engine/grammar/), the server builds it from the APIs' fields.

Invariants: exactly one kind is set; `key` is the constraint as sent, a schema's key order included
(the order of its properties is the order the reply writes them in), so one compiled grammar serves
every request asking exactly the same thing; `field` names the API parameter the
constraint came from, and every error about it names that path.

A `grammar` is Lark as llguidance reads it (a GBNF grammar, told by its `::=` rules, is converted);
its `%json {...}` inline schemas and lazy (triggered) rules are what tool calling builds on
(chat/tools/), a `json` / `json_object` final answer beside tools included (one grammar of the answer or
calls: chat/tool_calls.py). A constraint covers the generated tokens only, never the prompt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# JSON as OpenAI's models write it: no free whitespace (so keys and separators are forced tokens); the
# options llguidance compiles every JSON constraint with, tool calls' included
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructuredOutput:
    json: Any = None  # a JSON schema: a dict (or its JSON text)
    json_object: bool = False  # any JSON object (OpenAI's response_format {"type": "json_object"})
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None  # Lark (llguidance's dialect) or GBNF
    field: str = "structured_outputs"  # the API parameter path errors name

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        if isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", json.loads(self.json))
            except json.JSONDecodeError as e:
                raise ValueError(f"{self.field}: the JSON schema is not valid JSON ({e.msg})") from None
        self.validate()

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if self._is_set(k))

    def _is_set(self, kind: str) -> bool:
        value = getattr(self, kind)
        return value is True if kind == "json_object" else value is not None

    def validate(self) -> None:
        given = [k for k in KINDS if self._is_set(k)]
        if len(given) != 1:
            raise ValueError(f"{self.field}: give exactly one of {', '.join(KINDS)}"
                             + (f" (got {', '.join(given)})" if given else ""))
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError(f"{self.field}: a JSON schema is an object, got {type(self.json).__name__}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError(f"{self.field}: a regex is a non-empty string")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError(f"{self.field}: a grammar is a non-empty string")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"{self.field}: choice is a non-empty list of non-empty strings")

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): equal for constraints that ask the same, in the same order."""
        kind = self.kind
        if kind == "json":
            return kind, json.dumps(self.json, separators=(",", ":"))
        if kind == "json_object":
            return kind, ""
        if kind == "choice":
            return kind, json.dumps(list(self.choice or ()))
        return kind, str(getattr(self, kind))
