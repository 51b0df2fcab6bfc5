"""`ToolCallFormat`, one model family's tool-call syntax (its parser, its constraint grammars, its prompt
preamble), and `ToolStream`, the incremental parser of one reply.

A format reads a reply with one generator (`read`) over a `Cursor`; `parse` runs it over the whole text,
`ToolStream` over the text as it is decoded, so both read alike: the ContentDelta texts of a stream join to
`parse(...).content` (modulo surrounding whitespace) and the ToolCallDelta pieces of call i join to its
`calls[i]`, for every well-formed reply, however it is split. A reply cut short (`cut`: it hit max_tokens)
drops the call it was cut in from both (reader.py); a stream has sent that call's fragments if its header
was whole.

Constraining: `constraint` is a tool choice's own grammar (calls forced from the first token under
`required` / a named function; under `auto` free text whose calls are constrained once opened, where the
format can, for strict tools); `answer_or_calls` is the grammar of `auto` beside a JSON final answer
(`ChatTools.constraint`, chat/tool_calls.py, decides which applies): calls from the first token,
exactly as `forced_grammar` writes them, or the answer's JSON, never text before either. A format whose
calls could read like an answer narrows the answer (`answer_schema`: llama3_json's).

Invariants: a format is immutable; `for_tokenizer` returns a copy that knows which of its markers are
single tokens (ids for the grammars), nothing else changes; `open_objects` (--open-json-objects) leaves
the objects of tool parameters, and of a final answer's schema, open in its grammars (closed otherwise),
as the engine compiles the `json` constraints. `needs_special_tokens` says the server must decode
replies with special tokens kept, or the parser would never see the markers.
"""

from __future__ import annotations

import dataclasses
import json
from abc import ABC, abstractmethod
from collections.abc import Generator, Mapping
from typing import Any

from radixserve.chat.tools.grammar import CallShape, answer_or_calls_grammar, calls_grammar, lazy_calls_grammar
from radixserve.chat.tools.reader import Cursor, Waiting
from radixserve.chat.tools.types import ParsedReply, ReplyDelta, ToolCall, ToolCallDelta, ToolChoice, ToolSpec
from radixserve.structured import StructuredOutput

Reading = Generator[None, None, None]


class ToolStream:
    """Incremental parser of one reply: feed the newly decoded text, get what can be told of it so far."""

    def __init__(self, fmt: ToolCallFormat) -> None:
        self._cursor = Cursor()
        self._reading: Reading | None = fmt.read(self._cursor)

    def feed(self, text: str) -> list[ReplyDelta]:
        if text and self._reading is not None:
            self._cursor.text += text
            self._advance()
        return self._take()

    def finish(self, cut: bool = False) -> list[ReplyDelta]:
        """The reply ended (`cut`: by max_tokens): what the parser held back comes out."""
        self._cursor.final, self._cursor.cut = True, cut
        while self._reading is not None:
            self._advance()
        return self._take()

    @property
    def called(self) -> bool:
        """Whether the reply made a call so far (finish_reason "tool_calls")."""
        return self._cursor.calls > 0

    def _advance(self) -> None:
        assert self._reading is not None
        try:
            next(self._reading)
        except StopIteration:
            self._reading = None

    def _take(self) -> list[ReplyDelta]:
        out, self._cursor.out = self._cursor.out, []
        return out


@dataclasses.dataclass(frozen=True)
class ToolCallFormat(ABC):
    name: str = ""
    needs_special_tokens: bool = False
    markers: tuple[str, ...] = ()  # the format's marker texts, which tokenizers may have as single tokens
    special_ids: Mapping[str, int] = dataclasses.field(default_factory=dict)
    open_objects: bool = False  # tool parameters' objects admit undeclared keys (chat/tools/grammar.py)

    # ---- reading
    @abstractmethod
    def read(self, c: Cursor) -> Reading:
        """Reads a reply from `c`: content and calls, emitted on `c`."""

    def stream(self) -> ToolStream:
        return ToolStream(self)

    def parse(self, text: str, cut: bool = False) -> ParsedReply:
        """A whole reply (`cut`: it hit max_tokens) split into content and calls."""
        c = Cursor(text=text, final=True, cut=cut)
        for _ in self.read(c):
            raise AssertionError("a parser waited for more text after the reply ended")
        ids = {d.index: d.id for d in c.out if isinstance(d, ToolCallDelta) and d.id}
        calls = [ToolCall(r.name, r.arguments, ids[r.call]) for r in c.records if r.call is not None and r.valid]
        content = "".join(r.text for r in c.records if r.call is None or not (r.valid or r.dropped))
        return ParsedReply(content.strip(), calls)

    def block(self, c: Cursor, opener: str, body: Waiting) -> Generator[None, None, None]:
        """Runs a call block that followed `opener`; a block that fails before committing a call is read
        as content from the opener on, so a malformed call stays visible as text; unless the reply was
        cut in it: then it is an unfinished call, dropped."""
        start, calls = c.pos, c.calls
        ok = yield from body
        if not ok and c.calls == calls and not c.unfinished(start, bool(opener)):
            c.pos = start
            c.content(opener)

    # ---- constraining
    @abstractmethod
    def shape(self) -> CallShape:
        """The text of a call and of a list of calls, as the constraints write them."""

    def trigger(self) -> str | None:
        """The text that opens calls in free text (auto + strict); None if the format has none."""
        return None

    def constraint(self, tools: list[ToolSpec], choice: ToolChoice, parallel: bool) -> StructuredOutput | None:
        offered = choice.offered(tools)
        if choice.mode == "none" or not offered:
            return None
        if choice.mode == "auto":
            if not any(t.strict for t in offered):
                return None
            return StructuredOutput(grammar=self.lazy_grammar(offered, parallel), field="tools")
        field = "tool_choice" if choice.mode == "named" else "tools"
        return StructuredOutput(grammar=self.forced_grammar(offered, parallel and choice.mode != "named"), field=field)

    def forced_grammar(self, tools: list[ToolSpec], parallel: bool, start: str = "start",
                       json_aligned: bool = False) -> str:
        """One call of any of `tools` (one or more when `parallel`) from the first token, the whole being
        the rule `start` (grammar.calls_grammar's arguments)."""
        return calls_grammar(self.shape(), tools, parallel, self.special_ids, self.open_objects, start, json_aligned)

    def answer_or_calls(self, tools: list[ToolSpec], parallel: bool, answer: StructuredOutput) -> str:
        """Either one or more calls of `tools` (one without `parallel`) as `forced_grammar` writes them, or a
        final answer matching `answer` (a `json` or `json_object` constraint)."""
        schema, closed = self.answer_schema(answer)
        calls = self.forced_grammar(tools, parallel, start="calls", json_aligned=True)
        return answer_or_calls_grammar(calls, schema, closed)

    def answer_schema(self, answer: StructuredOutput) -> tuple[dict[str, Any], bool]:
        """The JSON schema of a final answer beside calls, and whether its objects are closed: as the engine
        compiles `answer` alone (engine/grammar/compiler.py: `json_object` is any object, never closed)."""
        if answer.kind == "json_object":
            return {"type": "object"}, False
        if answer.kind != "json" or not isinstance(answer.json, (dict, bool)):
            raise ValueError(f"{answer.field}: only a JSON schema or json_object answers beside calls")
        if answer.json is False:
            raise ValueError(f"{answer.field}: the schema false admits no answer")
        return ({} if answer.json is True else answer.json), not self.open_objects

    def lazy_grammar(self, tools: list[ToolSpec], parallel: bool) -> str:
        trigger = self.trigger()
        assert trigger is not None, f"{self.name} has no trigger: it overrides lazy_grammar"
        return lazy_calls_grammar(self.shape(), trigger, tools, parallel, self.special_ids, self.open_objects)

    # ---- prompting
    @abstractmethod
    def call_syntax(self) -> str:
        """A description of how a call is written, for `system_prompt`."""

    @abstractmethod
    def render_calls(self, calls: list[ToolCall]) -> str:
        """Calls as this format writes them (an assistant turn in a template that has no tools support)."""

    def system_prompt(self, tools: list[ToolSpec]) -> str:
        listing = "\n".join(json.dumps(t.openai_dict(), ensure_ascii=False) for t in tools)
        return ("# Tools\n\nYou can call functions to help answer the user. These are the functions, one JSON "
                f"object a line:\n<tools>\n{listing}\n</tools>\n\n{self.call_syntax()}\n"
                "Call a function only when it helps; otherwise answer in plain text. "
                "The result of a call comes back to you in the next message.")

    # ---- binding
    def for_tokenizer(self, tokenizer: Any) -> ToolCallFormat:
        """This format for a tokenizer: its markers that are single added tokens are written as those tokens
        in the grammars."""
        added: dict[str, int] = dict(tokenizer.get_added_vocab()) if hasattr(tokenizer, "get_added_vocab") else {}
        ids = {m: added[m] for m in self.markers if m in added}
        return dataclasses.replace(self, special_ids=ids)


def arguments_object(arguments: str) -> Any:
    """A call's JSON arguments as a value for templates that write `arguments | tojson`; text that is not JSON
    stays text."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
