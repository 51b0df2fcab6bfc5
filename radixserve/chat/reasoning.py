"""Reasoning in the replies of thinking models: which format a model writes its thinking in, and one
incremental parser per format that splits a reply into its reasoning and its answer.

Formats (`REASONING_FORMATS`; `--reasoning-parser` names one, `auto` tells it from the chat template):
- `qwen3`: `<think>` ... `</think>`, then the answer. The reply may open `<think>` itself (Qwen3) or
  begin inside the thinking because the template opened it in the prompt (Qwen3-Thinking, Qwen3.5,
  DeepSeek-R1): `opened`, told from the prompt's last characters (`opens_in`). Only a `<think>` at
  the very start of the reply opens reasoning; after `</think>`, tags are answer text.
- `deepseek_r1`: the reply always begins inside the thinking (a leading `<think>` the model writes
  itself is dropped), `</think>` closes it.
- `gemma4`: Gemma 4's thought channel, `<|channel>thought` ... `<channel|>`, then the answer; read as
  `qwen3` reads its tags (the markers are special tokens: `needs_special_tokens`).
- `gpt_oss`: harmony channels. `<|channel|>analysis<|message|>...<|end|>` is reasoning,
  `<|channel|>final<|message|>...` (and commentary without a recipient: a preamble the user sees) is
  answer, and a message to `functions.NAME` (`... to=functions.NAME ... <|message|>{args}<|call|>`, the
  recipient before or after the channel) is a tool call: it goes into the answer in one canonical
  form, `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{args}<|call|>`, which
  the harmony tool-call format (chat/tools/harmony.py) reads. Messages to other recipients (built-in
  tools the server does not run) are reasoning. Harmony markers are special tokens, so replies are
  decoded with special tokens kept (`needs_special_tokens`).

Invariants:
- Where a reply is split never changes the result: a tag split across pieces is held back until it
  is whole or cannot be one, so the reasoning pieces of any split join to the same reasoning text and
  the answer pieces to the same answer text; a whole reply is read by the same stream (`split`).
- Think tags: the reasoning's surrounding whitespace is dropped (templates write `<think>\\n` R
  `\\n</think>\\n\\n`, so R round-trips as `reasoning_content`), and so is the whitespace that separates
  it from the answer; a reply without reasoning is answer text exactly as generated.
- A reply that ends inside its reasoning (cut by max_tokens, or no `</think>`) is all reasoning.
- A fully constrained reply (a forced tool call, a JSON schema: the grammar writes it from the first
  token) has no think-tag reasoning: it is answer from the start (`constrained`).
- `reasoning_tokens` counts the generated tokens spent inside reasoning (its tags and, for harmony,
  the headers and ends of analysis messages included): pieces are fed with their token counts, and
  a piece's tokens count in the share of its characters that are reasoning.
"""

from __future__ import annotations

import dataclasses
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from radixserve.chat.tools.base import ToolStream
from radixserve.chat.tools.harmony import CALL, CHANNEL, CONSTRAIN, END, MESSAGE, RETURN, START, harmony_call_text
from radixserve.chat.tools.types import ContentDelta, ToolCallDelta

REASONING_PARSERS = ("auto", "none", "qwen3", "deepseek_r1", "gpt_oss", "gemma4")  # --reasoning-parser
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
GEMMA4_THOUGHT_OPEN, GEMMA4_THOUGHT_CLOSE = "<|channel>thought", "<channel|>"
HEADER_CHARS = 512  # a harmony header longer than this is no header: the text is answer
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
# what a harmony header may begin with (after the prompt's `<|start|>assistant`, or at a new message)
_HEADER_STARTS = (CHANNEL, START, "to=", CONSTRAIN, "assistant")


@dataclass(frozen=True)
class ReasoningDelta:
    """A piece of the reply's reasoning."""

    text: str


@dataclass(frozen=True)
class AnswerText:
    """A piece of the reply's answer as the model wrote it (tool calls are read out of it later)."""

    text: str


Piece = ReasoningDelta | AnswerText
ReplyPiece = ReasoningDelta | ContentDelta | ToolCallDelta


def _partial_end(text: str, markers: Iterable[str]) -> int:
    """The length of the longest end of `text` that is a proper prefix of one of `markers`."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


class _Trimmed:
    """A run of text whose surrounding whitespace is dropped as it streams: leading whitespace is never
    emitted, trailing whitespace is held until text follows it."""

    def __init__(self) -> None:
        self.started = False
        self.held = ""

    def take(self, text: str) -> str:
        text = self.held + text
        if not self.started:
            text = text.lstrip()
            self.held = ""
            if not text:
                return ""
            self.started = True
        body = text.rstrip()
        self.held = text[len(body):]
        return body


class ReasoningStream(ABC):
    """Incremental reader of one reply: feed the newly decoded text (and how many tokens it took), get
    the reasoning and answer pieces it settles.

    Token counts: the reply's characters fall into runs of reasoning and of answer (`_runs`: where each
    run starts, set as the stream settles them; tags and headers go with what they open or close), and
    a piece's tokens count as reasoning in the share of its characters that are (`reasoning_tokens`), so
    a piece of many tokens (drafts, a grammar's forced text) that spans the end of the reasoning is
    split between the two."""

    def __init__(self, reasoning_first: bool | None) -> None:
        self._out: list[Piece] = []
        self._buf = ""  # text read but not settled (a piece of a tag, a header)
        self._fed = 0  # characters fed so far
        self._pieces: list[tuple[int, int, int]] = []  # (first character, end, tokens) of each piece fed
        self._runs: list[tuple[int, bool | None]] = [(0, reasoning_first)]  # None: not known yet

    def feed(self, text: str, tokens: int = 0) -> list[Piece]:
        if tokens:
            self._pieces.append((self._fed, self._fed + len(text), tokens))
        self._fed += len(text)
        if text:
            self._buf += text
            while self._buf and self._step(final=False):
                pass
        return self._take()

    def finish(self) -> list[Piece]:
        """The reply ended: what was held back comes out."""
        while self._buf and self._step(final=True):
            pass
        return self._take()

    @property
    def reasoning_tokens(self) -> int:
        """The tokens fed so far that were spent inside the reasoning (see the class docstring)."""
        total = 0.0
        for start, end, tokens in self._pieces:
            if end == start:
                total += tokens if self._reasoning_at(start) else 0
            else:
                total += tokens * self._reasoning_chars(start, end) / (end - start)
        return round(total)

    def _reasoning_at(self, pos: int) -> bool:
        kind = False
        for at, reasoning in self._runs:
            if at > pos:
                break
            kind = bool(reasoning)
        return kind

    def _reasoning_chars(self, start: int, end: int) -> int:
        n = 0
        for k, (at, reasoning) in enumerate(self._runs):
            stop = self._runs[k + 1][0] if k + 1 < len(self._runs) else self._fed
            if reasoning:
                n += max(0, min(stop, end) - max(at, start))
        return n

    def _run(self, offset: int, reasoning: bool | None) -> None:
        """From `offset` characters into the held text on, the reply is reasoning (or not; None: not known
        yet); a run that starts where the last did replaces it."""
        at = self._fed - len(self._buf) + offset
        if self._runs[-1][0] >= at:
            while len(self._runs) > 1 and self._runs[-1][0] >= at:
                self._runs.pop()
            if self._runs[-1][0] >= at:
                self._runs[-1] = (at, reasoning)
                return
        self._runs.append((at, reasoning))

    def _settle(self, reasoning: bool) -> None:
        """The run not known yet (a header's) turns out to be reasoning or not."""
        at, kind = self._runs[-1]
        if kind is None:
            self._runs[-1] = (at, reasoning)

    def _reasoning(self, text: str) -> None:
        if text:
            self._out.append(ReasoningDelta(text))

    def _answer(self, text: str) -> None:
        if text:
            self._out.append(AnswerText(text))

    def _take(self) -> list[Piece]:
        out, self._out = self._out, []
        return out

    @abstractmethod
    def _step(self, final: bool) -> bool:
        """One move on the held text; False when it must wait for more (or, `final`, is done)."""


class _ThinkStream(ReasoningStream):
    """`<think>` ... `</think>`: see the module docstring."""

    def __init__(self, inside: bool, may_open: bool, tags: tuple[str, str] = (THINK_OPEN, THINK_CLOSE)) -> None:
        # "start": may still open with <think>; "open": inside, a leading <think> is dropped;
        # "think": inside; "after": the separator after </think>; "answer": as generated
        super().__init__(True if inside else None if may_open else False)
        self._state = "open" if inside else "start" if may_open else "answer"
        self._trim = _Trimmed()
        self._open, self._close = tags

    def _step(self, final: bool) -> bool:
        buf = self._buf
        if self._state in ("start", "open"):
            head = buf.lstrip()
            if head.startswith(self._open):
                self._settle(True)
                self._buf, self._state = head[len(self._open):], "think"
                return True
            if not final and self._open.startswith(head):
                return False  # whitespace, or a piece of the opening tag
            self._settle(self._state == "open")
            self._state = "answer" if self._state == "start" else "think"
            return True
        if self._state == "think":
            at = buf.find(self._close)
            if at >= 0:
                self._reasoning(self._trim.take(buf[:at]))
                self._run(at + len(self._close), False)
                self._buf, self._state = buf[at + len(self._close):], "after"
                return True
            keep = 0 if final else _partial_end(buf, (self._close,))
            self._reasoning(self._trim.take(buf[:len(buf) - keep]))
            self._buf = buf[len(buf) - keep:]
            return False
        if self._state == "after":
            rest = buf.lstrip()
            self._buf = rest
            if rest:
                self._state = "answer"
                return True
            return False
        self._answer(buf)
        self._buf = ""
        return False


class _HarmonyStream(ReasoningStream):
    """Harmony's channels: see the module docstring."""

    def __init__(self) -> None:
        super().__init__(None)  # a header first: what it heads is not known yet
        self._state = "header"  # "header": reading a message's header; "body": its text
        self._kind = "answer"  # the body's: "reasoning", "answer", "call"

    def _step(self, final: bool) -> bool:
        if self._state == "header":
            return self._header(final)
        return self._body(final)

    def _header(self, final: bool) -> bool:
        buf = self._buf
        head, at = buf.lstrip(), buf.find(MESSAGE)
        looks = any(head.startswith(s) for s in _HEADER_STARTS)
        if at < 0 and (looks or any(s.startswith(head) for s in _HEADER_STARTS)):
            if not final and len(buf) <= HEADER_CHARS:
                return False
            self._settle(False)
            if final:  # the reply ended in a header: nothing of it is text
                self._buf = ""
                return False
            self._answer(buf)  # too long for a header: answer text (read as a body, it would open a header again)
            self._buf = ""
        if at < 0 or not looks:  # no harmony header: answer text, up to the next message
            self._settle(False)
            self._state, self._kind = "body", "answer"
            return True
        header, self._buf = buf[:at], buf[at + len(MESSAGE):]
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        self._state = "body"
        if recipient is not None and recipient.group(1).startswith("functions."):
            self._kind = "call"
            self._answer(harmony_call_text(recipient.group(1).removeprefix("functions."), "")[:-len(CALL)])
        elif recipient is not None or (channel is not None and channel.group(1) == "analysis"):
            self._kind = "reasoning"
        else:
            self._kind = "answer"
        self._settle(self._kind == "reasoning")
        return True

    def _body(self, final: bool) -> bool:
        buf = self._buf
        ends = (END, RETURN, CALL, START, CHANNEL)
        hits = [(i, m) for m in ends if (i := buf.find(m)) >= 0]
        if hits:
            at, marker = min(hits)
            self._emit(buf[:at])
            if self._kind == "call":
                self._answer(CALL)
            nxt = at if marker == CHANNEL else at + len(marker)  # a channel opens the next header
            self._run(nxt, None)  # the next message's header: what it heads is not known yet
            self._buf = buf[nxt:]
            self._state, self._kind = "header", "answer"
            return True
        keep = 0 if final else _partial_end(buf, ends)
        self._emit(buf[:len(buf) - keep])
        self._buf = buf[len(buf) - keep:]
        return False

    def _emit(self, text: str) -> None:
        if self._kind == "reasoning":
            self._reasoning(text)
        else:
            self._answer(text)


@dataclass(frozen=True)
class ReasoningFormat(ABC):
    """How one model family writes its reasoning."""

    name: str = ""
    needs_special_tokens: bool = False  # replies must be decoded with special tokens kept

    @abstractmethod
    def stream(self, opened: bool = False, constrained: bool = False) -> ReasoningStream:
        """A reader of one reply; `opened`: its prompt left it inside the reasoning (`opens_in`);
        `constrained`: a grammar writes it from its first token."""

    def opens_in(self, prompt_tail: str) -> bool:
        """Whether a prompt ending in `prompt_tail` (decoded with special tokens) leaves the reply inside
        the reasoning."""
        return False

    def split(self, text: str, opened: bool = False, constrained: bool = False) -> tuple[str, str]:
        """A whole reply's (reasoning, answer), read by the same stream as pieces are."""
        s = self.stream(opened, constrained)
        pieces = s.feed(text) + s.finish()
        return ("".join(p.text for p in pieces if isinstance(p, ReasoningDelta)),
                "".join(p.text for p in pieces if isinstance(p, AnswerText)))

    def for_tokenizer(self, tokenizer: Any) -> ReasoningFormat:
        """This format for a tokenizer (whether its markers are special tokens, which decoding drops)."""
        return self


@dataclass(frozen=True)
class ThinkTags(ReasoningFormat):
    starts_inside: bool = False  # deepseek_r1: the reply always begins inside the thinking
    open_tag: str = THINK_OPEN
    close_tag: str = THINK_CLOSE

    def stream(self, opened: bool = False, constrained: bool = False) -> ReasoningStream:
        tags = (self.open_tag, self.close_tag)
        if constrained:
            return _ThinkStream(inside=False, may_open=False, tags=tags)
        return _ThinkStream(inside=opened or self.starts_inside, may_open=True, tags=tags)

    def opens_in(self, prompt_tail: str) -> bool:
        return prompt_tail.rfind(self.open_tag) > prompt_tail.rfind(self.close_tag)

    def for_tokenizer(self, tokenizer: Any) -> ReasoningFormat:
        special = _special_tokens(tokenizer)
        marked = self.open_tag in special or self.close_tag in special or self.needs_special_tokens
        return dataclasses.replace(self, needs_special_tokens=marked)


@dataclass(frozen=True)
class Harmony(ReasoningFormat):
    needs_special_tokens: bool = True

    def stream(self, opened: bool = False, constrained: bool = False) -> ReasoningStream:
        return _HarmonyStream()


REASONING_FORMATS: dict[str, ReasoningFormat] = {
    f.name: f for f in (ThinkTags("qwen3"), ThinkTags("deepseek_r1", starts_inside=True), Harmony("gpt_oss"),
                        ThinkTags("gemma4", needs_special_tokens=True, open_tag=GEMMA4_THOUGHT_OPEN,
                                  close_tag=GEMMA4_THOUGHT_CLOSE))}


def reasoning_format(chat_template: str | None, override: str = "auto", tokenizer: Any = None) -> ReasoningFormat | None:
    """The format for a model: `override` (a REASONING_PARSERS value) if not "auto", else told from its
    template (None: the model does not reason, or "none")."""
    if override not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {override!r}; choose one of {', '.join(REASONING_PARSERS)}")
    if override == "none":
        return None
    fmt = REASONING_FORMATS[override] if override != "auto" else _from_template(chat_template or "")
    return fmt.for_tokenizer(tokenizer) if fmt is not None and tokenizer is not None else fmt


def _from_template(template: str) -> ReasoningFormat | None:
    if CHANNEL in template and MESSAGE in template:
        return REASONING_FORMATS["gpt_oss"]
    if GEMMA4_THOUGHT_CLOSE in template:  # Gemma 4's thought channel (harmony's markers are <|channel|>)
        return REASONING_FORMATS["gemma4"]
    if THINK_OPEN in template:
        # DeepSeek-R1's template opens the thinking in the prompt; its turns are marked with full-width bars
        return REASONING_FORMATS["deepseek_r1" if "<｜Assistant｜>" in template else "qwen3"]
    return None


def _special_tokens(tokenizer: Any) -> set[str]:
    names = set(getattr(tokenizer, "all_special_tokens", None) or ())
    for token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(token, "special", False):
            names.add(str(token.content))
    return names


class ReplyStream:
    """One reply read as it streams: its reasoning (with a reasoning format), then its answer, read for
    tool calls when `tools` is given (else the answer is content as generated). Keeps the whole
    reasoning and answer text for the reply's end."""

    def __init__(self, reasoning: ReasoningStream | None, tools: ToolStream | None = None) -> None:
        self._reasoning, self._tools = reasoning, tools
        self.reasoning: list[str] = []
        self.answer: list[str] = []

    @property
    def reasoning_text(self) -> str:
        return "".join(self.reasoning)

    @property
    def answer_text(self) -> str:
        return "".join(self.answer)

    @property
    def reasoning_tokens(self) -> int:
        return self._reasoning.reasoning_tokens if self._reasoning is not None else 0

    @property
    def called(self) -> bool:
        return self._tools is not None and self._tools.called

    def feed(self, text: str, tokens: int = 0) -> list[ReplyPiece]:
        if self._reasoning is None:
            return self._answer([AnswerText(text)] if text else [])
        return self._answer(self._reasoning.feed(text, tokens))

    def finish(self, cut: bool = False) -> list[ReplyPiece]:
        """The reply ended (`cut`: by max_tokens)."""
        out = self._answer(self._reasoning.finish()) if self._reasoning is not None else []
        if self._tools is not None:
            out += self._tools.finish(cut)
        return out

    def _answer(self, pieces: list[Piece]) -> list[ReplyPiece]:
        out: list[ReplyPiece] = []
        for p in pieces:
            if isinstance(p, ReasoningDelta):
                self.reasoning.append(p.text)
                out.append(p)
                continue
            self.answer.append(p.text)
            out += self._tools.feed(p.text) if self._tools is not None else [ContentDelta(p.text)]
        return out

