"""The structured-output request fields (server/pipeline/structured.py), without a model: every accepted
shape becomes the StructuredOutput the engine compiles, with the parameter path its errors name;
every malformed one is a 400 `invalid_field` whose `param` is that path; and an engine's
ConstraintError reaches the client as the same 400 with the same `param`."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from radixserve.errors import ConstraintError, RequestError
from radixserve.sampling_fields import SamplingFields
from radixserve.server.pipeline.compile_slots import CLIENT, CompileSlots
from radixserve.server.pipeline.sampling import build_sampling_params
from radixserve.server.pipeline.stream import api_error_from
from radixserve.server.pipeline.structured import compile_off_loop, structured_output, with_structured
from radixserve.server.validation import ApiError
from radixserve.structured import StructuredOutput

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]}
LARK = 'start: "yes" | "no"'


def refused(body: dict[str, Any]) -> ApiError:
    with pytest.raises(ApiError) as e:
        structured_output(body)
    assert e.value.status == 400 and e.value.code == "invalid_field", e.value.message
    return e.value


def test_no_field_and_text_format_ask_for_nothing() -> None:
    assert structured_output({}) is None
    assert structured_output({"response_format": {"type": "text"}}) is None
    assert structured_output({"response_format": None, "guided_json": None, "structured_outputs": None}) is None
    # text does not count as a second constraint
    got = structured_output({"response_format": {"type": "text"}, "guided_regex": "[0-9]+"})
    assert got == StructuredOutput(regex="[0-9]+", field="guided_regex")


@pytest.mark.parametrize("body, expected", [
    ({"response_format": {"type": "json_object"}}, StructuredOutput(json_object=True, field="response_format")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "Person", "schema": SCHEMA, "strict": True}}},
     StructuredOutput(json=SCHEMA, field="response_format.json_schema.schema")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "any_object-1"}}},
     StructuredOutput(json_object=True, field="response_format.json_schema")),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput(json=SCHEMA, field="structured_outputs.json")),
    ({"structured_outputs": {"json": '{"type": "integer"}'}},
     StructuredOutput(json={"type": "integer"}, field="structured_outputs.json")),
    ({"structured_outputs": {"regex": r"\d{3}", "choice": None, "backend": "auto"}},
     StructuredOutput(regex=r"\d{3}", field="structured_outputs.regex")),
    ({"structured_outputs": {"choice": ["yes", "no"], "json_object": False}},
     StructuredOutput(choice=("yes", "no"), field="structured_outputs.choice")),
    ({"structured_outputs": {"grammar": LARK}}, StructuredOutput(grammar=LARK, field="structured_outputs.grammar")),
    ({"structured_outputs": {"json_object": True}},
     StructuredOutput(json_object=True, field="structured_outputs.json_object")),
    ({"guided_json": SCHEMA}, StructuredOutput(json=SCHEMA, field="guided_json")),
    ({"guided_regex": "a|b"}, StructuredOutput(regex="a|b", field="guided_regex")),
    ({"guided_choice": ["red", "green"]}, StructuredOutput(choice=("red", "green"), field="guided_choice")),
    ({"guided_grammar": LARK}, StructuredOutput(grammar=LARK, field="guided_grammar")),
])
def test_each_field_becomes_its_constraint(body: dict[str, Any], expected: StructuredOutput) -> None:
    got = structured_output(body)
    assert got == expected and got is not None and got.field == expected.field and got.key == expected.key


@pytest.mark.parametrize("body, param", [
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {}}, "response_format.type"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "structural_tag"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": []}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "has space", "schema": SCHEMA}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x" * 65, "schema": SCHEMA}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "description": 1}}},
     "response_format.json_schema.description"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": "{}"}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": ["regex"]}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"json": 5}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": "[1, 2]"}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": "[" * 100 + "]" * 100}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": '{"maximum": NaN}'}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"),
    ({"guided_json": [SCHEMA]}, "guided_json"),
    ({"guided_regex": 5}, "guided_regex"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", ""]}, "guided_choice"),
    ({"guided_choice": ["a", 1]}, "guided_choice"),
    ({"guided_grammar": "   "}, "guided_grammar"),
])
def test_malformed_fields_name_their_path(body: dict[str, Any], param: str) -> None:
    err = refused(body)
    assert err.param == param, (err.param, err.message)


def test_several_fields_at_once_are_refused_naming_them() -> None:
    err = refused({"response_format": {"type": "json_object"}, "guided_regex": "a", "guided_choice": ["b"]})
    assert err.param == "response_format, guided_regex, guided_choice"
    assert all(name in err.message for name in ("response_format", "guided_regex", "guided_choice"))
    assert refused({"structured_outputs": {"regex": "a"}, "guided_json": SCHEMA}).param == \
        "structured_outputs, guided_json"


def test_a_turn_carries_its_constraint_into_sampling_params() -> None:
    sampling = SamplingFields(temperature=0.0)
    assert with_structured(sampling, {"content": "hi"}) is sampling
    merged = with_structured(sampling, {"response_format": {"type": "json_object"}})
    params = build_sampling_params(merged, prompt_len=4, max_model_len=64, default_max_tokens=8)
    assert params.structured == StructuredOutput(json_object=True, field="response_format")
    assert build_sampling_params(sampling, prompt_len=4, max_model_len=64, default_max_tokens=8).structured is None


def test_an_engine_constraint_error_is_a_400_naming_the_parameter() -> None:
    err = api_error_from(ConstraintError("response_format.json_schema.schema", "unsupported keyword 'foo'"))
    assert (err.status, err.code, err.param) == (400, "invalid_field", "response_format.json_schema.schema")
    assert err.message.startswith("response_format.json_schema.schema: ")
    other = api_error_from(RequestError("the prompt is empty"))  # other request errors name no parameter
    assert (other.status, other.code, other.param) == (400, "invalid_field", None)


class _Grammars:
    """A grammar cache that records which thread compiled, and refuses regexes; `gate`, when set, holds
    every compile until it is set."""

    def __init__(self) -> None:
        self.compiled: dict[tuple[str, str, str], int] = {}
        self.gate: threading.Event | None = None

    def is_cached(self, constraint: StructuredOutput, namespace: str = "") -> bool:
        return (namespace, *constraint.key) in self.compiled

    def compile(self, constraint: StructuredOutput, for_a_check: bool = False, namespace: str = "") -> object:
        if self.gate is not None:
            assert self.gate.wait(30)
        if constraint.kind == "regex":
            raise ConstraintError(constraint.field, "invalid regex: unclosed group")
        self.compiled[(namespace, *constraint.key)] = threading.get_ident()
        return object()


def _state(grammars: object, per_client: int = 1) -> Any:
    engine = SimpleNamespace(intake=SimpleNamespace(grammars=grammars))
    return SimpleNamespace(require_engine=lambda: engine, compile_slots=CompileSlots(),
                           config=SimpleNamespace(max_compiles_per_client=per_client))


def test_a_constraint_compiles_off_the_event_loop_and_its_error_names_the_parameter() -> None:
    grammars = _Grammars()
    state = _state(grammars)
    choice = StructuredOutput(choice=("a", "b"), field="guided_choice")

    async def run() -> int:
        await compile_off_loop(state, None, "")
        await compile_off_loop(state, choice, "")
        await compile_off_loop(state, choice, "")  # cached: nothing more to do
        await compile_off_loop(state, choice, "tenant-b")  # another namespace's own entry
        with pytest.raises(ApiError) as e:
            await compile_off_loop(state, StructuredOutput(regex="(", field="structured_outputs.regex"), "")
        assert (e.value.status, e.value.code, e.value.param) == (400, "invalid_field", "structured_outputs.regex")
        return threading.get_ident()

    loop_thread = asyncio.run(run())
    assert list(grammars.compiled) == [("", *choice.key), ("tenant-b", *choice.key)]
    assert grammars.compiled[("", *choice.key)] != loop_thread
    asyncio.run(compile_off_loop(_state(None), choice, ""))
    assert state.compile_slots.busy("127.0.0.1") == 0


def test_a_client_holds_at_most_its_compile_slots_and_others_are_not_held_up() -> None:
    grammars = _Grammars()
    grammars.gate = threading.Event()
    state = _state(grammars)

    async def compile_as(client: str, constraint: StructuredOutput) -> None:
        CLIENT.set(client)
        await compile_off_loop(state, constraint, "")

    async def run() -> tuple[ApiError, int]:
        first = asyncio.create_task(compile_as("10.0.0.1", StructuredOutput(choice=("a",))))
        while state.compile_slots.busy("10.0.0.1") == 0:
            await asyncio.sleep(0.01)
        with pytest.raises(ApiError) as refused:  # the same client's second compile, while its first runs
            await compile_as("10.0.0.1", StructuredOutput(choice=("b",)))
        other = asyncio.create_task(compile_as("10.0.0.2", StructuredOutput(choice=("c",))))
        while state.compile_slots.busy("10.0.0.2") == 0:
            await asyncio.sleep(0.01)
        grammars.gate.set()
        await asyncio.gather(first, other)
        return refused.value, state.compile_slots.refused

    refused, count = asyncio.run(run())
    assert (refused.status, refused.code, refused.retry_after) == (429, "rate_limited", 1) and count == 1
    assert state.compile_slots.busy("10.0.0.1") == state.compile_slots.busy("10.0.0.2") == 0
