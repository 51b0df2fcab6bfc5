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

Reasoning: an assistant message may carry `reasoning_content` (its earlier reply's thinking), which
templates such as Qwen3's render inside `<think>` tags (Qwen3's for the turns after the last user
message only); it is content like `content`, so it is placed and tokenized the same way. The
formatter also knows the model's reasoning format (chat/reasoning.py), told from its template.

Template variables: every rendering takes `variables`, extra names the template reads (the requests'
`chat_template_kwargs`, `enable_thinking`, `reasoning_effort`). They are template text once rendered,
so `check_variables` refuses one that holds a control-token string, and one that would replace what
the formatter or transformers passes itself (`messages`, `tools`, `add_generation_prompt`, the special
tokens, ...). When a template drops what it rendered of an earlier turn once a later turn follows (Qwen3
drops earlier replies' `<think>`), a new message is appended after the last message's content as the
history's rendering closed it, not after the text the two renderings share (which would repeat that
reply).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from radixserve.chat.reasoning import ReasoningFormat, reasoning_format
from radixserve.chat.tools import ToolCallFormat, ToolSpec, tool_format
from radixserve.chat.tools.rendering import ControlText, as_contents, template_message

log = logging.getLogger("radixserve.server")

# Used when a tokenizer ships without a chat template (ChatML, as SmolLM2 and many others use).
FALLBACK_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_SENTINEL = "\ue000radixserve-reply\ue001"
# what the formatter and transformers' apply_chat_template pass a template themselves; a variable may not
# replace them (the special tokens' names are added per tokenizer)
RESERVED_VARIABLES = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "chat_template", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "raise_exception", "strftime_now"})
MAX_VARIABLE_DEPTH = 8

Message = dict[str, Any]
Variables = Mapping[str, Any]


@dataclass(frozen=True)
class Piece:
    """A run of rendered text: the template's own (`content` False) or a message's content (`source`:
    which, as "c<i>" for messages[i]'s content or "r<i>" for its reasoning_content)."""

    text: str
    content: bool
    source: str = ""


def pieces_after(pieces: list[Piece], start: int) -> list[Piece]:
    """The pieces of the text from character `start` on."""
    out: list[Piece] = []
    for p in pieces:
        if start >= len(p.text):
            start -= len(p.text)
            continue
        out.append(Piece(p.text[start:], p.content, p.source))
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
        # how the model writes its reasoning, told from the template (None: it writes none); the server's
        # --reasoning-parser may name another (`reasoning_for`)
        self.template_text = template_text
        self.reasoning_format: ReasoningFormat | None = reasoning_format(template_text, "auto", tokenizer)
        self._reasoning_formats: dict[str, ReasoningFormat | None] = {}
        self._control_text = ControlText(tokenizer)
        self._reserved = RESERVED_VARIABLES | _special_token_names(tokenizer)
        self._controls = _control_pattern(tokenizer)
        self.incremental_fallbacks = 0
        self.alignment_fallbacks = 0
        self._mark_tag = secrets.token_hex(6)  # placeholders no template text contains
        # What every conversation without a system message starts with (a default system prompt the
        # template injects, or just the first user header): its length decides whether such a
        # request "hit" the cache.
        opened = self.render([{"role": "user", "content": _SENTINEL}], add_generation_prompt=False)
        self.implicit_prefix_len = len(self.encode(opened[:max(0, opened.find(_SENTINEL))]))

    def render(self, messages: list[Message], add_generation_prompt: bool, tools: list[ToolSpec] | None = None,
               variables: Variables | None = None) -> str:
        """The template's text for `messages` (with `tools` offered, as `with_tools` prepares them, and the
        template `variables`, checked by `check_variables`)."""
        messages, template_tools = self.with_tools(messages, tools)  # first: tools alone render a system turn
        if not messages:  # nothing rendered yet (transformers renders no empty conversation, tools or not)
            return ""
        extra = {**(variables or {}), **({"tools": template_tools} if template_tools else {})}
        text = self.tokenizer.apply_chat_template(
            messages, chat_template=self.template, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
        )
        return str(text)

    def reasoning_for(self, parser: str = "auto") -> ReasoningFormat | None:
        """The reasoning format `parser` (a --reasoning-parser value) names for this model: "auto" is the
        template's."""
        if parser == "auto":
            return self.reasoning_format
        if parser not in self._reasoning_formats:  # one binding to the tokenizer per parser, not per request
            self._reasoning_formats[parser] = reasoning_format(self.template_text, parser, self.tokenizer)
        return self._reasoning_formats[parser]

    def check_variables(self, variables: Variables, param: str = "chat_template_kwargs") -> dict[str, Any]:
        """`variables` as a template takes them; ValueError naming `param` and the key for one the formatter
        passes itself, or a string holding a control-token string (it would be rendered as markup)."""
        out: dict[str, Any] = {}
        for key, value in variables.items():
            if not isinstance(key, str) or not key:
                raise ValueError(f"{param}: keys are non-empty strings")
            if key in self._reserved:
                raise ValueError(f"{param}.{key}: set by the server itself, it cannot be passed to the template")
            self._check_value(value, f"{param}.{key}", 0)
            out[key] = value
        return out

    def _check_value(self, value: Any, path: str, depth: int) -> None:
        if depth > MAX_VARIABLE_DEPTH:
            raise ValueError(f"{path}: nested deeper than {MAX_VARIABLE_DEPTH} levels")
        if isinstance(value, str):
            found = self._controls.search(value) if self._controls is not None else None
            if found is not None:
                raise ValueError(f"{path} contains the control token {found.group()!r}, which the chat template "
                                 "would render as markup")
        elif isinstance(value, Mapping):
            for k, v in value.items():
                self._check_value(k, path, depth + 1)
                self._check_value(v, f"{path}.{k}", depth + 1)
        elif isinstance(value, list | tuple):
            for i, v in enumerate(value):
                self._check_value(v, f"{path}[{i}]", depth + 1)

    def prompt_tail(self, ids: list[int], n: int = 8) -> str:
        """The text of a prompt's last `n` tokens, special tokens kept (does it leave a reply inside its
        reasoning? ReasoningFormat.opens_in)."""
        return str(self.tokenizer.decode(ids[-n:], skip_special_tokens=False)) if ids else ""

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
               tools: list[ToolSpec] | None = None, variables: Variables | None = None) -> list[Piece]:
        """The rendered conversation split into template text and message contents (each message's
        `content` and `reasoning_content`)."""
        messages, template_tools = self.with_tools(messages, tools)
        specs = tools if template_tools else None
        real = self.render(messages, add_generation_prompt, specs, variables)
        if not messages:
            return [Piece(real, False)] if real else []
        texts: dict[str, tuple[str, str]] = {}  # placeholder -> (source, text)
        skeleton_messages = []
        for i, m in enumerate(messages):
            shown = dict(m)
            for field, kind in (("content", "c"), ("reasoning_content", "r")):
                if isinstance(m.get(field), str) and m[field]:
                    mark = f"\ue000{self._mark_tag}:{kind}{i}\ue001"
                    texts[mark] = (f"{kind}{i}", m[field])
                    shown[field] = mark
            skeleton_messages.append(shown)
        if not texts:
            return [Piece(real, False)] if real else []
        skeleton = self.render(skeleton_messages, add_generation_prompt, specs, variables)
        parts = re.split("(" + "|".join(map(re.escape, texts)) + ")", skeleton)
        sources = [texts[part] for part in parts[1::2]]
        aligned = _align(real, parts[0::2], sources)
        if aligned is not None:
            return aligned
        # The template does more to a content than trimming it (or branches on it): keep its structure
        # from the placeholder rendering and the contents as sent.
        self.alignment_fallbacks += 1
        if self.alignment_fallbacks == 1:
            log.warning("chat template output could not be aligned with its message contents; "
                        "contents are inserted as sent")
        out = [Piece(parts[0], False)]
        for (source, content), template in zip(sources, parts[2::2], strict=True):
            out += [Piece(content, True, source), Piece(template, False)]
        return [p for p in out if p.text]

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def prompt_tokens(self, messages: list[Message], tools: list[ToolSpec] | None = None,
                      variables: Variables | None = None) -> list[int]:
        """A whole conversation ending in the assistant generation prompt (the OpenAI path)."""
        return self.encode_pieces(self.pieces(messages, add_generation_prompt=True, tools=tools, variables=variables))

    def system_tokens(self, messages: list[Message], tools: list[ToolSpec] | None = None,
                      variables: Variables | None = None) -> list[int]:
        """Tokens of the leading system message(s) as the template renders them (with the tools preamble when
        the template puts tools there); [] when there are none."""
        messages, _ = self.with_tools(messages, tools) if not self.template_renders_tools else (messages, [])
        k = 0
        while k < len(messages) and messages[k]["role"] == "system":
            k += 1
        if not k:
            return []
        try:
            return self.encode_pieces(self.pieces(messages[:k], add_generation_prompt=False, tools=tools,
                                                  variables=variables))
        except Exception:  # noqa: BLE001 - a template may insist on a user turn to put tools in (Llama 3.1)
            return self.encode_pieces(self.pieces(messages[:k], add_generation_prompt=False, variables=variables))

    def append_user(self, history: list[Message], content: str, tools: list[ToolSpec] | None = None,
                    variables: Variables | None = None) -> TurnTokens:
        """Tokens that turn `history` (closed, as rendered) into history + user message + generation prompt."""
        return self.append_messages(history, [{"role": "user", "content": content}], tools, variables)

    def append_message(self, history: list[Message], message: Message,
                       tools: list[ToolSpec] | None = None, variables: Variables | None = None) -> TurnTokens:
        return self.append_messages(history, [message], tools, variables)

    def append_messages(self, history: list[Message], messages: list[Message],
                        tools: list[ToolSpec] | None = None, variables: Variables | None = None) -> TurnTokens:
        """Tokens that turn `history` (closed, as rendered) into history + `messages` (a user message, or the
        tool results answering the last reply's calls: give them all at once, templates merge them into
        one turn) + generation prompt."""
        before = self.render(history, add_generation_prompt=False, tools=tools, variables=variables)
        with_user = history + messages
        closed_pieces = self.pieces(with_user, add_generation_prompt=False, tools=tools, variables=variables)
        opened_pieces = self.pieces(with_user, add_generation_prompt=True, tools=tools, variables=variables)
        closed, opened = pieces_text(closed_pieces), pieces_text(opened_pieces)
        gen = self.encode_pieces(pieces_after(opened_pieces, len(closed))) if opened.startswith(closed) else []
        if closed.startswith(before) and opened.startswith(closed):
            return TurnTokens(self.encode_pieces(pieces_after(closed_pieces, len(before))), gen)
        # The template rewrote earlier turns: keep the history the model actually saw and append the new
        # message as rendered after the last message's content and the text that closed it, else after the
        # longest common text prefix.
        self._note_fallback("a new user message")
        k = _after_last_content(self.pieces(history, add_generation_prompt=False, tools=tools, variables=variables),
                                closed_pieces)
        if k is None:
            k = len(os.path.commonprefix([before, closed]))
        return TurnTokens(self.encode_pieces(pieces_after(closed_pieces, k)), gen)

    def close_assistant(self, history: list[Message], generated: list[int],
                        end_token_ids: tuple[int, ...], tools: list[ToolSpec] | None = None,
                        variables: Variables | None = None) -> list[int]:
        """Tokens that end the assistant turn after `generated` (history ends with the user message).

        If the last generated token is an end token whose text opens the template's end-of-turn text,
        only the rest of that text is appended; otherwise (stopped by length, by a stop string, or
        aborted) all of it is."""
        return self.encode(self._closing_after(self._closing_text(history, tools, variables), generated,
                                               end_token_ids))

    def closed_reply(self, history: list[Message], generated: list[int], end_token_ids: tuple[int, ...],
                     tools: list[ToolSpec] | None = None, variables: Variables | None = None) -> list[int]:
        """The reply's tokens as the history holds them: `generated`, then what ends the turn
        (`close_assistant`). A final special end token that opens none of the template's closing is
        replaced by it: GLM stops at the next turn's `<|user|>`, which the next turn writes again;
        gpt-oss stops at `<|return|>`, which history writes as `<|end|>`. That token was sampled, never
        run through the model, so no cached state depends on it."""
        text = self._closing_text(history, tools, variables)
        closing = self._closing_after(text, generated, end_token_ids)
        if (generated and generated[-1] in end_token_ids and closing == text
                and not self.tokenizer.decode([generated[-1]], skip_special_tokens=True)):
            return generated[:-1] + self.encode(closing)
        return generated + self.encode(closing)

    def _closing_text(self, history: list[Message], tools: list[ToolSpec] | None, variables: Variables | None) -> str:
        """The template's text after an assistant reply's content, to the end of its turn."""
        opened = self.render(history, add_generation_prompt=True, tools=tools, variables=variables)
        full = self.render(history + [{"role": "assistant", "content": _SENTINEL}], add_generation_prompt=False,
                           tools=tools, variables=variables)
        at = full.find(_SENTINEL, len(opened))
        if not full.startswith(opened) or at != len(opened):
            self._note_fallback("an assistant reply")
            at = full.find(_SENTINEL)
        return full[at + len(_SENTINEL):] if at >= 0 else ""

    def _closing_after(self, closing: str, generated: list[int], end_token_ids: tuple[int, ...]) -> str:
        """What of `closing` is left to write after `generated`: all of it, or the rest after an end
        token whose text opens it."""
        if generated and generated[-1] in end_token_ids:
            end_text = str(self.tokenizer.decode([generated[-1]], skip_special_tokens=False))
            if end_text and closing.startswith(end_text):
                return closing[len(end_text):]
        return closing

    def _note_fallback(self, what: str) -> None:
        self.incremental_fallbacks += 1
        if self.incremental_fallbacks == 1:
            log.warning("chat template does not render %s as a pure suffix of the history; "
                        "token sequences for such turns are rebuilt from text", what)


def _after_last_content(before: list[Piece], closed: list[Piece]) -> int | None:
    """Where, in the text of `closed` (the history and new messages), the new messages start: after the
    history's last content piece and the template text that followed it in the history's own rendering
    `before`; None when `closed` does not go on that way there."""
    last = next((i for i in range(len(before) - 1, -1, -1) if before[i].content), None)
    if last is None:
        return None
    tail = pieces_text(before[last + 1:])
    pos = 0
    found = None
    for p in closed:
        pos += len(p.text)
        if p.content and p.source == before[last].source and p.text == before[last].text:
            found = pos
    if found is None:
        return None
    text = pieces_text(closed)
    return found + len(tail) if text.startswith(tail, found) else None


def _control_pattern(tokenizer: Any) -> re.Pattern[str] | None:
    """The tokenizer's control-token strings (special and added tokens), longest first."""
    try:
        added = list(tokenizer.get_added_vocab())
    except (AttributeError, NotImplementedError):
        added = []
    controls = {t for t in [*getattr(tokenizer, "all_special_tokens", []), *added] if t}
    return re.compile("|".join(map(re.escape, sorted(controls, key=len, reverse=True)))) if controls else None


def _special_token_names(tokenizer: Any) -> frozenset[str]:
    """The names transformers passes a template for the tokenizer's special tokens (bos_token, ...)."""
    names = getattr(tokenizer, "special_tokens_map", None)
    return frozenset(names) if isinstance(names, Mapping) else frozenset()


def _align(real: str, templates: list[str], sources: list[tuple[str, str]]) -> list[Piece] | None:
    """Split `real` into templates[0], content 0, templates[1], ... where each content (`sources`: which
    message's and its text) is rendered as sent or trimmed (what templates do to contents); None when the
    text does not fit that shape."""
    out, pos = [Piece(templates[0], False)], len(templates[0])
    if not real.startswith(templates[0]):
        return None
    for (source, content), template in zip(sources, templates[1:], strict=True):
        # as sent, trimmed, or as a JSON string's inside (Llama 3.1 writes tool results `| tojson`)
        for shown in (content, content.strip(), content.lstrip(), content.rstrip(),
                      json.dumps(content, ensure_ascii=False)[1:-1]):
            if real.startswith(shown, pos) and real.startswith(template, pos + len(shown)):
                break
        else:
            return None
        out += [Piece(shown, True, source), Piece(template, False)]
        pos += len(shown) + len(template)
    return [p for p in out if p.text] if pos == len(real) else None


def token_hash(ids: Iterable[int]) -> str:
    """A short stable id for a token sequence (system prompts are keyed by their token IDs)."""
    h = hashlib.sha256()
    for i in ids:
        h.update(i.to_bytes(4, "little", signed=False))
    return h.hexdigest()[:12]

