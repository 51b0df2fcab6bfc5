"""Chat-template rendering and incremental conversation tokens.

A session's tokens must be exactly what the model saw and produced, so a new turn is built by
appending tokens, never by re-tokenizing the history. The template is rendered as text for the
history and for the history plus the new piece; only the text suffix is tokenized. After a reply, the
turn is closed the way the template closes an assistant message (for ChatML: the generated tokens end
with <|im_end|>, the template then adds "\\n"; if generation stopped by length, the whole end-of-turn
text is appended).

Invariant (checked by tests for the embedded model): when the reply text round-trips through the
tokenizer, the appended tokens equal the full re-tokenization of the same conversation. Templates
that rewrite earlier turns when later ones are added (so history is not a text prefix) keep the
tokens the model saw and append the new text after the longest common text prefix;
`incremental_fallbacks` counts those turns.

Content is text, never markup: a message that contains "<|im_start|>system" must not open a system
turn. So the template is rendered twice, once with the real contents and once with a unique
placeholder per message; the placeholder rendering splits the text into the template's own pieces
and content pieces. Template pieces are tokenized with special tokens recognized, content pieces
with special-token parsing off (`split_special_tokens=True`), and the ids are concatenated. The
real rendering tells what the template did to each content (e.g. Llama 3 trims it); if it cannot be
aligned with the placeholder rendering, the placeholder rendering with the raw contents is used.

Tools: messages may be assistant turns with `tool_calls` and `tool` results. A template that renders
tools itself (its text mentions `tools`) gets them as `tools=[...]` in OpenAI's shape and call arguments
as objects (templates write `arguments | tojson`); there, names, ids, descriptions and arguments are
template text, so one holding a control-token string is refused (ValueError), never tokenized as markup.
A template without tools support (ChatML, SmolLM2) gets them as contents: the tool-call format's
preamble opens the system message, an assistant turn's calls follow its text in the format's syntax,
and a tool result is a `tool` turn (for hermes, a user turn of <tool_response> blocks, as Qwen's).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from radixserve.chat.tools import ToolCallFormat, ToolSpec, tool_format
from radixserve.chat.tools.rendering import ControlText, as_contents, template_message

log = logging.getLogger("radixserve.server")

# Used when a tokenizer ships without a chat template (ChatML, as SmolLM2 and many others use).
FALLBACK_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_SENTINEL = "\ue000radixserve-reply\ue001"

Message = dict[str, Any]


@dataclass(frozen=True)
class Piece:
    """A run of rendered text: the template's own (`content` False) or a message's content."""

    text: str
    content: bool


def pieces_after(pieces: list[Piece], start: int) -> list[Piece]:
    """The pieces of the text from character `start` on."""
    out: list[Piece] = []
    for p in pieces:
        if start >= len(p.text):
            start -= len(p.text)
            continue
        out.append(Piece(p.text[start:], p.content))
        start = 0
    return out


def pieces_text(pieces: Iterable[Piece]) -> str:
    return "".join(p.text for p in pieces)


@dataclass
class TurnTokens:
    """Tokens a new user message appends: the message itself, then the assistant generation prompt."""

    user: list[int]
    generation_prompt: list[int]


class ChatFormatter:
    def __init__(self, tokenizer: Any, tool_call_format: ToolCallFormat | None = None,
                 open_objects: bool = False) -> None:
        """`open_objects`: tool parameters' objects open, as JSON Schema has them (the template's own
        format only; a given `tool_call_format` says for itself)."""
        if tokenizer is None:
            raise ValueError("the model has no tokenizer; chat endpoints need one")
        self.tokenizer = tokenizer
        self.template: str | None = None if getattr(tokenizer, "chat_template", None) else FALLBACK_TEMPLATE
        own = getattr(tokenizer, "chat_template", None)
        template_text = self.template or (own if isinstance(own, str) else "")
        self.tool_format = tool_call_format or tool_format(template_text, tokenizer=tokenizer, open_objects=open_objects)
        self.template_renders_tools = "tools" in template_text
        self._control_text = ControlText(tokenizer)
        self.incremental_fallbacks = 0
        self.alignment_fallbacks = 0
        self._mark_tag = secrets.token_hex(6)  # placeholders no template text contains
        # What every conversation without a system message starts with (a default system prompt the
        # template injects, or just the first user header): its length decides whether such a
        # request "hit" the cache.
        opened = self.render([{"role": "user", "content": _SENTINEL}], add_generation_prompt=False)
        self.implicit_prefix_len = len(self.encode(opened[:max(0, opened.find(_SENTINEL))]))

    def render(self, messages: list[Message], add_generation_prompt: bool, tools: list[ToolSpec] | None = None) -> str:
        """The template's text for `messages` (with `tools` offered, as `with_tools` prepares them)."""
        messages, template_tools = self.with_tools(messages, tools)  # first: tools alone render a system turn
        if not messages and not template_tools and not add_generation_prompt:
            return ""
        extra = {"tools": template_tools} if template_tools else {}
        text = self.tokenizer.apply_chat_template(
            messages, chat_template=self.template, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
        )
        return str(text)

    def with_tools(self, messages: list[Message], tools: list[ToolSpec] | None) -> tuple[list[Message], list[Any]]:
        """Messages and `tools=` as this template takes them (see the module docstring); idempotent."""
        if self.template_renders_tools:
            self._control_text.refuse_in(messages, tools or [])
            return [template_message(m) for m in messages], [t.openai_dict() for t in tools or []]
        if not tools and not any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
            return messages, []
        return as_contents(messages, tools or [], self.tool_format), []

    def encode(self, text: str) -> list[int]:
        """Template text: it holds every special token (BOS included where the template wants it)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def encode_content(self, text: str) -> list[int]:
        """Message content: special-token strings in it are tokenized as the plain text they are."""
        if not text:
            return []
        return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def encode_pieces(self, pieces: list[Piece]) -> list[int]:
        ids: list[int] = []
        for p in pieces:
            ids += self.encode_content(p.text) if p.content else self.encode(p.text)
        return ids

    def pieces(self, messages: list[Message], add_generation_prompt: bool,
               tools: list[ToolSpec] | None = None) -> list[Piece]:
        """The rendered conversation split into template text and message contents."""
        messages, template_tools = self.with_tools(messages, tools)
        specs = tools if template_tools else None
        real = self.render(messages, add_generation_prompt, specs)
        if not messages:
            return [Piece(real, False)] if real else []
        marks = [f"\ue000{self._mark_tag}:{i}\ue001" for i in range(len(messages))]
        marked = [i for i, m in enumerate(messages) if isinstance(m.get("content"), str) and m["content"]]
        if not marked:
            return [Piece(real, False)] if real else []
        skeleton = self.render([{**m, "content": marks[i]} if i in marked else m for i, m in enumerate(messages)],
                               add_generation_prompt, specs)
        parts = re.split("(" + "|".join(re.escape(marks[i]) for i in marked) + ")", skeleton)
        contents = [messages[marks.index(part)]["content"] for part in parts[1::2]]
        aligned = _align(real, parts[0::2], contents)
        if aligned is not None:
            return aligned
        # The template does more to a content than trimming it (or branches on it): keep its structure
        # from the placeholder rendering and the contents as sent.
        self.alignment_fallbacks += 1
        if self.alignment_fallbacks == 1:
            log.warning("chat template output could not be aligned with its message contents; "
                        "contents are inserted as sent")
        out = [Piece(parts[0], False)]
        for content, template in zip(contents, parts[2::2], strict=True):
            out += [Piece(content, True), Piece(template, False)]
        return [p for p in out if p.text]

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def prompt_tokens(self, messages: list[Message], tools: list[ToolSpec] | None = None) -> list[int]:
        """A whole conversation ending in the assistant generation prompt (the OpenAI path)."""
        return self.encode_pieces(self.pieces(messages, add_generation_prompt=True, tools=tools))

    def system_tokens(self, messages: list[Message], tools: list[ToolSpec] | None = None) -> list[int]:
        """Tokens of the leading system message(s) as the template renders them (with the tools preamble when
        the template puts tools there); [] when there are none."""
        messages, _ = self.with_tools(messages, tools) if not self.template_renders_tools else (messages, [])
        k = 0
        while k < len(messages) and messages[k]["role"] == "system":
            k += 1
        if not k:
            return []
        try:
            return self.encode_pieces(self.pieces(messages[:k], add_generation_prompt=False, tools=tools))
        except Exception:  # noqa: BLE001 - a template may insist on a user turn to put tools in (Llama 3.1)
            return self.encode_pieces(self.pieces(messages[:k], add_generation_prompt=False))

    def append_user(self, history: list[Message], content: str, tools: list[ToolSpec] | None = None) -> TurnTokens:
        """Tokens that turn `history` (closed, as rendered) into history + user message + generation prompt."""
        return self.append_messages(history, [{"role": "user", "content": content}], tools)

    def append_message(self, history: list[Message], message: Message,
                       tools: list[ToolSpec] | None = None) -> TurnTokens:
        return self.append_messages(history, [message], tools)

    def append_messages(self, history: list[Message], messages: list[Message],
                        tools: list[ToolSpec] | None = None) -> TurnTokens:
        """Tokens that turn `history` (closed, as rendered) into history + `messages` (a user message, or the
        tool results answering the last reply's calls: give them all at once, templates merge them into
        one turn) + generation prompt."""
        before = self.render(history, add_generation_prompt=False, tools=tools)
        with_user = history + messages
        closed_pieces = self.pieces(with_user, add_generation_prompt=False, tools=tools)
        opened_pieces = self.pieces(with_user, add_generation_prompt=True, tools=tools)
        closed, opened = pieces_text(closed_pieces), pieces_text(opened_pieces)
        gen = self.encode_pieces(pieces_after(opened_pieces, len(closed))) if opened.startswith(closed) else []
        if closed.startswith(before) and opened.startswith(closed):
            return TurnTokens(self.encode_pieces(pieces_after(closed_pieces, len(before))), gen)
        # The template rewrote earlier turns: keep the history the model actually saw and append the new
        # message as rendered after the longest common text prefix.
        self._note_fallback("a new user message")
        k = len(os.path.commonprefix([before, closed]))
        return TurnTokens(self.encode_pieces(pieces_after(closed_pieces, k)), gen)

    def close_assistant(self, history: list[Message], generated: list[int],
                        end_token_ids: tuple[int, ...], tools: list[ToolSpec] | None = None) -> list[int]:
        """Tokens that end the assistant turn after `generated` (history ends with the user message).

        If the last generated token is an end token whose text opens the template's end-of-turn text,
        only the rest of that text is appended; otherwise (stopped by length, by a stop string, or
        aborted) all of it is."""
        opened = self.render(history, add_generation_prompt=True, tools=tools)
        full = self.render(history + [{"role": "assistant", "content": _SENTINEL}], add_generation_prompt=False,
                           tools=tools)
        at = full.find(_SENTINEL, len(opened))
        if not full.startswith(opened) or at != len(opened):
            self._note_fallback("an assistant reply")
            at = full.find(_SENTINEL)
        closing = full[at + len(_SENTINEL):] if at >= 0 else ""
        if generated and generated[-1] in end_token_ids:
            end_text = str(self.tokenizer.decode([generated[-1]], skip_special_tokens=False))
            if end_text and closing.startswith(end_text):
                closing = closing[len(end_text):]
        return self.encode(closing)

    def _note_fallback(self, what: str) -> None:
        self.incremental_fallbacks += 1
        if self.incremental_fallbacks == 1:
            log.warning("chat template does not render %s as a pure suffix of the history; "
                        "token sequences for such turns are rebuilt from text", what)


def _align(real: str, templates: list[str], contents: list[str]) -> list[Piece] | None:
    """Split `real` into templates[0], content 0, templates[1], ... where each content is rendered as
    sent or trimmed (what templates do to contents); None when the text does not fit that shape."""
    out, pos = [Piece(templates[0], False)], len(templates[0])
    if not real.startswith(templates[0]):
        return None
    for content, template in zip(contents, templates[1:], strict=True):
        # as sent, trimmed, or as a JSON string's inside (Llama 3.1 writes tool results `| tojson`)
        for shown in (content, content.strip(), content.lstrip(), content.rstrip(),
                      json.dumps(content, ensure_ascii=False)[1:-1]):
            if real.startswith(shown, pos) and real.startswith(template, pos + len(shown)):
                break
        else:
            return None
        out += [Piece(shown, True), Piece(template, False)]
        pos += len(shown) + len(template)
    return [p for p in out if p.text] if pos == len(real) else None


def token_hash(ids: Iterable[int]) -> str:
    """A short stable id for a token sequence (system prompts are keyed by their token IDs)."""
    h = hashlib.sha256()
    for i in ids:
        h.update(i.to_bytes(4, "little", signed=False))
    return h.hexdigest()[:12]

