"""The structured-output fields of a request body, as one `StructuredOutput` (radixserve/structured.py)
or an ApiError naming the parameter path. Shared by the OpenAI chat endpoint, WebSocket chat frames
and REST session messages, which all accept the same fields:

- `response_format` (OpenAI): `{"type": "text"}` (no constraint), `{"type": "json_object"}`, or
  `{"type": "json_schema", "json_schema": {"name", "schema"?, "strict"?, "description"?}}`;
- `structured_outputs` (vLLM's extension): an object with exactly one of `json` (a schema, or its
  JSON text), `regex`, `choice` (a list of strings), `grammar` (Lark or GBNF), `json_object: true`;
- vLLM's older top-level `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

A constraint the engine has not compiled yet is compiled by `compile_off_loop` on a worker thread
before the request is checked, so a slow compile (up to the engine's compile timeout) never holds the
event loop, and under the client's compile slots (compile_slots.py); the check then finds it in the
engine's grammar cache.

Invariants: at most one of these constrains a request (several: 400 naming them all); every
refusal is 400 `invalid_field` whose `param` is the path of the offending value, and the
StructuredOutput's `field` is the path the engine's compile errors then name (a ConstraintError's
`param`, mapped to the same 400 by generation.api_error_from). Only shape is checked here: whether a
schema, regex or grammar compiles is the engine's to say, once, when it compiles it.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from radixserve.errors import RequestError
from radixserve.sampling_fields import SamplingFields
from radixserve.server.pipeline.compile_slots import CLIENT
from radixserve.server.pipeline.stream import api_error_from
from radixserve.server.validation import ApiError, parse_json_text
from radixserve.structured import StructuredOutput

if TYPE_CHECKING:
    from radixserve.server.state import ServerState

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
SCHEMA_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for json_schema.name
# structured_outputs' constraint kinds (exactly one), and vLLM's tuning options that change nothing here
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
STRUCTURED_OPTIONS = ("backend", "disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                      "whitespace_pattern")
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
FIELDS = ("response_format", "structured_outputs", *GUIDED)


def structured_output(body: dict[str, Any]) -> StructuredOutput | None:
    """The constraint `body` asks for, or None (no field, or response_format text); ApiError if malformed."""
    asked = [(name, c) for name in FIELDS if body.get(name) is not None
             if (c := _parse_field(name, body[name])) is not None]
    if len(asked) > 1:
        names = [name for name, _ in asked]
        raise ApiError("invalid_field", f"give at most one structured-output field, got {', '.join(names)}",
                       param=", ".join(names))
    return asked[0][1] if asked else None


def with_structured(sampling: SamplingFields, body: dict[str, Any]) -> SamplingFields:
    """A WebSocket/REST turn's sampling plus the body's constraint (read by
    sampling_fields.build_sampling_params); unchanged when the body asks for none."""
    structured = structured_output(body)
    return sampling if structured is None else replace(sampling, structured=structured)


async def compile_off_loop(state: ServerState, structured: StructuredOutput | None, namespace: str) -> None:
    """Compile `structured` into the engine's grammar cache on a worker thread (the engine's request
    check compiles it on the caller's thread, which on the server is the event loop), holding one of
    the request's client's compile `slots` meanwhile; a constraint that does not compile is the 400
    naming its parameter, as the check would raise it."""
    grammars = getattr(state.require_engine().intake, "grammars", None)  # None: an engine that compiles nothing here
    # a cached one needs no thread; not counted as a hit here, the check counts it
    if structured is None or grammars is None or grammars.is_cached(structured, namespace):
        return
    with state.compile_slots.hold(CLIENT.get(), state.config.max_compiles_per_client):
        try:
            await asyncio.to_thread(grammars.compile, structured, True, namespace)  # the check counts no hit
        except RequestError as e:
            raise api_error_from(e) from None


def _parse_field(name: str, value: Any) -> StructuredOutput | None:
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        return _structured_outputs(value)
    return _make(name, **{GUIDED[name]: value})


def _response_format(fmt: Any) -> StructuredOutput | None:
    path = "response_format"
    if not isinstance(fmt, dict):
        raise ApiError("invalid_field", f"'{path}' must be an object", param=path)
    kind = fmt.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise ApiError("invalid_field", f"'{path}.type' must be one of {', '.join(RESPONSE_FORMAT_TYPES)}, "
                       f"got {_show(kind)}", param=f"{path}.type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _make(path, json_object=True)
    spec = fmt.get("json_schema")
    path += ".json_schema"
    if not isinstance(spec, dict):
        raise ApiError("invalid_field", f"'{path}' must be an object with a 'name' and a 'schema'", param=path)
    name = spec.get("name")
    if not isinstance(name, str) or not SCHEMA_NAME.fullmatch(name):
        raise ApiError("invalid_field", f"'{path}.name' must be 1-64 characters of a-z, A-Z, 0-9, _ and -", param=f"{path}.name")
    for key, kind_ok, what in (("strict", bool, "a boolean"), ("description", str, "a string")):
        if spec.get(key) is not None and not isinstance(spec[key], kind_ok):
            raise ApiError("invalid_field", f"'{path}.{key}' must be {what}", param=f"{path}.{key}")
    schema = spec.get("schema")
    if schema is None:  # OpenAI's `schema` is optional: then any JSON object
        return _make(path, json_object=True)
    if not isinstance(schema, dict):
        raise ApiError("invalid_field", f"'{path}.schema' must be a JSON schema object", param=f"{path}.schema")
    return _make(f"{path}.schema", json=schema)


def _structured_outputs(value: Any) -> StructuredOutput:
    path = "structured_outputs"
    if not isinstance(value, dict):
        raise ApiError("invalid_field", f"'{path}' must be an object with one of {', '.join(STRUCTURED_KINDS)}",
                       param=path)
    unknown = sorted(set(value) - set(STRUCTURED_KINDS) - set(STRUCTURED_OPTIONS))
    if unknown:
        raise ApiError("invalid_field", f"'{path}.{unknown[0]}' is not supported; give one of "
                       f"{', '.join(STRUCTURED_KINDS)}", param=f"{path}.{unknown[0]}")
    # null and json_object: false mean unset, as a client that sends every field with defaults writes them
    given = [k for k in STRUCTURED_KINDS if value.get(k) is not None and value.get(k) is not False]
    if len(given) != 1:
        got = f", got {', '.join(given)}" if given else ""
        raise ApiError("invalid_field", f"'{path}' takes exactly one of {', '.join(STRUCTURED_KINDS)}{got}",
                       param=path)
    kind = given[0]
    if kind == "json_object" and value[kind] is not True:
        raise ApiError("invalid_field", f"'{path}.json_object' must be a boolean", param=f"{path}.json_object")
    return _make(f"{path}.{kind}", **{kind: value[kind]})


def _make(field: str, **kind: Any) -> StructuredOutput:
    """The StructuredOutput, its own checks (one kind, types, a schema given as JSON text parsing) as
    400s naming `field`."""
    choice = kind.get("choice")
    if choice is not None and not isinstance(choice, list):
        raise ApiError("invalid_field", f"'{field}' must be a list of strings", param=field)
    json_value = kind.get("json")
    if isinstance(json_value, str):  # its JSON text: parsed with the body's bounds (depth, finite numbers)
        try:
            kind["json"] = json_value = parse_json_text(json_value, len(json_value.encode("utf-8", "surrogatepass")))
        except ApiError as e:
            raise ApiError("invalid_field", f"{field}: the JSON schema is not valid JSON ({e.message})",
                           param=field) from None
    if json_value is not None and not isinstance(json_value, dict):
        raise ApiError("invalid_field", f"'{field}' must be a JSON schema (an object, or its JSON text)",
                       param=field)
    try:
        return StructuredOutput(field=field, **kind)
    except ValueError as e:  # its messages start with the field already
        raise ApiError("invalid_field", str(e), param=field) from None


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
