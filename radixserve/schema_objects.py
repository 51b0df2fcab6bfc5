"""Closed objects by default in JSON schemas: `close_objects` returns a copy of a schema in which an object
allows only the properties it declares, as OpenAI's strict mode requires and xgrammar assumes. JSON
Schema's own default is open (any undeclared key, with any value), and a small model given an open object
writes keys nobody asked for until `max_tokens`. Neutral: the grammar compiler (the `json` constraint) and
the tool-call grammars (each tool's `parameters`) both use it; `EngineConfig.open_json_objects` keeps
JSON Schema's default instead.

What it does: every object schema (a dict whose `type` is or includes "object", or that has `properties`)
gets `"additionalProperties": false` appended (its other keys keep their order, which is the order
properties are generated in), unless

- it says something about undeclared keys itself: `additionalProperties`, `unevaluatedProperties`,
  `patternProperties` or `propertyNames` (whatever their value), or a `required` that names a key its
  `properties` do not declare;
- it shares its instance with another schema that declares keys. `allOf` branches, `anyOf` / `oneOf`
  alternatives, `then` / `else`, `dependentSchemas` (and old `dependencies`) schemas and a `$ref`'s
  target all describe the same object as the schema holding them, and the validator (and llguidance,
  which intersects them) checks the object against each: closing one piece rejects the keys the
  others declare. So `{"allOf": [{"properties": {"a": ...}}, {"properties": {"b": ...}}]}` keeps both
  branches open (closed separately, they would admit only `{}`); a piece is closed when no other piece
  it is checked together with (its siblings in `allOf`, the holder's own keywords, the holder's other
  applicators; not its fellow alternatives of one `anyOf` / `oneOf`) declares keys, and the holder is
  closed when none of its pieces does. A discriminated union (`anyOf` of whole object schemas) is
  therefore closed alternative by alternative; an object split across `allOf` stays open at that level
  (its nested objects are closed as usual): write it as one object to have it closed. A `$ref` target
  reached from such a shared place stays open, wherever else it is used. Only local refs ("#...") are
  followed; a schema holding any other ref is left open.
- it lies under `not` or `if`: those are tests, and closing an object inside one changes what it tests
  (under `not` it would admit more). Nothing written beneath them changes (a `$ref` there still reaches
  its target, which is closed or not by the rules above).

An object schema that declares no properties (`{"type": "object"}`) becomes the empty object; write
`"additionalProperties": true` for a free-form map.

Invariants: the input is never modified; the output is equal to the input except for the appended
`additionalProperties` keys, with every dict's key order kept; sharing and cycles among the input's
containers (a Python caller's schema) are kept as they are. Work is linear in the schema's size and
uses no recursion, so a schema of any depth is fine.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

# keys whose presence says what an object does with keys it does not declare
_SAYS_OTHERWISE = ("additionalProperties", "unevaluatedProperties", "patternProperties", "propertyNames")
# subschemas that describe a value inside the instance (a property, an item), never the instance itself
_CHILD = ("additionalProperties", "unevaluatedProperties", "additionalItems", "unevaluatedItems", "contains",
          "propertyNames", "contentSchema")
_CHILD_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_CHILD_LISTS = ("prefixItems",)
_ALTERNATIVES = ("anyOf", "oneOf")
_UNKNOWN: dict[str, Any] = {}  # the target of a ref that is not followed: assumed to declare keys


def close_objects(schema: Any) -> Any:
    """`schema` with its objects closed (see the module docstring); a copy, the input untouched."""
    return _Closer(schema).run()


def is_object_schema(node: dict[str, Any]) -> bool:
    kind = node.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in node


def _says_otherwise(node: dict[str, Any]) -> bool:
    if any(k in node for k in _SAYS_OTHERWISE):
        return True
    required, properties = node.get("required"), node.get("properties")
    declared = properties if isinstance(properties, dict) else {}
    return isinstance(required, list) and any(name not in declared for name in required)


def _own_keys(node: dict[str, Any]) -> bool:
    """Whether the schema's own keywords admit some key (so closing a piece beside it would refuse it)."""
    return (bool(node.get("properties")) or "patternProperties" in node or "propertyNames" in node
            or node.get("additionalProperties", False) is not False
            or node.get("unevaluatedProperties", False) is not False)


class _Closer:
    def __init__(self, root: Any) -> None:
        self.root = root
        self._refs: dict[str, Any] = {}
        self._declares: dict[int, bool] = {}

    def run(self) -> Any:
        return self._copy(self._closable())

    # -- which schemas close ------------------------------------------------------------------------
    def _closable(self) -> set[int]:
        """Ids of the object schemas to close: those closable at every place they are reached from."""
        candidates: set[int] = set()
        kept_open: set[int] = set()
        seen: set[tuple[int, bool]] = set()
        stack: list[tuple[Any, bool]] = [(self.root, False)]  # (schema, shares its instance with keys elsewhere)
        while stack:
            node, shared = stack.pop()
            if not isinstance(node, dict) or node is _UNKNOWN or (id(node), shared) in seen:
                continue
            seen.add((id(node), shared))
            pieces = self._pieces(node)
            declaring = [self._declares_keys(p) for _, p in pieces]
            if is_object_schema(node):
                if shared or _says_otherwise(node) or any(declaring):
                    kept_open.add(id(node))
                else:
                    candidates.add(id(node))
            total = sum(declaring)
            per_group: dict[str, int] = {}
            for (group, _), d in zip(pieces, declaring):
                per_group[group] = per_group.get(group, 0) + d
            beside = shared or _own_keys(node)
            for (group, piece), d in zip(pieces, declaring):
                # checked together with every other piece but its fellow alternatives
                others = total - (per_group[group] if group in _ALTERNATIVES or group == "cond" else d)
                stack.append((piece, beside or others > 0))
            stack.extend((child, False) for child in _children(node))
        return candidates - kept_open

    def _pieces(self, node: dict[str, Any]) -> list[tuple[str, Any]]:
        """The subschemas that describe the same instance as `node`, each with its group: alternatives of
        one group are never checked together."""
        out: list[tuple[str, Any]] = []
        for key in ("allOf", *_ALTERNATIVES):
            if isinstance(node.get(key), list):
                out += [(key, p) for p in node[key]]
        out += [("cond", node[k]) for k in ("then", "else") if k in node]
        for key in ("dependentSchemas", "dependencies"):
            if isinstance(node.get(key), dict):
                out += [("allOf", p) for p in node[key].values() if isinstance(p, dict)]
        for key in ("$ref", "$dynamicRef", "$recursiveRef"):
            if key in node:
                out.append(("allOf", self._resolve(node[key]) if key == "$ref" else _UNKNOWN))
        return [(g, p) for g, p in out if isinstance(p, dict)]

    def _declares_keys(self, root: dict[str, Any]) -> bool:
        """Whether the schema, with the pieces it holds, admits some key (memoized; a ref cycle reads as
        declaring nothing)."""
        if root is _UNKNOWN:
            return True
        memo = self._declares
        stack: list[tuple[dict[str, Any], bool]] = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            key = id(node)
            if not expanded:
                if key in memo:
                    continue
                if node is _UNKNOWN or _own_keys(node):
                    memo[key] = True
                    continue
                memo[key] = False  # in progress
                stack.append((node, True))
                stack.extend((p, False) for _, p in self._pieces(node) if id(p) not in memo)
            else:
                memo[key] = any(memo.get(id(p), False) for _, p in self._pieces(node))
        return memo[id(root)]

    def _resolve(self, ref: Any) -> Any:
        """The schema a local JSON-pointer ref ("#", "#/$defs/x") names; _UNKNOWN for any other."""
        if not isinstance(ref, str) or not ref.startswith("#"):
            return _UNKNOWN
        if ref not in self._refs:
            node: Any = self.root
            for part in ref[1:].split("/")[1:] if ref != "#" else ():
                part = unquote(part).replace("~1", "/").replace("~0", "~")
                if isinstance(node, dict) and part in node:
                    node = node[part]
                elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                    node = node[int(part)]
                else:
                    node = _UNKNOWN
                    break
            self._refs[ref] = node if isinstance(node, dict) else _UNKNOWN
        return self._refs[ref]

    # -- the copy -----------------------------------------------------------------------------------
    def _copy(self, close: set[int]) -> Any:
        """A deep copy of the root (dicts and lists; keys in order, sharing kept) with the closed ones'
        `additionalProperties: false` appended."""
        copies: dict[int, Any] = {}
        todo: list[tuple[Any, Any]] = []

        def shell(x: Any) -> Any:
            if not isinstance(x, (dict, list)):
                return x
            if id(x) not in copies:
                copies[id(x)] = {} if isinstance(x, dict) else []
                todo.append((x, copies[id(x)]))
            return copies[id(x)]

        out = shell(self.root)
        while todo:
            src, dst = todo.pop()
            if isinstance(src, dict):
                for k, v in src.items():
                    dst[k] = shell(v)
                if id(src) in close:
                    dst["additionalProperties"] = False
            else:
                dst.extend(shell(v) for v in src)
        return out


def _children(node: dict[str, Any]) -> list[Any]:
    """Subschemas of values inside the instance (never the instance itself); not those under tests."""
    out = [node[k] for k in _CHILD if k in node]
    for key in _CHILD_MAPS:
        if isinstance(node.get(key), dict):
            out += node[key].values()
    for key in _CHILD_LISTS:
        if isinstance(node.get(key), list):
            out += node[key]
    items = node.get("items")
    out += items if isinstance(items, list) else [items] if items is not None else []
    return out
