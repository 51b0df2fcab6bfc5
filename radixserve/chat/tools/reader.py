"""The incremental reader every format's parser is written on: a `Cursor` over the reply text seen so far,
and generator helpers that wait (yield) until enough text has arrived to decide.

One parser serves streaming and whole replies: `ToolStream` feeds the text piece by piece, `parse` feeds it
all and finishes. A helper decides only once the text it has seen settles the question (or the reply has
ended), so where a reply is split never changes the result: the deltas of any split join to the same
content and calls.

Invariants: content is emitted with surrounding whitespace dropped (a whitespace run is held until text
follows it, so runs at the reply's ends never go out); a call is committed (its index, id and name emitted)
only once its header is whole; a block that fails before that point is rewound and read as content. A
committed call whose arguments turn out not to be JSON cannot be taken back from a stream; `parse` then
reads its text as content (`Record.valid`).

A reply cut short (`cut`: max_tokens) may end inside a call. Then what the reply wrote of that call is
neither content nor a call: a block the text ran out in (`starved`) is dropped instead of rewound, a
committed call whose arguments ran out is dropped by `parse` (`Record.dropped`; a stream has sent its
fragments already), and a held piece of an opener at the end is not content. A markerless block (a
reply that starts with a call object) is dropped only if its first key may still be a call's; a cut
JSON answer stays content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Generator
from dataclasses import dataclass, field

from radixserve.chat.tools.types import ContentDelta, ReplyDelta, ToolCallDelta, new_call_id

Waiting = Generator[None, None, bool]  # a parser step: yields while it needs more text, returns success

# `{"name": "f", "arguments": ` up to the first character of the arguments value (which must have arrived,
# so how far the whitespace before it reaches never depends on where the text was split)
_HEADER = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')
_HEADER_WINDOW = 512  # a header longer than this (whitespace padding) is read as a whole object instead
_SCALAR_CHARS = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.+-")
# the start of a markerless call (an object, or a list of them) up to its first key, which may be cut
_FIRST_KEY = re.compile(r'\[?\s*\{\s*(?:"((?:[^"\\]|\\.)*)(")?)?')
_CALL_KEYS = ("name", "arguments", "parameters")


@dataclass
class Record:
    """What `parse` needs about one segment of the reply: content text, or a call and its source text."""

    text: str
    call: int | None = None  # the stream's call index, for a call
    name: str = ""
    arguments: str = ""
    valid: bool = True
    dropped: bool = False  # a call the reply was cut in: neither a call nor content


@dataclass
class Cursor:
    text: str = ""
    pos: int = 0
    final: bool = False
    out: list[ReplyDelta] = field(default_factory=list)
    records: list[Record] = field(default_factory=list)
    calls: int = 0
    cut: bool = False  # the reply was cut short (max_tokens): known once final
    starved: bool = False  # a helper gave up because the text ended (final), not because it did not match
    _held_ws: str = ""
    _emitted: bool = False

    # ---- waiting
    def wait(self, n: int = 1) -> Generator[None, None, bool]:
        """Until `n` characters after pos have arrived; False if the reply ended first."""
        while len(self.text) - self.pos < n:
            if self.final:
                self.starved = True
                return False
            yield
        return True

    def skip_ws(self) -> Generator[None, None, bool]:
        """Past whitespace; False if the reply ended there."""
        while True:
            while self.pos < len(self.text) and self.text[self.pos].isspace():
                self.pos += 1
            if self.pos < len(self.text):
                return True
            if self.final:
                self.starved = True
                return False
            yield

    def accept(self, literal: str) -> Generator[None, None, bool]:
        """Consumes `literal` if the text goes on with it."""
        while True:
            have = self.text[self.pos:self.pos + len(literal)]
            if not literal.startswith(have):
                return False
            if len(have) == len(literal):
                self.pos += len(literal)
                return True
            if self.final:
                self.starved = True
                return False
            yield

    def accept_any(self, literals: tuple[str, ...]) -> Generator[None, None, bool]:
        for literal in literals:
            if (yield from self.accept(literal)):
                return True
        return False

    def until(self, marker: str) -> Generator[None, None, str | None]:
        """The text up to `marker`, which is consumed; None when the reply ends first (all of it consumed)."""
        start = scan = self.pos
        while (at := self.text.find(marker, scan)) < 0:
            if self.final:
                self.pos, self.starved = len(self.text), True
                return None
            scan = max(start, len(self.text) - len(marker) + 1)
            yield
        self.pos = at + len(marker)
        return self.text[start:at]

    # ---- content
    def content_until(self, openers: tuple[str, ...]) -> Generator[None, None, str | None]:
        """Emits content up to the first opener and consumes the opener; None when the reply ends first.
        Text that may be the start of an opener is held until it is clear."""
        while True:
            hits = [(i, o) for o in openers if (i := self.text.find(o, self.pos)) >= 0]
            if hits:
                at, opener = min(hits)
                self.content(self.text[self.pos:at])
                self.pos = at + len(opener)
                return opener
            if self.final:
                # a cut reply's last characters that may begin an opener are the start of a call, not text
                held = _partial_opener(self.text, self.pos, openers) if self.cut else 0
                self.content(self.text[self.pos:len(self.text) - held])
                self.pos = len(self.text)
                return None
            safe = len(self.text) - _partial_opener(self.text, self.pos, openers)
            self.content(self.text[self.pos:safe])
            self.pos = safe
            yield

    def content(self, text: str) -> None:
        if not text:
            return
        self.records.append(Record(text))
        held = self._held_ws + text
        body = held.rstrip()
        if not body:
            self._held_ws = held
            return
        piece = body if self._emitted else body.lstrip()
        self._held_ws = held[len(body):]
        self._emitted = True
        self.out.append(ContentDelta(piece))

    # ---- calls
    def call_object(self) -> Waiting:
        """A call object `{"name": ..., "arguments"|"parameters": ...}` at pos (text[pos] is "{")."""
        start, scan = self.pos, _Scanner()
        while True:
            end = scan.feed(self.text, self.pos, len(self.text))
            self.pos = len(self.text) if end is None else end
            header = _HEADER.match(self.text, start) if start + _HEADER_WINDOW > self.pos or end else None
            if header and (end is None or header.end() < end):
                return (yield from self._streamed_call(start, header))
            if end is not None:
                return self._whole_call(start, end)
            if self.final:
                self.starved = True
                return False
            yield

    def call_list(self) -> Waiting:
        """A JSON list of call objects at pos (text[pos] is "["), as Mistral's and Granite's calls are
        written. A list the reply never closed, or one that goes on with anything but another call,
        keeps the calls read so far."""
        self.pos += 1
        while True:
            if not (yield from self.skip_ws()) or self.text[self.pos] != "{" or not (yield from self.call_object()):
                return False
            if not (yield from self.skip_ws()):
                return True
            if self.text[self.pos] == "]":
                self.pos += 1
                return True
            if self.text[self.pos] != ",":
                return True
            self.pos += 1

    def _whole_call(self, start: int, end: int) -> bool:
        """A call object whose keys are not in the streamable order: one delta once it is whole."""
        try:
            obj = json.loads(self.text[start:end])
        except ValueError:
            return False
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return False
        args = obj.get("arguments", obj.get("parameters"))
        if args is None and not ("arguments" in obj or "parameters" in obj):
            return False
        arguments = _arguments_text(args)
        index = self._commit(obj["name"], arguments)
        self.records.append(Record(self.text[start:end], index, obj["name"], arguments))
        return True

    def _streamed_call(self, start: int, header: re.Match[str]) -> Waiting:
        try:
            name = json.loads('"' + header.group(1) + '"')
        except ValueError:
            return False
        self.pos = header.end()
        index = self._commit(name, "")
        record = Record("", index, name)
        self.records.append(record)
        ok, arguments = yield from self.arguments_value(index)
        record.arguments = arguments
        yield from self._close_object()
        self.settle(record, start, ok)
        return True

    def _close_object(self) -> Generator[None, None, None]:
        """Past the rest of a call object after its arguments: "}", or more keys and then "}". A missing
        "}" (the usual slip of a model writing calls unconstrained) is forgiven: the call stands."""
        if not (yield from self.skip_ws()) or self.text[self.pos] not in "},":
            return
        outer = _Scanner(depth=1)
        while (end := outer.feed(self.text, self.pos, len(self.text))) is None:
            self.pos = len(self.text)
            if self.final:
                return
            yield
        self.pos = end

    def arguments_value(self, index: int) -> Generator[None, None, tuple[bool, str]]:
        """The JSON value at pos as call `index`'s arguments. An object goes out piece by piece as it
        arrives; anything else (a JSON string holding the object, null) once whole, normalized."""
        start, scan = self.pos, _Scanner()
        streamed = self.text[start] == "{"
        sent = start
        while (end := scan.feed(self.text, self.pos, len(self.text))) is None:
            self.pos = len(self.text)
            if streamed and self.pos > sent:
                self.out.append(ToolCallDelta(index, None, None, self.text[sent:self.pos]))
                sent = self.pos
            if self.final:
                self.starved = True
                return False, self.text[start:self.pos]
            yield
        self.pos = end
        raw = self.text[start:end]
        if streamed:
            if end > sent:
                self.out.append(ToolCallDelta(index, None, None, self.text[sent:end]))
            try:
                json.loads(raw)
            except ValueError:
                return False, raw
            return True, raw
        try:
            arguments = _arguments_text(json.loads(raw))
        except ValueError:
            return False, raw
        self.out.append(ToolCallDelta(index, None, None, arguments))
        return True, arguments

    def settle(self, record: Record, start: int, ok: bool) -> None:
        """A committed call's record once its arguments are read: its source text (from `start`), whether
        they are JSON, and whether the reply was cut in them (then it is dropped)."""
        record.text, record.valid = self.text[start:self.pos], ok
        record.dropped = not ok and self.cut and self.starved

    def unfinished(self, start: int, marked: bool) -> bool:
        """Whether the reply was cut inside the call markup that began at `start` (after an opener when
        `marked`); if so the rest of the text is consumed: it is neither content nor a call."""
        if not (self.cut and self.starved and (marked or _may_be_call(self.text, start))):
            return False
        self.pos = len(self.text)
        return True

    def open_call(self, name: str, source: str) -> int:
        """Commits a call whose name a format read itself (not from a call object)."""
        index = self._commit(name, "")
        self.records.append(Record(source, index, name))
        return index

    def _commit(self, name: str, arguments: str) -> int:
        index, self.calls = self.calls, self.calls + 1
        self.out.append(ToolCallDelta(index, new_call_id(), name, arguments))
        return index


def _arguments_text(value: object) -> str:
    """Arguments as JSON text: a string that holds JSON is taken as that JSON; none is an empty object."""
    if value is None:
        return "{}"
    if isinstance(value, str):
        try:
            json.loads(value)
            return value
        except ValueError:
            pass
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


def _may_be_call(text: str, start: int) -> bool:
    """Whether text[start:], which ends early, may be the start of a call object (or of a list of them):
    its first key is, or may still become, one a call begins with."""
    m = _FIRST_KEY.match(text, start)
    if m is None:
        return False
    key, closed = m.group(1), m.group(2)
    if closed:
        return key in _CALL_KEYS
    return m.end() == len(text) and (key is None or any(k.startswith(key) for k in _CALL_KEYS))


def _partial_opener(text: str, pos: int, openers: tuple[str, ...]) -> int:
    """The length of the longest end of text[pos:] that is a proper prefix of an opener."""
    best = 0
    for opener in openers:
        for n in range(min(len(opener) - 1, len(text) - pos), best, -1):
            if text.endswith(opener[:n]):
                best = n
                break
    return best


class _Scanner:
    """Finds where a JSON value ends, fed text as it arrives (resumable: keeps its state between feeds).
    It checks nesting and strings only; whether the value is JSON is json.loads's to say."""

    def __init__(self, depth: int = 0) -> None:
        self.depth, self.in_string, self.escape = depth, False, False
        self.scalar = False
        self.nested = depth > 0

    def feed(self, text: str, start: int, stop: int) -> int | None:
        """The index just past the value's end if it lies in text[start:stop]; None if it goes on."""
        for i in range(start, stop):
            ch = text[i]
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1
            elif self.scalar:
                if ch not in _SCALAR_CHARS:
                    return i
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
                self.nested = True
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return i + 1
            elif self.depth == 0 and not self.nested and not ch.isspace():
                self.scalar = True
        return None
