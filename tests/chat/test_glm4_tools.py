"""The GLM-4.5/4.6 tool-call format (chat/tools/glm4.py): `<tool_call>NAME` and one `<arg_key>` /
`<arg_value>` pair of tags per argument. Replies written the way GLM writes them, parsed whole and
streamed under random splits; value typing (JSON when it parses, else the string); cut and malformed
calls; the choice from a template; calls rendered back into history; and the constraint grammars over a
tokenizer that spells the tags and ones that have them as added or special tokens: forced calls always
parse and validate, and bare string values are exactly the texts that read back as strings."""

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
from radixserve.chat.tools.glm4 import CLOSE, KEY, KEY_END, OPEN, VALUE, VALUE_END, Glm4Format, glm_value, glm_value_text

GLM = FORMATS["glm4"]
MARKERS = (OPEN, CLOSE, KEY, KEY_END, VALUE, VALUE_END)


def call(name: str, **pairs: str) -> str:
    """A call as GLM-4.5 writes it: every value as text, one pair a line."""
    body = "".join(f"{KEY}{k}{KEY_END}\n{VALUE}{v}{VALUE_END}\n" for k, v in pairs.items())
    return f"{OPEN}{name}\n{body}{CLOSE}"


# (reply, content, [(name, arguments)])
RECORDED: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("Let me check.\n" + call("get_weather", city="Beijing", days="3"), "Let me check.",
     [("get_weather", '{"city": "Beijing", "days": 3}')]),
    # every kind of value: JSON when it parses as JSON, else the string as written (NaN is no JSON)
    (call("f", a="true", b="[1, 2]", c='{"k": null}', d='"quoted"', e="3.5", f="NaN", g="a < b\nc </d>") + "\n"
     + call("now"), "", [("f", '{"a": true, "b": [1, 2], "c": {"k": null}, "d": "quoted", "e": 3.5, "f": "NaN", '
                               '"g": "a < b\\nc </d>"}'), ("now", "{}")]),
    # the compact layout (no newlines between tags), and a call without arguments
    (f"{OPEN}get_time{KEY}tz{KEY_END}{VALUE}CET{VALUE_END}{CLOSE}", "", [("get_time", '{"tz": "CET"}')]),
    (f"{OPEN}get_time\n{CLOSE}", "", [("get_time", "{}")]),
    # after thinking (the reasoning parser's business, content here); a missing closing tag is forgiven
    ("<think>The user wants the weather.</think>\n" + call("get_weather", city="Paris"),
     "<think>The user wants the weather.</think>", [("get_weather", '{"city": "Paris"}')]),
    (f"{OPEN}f\n{KEY}a{KEY_END}\n{VALUE}1{VALUE_END}\nDone.", "Done.", [("f", '{"a": 1}')]),
    # malformed: a hermes object or a Python call after the tag is no call: content
    (f'{OPEN}{{"name": "f", "arguments": {{}}}}{CLOSE}', f'{OPEN}{{"name": "f", "arguments": {{}}}}{CLOSE}', []),
    (f"Sure {OPEN}get_weather(city='Paris'){CLOSE}", f"Sure {OPEN}get_weather(city='Paris'){CLOSE}", []),
    ("The capital of France is Paris.", "The capital of France is Paris.", []),
]


@pytest.mark.parametrize("text,content,calls", RECORDED)
def test_replies_parse_and_stream_alike(text: str, content: str, calls: list[tuple[str, str]]) -> None:
    check_reply(GLM, text, content, calls)


def test_a_call_whose_pairs_are_broken_is_content_when_whole() -> None:
    """As every format: its name went out as a call when streamed; read whole, its text is content."""
    text = f"{OPEN}f\n{KEY}a{KEY_END}\nno value{CLOSE}"
    parsed = GLM.parse(text)
    assert parsed.calls == [] and parsed.content == text.removeprefix(OPEN)
    assert joined(streamed(GLM, text, random.Random(0)))[1] == [("f", "")]


@pytest.mark.parametrize(("text", "content", "calls"), [
    (f"{OPEN}get_wea", "", 0),
    (f"Checking. {OPEN[:-3]}", "Checking.", 0),
    (f"{OPEN}f\n{KEY}city{KEY_END}\n{VALUE}Par", "", 0),
    (f"{OPEN}f\n{KEY}a{KEY_END}\n{VALUE}1{VALUE_END}\n", "", 0),  # more pairs may have been coming
    (f"Sure.\n{OPEN}f\n{KEY}a{KEY_END}\n{VALUE}1{VALUE_END}\n{KEY[:4]}", "Sure.", 0),
    (f"{OPEN}f\n{KEY}a{KEY_END}\n{VALUE}1{VALUE_END}\n{CLOSE[:-3]}", "", 1),  # cut in the closing tag: whole
    (call("f", a="1") + f"\n{OPEN}g\n{KEY}b", "", 1),
])
def test_a_cut_call_is_neither_content_nor_a_call(text: str, content: str, calls: int) -> None:
    assert all("<tool" not in got and "<arg" not in got for got in check_cut(GLM, text, content, calls))
    assert all(c.arguments == '{"a": 1}' for c in GLM.parse(text, cut=True).calls)


@pytest.mark.parametrize(("value", "text"), [
    ("Paris", "Paris"), ("x\ny", "x\ny"), ("", ""), ("NaN", "NaN"), ("-3 degrees", "-3 degrees"),  # bare
    ("5", '"5"'), (" 5", '" 5"'), ("true", '"true"'), ("null ", '"null "'), ('"q"', '"\\"q\\""'),  # would read as JSON
    ("a</arg_value>b", '"a<\\/arg_value>b"'),  # would close the tag
    (5, "5"), (2.5, "2.5"), (True, "true"), (None, "null"), ([1, "a"], '[1, "a"]'), ({"k": [False]}, '{"k": [false]}'),
])
def test_values_round_trip_through_their_text(value: Any, text: str) -> None:
    assert glm_value_text(value) == text and glm_value(text) == value


def test_calls_round_trip_through_history_and_the_prompt_teaches_them() -> None:
    calls = [ToolCall("get_weather", '{"city": "Paris", "days": 3}'), ToolCall("note", '{"text": "42", "tags": ["a"]}')]
    rendered = GLM.render_calls(calls)
    assert rendered.startswith(OPEN + "get_weather\n") and f"{VALUE}Paris{VALUE_END}" in rendered
    assert f'{VALUE}"42"{VALUE_END}' in rendered  # a string that reads as JSON goes quoted
    assert [(c.name, json.loads(c.arguments)) for c in GLM.parse(rendered).calls] == [
        (c.name, json.loads(c.arguments)) for c in calls]
    prompt = GLM.system_prompt([WEATHER])
    assert '"name": "get_weather"' in prompt and KEY in prompt and VALUE in prompt


def test_chosen_from_the_template_or_the_flag() -> None:
    glm45 = ("[gMASK]<sop>{%- if tools -%}<|system|>\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
             "{%- endif -%}{%- for m in messages -%}<|{{ m.role }}|>\n{{ m.content }}"
             "{%- for tc in m.tool_calls or [] -%}\n<tool_call>{{ tc.function.name }}\n"
             "{%- for k, v in tc.function.arguments.items() -%}<arg_key>{{ k }}</arg_key>\n<arg_value>{{ v }}"
             "</arg_value>\n{%- endfor -%}</tool_call>{%- endfor -%}{%- endfor -%}")
    fmt = tool_format(glm45)
    assert isinstance(fmt, Glm4Format) and fmt.name == "glm4" and fmt.needs_special_tokens
    assert tool_format(None, override="glm4") is GLM
    assert tool_format("{% if tools %}<tool_call>{% endif %}").name == "hermes"  # no pairs: Qwen's


# ---- constraint grammars -------------------------------------------------------------------------------

FLAGS = ToolSpec("set_flags", "Flags and ids", {
    "type": "object", "required": ["on", "unit"], "$defs": {"unit": {"enum": ["c", "f", 0]}},
    "properties": {"on": {"type": "boolean"}, "ids": {"type": "array", "maxItems": 2,
                                                     "items": {"type": "integer", "minimum": 0, "maximum": 9}},
                   "mode": {"const": "fast"}, "unit": {"$ref": "#/$defs/unit"}}}, strict=True)
NOW = ToolSpec("get_time", "The time", strict=True)  # no arguments
NOTE = ToolSpec("note", "Write a note", {
    "type": "object", "required": ["text"], "properties": {"text": {"type": "string"}, "pages": {"type": "integer"}}},
    strict=True)
# the tags spelled in pieces, as added tokens (GLM's tokenizers), as special tokens
KINDS = [("tiny", True), ("markers", False), ("markers", True)]


def bound(kind: str, special: bool) -> tuple[Glm4Format, tuple[Any, Any]]:
    return kit_bound(GLM, kind, MARKERS, special)


@pytest.mark.parametrize("kind,special", KINDS)
def test_forced_calls_always_parse_and_validate(kind: str, special: bool) -> None:
    fmt, tokens = bound(kind, special)
    check_forced_calls(fmt, tokens, [FLAGS, NOW], random.Random(f"{kind}:{special}"))


@pytest.mark.parametrize("kind,special", KINDS)
def test_auto_with_a_strict_tool_constrains_the_call_once_opened(kind: str, special: bool) -> None:
    fmt, tokens = bound(kind, special)
    check_auto_constrains_the_call_once_opened(fmt, tokens, OPEN)


@pytest.mark.parametrize("kind,special", KINDS)
def test_string_values_are_bare_unless_they_would_read_as_json(kind: str, special: bool) -> None:
    """A string property's value is any text that reads back as that string: bare when it does not parse as
    JSON, JSON-quoted otherwise; other keys, a missing required key and a bare value that would read as
    another type are refused."""
    fmt, tokens = bound(kind, special)
    c = fmt.constraint([NOTE], ToolChoice("required"), False)
    assert c is not None and c.grammar
    good = ["Buy milk", "two\nlines < and > too", '"5"', '"true"', '" padded"', "x", "trueish"]
    for value in good:
        text = call("note", text=value)
        assert accepts(tokens, c.grammar, text), value
        (parsed,) = fmt.parse(text).calls
        jsonschema.validate(json.loads(parsed.arguments), NOTE.parameters)
    assert accepts(tokens, c.grammar, f"{OPEN}note\n{KEY}text{KEY_END}\n{VALUE}{VALUE_END}\n{CLOSE}")  # ""
    assert accepts(tokens, c.grammar, call("note", text="a", pages="3"))
    for value in ["5", "true", "null", "[1]", " x", "-2", '{"a": 1}']:
        assert not accepts(tokens, c.grammar, call("note", text=value)), value
    assert not accepts(tokens, c.grammar, call("note", pages="3"))
    assert not accepts(tokens, c.grammar, call("note", text="a", other="b"))
    assert not accepts(tokens, c.grammar, call("note", text="a", pages="x"))
