"""The Granite 3.x and Phi-4-mini tool-call formats (chat/tools/granite.py): `<|tool_call|>` and a JSON
list of calls, Phi-4-mini's closed by `<|/tool_call|>`. Replies written the way the models write them,
parsed whole and streamed under random splits; cut and malformed calls; the choice from a template;
calls rendered back into history; and the constraint grammars, compiled by llguidance over a tokenizer
that spells the markers and one that has them as special tokens, driven with random allowed tokens:
what they let through parses and validates."""

from __future__ import annotations

import random

import pytest
from test_tool_formats import ADD, TOOLS, WEATHER, check_calls
from tool_grammar_kit import TOKENIZERS, check_cut, check_reply, drive, tokenizer

from radixserve.chat.tools import FORMATS, ToolCall, ToolCallFormat, ToolChoice, tool_format
from radixserve.chat.tools.granite import PHI_CLOSE, TOOL_CALL, GraniteFormat

GRANITE, PHI = FORMATS["granite"], FORMATS["phi4_mini"]

# (format, reply, content, [(name, arguments)])
RECORDED: list[tuple[ToolCallFormat, str, str, list[tuple[str, str]]]] = [
    # Granite 3.x: the marker and the list, nothing before
    (GRANITE, '<|tool_call|>[{"name": "get_current_weather", "arguments": {"city": "Boston"}}]', "",
     [("get_current_weather", '{"city": "Boston"}')]),
    # text, then two calls in one list; braces and brackets inside strings
    (GRANITE, 'I will look both up.<|tool_call|>[{"name": "search", "arguments": {"q": "a [b] {c}"}}, '
              '{"name": "add", "arguments": {"a": 1, "b": 2}}]', "I will look both up.",
     [("search", '{"q": "a [b] {c}"}'), ("add", '{"a": 1, "b": 2}')]),
    (GRANITE, "The capital of France is Paris.", "The capital of France is Paris.", []),
    # keys in the other order; a list the reply never closed keeps its calls
    (GRANITE, '<|tool_call|>[{"arguments": {"x": 1}, "name": "f"}', "", [("f", '{"x": 1}')]),
    # decoded without special tokens: the marker is gone, the leading list still is the calls
    (GRANITE, '[{"name": "add", "arguments": {"a": 1, "b": 2}}]', "", [("add", '{"a": 1, "b": 2}')]),
    # malformed: no list of calls after the marker, a JSON answer that is no call
    (GRANITE, "<|tool_call|> sorry, no JSON", "<|tool_call|> sorry, no JSON", []),
    (GRANITE, "[1, 2, 3] are numbers.", "[1, 2, 3] are numbers.", []),
    (GRANITE, '<|tool_call|>[{"city": "Paris"}]', '<|tool_call|>[{"city": "Paris"}]', []),
    # Phi-4-mini: the list closed by its marker, text after it is content
    (PHI, '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]<|/tool_call|>', "",
     [("get_weather", '{"city": "Paris"}')]),
    (PHI, 'Checking.<|tool_call|>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"n": [1]}}]'
          '<|/tool_call|>\nDone.', "Checking.\nDone.", [("a", "{}"), ("b", '{"n": [1]}')]),
    # the closing marker left out (forgiven: what follows is content), and two lists
    (PHI, '<|tool_call|>[{"name": "a", "arguments": {}}] then text', "then text", [("a", "{}")]),
    (PHI, '<|tool_call|>[{"name": "a", "arguments": {}}]<|/tool_call|><|tool_call|>[{"name": "b", "arguments": {}}]'
          '<|/tool_call|>', "", [("a", "{}"), ("b", "{}")]),
    (PHI, "<|tool_call|>get_weather(city='Paris')<|/tool_call|>", "<|tool_call|>get_weather(city='Paris')<|/tool_call|>",
     []),
]


@pytest.mark.parametrize("fmt,text,content,calls", RECORDED)
def test_replies_parse_and_stream_alike(fmt: ToolCallFormat, text: str, content: str,
                                        calls: list[tuple[str, str]]) -> None:
    check_reply(fmt, text, content, calls)


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), [
    (GRANITE, '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Pa', "", 0),
    (GRANITE, "Checking. <|tool_c", "Checking.", 0),
    (GRANITE, '<|tool_call|>[{"name": "a", "arguments": {}}, {"name": "get_w', "", 1),
    (GRANITE, '[{"name": "get_w', "", 0),
    (PHI, '<|tool_call|>[{"name": "a", "arguments": {}}]<|/tool_ca', "", 1),  # cut in the closing marker
    (PHI, 'Sure. <|tool_call|>[{"name": "a", "arguments": {"x": "', "Sure.", 0),
])
def test_a_cut_call_is_neither_content_nor_a_call(fmt: ToolCallFormat, text: str, content: str, calls: int) -> None:
    assert all("<|" not in got for got in check_cut(fmt, text, content, calls))


def test_chosen_from_the_template_or_the_flag() -> None:
    granite = ("{%- if tools %}<|start_of_role|>available_tools<|end_of_role|>{{ tools | tojson }}<|end_of_text|>"
               "{%- endif %}{%- for m in messages %}<|start_of_role|>{{ m.role }}<|end_of_role|>"
               "{%- if m.tool_calls %}<|tool_call|>{{ m.tool_calls | tojson }}{%- else %}{{ m.content }}{%- endif %}"
               "<|end_of_text|>\n{%- endfor %}")
    fmt = tool_format(granite)
    assert fmt.name == "granite" and isinstance(fmt, GraniteFormat) and fmt.needs_special_tokens and not fmt.closing
    # Phi-4-mini's template lists the tools in <|tool|> ... <|/tool|>; its replies close their calls
    phi = ("{% for m in messages %}{% if m.role == 'system' and m.tools %}<|system|>{{ m.content }}<|tool|>"
           "{{ m.tools }}<|/tool|><|end|>{% else %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endif %}{% endfor %}")
    assert tool_format(phi).name == "phi4_mini" and tool_format(phi).needs_special_tokens
    assert tool_format("{{ '<|tool_call|>' }}{{ calls }}{{ '<|/tool_call|>' }}").name == "phi4_mini"
    assert tool_format(None, override="granite") is GRANITE and tool_format(None, override="phi4_mini") is PHI
    assert tool_format(granite, override="hermes").name == "hermes"


def test_calls_round_trip_through_history_and_the_prompt_teaches_them() -> None:
    calls = [ToolCall("get_weather", '{"city": "Paris"}'), ToolCall("add", '{"a": 1, "b": 2}')]
    for fmt, end in ((GRANITE, "]"), (PHI, "]" + PHI_CLOSE)):
        rendered = fmt.render_calls(calls)
        assert rendered.startswith(TOOL_CALL + "[") and rendered.endswith(end)
        assert [(c.name, c.arguments) for c in fmt.parse(rendered).calls] == [(c.name, c.arguments) for c in calls]
        prompt = fmt.system_prompt([WEATHER])
        assert '"name": "get_weather"' in prompt and fmt.call_syntax() in prompt and TOOL_CALL in fmt.call_syntax()
        assert (PHI_CLOSE in prompt) == (fmt is PHI)


# ---- constraint grammars -------------------------------------------------------------------------------

def bound(base: ToolCallFormat, kind: str) -> tuple[ToolCallFormat, tuple[object, object]]:
    tokens = tokenizer(kind, (TOOL_CALL, PHI_CLOSE))
    return base.for_tokenizer(tokens[0]), tokens


@pytest.mark.parametrize("kind", TOKENIZERS)
@pytest.mark.parametrize("base", [GRANITE, PHI], ids=["granite", "phi4_mini"])
def test_forced_calls_always_parse_and_validate(kind: str, base: ToolCallFormat) -> None:
    fmt, tokens = bound(base, kind)
    if kind == "markers":  # the markers are special tokens: the grammars name them as tokens
        assert set(fmt.special_ids) == set(base.markers)
    rng = random.Random(f"{kind}:{base.name}")
    for parallel in (False, True):
        c = fmt.constraint(TOOLS, ToolChoice("required"), parallel)
        assert c is not None and c.grammar and c.field == "tools"
        assert (TOOL_CALL in c.grammar) == (kind == "tiny")
        for _ in range(2):
            check_calls(fmt, drive(tokens, c.grammar, rng), TOOLS, 1, 99 if parallel else 1)
    named = fmt.constraint(TOOLS, ToolChoice("named", "add"), True)
    assert named is not None and named.field == "tool_choice" and named.grammar
    text = drive(tokens, named.grammar, rng)
    check_calls(fmt, text, [ADD], 1, 1)
    assert text.endswith("]" + (PHI_CLOSE if base is PHI else ""))


@pytest.mark.parametrize("kind", TOKENIZERS)
@pytest.mark.parametrize("base", [GRANITE, PHI], ids=["granite", "phi4_mini"])
def test_auto_with_a_strict_tool_constrains_the_call_once_opened(kind: str, base: ToolCallFormat) -> None:
    fmt, tokens = bound(base, kind)
    c = fmt.constraint(TOOLS, ToolChoice("auto"), False)
    assert c is not None and c.grammar
    rng = random.Random(7)
    for _ in range(2):
        text = drive(tokens, c.grammar, rng, forced="Let me check." + TOOL_CALL)
        check_calls(fmt, text, TOOLS, 1, 1)
        assert fmt.parse(text).content == "Let me check."
    assert fmt.constraint([ADD], ToolChoice("auto"), False) is None  # nothing strict: free text
