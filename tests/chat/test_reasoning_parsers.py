"""Reasoning parsers (chat/reasoning.py): each format on replies written the way its models write them,
the stream against the whole reply under every split (a tag cut anywhere), the token counts, which format
a template implies, and the reasoning and tool parsers read together (`ReplyStream`)."""

from __future__ import annotations

import random
import re

import pytest

from radixserve.chat.reasoning import (
    REASONING_FORMATS,
    AnswerText,
    Piece,
    ReasoningDelta,
    ReasoningFormat,
    ReplyStream,
    ThinkTags,
    reasoning_format,
)
from radixserve.chat.tools import FORMATS, ContentDelta, ToolCallDelta

QWEN3, R1, HARMONY = REASONING_FORMATS["qwen3"], REASONING_FORMATS["deepseek_r1"], REASONING_FORMATS["gpt_oss"]
GEMMA4 = REASONING_FORMATS["gemma4"]

# (format, reply, opened by the prompt, reasoning, answer)
RECORDED: list[tuple[ReasoningFormat, str, bool, str, str]] = [
    # Qwen3 with thinking on: the reply opens <think> itself
    (QWEN3, "<think>\nThe user wants the capital.\n</think>\n\nParis.", False, "The user wants the capital.", "Paris."),
    # the template opened it in the prompt (Qwen3-Thinking, Qwen3.5): the reply starts inside
    (QWEN3, "Short thought.\n</think>\n\nParis.", True, "Short thought.", "Paris."),
    # enable_thinking false: the prompt closed an empty <think>; the reply is answer as generated
    (QWEN3, "Paris is the capital.\n", False, "", "Paris is the capital.\n"),
    # whitespace before the opening tag belongs to nothing
    (QWEN3, "\n <think>a</think>b", False, "a", "b"),
    # a tag not at the start is answer text, and so is any tag after the reasoning closed
    (QWEN3, "Use <think> tags.", False, "", "Use <think> tags."),
    (QWEN3, "<think>x</think>y <think>z</think>", False, "x", "y <think>z</think>"),
    # cut inside the reasoning (max_tokens): all reasoning
    (QWEN3, "<think>\nStill thinking about", False, "Still thinking about", ""),
    # an opening tag cut short at the very end is not a tag
    (QWEN3, "<thi", False, "", "<thi"),
    # DeepSeek-R1: the reply begins inside the thinking, with or without writing <think>
    (R1, "Let me see.\n</think>\n\nParis.", False, "Let me see.", "Paris."),
    (R1, "<think>\nLet me see.\n</think>\n\nParis.", False, "Let me see.", "Paris."),
    (R1, "No end tag at all", False, "No end tag at all", ""),
    # Gemma 4: the thought channel, then the answer; without thinking, the answer alone; cut in the channel
    (GEMMA4, "<|channel>thought\nThe user wants the capital.<channel|>Paris.", False, "The user wants the capital.",
     "Paris."),
    (GEMMA4, "<|channel>thought\n<channel|>Paris.", False, "", "Paris."),
    (GEMMA4, "Paris is the capital.", False, "", "Paris is the capital."),
    (GEMMA4, "<|channel>thought\nStill", False, "Still", ""),
    (GEMMA4, "<|channel>thought\nNeed it.<channel|><|tool_call>call:f{}<tool_call|>", False, "Need it.",
     "<|tool_call>call:f{}<tool_call|>"),
    # gpt-oss: analysis, then the final answer
    (HARMONY, "<|channel|>analysis<|message|>User greets. Reply.<|end|><|start|>assistant<|channel|>final"
              "<|message|>Hello! How can I help?<|return|>", False, "User greets. Reply.", "Hello! How can I help?"),
    # a call in the commentary channel goes to the answer in the one form the harmony tool format reads
    (HARMONY, "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
              "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>", False,
     "Need the weather.", "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                          "{\"city\": \"Paris\"}<|call|>"),
    # the recipient before the channel, no <|constrain|>, <|call|> dropped as an end-of-sequence token
    (HARMONY, " to=functions.add<|channel|>commentary json<|message|>{\"a\": 1}", False, "",
     "<|channel|>commentary to=functions.add <|constrain|>json<|message|>{\"a\": 1}"),
    # a preamble to the user (commentary without a recipient) is answer; a built-in tool's call is reasoning
    (HARMONY, "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=browser.search<|channel|>"
              "commentary<|message|>{\"q\": 1}<|call|>", False, "{\"q\": 1}", "Checking."),
    # a message that is not harmony at all (a grammar wrote JSON from the first token): answer text
    (HARMONY, "{\"answer\": 42}", False, "", "{\"answer\": 42}"),
    # cut in a header: nothing of it is text
    (HARMONY, "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|chan", False, "Hm.", ""),
]


def pieces_of(fmt: ReasoningFormat, parts: list[str], opened: bool = False) -> list[Piece]:
    s = fmt.stream(opened)
    out: list[Piece] = []
    for p in parts:
        out += s.feed(p, 1)
    return out + s.finish()


def joined(pieces: list[Piece]) -> tuple[str, str]:
    return ("".join(p.text for p in pieces if isinstance(p, ReasoningDelta)),
            "".join(p.text for p in pieces if isinstance(p, AnswerText)))


@pytest.mark.parametrize(("fmt", "text", "opened", "reasoning", "answer"), RECORDED)
def test_recorded_replies(fmt: ReasoningFormat, text: str, opened: bool, reasoning: str, answer: str) -> None:
    assert fmt.split(text, opened) == (reasoning, answer)


@pytest.mark.parametrize(("fmt", "text", "opened", "reasoning", "answer"), RECORDED)
def test_every_split_reads_as_the_whole(fmt: ReasoningFormat, text: str, opened: bool, reasoning: str,
                                        answer: str) -> None:
    """Cut in two anywhere (a tag or marker split across pieces), one character a piece, and random pieces."""
    for cut in range(len(text) + 1):
        assert joined(pieces_of(fmt, [text[:cut], text[cut:]], opened)) == (reasoning, answer), cut
    assert joined(pieces_of(fmt, list(text), opened)) == (reasoning, answer)
    rng = random.Random(len(text))
    for _ in range(50):
        parts, i = [], 0
        while i < len(text):
            k = rng.randint(1, 6)
            parts.append(text[i:i + k])
            i += k
        assert joined(pieces_of(fmt, parts, opened)) == (reasoning, answer)


def test_reasoning_streams_before_its_end_tag_arrives() -> None:
    s = QWEN3.stream()
    assert s.feed("<thi") == []  # may be the opening tag: held
    assert s.feed("nk>\nStep one") == [ReasoningDelta("Step one")]
    assert s.feed("\n</thi") == []  # a trailing newline and a piece of the end tag: held
    assert s.feed("nk>\n\nDone") == [AnswerText("Done")]
    assert s.finish() == []
    h = HARMONY.stream()
    assert h.feed("<|channel|>analysis<|mess") == []
    assert h.feed("age|>Thinking") == [ReasoningDelta("Thinking")]
    assert h.feed("<|e") == []
    assert h.feed("nd|><|start|>assistant<|channel|>final<|message|>Hi") == [AnswerText("Hi")]


def test_a_constrained_reply_has_no_think_tag_reasoning() -> None:
    """A grammar writes it from the first token (a JSON schema, a forced call), even after a prompt that
    opened the thinking."""
    s = QWEN3.stream(opened=True, constrained=True)
    assert joined(s.feed('{"a": "</think>"}') + s.finish()) == ("", '{"a": "</think>"}')
    s = R1.stream(constrained=True)
    assert joined(s.feed("<tool_call>") + s.finish()) == ("", "<tool_call>")


def test_opened_by_the_prompt() -> None:
    assert QWEN3.opens_in("<|im_start|>assistant\n<think>\n")
    assert not QWEN3.opens_in("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking false
    assert not QWEN3.opens_in("<|im_start|>assistant\n")
    assert not HARMONY.opens_in("<|start|>assistant")


def test_token_counts() -> None:
    """One token a piece: exactly the pieces inside the reasoning, its tags included; a piece of several
    tokens across the end of the reasoning is split by its characters."""
    tokens = ["<think>", "\n", "Two", " steps", ".", "\n", "</think>", "\n\n", "Par", "is", "."]
    s = QWEN3.stream()
    for t in tokens:
        s.feed(t, 1)
    s.finish()
    assert s.reasoning_tokens == 7
    whole = "".join(tokens)
    s = QWEN3.stream()
    s.feed(whole, len(tokens))
    s.finish()
    assert s.reasoning_tokens == round(len(tokens) * whole.index("\n\nPar") / len(whole))
    s = QWEN3.stream()
    for t in ["Par", "is", "."]:
        s.feed(t, 1)
    s.finish()
    assert s.reasoning_tokens == 0
    text = ("<|channel|>analysis<|message|>Think twice.<|end|><|start|>assistant<|channel|>final<|message|>Hi"
            "<|start|>assistant<|channel|>analysis<|message|>More.")
    parts = re.findall(r"<\|[a-z]+\|>|[^<]+", text)
    h = HARMONY.stream()
    for p in parts:
        h.feed(p, 1)
    h.finish()
    # analysis: 3 header pieces, its text and <|end|>; then the final's 6 pieces; then 4 + "More." of analysis
    assert h.reasoning_tokens == 5 + 5


def test_format_from_the_template_or_the_flag() -> None:
    from tiny_models import TINY_CHAT_TEMPLATE, reasoning_chat_template

    assert reasoning_format(TINY_CHAT_TEMPLATE) is None
    assert reasoning_format(None) is None
    for kind in ("qwen3", "qwen3_keep", "qwen3_opened"):
        fmt = reasoning_format(reasoning_chat_template(kind))
        assert fmt is not None and fmt.name == "qwen3"
    harmony = reasoning_format(reasoning_chat_template("harmony"))
    assert harmony is not None and harmony.name == "gpt_oss" and harmony.needs_special_tokens
    r1 = reasoning_format("{{ '<｜Assistant｜><think>\\n' }}")
    assert r1 is not None and r1.name == "deepseek_r1"
    assert reasoning_format(reasoning_chat_template("qwen3"), "none") is None
    forced = reasoning_format(TINY_CHAT_TEMPLATE, "gpt_oss")
    assert forced is not None and forced.name == "gpt_oss"
    gemma4 = reasoning_format("{{ '<|turn>model\\n<|channel>thought\\n<channel|>' }}")
    assert gemma4 is not None and gemma4.name == "gemma4" and gemma4.needs_special_tokens
    with pytest.raises(ValueError, match="auto, none, qwen3, deepseek_r1, gpt_oss, gemma4"):
        reasoning_format(None, "o1")


def test_think_tags_that_are_special_tokens_are_decoded_kept() -> None:
    """A tokenizer whose <think> is a special token would lose it when decoding skips special tokens."""

    class Token:
        def __init__(self, content: str, special: bool) -> None:
            self.content, self.special = content, special

    class Tokenizer:
        all_special_tokens = ["<|im_end|>"]

        def __init__(self, special: bool) -> None:
            self.added_tokens_decoder = {5: Token("<think>", special), 6: Token("</think>", special)}

    assert QWEN3.for_tokenizer(Tokenizer(True)).needs_special_tokens
    assert not QWEN3.for_tokenizer(Tokenizer(False)).needs_special_tokens
    assert isinstance(QWEN3, ThinkTags) and not QWEN3.needs_special_tokens


def test_reasoning_then_a_hermes_call() -> None:
    """Qwen3 thinks, then calls: the reasoning comes out as reasoning, the call as a call, nothing as content."""
    text = ('<think>\nI need the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call>')
    for size in (1, 3, 1000):
        reader = ReplyStream(QWEN3.stream(), FORMATS["hermes"].stream())
        out = []
        for i in range(0, len(text), size):
            out += reader.feed(text[i:i + size], 1)
        out += reader.finish()
        assert "".join(d.text for d in out if isinstance(d, ReasoningDelta)) == "I need the weather."
        assert not [d for d in out if isinstance(d, ContentDelta)]
        calls = [d for d in out if isinstance(d, ToolCallDelta)]
        assert calls[0].name == "get_weather" and "".join(d.arguments for d in calls) == '{"city": "Paris"}'
        assert reader.called and reader.reasoning_text == "I need the weather."


def test_gemma4_thinks_then_calls() -> None:
    """Gemma 4's thought channel, then a call in its own format: reasoning, then a call, no content."""
    text = '<|channel>thought\nI need the weather.<channel|><|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
    for size in (1, 3, 1000):
        reader = ReplyStream(GEMMA4.stream(), FORMATS["gemma4"].stream())
        out = []
        for i in range(0, len(text), size):
            out += reader.feed(text[i:i + size], 1)
        out += reader.finish()
        assert reader.reasoning_text == "I need the weather." and reader.called
        assert not [d for d in out if isinstance(d, ContentDelta)]
        calls = [d for d in out if isinstance(d, ToolCallDelta)]
        assert calls[0].name == "get_weather" and "".join(d.arguments for d in calls) == '{"city": "Paris"}'


def test_harmony_reasoning_then_a_harmony_call() -> None:
    text = ("<|channel|>analysis<|message|>Weather needed.<|end|><|start|>assistant<|channel|>commentary "
            "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Rome\"}")
    reader = ReplyStream(HARMONY.stream(), FORMATS["harmony"].stream())
    out = []
    for part in re.findall(r"<\|[a-z]+\|>|[^<]+", text):
        out += reader.feed(part, 1)
    out += reader.finish()
    assert reader.reasoning_text == "Weather needed."
    calls = [d for d in out if isinstance(d, ToolCallDelta)]
    assert calls[0].name == "get_weather" and "".join(d.arguments for d in calls) == '{"city": "Rome"}'
    assert not [d for d in out if isinstance(d, ContentDelta)]
    parsed = FORMATS["harmony"].parse(reader.answer_text)
    assert parsed.content == "" and [(c.name, c.arguments) for c in parsed.calls] == [("get_weather",
                                                                                      '{"city": "Rome"}')]


def test_without_a_format_the_reply_is_content_as_generated() -> None:
    reader = ReplyStream(None)
    out = reader.feed(" <think>x</think> ", 2) + reader.finish()
    assert out == [ContentDelta(" <think>x</think> ")] and reader.reasoning_tokens == 0
