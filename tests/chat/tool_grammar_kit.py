"""What the tests of the newer tool-call formats (granite, glm4, gemma4, pythonic) share: the checks of a reply
read whole and streamed however split (on test_tool_formats.py's `joined` and `streamed`), and of one cut
by max_tokens; tokenizers that have a format's markers as text or as added tokens; and a driver that
walks a constraint grammar with random allowed tokens, so a test can check that whatever a grammar lets
through parses into calls whose arguments validate."""

from __future__ import annotations

import random
from functools import cache
from typing import Any

from test_tool_formats import ADD, TOOLS, WEATHER, check_calls, joined, streamed

from radixserve.chat.tools import ToolCallFormat, ToolChoice, ToolSpec

TOKENIZERS = ["tiny", "markers"]


def check_reply(fmt: ToolCallFormat, text: str, content: str, calls: list[tuple[str, str]]) -> None:
    """`fmt` reads `text` as `content` and `calls` ((name, arguments) each), whole and streamed in random
    pieces, every call with an id of its own."""
    parsed = fmt.parse(text)
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.calls] == calls
    assert len({c.id for c in parsed.calls}) == len(calls)
    rng = random.Random(len(text))
    for _ in range(25):
        assert joined(streamed(fmt, text, rng)) == (content, calls)


def check_cut(fmt: ToolCallFormat, text: str, content: str, calls: int) -> list[str]:
    """`text` cut by max_tokens reads as `content` and `calls` whole calls, and streams that content in
    pieces of any size; returns the streamed contents, for the test to check no markup is in them."""
    parsed = fmt.parse(text, cut=True)
    assert parsed.content == content and len(parsed.calls) == calls, parsed
    contents = []
    for piece in (1, 3, 1000):
        stream = fmt.stream()
        out = [d for i in range(0, len(text), piece) for d in stream.feed(text[i:i + piece])] + stream.finish(cut=True)
        got, _ = joined(out)
        assert got == content
        contents.append(got)
    return contents


def bound(fmt: ToolCallFormat, kind: str, markers: tuple[str, ...], special: bool) -> tuple[Any, tuple[Any, Any]]:
    """`fmt` for a tokenizer of `kind` with `markers` (special or not): it writes them as that tokenizer's
    tokens where they are single ones."""
    tokens = tokenizer(kind, markers, special)
    bound_fmt = fmt.for_tokenizer(tokens[0])
    assert type(bound_fmt) is type(fmt)
    assert set(bound_fmt.special_ids) == (set() if kind == "tiny" else set(markers))
    return bound_fmt, tokens


def check_forced_calls(fmt: ToolCallFormat, tokens: tuple[Any, Any], extra: list[ToolSpec], rng: random.Random,
                       prefer: tuple[str, ...] = (), named_repeats: int = 1) -> None:
    """Whatever a random walk through `required` (one call, or several in parallel) and a named choice of
    ADD and each of `extra` writes parses into calls of the offered tools that validate."""
    tools = [*TOOLS, *extra]
    for parallel in (False, True):
        c = fmt.constraint(tools, ToolChoice("required"), parallel)
        assert c is not None and c.grammar and c.field == "tools"
        for _ in range(3):
            check_calls(fmt, drive(tokens, c.grammar, rng, budget=800, prefer=prefer), tools, 1, 99 if parallel else 1)
    for tool in (ADD, *extra):
        named = fmt.constraint(tools, ToolChoice("named", tool.name), True)
        assert named is not None and named.field == "tool_choice" and named.grammar
        for _ in range(named_repeats):
            check_calls(fmt, drive(tokens, named.grammar, rng, budget=800, prefer=prefer), [tool], 1, 1)


def check_auto_constrains_the_call_once_opened(fmt: ToolCallFormat, tokens: tuple[Any, Any], opener: str,
                                               prefer: tuple[str, ...] = ()) -> None:
    """`auto` with a strict tool: free text, and a call constrained once `opener` is written."""
    c = fmt.constraint([WEATHER, ADD], ToolChoice("auto"), False)
    assert c is not None and c.grammar
    rng = random.Random(11)
    for _ in range(2):
        text = drive(tokens, c.grammar, rng, forced="Let me check.\n" + opener, prefer=prefer)
        check_calls(fmt, text, [WEATHER, ADD], 1, 1)
        assert fmt.parse(text).content == "Let me check."
    assert accepts(tokens, c.grammar, "The weather is fine.")


@cache
def tokenizer(kind: str, markers: tuple[str, ...] = (), special: bool = True) -> tuple[Any, Any]:
    """(transformers tokenizer, llguidance tokenizer): "tiny" is the tiny chat tokenizer, which spells every
    marker in pieces; "markers" the embedded SmolLM2's with `markers` added as tokens (`special` or not)."""
    import llguidance.hf
    from tiny_models import tiny_chat_model_dir
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    from radixserve.model.embedded import embedded_model_dir
    from radixserve.model.loader import load_tokenizer

    if kind == "tiny":
        tok: Any = AutoTokenizer.from_pretrained(tiny_chat_model_dir("llama"))
    else:
        tok = load_tokenizer(embedded_model_dir())
        if special:
            tok.add_special_tokens({"additional_special_tokens": list(markers)})
        else:
            tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in markers])
    return tok, llguidance.hf.from_tokenizer(tok)


def drive(tokens: tuple[Any, Any], grammar: str, rng: random.Random, forced: str = "", budget: int = 300,
          prefer: tuple[str, ...] = ()) -> str:
    """Text a matcher of `grammar` lets through: `forced` first, then random allowed tokens (the end of
    the reply half the times it is allowed, short tokens more often than long ones, and the texts of
    `prefer` often where allowed, finished once begun: a string that only a marker ends does end) until
    it stops."""
    import llguidance
    import llguidance.torch
    import torch

    tok, lltok = tokens
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_lark(grammar))
    assert not matcher.is_error(), matcher.get_error()
    out = list(tok(forced, add_special_tokens=False)["input_ids"]) if forced else []
    assert matcher.consume_tokens(out), matcher.get_error()
    mask = llguidance.torch.allocate_token_bitmask(1, lltok.vocab_size)
    shifts = torch.arange(32, dtype=torch.int32)
    short = _short_tokens(tok, lltok.vocab_size)
    preferred = [list(tok(text, add_special_tokens=False)["input_ids"]) for text in prefer]
    for _ in range(budget):
        if matcher.is_stopped():
            break
        llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
        allowed = ((mask[0].unsqueeze(1) >> shifts) & 1).flatten()[:lltok.vocab_size].bool()
        favoured = allowed & short
        pick = favoured if favoured.any() and rng.random() < 0.7 else allowed
        ending = bool(allowed[tok.eos_token_id]) and rng.random() < 0.5  # or parallel calls could go on and on
        token = tok.eos_token_id if ending else rng.choice(torch.nonzero(pick).flatten().tolist())
        begun = [ids[n] for ids in preferred for n in range(1, len(ids)) if out[-n:] == ids[:n] and allowed[ids[n]]]
        starts = [ids[0] for ids in preferred if allowed[ids[0]]]
        if begun:
            token = begun[0]
        elif starts and not ending and rng.random() < 0.3:
            token = rng.choice(starts)
        assert matcher.consume_token(token), matcher.get_error()
        out.append(token)
    assert matcher.is_stopped(), f"no end within {budget} tokens: {tok.decode(out, skip_special_tokens=False)!r}"
    return str(tok.decode([t for t in out if t != tok.eos_token_id], skip_special_tokens=False))


def accepts(tokens: tuple[Any, Any], grammar: str, text: str) -> bool:
    """Whether `grammar` admits exactly `text` (as the tokenizer splits it) as a whole reply."""
    import llguidance

    tok, lltok = tokens
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return bool(matcher.consume_tokens(ids)) and matcher.is_accepting()


@cache
def _short_tokens(tok: Any, vocab: int) -> Any:
    """Which tokens decode to at most 2 characters: strings and numbers end within a small budget."""
    import torch

    short = torch.zeros(vocab, dtype=torch.bool)
    for token, text in enumerate(tok.batch_decode([[t] for t in range(len(tok))])):
        short[token] = len(text) <= 2
    return short
