"""The Gemma 4 tool-call format (chat/tools/gemma4.py): `<|tool_call>call:NAME{key:value,...}<tool_call|>`
with strings between `<|"|>` marks. Replies written the way Gemma 4 writes them, parsed whole and
streamed under random splits; every kind of value, nested; cut and malformed calls; values round-tripping
through their text; the choice from a template; calls rendered back into history; and the constraint
grammars over a tokenizer that spells the marks and ones that have them as added or special tokens:
forced calls always parse and validate against their tool's parameters."""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import pytest
from test_tool_formats import WEATHER, joined, streamed
from tool_grammar_kit import accepts, check_auto_constrains_the_call_once_opened, check_cut, check_forced_calls, check_reply
from tool_grammar_kit import bound as kit_bound

from radixserve.chat.tools import FORMATS, ToolCall, ToolChoice, ToolSpec, tool_format
from radixserve.chat.tools.gemma4 import CLOSE, OPEN, QUOTE, Gemma4Format, gemma_value, gemma_value_text

GEMMA = FORMATS["gemma4"]
MARKERS = (OPEN, CLOSE, QUOTE)
Q = QUOTE


def call(name: str, body: str) -> str:
    return f"{OPEN}call:{name}{{{body}}}{CLOSE}"


# (reply, content, [(name, arguments)])
RECORDED: list[tuple[str, str, list[tuple[str, str]]]] = [
    (f"Let me check.{call('get_weather', f'city:{Q}Paris{Q},days:3')}", "Let me check.",
     [("get_weather", '{"city": "Paris", "days": 3}')]),
    # every kind of value, nested; braces, brackets, commas and colons inside strings are text
    (call("f", f"a:true,b:[1,{Q}x{Q}],c:{{k:null,n:{{m:-2.5e3}}}},d:{Q}a, b: {{c}} [d]{Q},e:None,f:nil,g:false,"
               f"h:[],i:{{}},j:bare words") + call("now", ""),
     "", [("f", '{"a": true, "b": [1, "x"], "c": {"k": null, "n": {"m": -2500.0}}, "d": "a, b: {c} [d]", '
                '"e": null, "f": null, "g": false, "h": [], "i": {}, "j": "bare words"}'), ("now", "{}")]),
    # whitespace between the parts, a key between marks, a trailing comma, text after the calls
    (f"{OPEN} call:get_time {{ tz : {Q}CET{Q} , {Q}odd key{Q}: 1, }}{CLOSE}\nDone.", "Done.",
     [("get_time", '{"tz": "CET", "odd key": 1}')]),
    # names with dots and dashes; a string that holds newlines; an empty string
    (call("tools.shell-exec", f"cmd:{Q}ls -l\necho hi{Q},note:{Q}{Q}"), "",
     [("tools.shell-exec", '{"cmd": "ls -l\\necho hi", "note": ""}')]),
    # a missing closing tag is forgiven: the "}" ended the call
    (f"{OPEN}call:f{{a:1}} and more", "and more", [("f", '{"a": 1}')]),
    # a model slipping into JSON is read
    (f'{OPEN}call:f{{"a": "x", "b": 1}}{CLOSE}', "", [("f", '{"a": "x", "b": 1}')]),
    # not calls: no call:, no arguments, a call without its marks
    (f"{OPEN}f{{a:1}}{CLOSE}", f"{OPEN}f{{a:1}}{CLOSE}", []),
    (f"{OPEN}call:f{CLOSE}", f"{OPEN}call:f{CLOSE}", []),
    ("call:f{a:1}", "call:f{a:1}", []),
    ("The capital of France is Paris.", "The capital of France is Paris.", []),
]


@pytest.mark.parametrize("text,content,calls", RECORDED)
def test_replies_parse_and_stream_alike(text: str, content: str, calls: list[tuple[str, str]]) -> None:
    check_reply(GEMMA, text, content, calls)


def test_a_call_whose_arguments_are_broken_is_content_when_whole() -> None:
    text = f"{OPEN}call:f{{a 1}}{CLOSE}"
    parsed = GEMMA.parse(text)
    assert parsed.calls == [] and parsed.content == text.removeprefix(OPEN)
    assert joined(streamed(GEMMA, text, random.Random(0)))[1] == [("f", "")]
    deep = "[" * 40 + "]" * 40  # deeper than the parser nests: no call, and no recursion error
    assert GEMMA.parse(call("f", f"a:{deep}")).calls == []


@pytest.mark.parametrize(("text", "content", "calls"), [
    (f"{OPEN}call:get_wea", "", 0),
    (f"Checking. {OPEN[:-3]}", "Checking.", 0),
    (f"{OPEN}call:f{{city:{Q}Par", "", 0),
    (f"{OPEN}call:f{{a:1", "", 0),  # 1 may have been 12
    (f"{OPEN}call:f{{a:1,b:{Q[:2]}", "", 0),
    (f"Sure.\n{OPEN}call:f{{a:1,", "Sure.", 0),
    (f"{OPEN}call:f{{a:1}}{CLOSE[:-3]}", "", 1),  # cut in the closing tag: whole
    (f"{OPEN}call:f{{a:1}}", "", 1),
    (call("f", "a:1") + f"{OPEN}call:g{{b:", "", 1),
])
def test_a_cut_call_is_neither_content_nor_a_call(text: str, content: str, calls: int) -> None:
    assert all("<|" not in got and "|>" not in got for got in check_cut(GEMMA, text, content, calls))
    assert all(c.arguments == '{"a": 1}' for c in GEMMA.parse(text, cut=True).calls)


@pytest.mark.parametrize("value", [
    "Paris", "", "x\ny", "5", "true", "null", "a, b: {c}", "<tool_call|>", 5, -2.5, 1e21, True, False, None,
    [], {}, [1, "a", [None]], {"k": [False, {"deep": "v"}], "odd key": 1, "x:y": 2, "": 3},
])
def test_values_round_trip_through_their_text(value: Any) -> None:
    assert gemma_value(gemma_value_text(value)) == value


def test_calls_round_trip_through_history_and_the_prompt_teaches_them() -> None:
    calls = [ToolCall("get_weather", '{"city": "Paris", "days": 3}'),
             ToolCall("note", '{"text": "42", "tags": ["a"], "meta": {"pinned": true}}')]
    rendered = GEMMA.render_calls(calls)
    assert rendered.startswith(f"{OPEN}call:get_weather{{city:{Q}Paris{Q},days:3}}{CLOSE}{OPEN}call:note{{")
    assert [(c.name, json.loads(c.arguments)) for c in GEMMA.parse(rendered).calls] == [
        (c.name, json.loads(c.arguments)) for c in calls]
    prompt = GEMMA.system_prompt([WEATHER])
    assert '"name": "get_weather"' in prompt and OPEN in prompt and QUOTE in prompt


def test_chosen_from_the_template_or_the_flag() -> None:
    template = ("{%- for m in messages -%}<|turn>{{ m.role }}\n{{ m.content }}"
                "{%- for c in m.tool_calls or [] -%}<|tool_call>call:{{ c.function.name }}{}<tool_call|>{%- endfor -%}"
                "<turn|>\n{%- endfor -%}")
    fmt = tool_format(template)
    assert isinstance(fmt, Gemma4Format) and fmt.name == "gemma4" and fmt.needs_special_tokens
    assert tool_format(None, override="gemma4") is GEMMA


# ---- constraint grammars -------------------------------------------------------------------------------

SHAPES = ToolSpec("set_shapes", "Every kind of argument", {
    "type": "object", "required": ["on", "unit", "where"],
    "$defs": {"unit": {"enum": ["c", "f", 0, None]}, "point": {
        "type": "object", "required": ["x"], "properties": {"x": {"type": "number", "minimum": 0}, "y": {"type": "integer"}}}},
    "properties": {
        "on": {"type": "boolean"},
        "ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}},
        "mode": {"const": "fast"},
        "unit": {"$ref": "#/$defs/unit"},
        "where": {"$ref": "#/$defs/point"},
        "path": {"type": ["string", "null"], "minLength": 2, "maxLength": 5},
        "either": {"anyOf": [{"type": "boolean"}, {"type": "array", "items": {"type": "string"}}]},
        "anything": {},
        "points": {"type": "array", "items": {"$ref": "#/$defs/point"}},
    }}, strict=True)
NOW = ToolSpec("get_time", "The time", strict=True)  # no arguments
NOTE = ToolSpec("note", "Write a note", {
    "type": "object", "required": ["text"], "properties": {"text": {"type": "string"}, "pages": {"type": "integer"}}},
    strict=True)
KINDS = [("tiny", True), ("markers", False), ("markers", True)]


def bound(kind: str, special: bool) -> tuple[Gemma4Format, tuple[Any, Any]]:
    return kit_bound(GEMMA, kind, MARKERS, special)


@pytest.mark.parametrize("kind,special", KINDS)
def test_forced_calls_always_parse_and_validate(kind: str, special: bool) -> None:
    fmt, tokens = bound(kind, special)
    check_forced_calls(fmt, tokens, [SHAPES, NOW], random.Random(f"{kind}:{special}"), prefer=(QUOTE,), named_repeats=3)


@pytest.mark.parametrize("kind,special", KINDS)
def test_auto_with_a_strict_tool_constrains_the_call_once_opened(kind: str, special: bool) -> None:
    fmt, tokens = bound(kind, special)
    check_auto_constrains_the_call_once_opened(fmt, tokens, OPEN, prefer=(QUOTE,))


@pytest.mark.parametrize("kind,special", KINDS)
def test_the_grammar_takes_what_gemma_writes_and_refuses_what_does_not_validate(kind: str, special: bool) -> None:
    fmt, tokens = bound(kind, special)
    note = fmt.constraint([NOTE], ToolChoice("required"), False)
    shapes = fmt.constraint([SHAPES], ToolChoice("required"), False)
    assert note is not None and note.grammar and shapes is not None and shapes.grammar
    for text in ["Buy milk", "two\nlines, with {braces} and: colons", "", "5", "true"]:
        reply = call("note", f"text:{Q}{text}{Q}")
        assert accepts(tokens, note.grammar, reply), text
        (parsed,) = fmt.parse(reply).calls
        assert json.loads(parsed.arguments) == {"text": text}
    assert accepts(tokens, note.grammar, call("note", f"text:{Q}a{Q},pages:3"))
    for body in ["text:5", f"pages:3,text:{Q}a{Q}", f"text:{Q}a{Q},other:1", f"text:{Q}a{Q},pages:{Q}3{Q}", "pages:3",
                 'text:"a"']:
        assert not accepts(tokens, note.grammar, call("note", body)), body
    good = (f"on:true,ids:[1,9],mode:{Q}fast{Q},unit:null,where:{{x:0.5,y:-3}},path:{Q}/tmp{Q},either:[{Q}a{Q}],"
            f"anything:{{k:[1,{Q}v{Q}]}},points:[{{x:1}},{{x:2,y:2}}]")
    assert accepts(tokens, shapes.grammar, call("set_shapes", good))
    (parsed,) = fmt.parse(call("set_shapes", good)).calls
    jsonschema.validate(json.loads(parsed.arguments), SHAPES.parameters)
    assert accepts(tokens, shapes.grammar, call("set_shapes", "on:false,unit:0,where:{x:1}"))
    for path, ok in ((f"{Q}ab{Q}", True), (f"{Q}abcde{Q}", True), (f"{Q}a{Q}", False), (f"{Q}abcdef{Q}", False),
                     ("null", True), (f"{Q}a{Q}b{Q}", False)):
        assert accepts(tokens, shapes.grammar, call("set_shapes", f"on:true,unit:0,where:{{x:1}},path:{path}")) == ok, path
    for bad in [f"on:true,unit:{Q}k{Q},where:{{x:1}}", "on:true,unit:0,where:{x:-1}", "on:true,unit:0,where:{y:1}",
                "on:true,ids:[10],unit:0,where:{x:1}", "on:true,mode:1,unit:0,where:{x:1}",
                "on:true,unit:0,where:{x:1},either:3", "on:1,unit:0,where:{x:1}"]:
        assert not accepts(tokens, shapes.grammar, call("set_shapes", bad)), bad
