"""The harmony tool-call format (chat/tools/harmony.py, gpt-oss): calls read from the form the gpt_oss
reasoning parser hands over and from raw replies, the stream against the whole reply under random splits,
its registration and choice from a template, and its forced-call grammar compiled by llguidance over a
tokenizer with harmony's markers as special tokens and driven with random allowed tokens: what it lets
through always parses and validates."""

from __future__ import annotations

import json
import random
from functools import cache
from typing import Any

import jsonschema
import pytest

from radixserve.chat.reasoning import REASONING_FORMATS
from radixserve.chat.tools import FORMATS, ContentDelta, ToolCallDelta, ToolChoice, ToolSpec, tool_format
from radixserve.chat.tools.harmony import HarmonyFormat, harmony_call_text

HARMONY = FORMATS["harmony"]
WEATHER = ToolSpec("get_weather", "Weather of a city", {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"type": "string", "maxLength": 8}}}, strict=True)
ADD = ToolSpec("add", "Add two integers", {
    "type": "object", "additionalProperties": False, "required": ["a", "b"],
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer", "minimum": 0,
                                                                                "maximum": 99}}})

# (reply, content, [(name, arguments)])
REPLIES: list[tuple[str, str, list[tuple[str, str]]]] = [
    # what the gpt_oss reasoning parser hands over: one call in the canonical form
    (harmony_call_text("get_weather", '{"city": "Paris"}'), "", [("get_weather", '{"city": "Paris"}')]),
    # ... without <|call|> (an end-of-sequence token decoding drops), after a preamble the user sees
    ("Checking." + harmony_call_text("add", '{"a": 1, "b": 2}')[:-len("<|call|>")], "Checking.",
     [("add", '{"a": 1, "b": 2}')]),
    # raw (no reasoning parser): the recipient in a <|start|> header before the channel
    ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>', "",
     [("get_weather", '{"city": "Oslo"}')]),
    # two calls
    (harmony_call_text("add", '{"a": 1, "b": 2}') + "<|start|>assistant" + harmony_call_text("add", '{"a": 3, "b": 4}'),
     "", [("add", '{"a": 1, "b": 2}'), ("add", '{"a": 3, "b": 4}')]),
    # a message to nobody is content, markers and all
    ("<|channel|>final<|message|>Hi", "<|channel|>final<|message|>Hi", []),
    ("No calls here.", "No calls here.", []),
]


def test_a_call_whose_arguments_are_not_json_is_content_when_whole() -> None:
    """As every format: its header went out as a call when streamed; read whole, its text is content."""
    parsed = HARMONY.parse("<|channel|>commentary to=functions.f <|constrain|>json<|message|>oops")
    assert parsed.calls == [] and parsed.content == "commentary to=functions.f <|constrain|>json<|message|>oops"


def streamed(text: str, rng: random.Random) -> tuple[str, list[tuple[str, str]]]:
    s = HARMONY.stream()
    out: list[Any] = []
    i = 0
    while i < len(text):
        k = rng.randint(1, 7)
        out += s.feed(text[i:i + k])
        i += k
    out += s.finish()
    content = "".join(d.text for d in out if isinstance(d, ContentDelta))
    calls: dict[int, list[str]] = {}
    for d in out:
        if isinstance(d, ToolCallDelta):
            calls.setdefault(d.index, [d.name or "", ""])[1] += d.arguments
    return content, [(n, a) for n, a in (calls[i] for i in sorted(calls))]


@pytest.mark.parametrize(("text", "content", "calls"), REPLIES)
def test_replies_parse_and_stream_alike(text: str, content: str, calls: list[tuple[str, str]]) -> None:
    parsed = HARMONY.parse(text)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [(n, json.loads(a)) for n, a in calls]
    rng = random.Random(len(text))
    for _ in range(30):
        got_content, got_calls = streamed(text, rng)
        assert got_content.strip() == content
        assert [(n, json.loads(a)) for n, a in got_calls] == [(n, json.loads(a)) for n, a in calls]


def test_reasoning_parser_then_format_on_a_gpt_oss_reply() -> None:
    reply = ("<|channel|>analysis<|message|>They want Paris weather.<|end|><|start|>assistant to=functions.get_weather"
             '<|channel|>commentary <|constrain|>json<|message|>{"city": "Paris"}')
    reasoning, answer = REASONING_FORMATS["gpt_oss"].split(reply)
    assert reasoning == "They want Paris weather."
    parsed = HARMONY.parse(answer)
    assert parsed.content == "" and [(c.name, c.arguments) for c in parsed.calls] == [("get_weather",
                                                                                      '{"city": "Paris"}')]


def test_a_call_cut_by_max_tokens_is_dropped() -> None:
    cut = harmony_call_text("get_weather", '{"city": "Pa')[:-len("<|call|>")]
    assert HARMONY.parse(cut, cut=True) == HARMONY.parse("", cut=True)
    assert HARMONY.parse("<|channel|>commentary to=functions.get_weather <|constrain|>json<|mess", cut=True).content == ""


def test_registered_and_chosen_from_the_template() -> None:
    from tiny_models import reasoning_chat_template

    assert isinstance(HARMONY, HarmonyFormat) and HARMONY.needs_special_tokens
    assert tool_format(reasoning_chat_template("harmony")).name == "harmony"
    assert tool_format(reasoning_chat_template("qwen3")).name == "hermes"
    assert tool_format(None, override="harmony").name == "harmony"
    rendered = HARMONY.render_calls(HARMONY.parse(REPLIES[0][0]).calls)
    assert [(c.name, c.arguments) for c in HARMONY.parse(rendered).calls] == [("get_weather", '{"city": "Paris"}')]


def test_auto_is_never_constrained() -> None:
    """A reply that may think first writes markers a free-text grammar could not admit."""
    assert HARMONY.constraint([WEATHER], ToolChoice("auto"), True) is None
    assert HARMONY.constraint([WEATHER], ToolChoice("none"), True) is None


@cache
def harmony_tokenizer() -> tuple[Any, Any]:
    import llguidance.hf
    from tiny_models import tiny_reasoning_model_dir
    from transformers import AutoTokenizer

    tok: Any = AutoTokenizer.from_pretrained(tiny_reasoning_model_dir("harmony"))
    return tok, llguidance.hf.from_tokenizer(tok)


def drive(grammar: str, rng: random.Random, budget: int = 200) -> str:
    """Text a matcher lets through: random allowed tokens until it stops."""
    import llguidance
    import llguidance.torch
    import torch

    tok, lltok = harmony_tokenizer()
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_lark(grammar))
    assert not matcher.is_error(), matcher.get_error()
    mask = llguidance.torch.allocate_token_bitmask(1, lltok.vocab_size)
    shifts = torch.arange(32, dtype=torch.int32)
    out: list[int] = []
    for _ in range(budget):
        if matcher.is_stopped():
            break
        llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
        allowed = ((mask[0].unsqueeze(1) >> shifts) & 1).flatten()[:lltok.vocab_size].bool()
        token = tok.eos_token_id if allowed[tok.eos_token_id] else rng.choice(torch.nonzero(allowed).flatten().tolist())
        assert matcher.consume_token(token), matcher.get_error()
        out.append(token)
    assert matcher.is_stopped(), tok.decode(out, skip_special_tokens=False)
    return str(tok.decode([t for t in out if t != tok.eos_token_id], skip_special_tokens=False))


@pytest.mark.parametrize("choice", [ToolChoice("required"), ToolChoice("named", "add")])
def test_forced_calls_are_written_with_the_markers_as_tokens_and_parse(choice: ToolChoice) -> None:
    tok, _ = harmony_tokenizer()
    fmt = HARMONY.for_tokenizer(tok)
    assert set(fmt.special_ids) == {"<|start|>", "<|channel|>", "<|constrain|>", "<|message|>", "<|call|>", "<|end|>",
                                    "<|return|>"}
    c = fmt.constraint([WEATHER, ADD], choice, False)
    assert c is not None and c.grammar is not None
    assert "<|channel|>" not in c.grammar and f"<[{fmt.special_ids['<|channel|>']}]>" in c.grammar
    assert f"<[{fmt.special_ids['<|call|>']}]>" not in c.grammar  # an end-of-sequence token: never in a grammar
    rng = random.Random(3)
    offered = choice.offered([WEATHER, ADD])
    for _ in range(3):
        text = drive(c.grammar, rng)
        reasoning, answer = REASONING_FORMATS["gpt_oss"].split(text)
        parsed = fmt.parse(answer)
        assert reasoning == "" and parsed.content == "" and len(parsed.calls) == 1, text
        tool = next(t for t in offered if t.name == parsed.calls[0].name)
        jsonschema.validate(json.loads(parsed.calls[0].arguments), tool.parameters)
