"""Incremental detokenization with stop strings, for one generated sequence.

Emitted text is always a prefix of the final text: a delta never ends in a split UTF-8 character
(decoding "\ufffd" at the tail holds it back), and when stop strings are set the last
`len(longest stop) - 1` characters are held back until they cannot start a stop string; the stop
string that matched (the earliest in the text, the first listed on a tie) is `stop_match`. Text added
while stops are not checked (the reply is shorter than its `min_tokens`) can never be matched: a stop
string counts only if it ends after that text, as in vLLM. Special
tokens are left out of the text unless `skip_special_tokens` is False; `hidden_ids` (the model's
end-of-sequence tokens) are left out always.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, stop: list[str], skip_special_tokens: bool = True,
                 hidden_ids: frozenset[int] = frozenset()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip_special_tokens, self.hidden_ids = skip_special_tokens, hidden_ids
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # decoded so far (complete characters only)
        self.emitted = 0  # characters of `text` handed out
        self._prefix = 0  # decode window start: a few tokens of context keep spacing right
        self._read = 0
        self.stopped = False
        self.stop_match: str | None = None  # the stop string that ended the text, once `stopped`
        self._exempt = 0  # characters of `text` added while stops were not checked

    def _decode(self, ids: list[int]) -> str:
        if not self.skip_special_tokens and self.hidden_ids:
            ids = [i for i in ids if i not in self.hidden_ids]
        return str(self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens))

    def add(self, token_ids: list[int], check_stops: bool = True) -> None:
        """Take new tokens; afterwards `stopped` says whether a stop string appeared (never while
        `check_stops` is False)."""
        if self.tokenizer is None:
            return
        self.ids.extend(token_ids)
        before = self._decode(self.ids[self._prefix:self._read])
        now = self._decode(self.ids[self._prefix:])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.text += now[len(before):]
            self._prefix, self._read = self._read, len(self.ids)
        if not check_stops:
            self._exempt = len(self.text)
        elif self.stop:
            start = max(0, self.emitted - self.holdback - 1)
            hits = [(i, k) for k, i in enumerate(self.text.find(s, max(start, self._exempt - len(s) + 1))
                                                 for s in self.stop) if i >= 0]
            if hits:
                at, k = min(hits)
                self.text = self.text[:at]
                self.stopped, self.stop_match = True, self.stop[k]

    def delta(self, final: bool) -> str:
        """Text not handed out yet that is safe to hand out (all of it when final)."""
        if self.tokenizer is None:
            return ""
        if final and not self.stopped and self._read < len(self.ids):
            self.text += self._decode(self.ids[self._prefix:])[len(self._decode(self.ids[self._prefix:self._read])):]
            self._read = len(self.ids)
        end = len(self.text) if (final or self.stopped) else max(self.emitted, len(self.text) - self.holdback)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out
