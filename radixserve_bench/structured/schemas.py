"""The structured workload's schemas: what one is (BenchSchema), the helpers the catalogs write them
with, the JSON-schema features a schema uses (found by walking it, not declared), and the two schemas
with a job of their own: FORCED (fixed keys: what forced tokens save) and STEP (never finishes within
the step test's tokens: what the mask costs per decode step).

Invariants: names are unique; every schema is a valid Draft 2020-12 schema; `features` reads the
schema itself, so a catalog cannot claim a feature it does not use.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

Schema = dict[str, Any]

# where a schema's kind comes from: ours, or one of JSONSchemaBench's datasets
FAMILIES = ("ours", "github", "kubernetes", "snowplow", "washington-post", "glaive", "schemastore")
# what the catalog must exercise (tests check each appears); see `features`
FEATURES = ("enum", "const", "pattern", "numeric-bounds", "string-length", "nested-object", "array-of-objects",
            "array-bounds", "anyOf", "oneOf", "allOf", "ref", "recursive-ref", "optional-property",
            "closed-object", "open-map", "nullable", "format", "boolean", "integer", "number")


@dataclass(frozen=True)
class BenchSchema:
    name: str
    family: str  # one of FAMILIES
    task: str  # what the user asks for, in words (the schema follows it in the prompt)
    schema: Schema

    def messages(self) -> list[dict[str, str]]:
        """The chat the model answers: a short system line, then the task and the schema itself."""
        return [{"role": "system", "content": "You are a helpful assistant. You reply with JSON only."},
                {"role": "user", "content": f"{self.task}\nReply with one JSON value that matches this JSON schema:\n"
                                            f"{json.dumps(self.schema)}"}]


# -- helpers the catalogs write schemas with --------------------------------------------------
def s(max_len: int = 40, **kw: Any) -> Schema:
    """A string; bounded by default, so a 135M model's reply ends within the token budget."""
    return {"type": "string", "maxLength": max_len, **kw} if max_len else {"type": "string", **kw}


def _bounded(kind: str, lo: float | None, hi: float | None) -> Schema:
    bounds = {"minimum": lo, "maximum": hi}
    return {"type": kind, **{k: v for k, v in bounds.items() if v is not None}}


def i(lo: int | None = None, hi: int | None = None) -> Schema:
    return _bounded("integer", lo, hi)


def n(lo: float | None = None, hi: float | None = None) -> Schema:
    return _bounded("number", lo, hi)


def b() -> Schema:
    return {"type": "boolean"}


def e(*values: Any) -> Schema:
    return {"enum": list(values)}


def arr(items: Schema, lo: int = 0, hi: int = 4) -> Schema:
    return {"type": "array", "items": items, "minItems": lo, "maxItems": hi}


def obj(props: Schema, required: tuple[str, ...] | None = None, closed: bool = True) -> Schema:
    """An object; every property required unless `required` names some; closed (additionalProperties
    false) unless asked otherwise."""
    out: Schema = {"type": "object", "properties": props, "required": list(props if required is None else required)}
    if closed:
        out["additionalProperties"] = False
    return out


def string_map(value: Schema) -> Schema:
    """An object with free keys (a label map, headers, env)."""
    return {"type": "object", "additionalProperties": value}


# -- features ------------------------------------------------------------------------------------
def _walk(node: Any, depth: int = 0) -> Iterator[tuple[Schema, int]]:
    """Every subschema (dicts) with its object-nesting depth."""
    if isinstance(node, list):
        for x in node:
            yield from _walk(x, depth)
    elif isinstance(node, dict):
        yield node, depth
        nested = depth + (1 if node.get("type") == "object" else 0)
        for key, value in node.items():
            if key in ("enum", "const", "required", "examples", "default"):
                continue  # values, not schemas
            if key in ("properties", "$defs", "definitions", "patternProperties"):
                for sub in value.values():
                    yield from _walk(sub, nested)
            else:
                yield from _walk(value, nested)


def features(schema: Schema) -> set[str]:
    """The FEATURES a schema uses, read off its subschemas."""
    out: set[str] = set()
    for node, depth in _walk(schema):
        types = node.get("type")
        types = set(types) if isinstance(types, list) else {types}
        out |= {k for k in ("enum", "const", "pattern", "anyOf", "oneOf", "allOf", "format") if k in node}
        out |= {t for t in ("boolean", "integer", "number") if t in types}
        if {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"} & node.keys():
            out.add("numeric-bounds")
        if {"minLength", "maxLength"} & node.keys():
            out.add("string-length")
        if {"minItems", "maxItems"} & node.keys():
            out.add("array-bounds")
        if "$ref" in node:
            out.add("recursive-ref" if node["$ref"] == "#" or _refers_to_itself(schema, node["$ref"]) else "ref")
        if "object" in types and depth >= 1:
            out.add("nested-object")
        if "array" in types and isinstance(node.get("items"), dict) and node["items"].get("type") == "object":
            out.add("array-of-objects")
        if "null" in types or any(isinstance(x, dict) and x.get("type") == "null" for x in node.get("anyOf", [])):
            out.add("nullable")
        if "properties" in node and set(node["properties"]) - set(node.get("required", [])):
            out.add("optional-property")
        if node.get("additionalProperties") is False:
            out.add("closed-object")
        if isinstance(node.get("additionalProperties"), dict):
            out.add("open-map")
    return out


def _refers_to_itself(schema: Schema, ref: str) -> bool:
    """A `#/$defs/X` reference made from inside X (a recursive definition)."""
    name = ref.rsplit("/", 1)[-1]
    target = schema.get("$defs", {}).get(name)
    return target is not None and f'"$ref": "{ref}"' in json.dumps(target)


# -- the schemas with a job of their own --------------------------------------------------------
FORCED = BenchSchema(
    "forced-fixed-keys", "ours", "Pick the account settings of a new user who likes dark screens and lives in Paris.",
    obj({"dark_mode": b(), "beta_access": b(), "newsletter": b(),
         "region": e("eu-west", "us-east", "ap-south"), "tier": e("free", "pro", "enterprise"),
         "language": e("en", "fr", "de", "es")}))
# an array far longer than the step test generates: every timed step decodes one constrained token of
# objects, strings, enums and numbers, and no request finishes inside the timed window
STEP = BenchSchema(
    "step-long-array", "ours", "List the inventory of a large warehouse, item by item.",
    obj({"items": arr(obj({"id": i(0, 99999), "name": s(24), "kind": e("tool", "part", "kit"), "price": n(0, 1000)}),
                      lo=200, hi=400)}))


def all_schemas() -> list[BenchSchema]:
    """The validity set: our schemas, then JSONSchemaBench's kinds (FORCED is among ours)."""
    from radixserve_bench.structured.catalog_jsb import JSB_SCHEMAS
    from radixserve_bench.structured.catalog_ours import OUR_SCHEMAS

    return [*OUR_SCHEMAS, *JSB_SCHEMAS]
