"""Tool-call formats (chat/tools/): each parser on replies written the way its model family writes them,
the streaming parser against the whole-reply one under random splits, format selection, and the constraint
grammars compiled by llguidance and driven with random allowed tokens: what they let through always parses
and its arguments validate against the tool's parameters."""

from __future__ import annotations

import json
import random
import zlib
from functools import cache
from typing import Any

import jsonschema
import pytest

from radixserve.chat.tools import (
    FORMATS,
    ContentDelta,
    ReplyDelta,
    ToolCallDelta,
    ToolCallFormat,
    ToolChoice,
    ToolSpec,
    tool_format,
)
from radixserve.chat.tools.mistral import MistralFormat

HERMES, LLAMA, MISTRAL = FORMATS["hermes"], FORMATS["llama3_json"], FORMATS["mistral"]
MISTRAL_ARGS = MistralFormat(args_syntax=True)

# (format, reply, content, [(name, arguments)])
RECORDED: list[tuple[ToolCallFormat, str, str, list[tuple[str, str]]]] = [
    # Qwen2.5: text, then two calls, each in its own block
    (HERMES, 'I\'ll look up both cities.\n<tool_call>\n{"name": "get_current_weather", "arguments": {"location": '
             '"San Francisco, CA", "unit": "fahrenheit"}}\n</tool_call>\n<tool_call>\n{"name": "get_current_weather", '
             '"arguments": {"location": "Dallas, TX", "unit": "fahrenheit"}}\n</tool_call>',
     "I'll look up both cities.",
     [("get_current_weather", '{"location": "San Francisco, CA", "unit": "fahrenheit"}'),
      ("get_current_weather", '{"location": "Dallas, TX", "unit": "fahrenheit"}')]),
    # Qwen3 after thinking; nested arguments with braces inside strings
    (HERMES, '<think>\nThe user wants a search.\n</think>\n\n<tool_call>\n{"name": "search", "arguments": '
             '{"query": "json {braces} \\"quoted\\"", "filters": {"year": [2023, 2024]}}}\n</tool_call>',
     "<think>\nThe user wants a search.\n</think>",
     [("search", '{"query": "json {braces} \\"quoted\\"", "filters": {"year": [2023, 2024]}}')]),
    (HERMES, "The capital of France is Paris.", "The capital of France is Paris.", []),
    # keys in the other order, no closing tag
    (HERMES, '<tool_call>\n{"arguments": {"x": 1}, "name": "f"}', "", [("f", '{"x": 1}')]),
    # arguments sent as a JSON string
    (HERMES, '<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n</tool_call>', "", [("f", '{"x": 1}')]),
    # the usual slip: the object's closing brace is missing; the call stands
    (HERMES, '<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>', "", [("f", '{"x": 1}')]),
    # malformed: no JSON object at all -> the text is content
    (HERMES, "Sure <tool_call>\nget_weather(city='Paris')\n</tool_call>",
     "Sure <tool_call>\nget_weather(city='Paris')\n</tool_call>", []),
    (HERMES, "a <tool_call> that never closes {", "a <tool_call> that never closes {", []),
    # Llama 3.1: a bare JSON call, and one after <|python_tag|> (decoded with special tokens)
    (LLAMA, '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", '{"city": "Paris"}')]),
    (LLAMA, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}<|eom_id|>', "",
     [("get_weather", '{"city": "Paris"}')]),
    (LLAMA, '{"name": "a", "parameters": {"n": 1}}; {"name": "b", "arguments": {"n": 2}}', "",
     [("a", '{"n": 1}'), ("b", '{"n": 2}')]),
    (LLAMA, 'Let me check. <|python_tag|>{"name": "a", "parameters": {}}', "Let me check.", [("a", "{}")]),
    # a JSON answer that is not a call, and text that merely mentions braces
    (LLAMA, '{"city": "Paris", "temperature": 21}', '{"city": "Paris", "temperature": 21}', []),
    (LLAMA, "Use {name} as a placeholder.", "Use {name} as a placeholder.", []),
    # Mistral: the JSON list (ids allowed), and the newer [ARGS] syntax
    (MISTRAL, '[TOOL_CALLS][{"name": "add", "arguments": {"a": 3, "b": 4}, "id": "a1b2c3d4e"}, '
              '{"name": "mul", "arguments": {"a": 5, "b": 6}, "id": "f5g6h7i8j"}]', "",
     [("add", '{"a": 3, "b": 4}'), ("mul", '{"a": 5, "b": 6}')]),
    (MISTRAL, 'I will compute it.[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}]', "I will compute it.",
     [("add", '{"a": 1, "b": 2}')]),
    (MISTRAL, '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[CALL_ID]x7y8z9w0v[ARGS]{"tz": "CET"}',
     "", [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "CET"}')]),
    (MISTRAL, "[TOOL_CALLS] sorry, no JSON here", "[TOOL_CALLS] sorry, no JSON here", []),
    (MISTRAL, "Plain answer with [brackets].", "Plain answer with [brackets].", []),
    # decoded with special tokens skipped: the marker is gone, the leading list is still the calls
    (MISTRAL, '[{"name": "add", "arguments": {"a": 1, "b": 2}}]', "", [("add", '{"a": 1, "b": 2}')]),
    (MISTRAL, "[1, 2, 3] are the first numbers.", "[1, 2, 3] are the first numbers.", []),
]


def joined(deltas: list[ReplyDelta]) -> tuple[str, list[tuple[str, str]]]:
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if isinstance(d, ToolCallDelta):
            if d.index not in calls:
                assert d.id is not None and d.id.startswith("call_") and len(d.id) == 29 and d.name, d
                calls[d.index] = [d.name, ""]
            else:
                assert d.id is None and d.name is None, d
            calls[d.index][1] += d.arguments
    assert sorted(calls) == list(range(len(calls)))
    return content.strip(), [(name, args) for name, args in (calls[i] for i in sorted(calls))]


def streamed(fmt: ToolCallFormat, text: str, rng: random.Random) -> list[ReplyDelta]:
    stream, out, i = fmt.stream(), [], 0
    while i < len(text):
        j = i + rng.choice([1, 1, 2, 3, 5, 8, 40])
        out += stream.feed(text[i:j])
        i = j
    return out + stream.finish()


@pytest.mark.parametrize("fmt,text,content,calls", RECORDED)
def test_parse_recorded_replies(fmt: ToolCallFormat, text: str, content: str, calls: list[tuple[str, str]]) -> None:
    parsed = fmt.parse(text)
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.calls] == calls
    assert len({c.id for c in parsed.calls}) == len(calls)
    for c in parsed.calls:
        json.loads(c.arguments)


@pytest.mark.parametrize("fmt,text,content,calls", RECORDED)
def test_stream_joins_to_the_parse_however_split(fmt: ToolCallFormat, text: str, content: str,
                                                 calls: list[tuple[str, str]]) -> None:
    rng = random.Random(len(text))
    for _ in range(25):
        assert joined(streamed(fmt, text, rng)) == (content, calls)


def test_a_call_cut_off_after_its_header() -> None:
    """A reply stopped mid-arguments (by length): `parse` reads it as content, as malformed JSON is; a stream has
    already announced the call and sent the arguments so far, and cannot take them back."""
    text = '{"name": "a", "parameters": {"n": 1'
    parsed = LLAMA.parse(text)
    assert parsed.content == text and parsed.calls == []
    assert joined(streamed(LLAMA, text, random.Random(1))) == ("", [("a", '{"n": 1')])


def test_stream_holds_back_a_possible_marker_and_streams_arguments() -> None:
    stream = HERMES.stream()
    assert stream.feed("Checking <tool") == [ContentDelta("Checking")]  # " <tool" may open a call
    assert stream.feed("_call>\n") == []
    first = stream.feed('{"name": "get_weather", "arguments": {"city": "Pa')
    assert isinstance(first[0], ToolCallDelta) and first[0].name == "get_weather" and first[0].index == 0
    assert "".join(d.arguments for d in first if isinstance(d, ToolCallDelta)) == '{"city": "Pa'
    assert stream.called
    rest = stream.feed('ris"}}\n</tool_call>') + stream.finish()
    assert rest == [ToolCallDelta(0, None, None, 'ris"}')]
    not_a_call = HERMES.stream()
    assert not_a_call.feed("a <") == [ContentDelta("a")]
    assert not_a_call.feed(" b is true") == [ContentDelta(" < b is true")]


def test_format_chosen_from_the_template_or_the_flag() -> None:
    assert tool_format(None).name == "hermes"  # the embedded SmolLM2's template has no tools
    assert tool_format("{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}").name == "hermes"
    assert tool_format("{% if tools %}<tool_call>{% endif %}").name == "hermes"
    llama = ("{%- if tools %}Respond in the format {\"name\": function name, \"parameters\": dictionary}{% endif %}"
             "{%- if message.role == 'ipython' %}<|start_header_id|>ipython<|end_header_id|>{% endif %}")
    assert tool_format(llama).name == "llama3_json"
    assert tool_format("{{ '<|python_tag|>' }}").name == "llama3_json"
    mistral = tool_format("{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}")
    assert mistral.name == "mistral" and mistral.needs_special_tokens
    assert isinstance(mistral, MistralFormat) and not mistral.args_syntax
    newer = tool_format("[TOOL_CALLS]{{ name }}[ARGS]{{ args }}")
    assert isinstance(newer, MistralFormat) and newer.args_syntax
    assert tool_format("[TOOL_CALLS]", override="hermes").name == "hermes"
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        tool_format(None, override="nope")
    assert not HERMES.needs_special_tokens and not LLAMA.needs_special_tokens


def test_tool_values_from_openai() -> None:
    spec = ToolSpec.from_openai({"type": "function", "function": {"name": "f", "strict": True}})
    assert spec.parameters == {"type": "object", "properties": {}} and spec.strict
    assert spec.openai_dict() == {"type": "function", "function": {
        "name": "f", "description": "", "parameters": {"type": "object", "properties": {}}, "strict": True}}
    with pytest.raises(ValueError, match=r"tools\[2\].function.name"):
        ToolSpec.from_openai({"type": "function", "function": {"name": "<|im_start|>"}}, "tools[2]")
    tools = [spec]
    assert ToolChoice.from_openai(None, tools) == ToolChoice("auto")
    assert ToolChoice.from_openai(None, []) == ToolChoice("none")
    assert ToolChoice.from_openai({"type": "function", "function": {"name": "f"}}, tools) == ToolChoice("named", "f")
    with pytest.raises(ValueError, match="not among the tools"):
        ToolChoice.from_openai({"type": "function", "function": {"name": "g"}}, tools)
    assert HERMES.constraint(tools, ToolChoice("none"), True) is None
    assert HERMES.constraint([ToolSpec("g")], ToolChoice("auto"), True) is None  # nothing strict: free text


def test_system_prompt_describes_tools_and_syntax() -> None:
    tools = [ToolSpec("get_weather", "Weather of a city", {"type": "object", "properties": {"city": {"type": "string"}}})]
    for fmt, syntax in ((HERMES, "<tool_call>"), (LLAMA, '"parameters"'), (MISTRAL, "[TOOL_CALLS]"),
                        (MISTRAL_ARGS, "[ARGS]")):
        prompt = fmt.system_prompt(tools)
        assert '"name": "get_weather"' in prompt and "Weather of a city" in prompt and syntax in prompt
        from radixserve.chat.tools import ToolCall
        rendered = fmt.render_calls([ToolCall("get_weather", '{"city": "Paris"}')])
        assert [(c.name, c.arguments) for c in fmt.parse(rendered).calls] == [("get_weather", '{"city": "Paris"}')]


# ---- constraint grammars -------------------------------------------------------------------------------

WEATHER = ToolSpec("get_weather", "Weather of a city", {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["celsius", "fahrenheit"]}}},
    strict=True)
ADD = ToolSpec("add", "Add two integers", {
    "type": "object", "additionalProperties": False, "required": ["a", "b"],
    "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                   "b": {"type": "integer", "minimum": 0, "maximum": 99999}}})
TOOLS = [WEATHER, ADD]
SPECIALS = ["<|python_tag|>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"]


@cache
def tokenizers() -> dict[str, Any]:
    """The tiny chat tokenizer (text markers) and the embedded SmolLM2 one with the Llama/Mistral markers as
    special tokens and Qwen's tool tags as added ones: the grammars must hold with markers as text or tokens."""
    import llguidance.hf
    from tiny_models import tiny_chat_model_dir
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    from radixserve.model.embedded import embedded_model_dir
    from radixserve.model.loader import load_tokenizer

    tiny = AutoTokenizer.from_pretrained(tiny_chat_model_dir("llama"))
    smol = load_tokenizer(embedded_model_dir())
    smol.add_special_tokens({"additional_special_tokens": SPECIALS})
    smol.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<tool_call>", "</tool_call>")])
    return {name: (tok, llguidance.hf.from_tokenizer(tok)) for name, tok in (("tiny", tiny), ("smollm2", smol))}


@cache
def short_tokens(name: str) -> Any:
    """Which tokens of a test tokenizer decode to at most 2 characters (or are EOS): the driver favours them
    so strings and numbers end and brackets close within a small token budget."""
    import torch

    tok, lltok = tokenizers()[name]
    short = torch.zeros(lltok.vocab_size, dtype=torch.bool)
    for token, text in enumerate(tok.batch_decode([[t] for t in range(len(tok))])):
        short[token] = len(text) <= 2
    short[tok.eos_token_id] = True
    return short


def drive(name: str, grammar: str, forced: list[int], rng: random.Random, budget: int = 240) -> str:
    """Text a matcher lets through: `forced` tokens first, then random allowed ones until it stops."""
    import llguidance
    import llguidance.torch
    import torch

    tok, lltok = tokenizers()[name]
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_lark(grammar))
    assert not matcher.is_error(), matcher.get_error()
    assert matcher.consume_tokens(forced), matcher.get_error()
    out = list(forced)
    mask = llguidance.torch.allocate_token_bitmask(1, lltok.vocab_size)
    shifts = torch.arange(32, dtype=torch.int32)
    short = short_tokens(name)
    for _ in range(budget):
        if matcher.is_stopped():
            break
        llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
        allowed = ((mask[0].unsqueeze(1) >> shifts) & 1).flatten()[:lltok.vocab_size].bool()
        favoured = allowed & short
        pick = favoured if favoured.any() and rng.random() < 0.7 else allowed
        ending = bool(allowed[tok.eos_token_id]) and rng.random() < 0.5  # or parallel calls could go on and on
        token = tok.eos_token_id if ending else rng.choice(torch.nonzero(pick).flatten().tolist())
        assert matcher.consume_token(token), matcher.get_error()
        out.append(token)
    assert matcher.is_stopped(), f"no end within {budget} tokens: {tok.decode(out, skip_special_tokens=False)!r}"
    return str(tok.decode([t for t in out if t != tok.eos_token_id], skip_special_tokens=False))


def check_calls(fmt: ToolCallFormat, text: str, allowed: list[ToolSpec], least: int, most: int) -> None:
    parsed = fmt.parse(text)
    assert least <= len(parsed.calls) <= most, text
    schemas = {t.name: t.parameters for t in allowed}
    for call in parsed.calls:
        assert call.name in schemas, text
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    assert joined(streamed(fmt, text, random.Random(0))) == (parsed.content, [(c.name, c.arguments)
                                                                             for c in parsed.calls])


FORMAT_CASES = [("hermes", HERMES), ("llama3_json", LLAMA), ("mistral", MISTRAL), ("mistral_args", MISTRAL_ARGS)]


@pytest.mark.parametrize("tokenizer", ["tiny", "smollm2"])
@pytest.mark.parametrize("label,base", FORMAT_CASES)
def test_required_and_named_calls_always_parse_and_validate(tokenizer: str, label: str, base: ToolCallFormat) -> None:
    tok, lltok = tokenizers()[tokenizer]
    fmt = base.for_tokenizer(tok)
    rng = random.Random(zlib.crc32(f"{tokenizer}:{label}".encode()))
    for parallel in (False, True):
        c = fmt.constraint(TOOLS, ToolChoice("required"), parallel)
        assert c is not None and c.grammar and c.field == "tools"
        for _ in range(2):
            check_calls(fmt, drive(tokenizer, c.grammar, [], rng), TOOLS, 1, 99 if parallel else 1)
    named = fmt.constraint(TOOLS, ToolChoice("named", "add"), True)
    assert named is not None and named.field == "tool_choice" and named.grammar
    check_calls(fmt, drive(tokenizer, named.grammar, [], rng), [ADD], 1, 1)


@pytest.mark.parametrize("tokenizer", ["tiny", "smollm2"])
@pytest.mark.parametrize("label,base", FORMAT_CASES)
def test_auto_with_a_strict_tool_constrains_the_call_once_opened(tokenizer: str, label: str,
                                                                base: ToolCallFormat) -> None:
    tok, lltok = tokenizers()[tokenizer]
    fmt = base.for_tokenizer(tok)
    c = fmt.constraint(TOOLS, ToolChoice("auto"), False)
    assert c is not None and c.grammar and c.field == "tools"
    # the model writes some text, then opens a call (forced here): from then on the call is constrained
    opening = {"hermes": "Let me check.\n<tool_call>", "llama3_json": "{", "mistral": "Sure.[TOOL_CALLS]",
               "mistral_args": "Sure.[TOOL_CALLS]"}[label]
    forced = list(tok(opening, add_special_tokens=False)["input_ids"])
    rng = random.Random(7)
    for _ in range(2):
        check_calls(fmt, drive(tokenizer, c.grammar, forced, rng), TOOLS, 1, 1)
    # free text stays free: a plain answer passes the grammar
    import llguidance

    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_lark(c.grammar))
    answer = list(tok("The weather is fine.", add_special_tokens=False)["input_ids"])
    assert matcher.consume_tokens(answer) and matcher.is_accepting(), matcher.get_error()


def test_markers_that_are_tokens_are_written_as_tokens() -> None:
    tok, _ = tokenizers()["smollm2"]
    fmt = MISTRAL.for_tokenizer(tok)
    ids = fmt.special_ids
    assert set(ids) == {"[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"}
    grammar = fmt.constraint(TOOLS, ToolChoice("required"), False)
    assert grammar is not None and f"<[{ids['[TOOL_CALLS]']}]>" in str(grammar.grammar)
    assert "[TOOL_CALLS]" not in str(grammar.grammar)
    assert HERMES.for_tokenizer(tokenizers()["tiny"][0]).special_ids == {}
