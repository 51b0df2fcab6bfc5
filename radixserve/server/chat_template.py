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
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("radixserve.server")

# Used when a tokenizer ships without a chat template (ChatML, as SmolLM2 and many others use).
FALLBACK_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_SENTINEL = "\ue000radixserve-reply\ue001"

Message = dict[str, str]


@dataclass
class TurnTokens:
    """Tokens a new user message appends: the message itself, then the assistant generation prompt."""

    user: list[int]
    generation_prompt: list[int]


class ChatFormatter:
    def __init__(self, tokenizer: Any) -> None:
        if tokenizer is None:
            raise ValueError("the model has no tokenizer; chat endpoints need one")
        self.tokenizer = tokenizer
        self.template: str | None = None if getattr(tokenizer, "chat_template", None) else FALLBACK_TEMPLATE
        self.incremental_fallbacks = 0
        # What every conversation without a system message starts with (a default system prompt the
        # template injects, or just the first user header): its length decides whether such a
        # request "hit" the cache.
        opened = self.render([{"role": "user", "content": _SENTINEL}], add_generation_prompt=False)
        self.implicit_prefix_len = len(self.encode(opened[:max(0, opened.find(_SENTINEL))]))

    def render(self, messages: list[Message], add_generation_prompt: bool) -> str:
        if not messages and not add_generation_prompt:
            return ""
        text = self.tokenizer.apply_chat_template(
            messages, chat_template=self.template, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return str(text)

    def encode(self, text: str) -> list[int]:
        # The template text already holds every special token (BOS included where the template wants it).
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def prompt_tokens(self, messages: list[Message]) -> list[int]:
        """A whole conversation ending in the assistant generation prompt (the OpenAI path)."""
        return self.encode(self.render(messages, add_generation_prompt=True))

    def system_tokens(self, messages: list[Message]) -> list[int]:
        """Tokens of the leading system message(s) as the template renders them; [] when there are none."""
        k = 0
        while k < len(messages) and messages[k]["role"] == "system":
            k += 1
        return self.encode(self.render(messages[:k], add_generation_prompt=False)) if k else []

    def append_user(self, history: list[Message], content: str) -> TurnTokens:
        """Tokens that turn `history` (closed, as rendered) into history + user message + generation prompt."""
        before = self.render(history, add_generation_prompt=False)
        with_user = history + [{"role": "user", "content": content}]
        closed = self.render(with_user, add_generation_prompt=False)
        opened = self.render(with_user, add_generation_prompt=True)
        if closed.startswith(before) and opened.startswith(closed):
            return TurnTokens(self.encode(closed[len(before):]), self.encode(opened[len(closed):]))
        # The template rewrote earlier turns: keep the history the model actually saw and append the new
        # message as rendered after the longest common text prefix.
        self._note_fallback("a new user message")
        k = len(os.path.commonprefix([before, closed]))
        gen = opened[len(closed):] if opened.startswith(closed) else ""
        return TurnTokens(self.encode(closed[k:]), self.encode(gen))

    def close_assistant(self, history: list[Message], generated: list[int],
                        end_token_ids: tuple[int, ...]) -> list[int]:
        """Tokens that end the assistant turn after `generated` (history ends with the user message).

        If the last generated token is an end token whose text opens the template's end-of-turn text,
        only the rest of that text is appended; otherwise (stopped by length, by a stop string, or
        aborted) all of it is."""
        opened = self.render(history, add_generation_prompt=True)
        full = self.render(history + [{"role": "assistant", "content": _SENTINEL}], add_generation_prompt=False)
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


def token_hash(ids: list[int]) -> str:
    """A short stable id for a token sequence (system prompts are keyed by their token IDs)."""
    h = hashlib.sha256()
    for i in ids:
        h.update(i.to_bytes(4, "little", signed=False))
    return h.hexdigest()[:12]
