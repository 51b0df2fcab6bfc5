"""`close_objects` (radixserve/schema_objects.py): JSON schemas with closed objects by default, the rules
for what stays open (a schema that says otherwise, an object described in pieces, tests), key order, the
input left alone, any depth, linear work. Validity is checked with `jsonschema`, whose reading of
`additionalProperties` (it sees only its own schema's `properties`) is the one the rules are made for."""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.schema_objects import _Closer, close_objects

CLOSED = {"additionalProperties": False}


def valid(schema: Any, instance: Any) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(instance)


def test_every_object_is_closed_where_subschemas_can_be() -> None:
    obj = {"type": "object", "properties": {"x": {"type": "integer"}}}
    schema = {
        "type": "object",
        "properties": {"p": obj, "arr": {"type": "array", "items": obj, "prefixItems": [obj], "contains": obj},
                       "map": {"type": "object", "additionalProperties": obj},
                       "either": {"anyOf": [obj, {"type": "null"}]}, "one": {"oneOf": [obj, {"type": "string"}]},
                       "nullable": {"type": ["object", "null"], "properties": {"y": {"type": "string"}}},
                       "ref": {"$ref": "#/$defs/D"}},
        "$defs": {"D": {"properties": {"z": {"type": "number"}}}},
        "definitions": {"E": obj},
    }
    out = close_objects(schema)
    inner = {**obj, **CLOSED}
    assert out["additionalProperties"] is False
    props = out["properties"]
    assert props["p"] == inner
    assert props["arr"]["items"] == inner and props["arr"]["prefixItems"] == [inner] and props["arr"]["contains"] == inner
    assert props["map"]["additionalProperties"] == inner and "additionalProperties" in schema["properties"]["map"]
    assert props["map"] == {"type": "object", "additionalProperties": inner}  # says otherwise: kept open
    assert props["either"]["anyOf"] == [inner, {"type": "null"}] and props["one"]["oneOf"][0] == inner
    assert props["nullable"]["additionalProperties"] is False
    assert out["$defs"]["D"] == {"properties": {"z": {"type": "number"}}, **CLOSED}
    assert out["definitions"]["E"] == inner
    assert props["ref"] == {"$ref": "#/$defs/D"}  # not an object schema itself; its target is closed
    # an object that declares nothing admits only {}
    assert close_objects({"type": "object"}) == {"type": "object", **CLOSED}


def test_key_order_is_kept_and_the_input_untouched() -> None:
    schema = {"type": "object", "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "object"},
                                               "mid": {"type": "string"}}, "required": ["zeta", "alpha"]}
    before = copy.deepcopy(schema)
    out = close_objects(schema)
    assert schema == before and json.dumps(schema) == json.dumps(before)
    assert list(out) == ["type", "properties", "required", "additionalProperties"]
    assert list(out["properties"]) == ["zeta", "alpha", "mid"]
    assert out["properties"]["alpha"] is not schema["properties"]["alpha"]


@pytest.mark.parametrize("says", [{"additionalProperties": True}, {"additionalProperties": {"type": "integer"}},
                                  {"additionalProperties": False}, {"unevaluatedProperties": False},
                                  {"patternProperties": {"^x_": {"type": "integer"}}},
                                  {"propertyNames": {"pattern": "^[a-z]+$"}}, {"required": ["a", "undeclared"]}])
def test_an_object_that_says_otherwise_stays_as_it_is(says: dict[str, Any]) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, **says}
    assert close_objects(schema) == schema


def test_values_are_not_schemas() -> None:
    """enum / const / default / examples hold instances, and properties named like keywords are names."""
    schema = {"type": "object", "properties": {"properties": {"type": "object", "properties": {}},
                                               "items": {"const": {"type": "object", "properties": {}}}},
              "default": {"type": "object"}, "examples": [{"properties": {}}], "enum": [{"type": "object"}]}
    out = close_objects(schema)
    assert out["properties"]["properties"] == {"type": "object", "properties": {}, **CLOSED}
    assert out["properties"]["items"] == schema["properties"]["items"]
    for key in ("default", "examples", "enum"):
        assert out[key] == schema[key]


def test_allof_branches_describe_one_object_and_stay_open() -> None:
    """Closed separately, two allOf branches would each refuse the other's keys: nothing but {} would be
    valid. So an object split across allOf stays open at that level; its nested objects still close."""
    a = {"type": "object", "properties": {"a": {"type": "integer"}, "deep": {"type": "object"}}, "required": ["a"]}
    b = {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}
    schema = {"allOf": [a, b]}
    out = close_objects(schema)
    assert valid(out, {"a": 1, "b": 2})
    naive = {"allOf": [{**a, **CLOSED}, {**b, **CLOSED}]}
    assert not valid(naive, {"a": 1, "b": 2})  # the choice it avoids
    assert "additionalProperties" not in out["allOf"][0] and "additionalProperties" not in out["allOf"][1]
    assert out["allOf"][0]["properties"]["deep"] == {"type": "object", **CLOSED}
    assert not valid(out, {"a": 1, "b": 2, "deep": {"x": 1}})


def test_a_single_declaring_piece_is_closed() -> None:
    """A holder with no keys of its own and one allOf branch that declares them: the branch closes, the
    holder (whose closing would refuse the branch's keys) stays open."""
    schema = {"type": "object", "allOf": [{"properties": {"a": {"type": "integer"}}}, {"required": ["a"]}]}
    out = close_objects(schema)
    assert "additionalProperties" not in out and out["allOf"][0]["additionalProperties"] is False
    assert valid(out, {"a": 1}) and not valid(out, {"a": 1, "junk": 2})


def test_alternatives_close_one_by_one_unless_their_holder_declares_keys() -> None:
    union = {"anyOf": [{"type": "object", "properties": {"kind": {"const": "a"}, "x": {"type": "integer"}}},
                       {"type": "object", "properties": {"kind": {"const": "b"}, "y": {"type": "string"}}}]}
    out = close_objects(union)
    assert all(alt["additionalProperties"] is False for alt in out["anyOf"])
    assert valid(out, {"kind": "a", "x": 1}) and not valid(out, {"kind": "a", "x": 1, "junk": 0})
    # the holder's own properties beside alternatives that declare more: both sides keep the other's keys
    mixed = {"type": "object", "properties": {"kind": {"type": "string"}},
             "oneOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]},
                       {"properties": {"b": {"type": "integer"}}, "required": ["b"]}]}
    out = close_objects(mixed)
    assert out == mixed and valid(out, {"kind": "k", "a": 1})
    # alternatives that only require keys the holder declares: the holder closes
    required = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}
    out = close_objects(required)
    assert out["additionalProperties"] is False and valid(out, {"a": 1}) and not valid(out, {"a": 1, "c": 1})


def test_a_ref_extended_in_allof_stays_open_and_recursion_is_closed() -> None:
    schema = {"$defs": {"Base": {"type": "object", "properties": {"id": {"type": "integer"}}}},
              "allOf": [{"$ref": "#/$defs/Base"}, {"properties": {"extra": {"type": "string"}}}]}
    out = close_objects(schema)
    assert "additionalProperties" not in out["$defs"]["Base"] and valid(out, {"id": 1, "extra": "x"})
    tree = {"$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "properties": {
        "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}}
    out = close_objects(tree)
    assert out["$defs"]["node"]["additionalProperties"] is False
    assert valid(out, {"value": 1, "children": [{"value": 2, "children": []}]})
    assert not valid(out, {"value": 1, "children": [{"value": 2, "junk": 1}]})
    # a ref this does not follow: its holder stays open
    remote = {"type": "object", "properties": {"a": {"type": "integer"}}, "$ref": "https://example.com/s.json"}
    assert close_objects(remote) == remote


def test_tests_are_left_alone() -> None:
    """Closing inside `not` would admit more; inside `if` it would change the test."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}},
              "not": {"type": "object", "properties": {"a": {"const": 0}}},
              "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["a"]}}
    out = close_objects(schema)
    assert out["not"] == schema["not"] and out["if"] == schema["if"]
    assert out["additionalProperties"] is False


def test_any_depth_without_recursion() -> None:
    depth = 5000
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"p": schema}}
    chain: dict[str, Any] = {"properties": {"leaf": {"type": "integer"}}}
    for _ in range(depth):
        chain = {"allOf": [chain]}
    for s in (schema, chain):
        out = close_objects(s)
        node, levels = out, 0
        while isinstance(node, dict) and ("properties" in node or "allOf" in node):
            if "allOf" in node:
                node = node["allOf"][0]
                continue
            assert node.get("additionalProperties") is False
            node, levels = node["properties"].get("p"), levels + 1
        assert levels == (depth if s is schema else 1)


def test_shared_and_cyclic_containers_are_kept() -> None:
    obj: dict[str, Any] = {"type": "object", "properties": {"x": {"type": "integer"}}}
    schema: dict[str, Any] = {"type": "object", "properties": {"a": obj, "b": obj}}
    schema["properties"]["self"] = schema  # a Python caller's cycle: no JSON, but no hang either
    out = close_objects(schema)
    assert out["properties"]["a"] is out["properties"]["b"] and out["properties"]["self"] is out
    assert out["properties"]["a"]["additionalProperties"] is False


@pytest.mark.parametrize("shape", ["wide", "deep"])
def test_work_is_linear(shape: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each schema's pieces are looked at a bounded number of times (no timing: a count)."""
    calls = 0
    pieces = _Closer._pieces

    def counted(self: _Closer, node: dict[str, Any]) -> list[tuple[str, Any]]:
        nonlocal calls
        calls += 1
        return pieces(self, node)

    monkeypatch.setattr(_Closer, "_pieces", counted)
    n = 3000
    if shape == "wide":
        schema: dict[str, Any] = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}}}
                                            for i in range(n)]}
    else:
        schema = {"properties": {"x": {"type": "integer"}}}
        for _ in range(n):
            schema = {"allOf": [schema, {"required": ["x"]}]}
    close_objects(schema)
    assert calls <= 8 * (2 * n + 2)


# -- properties, over generated schemas --------------------------------------------------------------

NAMES = st.sampled_from(["a", "b", "c", "type", "properties", "items"])
LEAVES = st.sampled_from([{"type": "integer"}, {"type": "string"}, {"enum": [1, {"x": 1}]},
                          {"const": {"type": "object"}}, True, {"type": "object"}])
SAYS = st.sampled_from([{}, {}, {"additionalProperties": True}, {"patternProperties": {"^x": {"type": "integer"}}},
                        {"required": ["zz"]}])


def _extend(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.builds(lambda props, says: {"type": "object", "properties": props, **says},
                  st.dictionaries(NAMES, children, max_size=3), SAYS),
        st.builds(lambda items: {"type": "array", "items": items}, children),
        st.builds(lambda alts: {"anyOf": alts}, st.lists(children, min_size=1, max_size=3)),
        st.builds(lambda parts: {"allOf": parts}, st.lists(children, min_size=1, max_size=3)),
    )


SCHEMAS = st.recursive(LEAVES, _extend, max_leaves=12)
INSTANCES = st.recursive(st.one_of(st.integers(0, 3), st.sampled_from(["s", "x"])),
                         lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(NAMES | st.just("zz"), c,
                                                                                       max_size=3)),
                         max_leaves=8)


def _same_but_closed(before: Any, after: Any) -> None:
    """`after` is `before` with at most an `additionalProperties: false` appended to some dicts."""
    if isinstance(before, dict):
        assert isinstance(after, dict) and list(after)[:len(before)] == list(before)
        assert set(after) - set(before) <= {"additionalProperties"}
        if len(after) > len(before):
            assert after["additionalProperties"] is False
        for k in before:
            _same_but_closed(before[k], after[k])
    elif isinstance(before, list):
        assert isinstance(after, list) and len(after) == len(before)
        for x, y in zip(before, after):
            _same_but_closed(x, y)
    else:
        assert before == after


@settings(max_examples=300, deadline=None)
@given(schema=SCHEMAS, instances=st.lists(INSTANCES, max_size=6))
def test_closing_only_narrows_keeps_order_and_is_idempotent(schema: Any, instances: list[Any]) -> None:
    before = copy.deepcopy(schema)
    out = close_objects(schema)
    assert schema == before
    _same_but_closed(schema, out)
    assert close_objects(out) == out
    for instance in instances:
        if valid(out, instance):
            assert valid(schema, instance), (out, instance)


@settings(max_examples=200, deadline=None)
@given(schema=SCHEMAS)
def test_without_pieces_every_object_is_closed(schema: Any) -> None:
    """Where no allOf / anyOf is involved, every object schema ends up saying what it does with
    undeclared keys, and an instance with an undeclared key is refused by each closed object."""
    text = json.dumps(schema)
    if "allOf" in text or "anyOf" in text:
        return
    out = close_objects(schema)
    stack = [out]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        if node.get("type") == "object":
            assert any(k in node for k in ("additionalProperties", "patternProperties")) or "zz" in node.get(
                "required", ()), node
            if node.get("additionalProperties") is False:
                assert not valid(node, {"undeclared_key": 0})
        stack += list(node.get("properties", {}).values()) + [node.get("items")]
