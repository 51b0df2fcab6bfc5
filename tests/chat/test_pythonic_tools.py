"""The pythonic tool-call format (chat/tools/pythonic.py; Llama 3.2, Llama 4): a Python list of calls
with literal keyword arguments. Replies written the way those models write them, parsed whole and
streamed under random splits; Python literals as JSON; cut and malformed calls; only the flag chooses
it; calls rendered back into history; and the constraint grammars, compiled by llguidance and driven with
random allowed tokens: forced calls parse and validate, booleans are written as Python's."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from test_tool_formats import ADD, TOOLS, WEATHER, check_calls, joined, streamed
from tool_grammar_kit import TOKENIZERS, accepts, check_cut, check_reply, drive, tokenizer

from radixserve.chat.tools import FORMATS, ToolCall, ToolChoice, ToolSpec, tool_format
from radixserve.chat.tools.pythonic import PYTHON_END, PYTHON_START, PYTHON_TAG, python_literal, python_value

PY = FORMATS["pythonic"]

# (reply, content, [(name, arguments)])
RECORDED: list[tuple[str, str, list[tuple[str, str]]]] = [
    # Llama 3.2: the whole reply is the list
    ('[get_weather(city="San Francisco", unit="celsius")]', "",
     [("get_weather", '{"city": "San Francisco", "unit": "celsius"}')]),
    # Python literals of every kind; brackets, quotes and commas inside strings
    ("[search(q='a(b)c, d] \"e\"', n=-3, exact=True, lang=None), tag(ids=[1, (2, 3)], meta={'k': 'v', 'x': 1.5})]", "",
     [("search", '{"q": "a(b)c, d] \\"e\\"", "n": -3, "exact": true, "lang": null}'),
      ("tag", '{"ids": [1, [2, 3]], "meta": {"k": "v", "x": 1.5}}')]),
    ("[get_time()]", "", [("get_time", "{}")]),
    # Llama 4's markers; Llama 3.x's tag after some text; text after the list
    (f"{PYTHON_START}[f(x=1)]{PYTHON_END}", "", [("f", '{"x": 1}')]),
    (f"Let me look. {PYTHON_TAG}[f(x='y')]", "Let me look.", [("f", '{"x": "y"}')]),
    ("[f(x=1)]\nDone.", "Done.", [("f", '{"x": 1}')]),
    # JSON's spellings, a trailing comma, free whitespace
    ("[f(a=true, b={'k': null}, c=\"\\u00e9\\/\",)]", "", [("f", '{"a": true, "b": {"k": null}, "c": "\u00e9/"}')]),
    ("[ f( a = 1 , b = 'x' ) , g() ]", "", [("f", '{"a": 1, "b": "x"}'), ("g", "{}")]),
    # lists that are not calls, and plain answers
    ("[1, 2, 3] are the first numbers.", "[1, 2, 3] are the first numbers.", []),
    ("[Note] the weather is fine.", "[Note] the weather is fine.", []),
    ("[]", "[]", []),
    ("The capital of France is Paris.", "The capital of France is Paris.", []),
]


@pytest.mark.parametrize("text,content,calls", RECORDED)
def test_replies_parse_and_stream_alike(text: str, content: str, calls: list[tuple[str, str]]) -> None:
    check_reply(PY, text, content, calls)


@pytest.mark.parametrize("text", ["[f(x=set())]", "[f(x=undefined)]", "[f(1, 2)]", "[f(x=1 y=2)]"])
def test_a_call_with_invalid_arguments_is_content_when_whole(text: str) -> None:
    """As every format: its name went out as a call when streamed; read whole, its text is content."""
    parsed = PY.parse(text)
    assert parsed.calls == [] and parsed.content == text.removeprefix("[")
    assert [name for name, _ in joined(streamed(PY, text, random.Random(0)))[1]] == ["f"]


@pytest.mark.parametrize(("text", "content", "calls"), [
    ("[get_wea", "", 0),
    ('[f(x="Pa', "", 0),
    ("[f(x=1), g(y=", "", 1),
    (f"Sure. {PYTHON_TAG[:-3]}", "Sure.", 0),
    (f"Sure. {PYTHON_TAG}[f(x=[1, ", "Sure.", 0),
])
def test_a_cut_call_is_neither_content_nor_a_call(text: str, content: str, calls: int) -> None:
    assert all("(" not in got and "[" not in got for got in check_cut(PY, text, content, calls))


@pytest.mark.parametrize("value", [1, -2.5, "it's \"quoted\"\n", True, False, None, [1, [None]], {"k": {"t": True}}, {}])
def test_values_round_trip_as_python_literals(value: Any) -> None:
    assert python_value(python_literal(value)) == value


def test_only_the_flag_chooses_it_and_calls_round_trip() -> None:
    # a template that asks for Python calls still gets the default: templates do not announce it reliably
    assert tool_format("{% if tools %}Respond with [func_name1(params_name1=params_value1)]{% endif %}").name == "hermes"
    assert tool_format(None, override="pythonic") is PY
    calls = [ToolCall("get_weather", '{"city": "Paris", "flags": [true, null]}'), ToolCall("get_time", "{}")]
    rendered = PY.render_calls(calls)
    assert rendered == '[get_weather(city="Paris", flags=[True, None]), get_time()]'
    assert [(c.name, json.loads(c.arguments)) for c in PY.parse(rendered).calls] == [
        (c.name, json.loads(c.arguments)) for c in calls]
    prompt = PY.system_prompt([WEATHER])
    assert '"name": "get_weather"' in prompt and PY.call_syntax() in prompt


# ---- constraint grammars -------------------------------------------------------------------------------

FLAGS = ToolSpec("set_flags", "Flags and ids", {
    "type": "object", "required": ["on"],
    "properties": {"verbose": {"type": "boolean"}, "on": {"type": "boolean"}, "nothing": {"type": "null"},
                   "ids": {"type": "array", "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}},
    strict=True)
NOW = ToolSpec("get_time", "The time", strict=True)  # no arguments


@pytest.mark.parametrize("kind", TOKENIZERS)
def test_forced_calls_always_parse_and_validate(kind: str) -> None:
    tokens = tokenizer(kind, (PYTHON_START, PYTHON_END, PYTHON_TAG))
    fmt = PY.for_tokenizer(tokens[0])
    tools = [*TOOLS, FLAGS, NOW]
    rng = random.Random(kind)
    for parallel in (False, True):
        c = fmt.constraint(tools, ToolChoice("required"), parallel)
        assert c is not None and c.grammar and c.field == "tools"
        for _ in range(3):
            check_calls(fmt, drive(tokens, c.grammar, rng, budget=500), tools, 1, 99 if parallel else 1)
    for tool in (ADD, FLAGS, NOW):
        named = fmt.constraint(tools, ToolChoice("named", tool.name), True)
        assert named is not None and named.field == "tool_choice" and named.grammar
        for _ in range(3):
            text = drive(tokens, named.grammar, rng)
            check_calls(fmt, text, [tool], 1, 99)
            assert "true" not in text and "false" not in text and "null" not in text  # Python's spellings


@pytest.mark.parametrize("kind", TOKENIZERS)
def test_auto_with_a_strict_tool_is_prose_or_calls(kind: str) -> None:
    tokens = tokenizer(kind, (PYTHON_START, PYTHON_END, PYTHON_TAG))
    fmt = PY.for_tokenizer(tokens[0])
    c = fmt.constraint([WEATHER, ADD], ToolChoice("auto"), False)
    assert c is not None and c.grammar
    rng = random.Random(5)
    for _ in range(2):
        check_calls(fmt, drive(tokens, c.grammar, rng, forced="["), [WEATHER, ADD], 1, 1)
    assert accepts(tokens, c.grammar, "The weather is fine.")
    assert accepts(tokens, c.grammar, '[add(a=1, b=2)]')
    assert not accepts(tokens, c.grammar, "[Note] the weather is fine.")  # would be read as calls
    assert not accepts(tokens, c.grammar, '[add(a=1)]')  # b is required
