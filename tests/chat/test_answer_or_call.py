"""A structured final answer beside tools (chat/tool_calls.py `ChatTools.constraint`, chat/tools/base.py
`answer_or_calls`): which constraint each tool choice gets with a JSON schema / json_object answer (and the
refusal of the other kinds), the same for the offline API's `constrain`; and, for every tool-call format
in the registry, the combined grammar compiled by llguidance over a tokenizer that spells the markers and
one that has them as special tokens: it admits one call (several with parallel calls) and a schema
answer, refuses free text, text before a call, a wrong answer; and what it lets through, driven with
random allowed tokens, reads back as a valid answer (content) or valid calls, whole and streamed."""

from __future__ import annotations

import dataclasses
import json
import random
import zlib
from typing import Any

import jsonschema
import pytest
from tool_grammar_kit import TOKENIZERS, check_reply, drive, tokenizer

from radixserve.chat.reasoning import REASONING_FORMATS
from radixserve.chat.tool_calls import ChatTools, ConstraintConflict
from radixserve.chat.tools import FORMATS, ToolCall, ToolCallFormat, ToolChoice, ToolSpec
from radixserve.chat.tools.harmony import CALL, HarmonyFormat, harmony_call_text
from radixserve.chat.tools.mistral import MistralFormat
from radixserve.sampling_params import SamplingParams
from radixserve.structured import StructuredOutput

# bounded values, so random walks end within a small budget
WEATHER = ToolSpec("get_weather", "Weather of a city", {
    "type": "object", "required": ["city"],
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}},
    strict=False)
ADD = ToolSpec("add", "Add two digits", {
    "type": "object", "required": ["a", "b"],
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                   "b": {"type": "integer", "minimum": 0, "maximum": 9}}}, strict=True)
TOOLS = [WEATHER, ADD]
VERDICT = {"type": "object", "required": ["verdict", "score"],
           "properties": {"verdict": {"enum": ["yes", "no"]}, "score": {"type": "integer", "minimum": 0, "maximum": 9}}}
ANSWER = StructuredOutput(json=VERDICT, field="response_format.json_schema.schema")
GOOD = '{"verdict": "yes", "score": 3}'
WRONG = ['{"verdict": "maybe", "score": 3}', '{"verdict": "yes"}', '{"verdict": "yes", "score": 3, "extra": 1}',
         '{"verdict": "yes", "score": "3"}']

ALL_FORMATS = [*FORMATS.values(), MistralFormat(args_syntax=True)]
LABELS = [f.name + ("_args" if isinstance(f, MistralFormat) and f.args_syntax else "") for f in ALL_FORMATS]


def call_text(fmt: ToolCallFormat, calls: list[tuple[str, str]]) -> str:
    """Calls as the grammar writes them: the format's own rendering, harmony's without the <|call|> a
    grammar may not name (an end-of-sequence token) and without the <|start|> header the prompt gives."""
    if isinstance(fmt, HarmonyFormat):
        return "<|start|>assistant".join(harmony_call_text(n, a)[:-len(CALL)] for n, a in calls)
    return fmt.render_calls([ToolCall(n, a, f"call_{i}") for i, (n, a) in enumerate(calls)])


def read(fmt: ToolCallFormat, text: str) -> tuple[str, list[tuple[str, str]]]:
    """A reply read as the server reads it (gpt-oss's through its reasoning parser first), checked to
    stream as it parses; (content, calls)."""
    if isinstance(fmt, HarmonyFormat):
        reasoning, text = REASONING_FORMATS["gpt_oss"].split(text, constrained=True)
        assert reasoning == ""
    parsed = fmt.parse(text)
    got = (parsed.content, [(c.name, c.arguments) for c in parsed.calls])
    check_reply(fmt, text, *got)
    return got


# one tokenizer with every format's markers as special tokens (built once, not once per format)
ALL_MARKERS = tuple(sorted({m for f in ALL_FORMATS for m in f.markers}))


def bound(fmt: ToolCallFormat, kind: str) -> tuple[ToolCallFormat, tuple[Any, Any]]:
    tokens = tokenizer(kind, ALL_MARKERS)
    bound_fmt = fmt.for_tokenizer(tokens[0])
    assert kind == "tiny" or set(bound_fmt.special_ids) == set(fmt.markers)
    return bound_fmt, tokens


_COMPILED: dict[tuple[int, str], Any] = {}


def accepts(tokens: tuple[Any, Any], grammar: str, text: str) -> bool:
    """Whether `grammar` admits exactly `text` (as the tokenizer splits it) as a whole reply: the kit's
    check, with each grammar compiled once and copied per text."""
    import llguidance

    tok, lltok = tokens
    key = (id(lltok), grammar)
    if key not in _COMPILED:
        _COMPILED.clear()  # one grammar at a time is all a test reuses
        _COMPILED[key] = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    matcher = _COMPILED[key].deep_copy()
    assert not matcher.is_error(), matcher.get_error()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return bool(matcher.consume_tokens(ids)) and matcher.is_accepting()


# ---- which constraint: one rule for every API and the offline one

def chat_tools(choice: Any, parallel: bool = True, fmt: ToolCallFormat = FORMATS["hermes"]) -> ChatTools:
    return ChatTools.of(TOOLS, choice, parallel, fmt)


@pytest.mark.parametrize("answer", [ANSWER, StructuredOutput(json_object=True, field="text.format")])
def test_auto_beside_an_answer_is_answer_or_calls(answer: StructuredOutput) -> None:
    for choice in (None, "auto"):  # strict and non-strict tools alike (ADD is strict, WEATHER not)
        c = chat_tools(choice).constraint(answer)
        assert c is not None and c.grammar is not None and c.field == f"{answer.field}, tools"
        assert c.grammar.startswith("start: calls | answer\n")
        assert c.grammar == FORMATS["hermes"].answer_or_calls(TOOLS, True, answer)


def test_a_forced_call_wins_over_the_answer_and_none_leaves_the_answer() -> None:
    hermes = FORMATS["hermes"]
    assert chat_tools("required").constraint(ANSWER) == hermes.constraint(TOOLS, ToolChoice("required"), True)
    named = {"type": "function", "function": {"name": "add"}}
    assert chat_tools(named).constraint(ANSWER) == hermes.constraint(TOOLS, ToolChoice("named", "add"), True)
    assert chat_tools("none").constraint(ANSWER) is ANSWER
    assert ChatTools.of([], None, True, hermes).constraint(ANSWER) is ANSWER  # no tools: plain chat
    assert chat_tools("auto").constraint(None) == hermes.constraint(TOOLS, ToolChoice("auto"), True)  # strict ADD


@pytest.mark.parametrize("other", [StructuredOutput(regex="[a-z]+", field="structured_outputs.regex"),
                                   StructuredOutput(choice=("a", "b"), field="guided_choice"),
                                   StructuredOutput(grammar='start: "x"', field="guided_grammar")])
def test_a_regex_choice_or_grammar_joins_no_active_tool_choice(other: StructuredOutput) -> None:
    named = {"type": "function", "function": {"name": "add"}}
    for choice in ("auto", "required", named):
        with pytest.raises(ConstraintConflict) as e:
            chat_tools(choice).constraint(other)
        assert e.value.field == other.field and other.kind in str(e.value)
    assert chat_tools("none").constraint(other) is other


def test_offline_constrain_joins_the_same_way() -> None:
    params = SamplingParams(structured=ANSWER, max_tokens=5)
    joined = chat_tools("auto").constrain(params)
    assert joined.structured == chat_tools("auto").constraint(ANSWER) and joined.max_tokens == 5
    assert chat_tools("required").constrain(params).structured == chat_tools("required").constraint(None)
    assert chat_tools("none").constrain(params) is params
    with pytest.raises(ValueError, match="regex"):
        chat_tools("auto").constrain(SamplingParams(structured=StructuredOutput(regex="a+")))


def test_a_false_schema_admits_no_answer() -> None:
    with pytest.raises(ConstraintConflict, match="admits no answer"):
        chat_tools("auto").constraint(StructuredOutput(json=False, field="response_format.json_schema.schema"))


# ---- the grammar, for every format

@pytest.mark.parametrize("kind", TOKENIZERS)
@pytest.mark.parametrize("base", ALL_FORMATS, ids=LABELS)
def test_the_grammar_admits_a_call_or_the_answer_and_nothing_else(kind: str, base: ToolCallFormat) -> None:
    fmt, tokens = bound(base, kind)
    one = fmt.answer_or_calls(TOOLS, False, ANSWER)
    several = fmt.answer_or_calls(TOOLS, True, ANSWER)
    weather = ("get_weather", '{"city": "Paris", "days": 2}')
    add = ("add", '{"a": 1, "b": 2}')
    for grammar in (one, several):
        for call in (weather, add):
            assert accepts(tokens, grammar, call_text(fmt, [call])), call
        assert accepts(tokens, grammar, GOOD)
        for text in ["The weather is fine.", "", *WRONG, "Sure. " + call_text(fmt, [add]),
                     call_text(fmt, [("get_weather", '{"city": "Rome"}')]), call_text(fmt, [("nope", "{}")])]:
            assert not accepts(tokens, grammar, text), text
    two = call_text(fmt, [add, weather])
    assert accepts(tokens, several, two) and not accepts(tokens, one, two)
    # read back as the server reads replies: calls are calls, the answer is content
    assert read(fmt, call_text(fmt, [add])) == ("", [add])
    assert read(fmt, two) == ("", [add, weather])
    assert read(fmt, GOOD) == (GOOD, [])


@pytest.mark.parametrize("kind", TOKENIZERS)
@pytest.mark.parametrize("base", ALL_FORMATS, ids=LABELS)
def test_what_the_grammar_lets_through_is_a_valid_answer_or_valid_calls(kind: str, base: ToolCallFormat) -> None:
    fmt, tokens = bound(base, kind)
    rng = random.Random(zlib.crc32(f"{kind}:{fmt.name}".encode()))
    schemas = {t.name: t.parameters for t in TOOLS}
    seen = set()
    shape = fmt.shape()
    # each branch once on purpose (its first characters forced), then wherever the walk goes
    for parallel, forced in ((False, '{"verdict'), (True, shape.open + shape.prefix("add")), (True, "")):
        grammar = fmt.answer_or_calls(TOOLS, parallel, ANSWER)
        content, calls = read(fmt, drive(tokens, grammar, rng, forced=forced, budget=400))
        if calls:
            assert content == "" and 1 <= len(calls) <= (99 if parallel else 1), calls
            for name, arguments in calls:
                jsonschema.validate(json.loads(arguments), schemas[name])
            seen.add("calls")
        else:
            jsonschema.validate(json.loads(content), VERDICT)
            seen.add("answer")
    assert seen == {"calls", "answer"}


@pytest.mark.parametrize("base", ALL_FORMATS, ids=LABELS)
def test_a_json_object_answer_is_any_object_that_reads_as_no_call(base: ToolCallFormat) -> None:
    fmt, tokens = bound(base, "markers")
    grammar = fmt.answer_or_calls(TOOLS, True, StructuredOutput(json_object=True, field="response_format"))
    for text in ('{"anything": [1, {"deep": null}]}', "{}", '{"name": "Ada"}'):
        assert accepts(tokens, grammar, text) and read(fmt, text) == (text, [])
    assert not accepts(tokens, grammar, "[1, 2]") and not accepts(tokens, grammar, "plain text")
    assert accepts(tokens, grammar, call_text(fmt, [("add", '{"a": 1, "b": 2}')]))
    # llama3_json's calls are objects: an answer object may not look like one (chat/tools/llama3.py)
    call_like = '{"name": "nope", "parameters": {"a": 1}}'
    assert accepts(tokens, grammar, call_like) == (fmt.name != "llama3_json")


def test_the_answer_layout_and_closed_objects_are_the_json_constraints() -> None:
    """Open objects (--open-json-objects) open the answer's objects too; the layout has no free whitespace."""
    fmt, tokens = bound(FORMATS["hermes"], "tiny")
    grammar = fmt.answer_or_calls(TOOLS, True, ANSWER)
    assert not accepts(tokens, grammar, '{"verdict":"yes","score":3}')
    opened = dataclasses.replace(fmt, open_objects=True).answer_or_calls(TOOLS, True, ANSWER)
    assert accepts(tokens, opened, '{"verdict": "yes", "score": 3, "extra": 1}')


@pytest.mark.parametrize("base", ALL_FORMATS, ids=LABELS)
def test_an_answer_of_any_json_type_stays_apart_from_calls(base: ToolCallFormat) -> None:
    """An array answer shares its first character with pythonic's and the JSON-list formats' calls."""
    fmt, tokens = bound(base, "markers")
    grammar = fmt.answer_or_calls(TOOLS, True, StructuredOutput(json={"type": "array", "items": {"type": "integer"}},
                                                                field="response_format.json_schema.schema"))
    for text in ("[1, 2]", "[]"):
        assert accepts(tokens, grammar, text) and read(fmt, text) == (text, [])
    assert accepts(tokens, grammar, call_text(fmt, [("add", '{"a": 1, "b": 2}')]))
    assert not accepts(tokens, grammar, '["a"]') and not accepts(tokens, grammar, "[1, 2] and more")


def test_llama3_reads_a_call_shaped_schema_answer_as_a_call() -> None:
    """The ambiguity chat/tools/llama3.py documents: a schema declaring "name" and "parameters" admits an
    answer that is a call's text; it is read as the call."""
    fmt, tokens = bound(FORMATS["llama3_json"], "markers")
    shaped = {"type": "object", "required": ["name", "parameters"],
              "properties": {"name": {"type": "string"}, "parameters": {"type": "object"}}}
    grammar = fmt.answer_or_calls(TOOLS, True, StructuredOutput(json=shaped, field="response_format"))
    text = '{"name": "someone", "parameters": {}}'
    assert accepts(tokens, grammar, text)
    assert read(fmt, text) == ("", [("someone", "{}")])


# ---- the offline API, end to end on the tiny chat model (hermes calls)

def test_llm_chat_and_sessions_answer_or_call() -> None:
    """`LLM.chat(..., tools=...)` with `params.structured`: under auto the reply is the answer (content,
    finish_reason stop) or calls (tool_calls), whichever the first token opens (chosen by logit_bias);
    under required a call; a session's turn the same. Its compile workers are stopped at the end."""
    from tiny_models import tiny_chat_model_dir
    from tool_fixtures import SCHEMAS
    from tool_fixtures import TOOLS as OPENAI_TOOLS

    from radixserve import LLM
    from radixserve.chat.tool_calls import ToolCallOutput

    llm = LLM(model=str(tiny_chat_model_dir("llama")), num_blocks=128)
    try:
        ask = [{"role": "user", "content": "Weather in Paris? Answer as JSON."}]

        def params(opening: str) -> SamplingParams:
            first = llm.tokenizer(opening, add_special_tokens=False)["input_ids"][0]
            return SamplingParams(structured=ANSWER, max_tokens=120, temperature=1.0, seed=3, logit_bias={first: 100.0})

        def sample(out: Any) -> ToolCallOutput:
            got = out.outputs[0]
            assert isinstance(got, ToolCallOutput)
            return got

        answered = sample(llm.chat(ask, params("{"), tools=OPENAI_TOOLS)[0])
        assert answered.finish_reason == "stop" and answered.tool_calls == []
        jsonschema.validate(json.loads(answered.content or ""), VERDICT)
        for choice in ("auto", "required"):
            called = sample(llm.chat(ask, params("<tool_call>" if choice == "auto" else "{"), tools=OPENAI_TOOLS,
                                     tool_choice=choice)[0])
            assert called.finish_reason == "tool_calls" and called.tool_calls and not called.content
            for call in called.tool_calls:
                jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        session = llm.session("You can call tools.", params("{"), tools=OPENAI_TOOLS)
        turn = sample(session.send("Weather in Oslo? Answer as JSON."))
        assert turn.finish_reason == "stop" and turn.tool_calls == []
        jsonschema.validate(json.loads(turn.content or ""), VERDICT)
        with pytest.raises(ValueError, match="regex"):
            llm.chat(ask, SamplingParams(structured=StructuredOutput(regex="[a-z]+")), tools=OPENAI_TOOLS)
    finally:
        llm.engine.grammars.close()  # its compile worker processes
