"""The Anthropic Messages API's reply side: a generated reply as content blocks, with its stop_reason
and usage, whole (`message_body`) or as the stream's events (`ReplyEvents`).

Invariants:
- usage: `input_tokens` are the prompt tokens NOT read from the cache; of those the radix cache
  served (the engine's cached_tokens), `cache_creation_input_tokens` are the ones a cache_control pin
  wrote for this very request (cache_control.py; 0 otherwise: every prompt is cached without being
  asked) and `cache_read_input_tokens` the rest; the three add up to the prompt's length, what
  count_tokens answers. `output_tokens` are the generated tokens.
- stop_reason: "max_tokens" for a reply cut by the caller's max_tokens; "model_context_window_exceeded"
  for one cut where the context ran out (a max_tokens past the context is clamped to the room left,
  pipeline/sampling.py, and the reply stopped at that clamp: `clamped`); "stop_sequence", with
  `stop_sequence` the string that matched (the engine's CompletionOutput.stop_reason); "tool_use" for
  a reply that called a tool and ended on its own; else "end_turn". A generation the server aborted
  (shutdown) is an error, never a message.
- Thinking: a reply's reasoning (a thinking model's, chat/reasoning.py) is a `thinking` block
  before the rest, whole; streamed, a thinking block opens where the reasoning does and its
  `thinking_delta` pieces join to its text. `signature` is always "": the server signs nothing, and
  thinking blocks sent back are not checked. Thinking blocks come whenever the model thought, whether
  or not the request enabled `thinking` (disabling it asks the template for a reply without). With
  `thinking.display` "omitted" (`show_thinking` false) the blocks keep their place but carry no text:
  streamed, a thinking block opens and closes without `thinking_delta` events.
- Blocks: without active tools, one text block holding the answer as generated (none for an empty
  reply). With tools the format's parser reads the reply: text blocks hold the text outside calls
  (surrounding whitespace dropped), tool_use blocks the calls (id "toolu_…", `input` the arguments'
  JSON value); without parallel calls only the first call is kept. Whole, the text comes first, then
  the calls (ChatTools.parse); streamed, the blocks come in the order they were generated. A call the
  reply was cut in (stop_reason "max_tokens") is in no block, whole; streamed, its tool_use block went
  out before the cut.
- Stream: `message_start` once, then a `ping` (as Anthropic sends); per block `content_block_start`,
  its deltas, `content_block_stop`, one block open at a time, indexes 0, 1, ...; then `message_delta`
  (stop_reason, stop_sequence, the final usage) and `message_stop`. A block's `text_delta` pieces join
  to its text, a tool_use block's `input_json_delta` pieces to its input's JSON. `message_start` goes
  out on the engine's first output, whose usage knows the cache hit, unless the stream has been quiet
  for a while before it (a long prefill: `heartbeat`), when it goes out with the usage known so far
  (the whole prompt as input_tokens); either way `message_delta` carries the final usage, which
  clients take over the start's. While quiet, a `ping` goes out at each heartbeat (api.py paces them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixserve.chat.reasoning import ReasoningDelta, ReplyPiece, ReplyStream
from radixserve.chat.tool_calls import ChatTools
from radixserve.chat.tools import ContentDelta, arguments_object
from radixserve.core import CompletionOutput, RequestOutput, Usage
from radixserve.server.http_util import dumps
from radixserve.server.validation import ApiError


def aborted() -> ApiError:
    return ApiError("aborted", "the generation was aborted before it finished (the server is shutting down)", 503)


def usage_body(u: Usage, created: int = 0) -> dict[str, int]:
    """`created`: the prompt tokens a cache_control pin prefilled for this request."""
    created = min(created, u.cached_tokens)
    return {"input_tokens": u.prompt_tokens - u.cached_tokens, "cache_creation_input_tokens": created,
            "cache_read_input_tokens": u.cached_tokens - created, "output_tokens": u.completion_tokens}


def stop_fields(o: CompletionOutput, called: bool, clamped: bool = False) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished reply; `clamped`: its max_tokens was cut to the
    context's room (below the caller's), so a reply cut by length ran out of context."""
    if o.finish_reason == "length":
        return ("model_context_window_exceeded" if clamped else "max_tokens"), None
    if o.finish_reason == "error":  # Anthropic has no stop_reason for a reply that broke its format
        raise ApiError("generation_failed", "the reply could not be completed within its output format or tool "
                       "schema (see docs/structured_output.md)", 500)
    if o.finish_reason != "stop":
        raise aborted()
    if isinstance(o.stop_reason, str):  # an int is a stop token id: Anthropic's API sets none, EOS-like
        return "stop_sequence", o.stop_reason
    return ("tool_use" if called else "end_turn"), None


def toolu_id(call_id: str) -> str:
    """Anthropic's tool_use id for the engine's call id ("call_" and 24 hex digits)."""
    return "toolu_" + call_id.removeprefix("call_")


def message(mid: str, model: str, content: list[dict[str, Any]], stop: tuple[str | None, str | None],
            usage: Usage, created: int = 0) -> dict[str, Any]:
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage_body(usage, created)}


def thinking_block(text: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": text, "signature": ""}


def message_body(mid: str, model: str, tools: ChatTools | None, text: str, final: CompletionOutput,
                 usage: Usage, created: int = 0, reasoning: str = "", clamped: bool = False,
                 show_thinking: bool = True) -> dict[str, Any]:
    """The whole reply: `text` is its answer (everything generated but its `reasoning`), `final` the
    output that finished it; `clamped` and `show_thinking`: see the module docstring."""
    thought = [thinking_block(reasoning if show_thinking else "")] if reasoning else []
    if tools is None or not tools.active:
        return message(mid, model, thought + ([{"type": "text", "text": text}] if text else []),
                       stop_fields(final, False, clamped), usage, created)
    parsed = tools.parse(text, cut=final.finish_reason == "length")
    blocks: list[dict[str, Any]] = thought + ([{"type": "text", "text": parsed.content}] if parsed.content else [])
    blocks += [{"type": "tool_use", "id": toolu_id(c.id), "name": c.name, "input": arguments_object(c.arguments)}
               for c in parsed.calls]
    return message(mid, model, blocks, stop_fields(final, bool(parsed.calls), clamped), usage, created)


def sse_event(name: str, body: dict[str, Any]) -> str:
    """One event of Anthropic's stream: its name twice, as the `event:` line and the body's `type`."""
    return f"event: {name}\ndata: {dumps({'type': name, **body})}\n\n"


@dataclass
class ReplyEvents:
    """The events of one streamed reply (n is 1), fed the engine's outputs in order."""

    mid: str
    model: str
    tools: ChatTools | None
    started: bool = False
    blocks: int = 0  # blocks started so far; the open one is the last
    open_kind: str | None = None  # "thinking" | "text" | "tool_use" while a block is open
    called: bool = False
    stopped: bool = False  # message_stop went out
    keep_call: bool = True  # whether the call being streamed is kept (not without parallel calls, after the first)
    created: int = 0  # prompt tokens a cache_control pin prefilled for this request (usage_body)
    reader: ReplyStream | None = None  # reads the reply (Plan.reader); None: `tools` alone
    clamped: bool = False  # max_tokens was clamped to the context's room (stop_fields)
    show_thinking: bool = True  # False: thinking blocks without their text (`thinking.display` "omitted")
    parser: ReplyStream = field(init=False)

    def __post_init__(self) -> None:
        active = self.tools is not None and self.tools.active
        self.parser = self.reader if self.reader is not None else ReplyStream(
            None, self.tools.format.stream() if self.tools is not None and active else None)

    def of(self, out: RequestOutput) -> list[str]:
        events = self._start(out.usage)
        for o in out.outputs:
            for d in self._deltas(o):
                events += self._delta(d)
            if o.finish_reason:
                events += self._close()
                reason, sequence = stop_fields(o, self.called, self.clamped)
                events.append(sse_event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                                          "usage": usage_body(out.usage, self.created)}))
                events.append(sse_event("message_stop", {}))
                self.stopped = True
        return events

    def heartbeat(self, prompt_tokens: int) -> list[str]:
        """The events of a quiet interval: a `ping`, after `message_start` (whose usage so far is the
        `prompt_tokens`, none known to be cached yet) if it has not gone out; none after the end."""
        if self.stopped:
            return []
        return self._start(Usage(prompt_tokens=prompt_tokens)) or [sse_event("ping", {})]

    def _start(self, usage: Usage) -> list[str]:
        """`message_start` and the ping after it, once."""
        if self.started:
            return []
        self.started = True
        start = message(self.mid, self.model, [], (None, None), usage, self.created)
        return [sse_event("message_start", {"message": start}), sse_event("ping", {})]

    def _deltas(self, o: CompletionOutput) -> list[ReplyPiece]:
        items = self.parser.feed(o.text, len(o.token_ids))
        return items + self.parser.finish(cut=o.finish_reason == "length") if o.finish_reason else items

    def _delta(self, d: ReplyPiece) -> list[str]:
        if isinstance(d, ReasoningDelta):
            if not d.text:
                return []
            events = [] if self.open_kind == "thinking" else self._open(thinking_block(""))
            if not self.show_thinking:
                return events
            return events + [self._block_delta({"type": "thinking_delta", "thinking": d.text})]
        if isinstance(d, ContentDelta):
            if not d.text:
                return []
            events = [] if self.open_kind == "text" else self._open({"type": "text", "text": ""})
            return events + [self._block_delta({"type": "text_delta", "text": d.text})]
        if d.id is not None:  # a call's first fragment names it
            self.keep_call = d.index == 0 or (self.tools is not None and self.tools.parallel)
            if not self.keep_call:
                return []
            self.called = True
            events = self._open({"type": "tool_use", "id": toolu_id(d.id), "name": d.name, "input": {}})
        elif not self.keep_call:
            return []
        else:
            events = []
        if d.arguments:
            events.append(self._block_delta({"type": "input_json_delta", "partial_json": d.arguments}))
        return events

    def _open(self, block: dict[str, Any]) -> list[str]:
        events = self._close()
        self.blocks += 1
        self.open_kind = block["type"]
        return events + [sse_event("content_block_start", {"index": self.blocks - 1, "content_block": block})]

    def _close(self) -> list[str]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [sse_event("content_block_stop", {"index": self.blocks - 1})]

    def _block_delta(self, delta: dict[str, Any]) -> str:
        return sse_event("content_block_delta", {"index": self.blocks - 1, "delta": delta})
