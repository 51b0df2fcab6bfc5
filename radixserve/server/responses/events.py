"""The Responses API's bodies: the response object (`ResponseHead.body`) and the streamed events.

The response object has every field the official `openai` client's Response type declares as
required, in OpenAI's shapes: its `output` items (`OutputItems`) in the order the reply wrote them —
a `message` item with one `output_text` part (the client's `response.output_text` joins them) for its
answer, and for a thinking model a `reasoning` item before it with the reasoning as one
`reasoning_text` part of `content` (`summary` is empty: no summaries are written; `encrypted_content`
null: nothing is encrypted); a reply whose reasoning and answer alternate (harmony's channels) has
one item per run — `usage` with `input_tokens_details.cached_tokens` (the prefix-cache hit;
`host_cached_tokens`, the part of it loaded back from the host tier, is this server's extension as on
the chat endpoint, and so is `output_tokens_details.speculation`, what speculative decoding drafted
and kept; `output_tokens_details.reasoning_tokens` counts the tokens generated inside the
reasoning) and `status` "completed", or "incomplete" with `incomplete_details.reason`
"max_output_tokens" when the reply stopped at its length limit (then its last item is incomplete);
a background response (background.py) is "queued" until it starts, "in_progress" while it runs, and
ends "failed" (with `error`) or "cancelled" (with what it wrote until then) besides. An empty reply
has one empty message item. The request's `text` (its format), `background`, `truncation`,
`max_tool_calls` and `top_logprobs` are echoed. With `include: ["message.output_text.logprobs"]`
each output_text part's `logprobs` lists its tokens (OpenAI's shape, pipeline/logprobs.py's entries:
token, logprob, bytes, top_logprobs), else it is empty: the tokens an engine output carried go with
the answer text that output wrote (tokens that wrote none yet, held back, go with the next answer
text; those of reasoning, calls and the end token with none).

A call the reply makes (tools offered, server/responses/input.py) is a `function_call` item in the
order it came (`call_id` the engine's call id, `arguments` its JSON text as the model wrote it).

A stream is SSE with `event: <type>` and `data:` lines, as OpenAI sends them; every event carries
`type` and `sequence_number` (0, 1, ... in order): response.created, response.in_progress, then per
output item response.output_item.added, response.content_part.added, its text deltas
(response.reasoning_text.delta for a reasoning item, response.output_text.delta for a message, its
`logprobs` the piece's tokens' when asked; one per piece the engine hands out),
response.reasoning_text.done / response.output_text.done (with the part's logprobs),
response.content_part.done, response.output_item.done (a function_call item: added, its
response.function_call_arguments.delta pieces and .done, done); then response.completed or
response.incomplete. An item's closing events are cut from the final response object (the last
item's) or from the item as it stands once the next one opens (the text goes only to the newest
item), so the stream and the non-streamed body (and GET) agree; events that carry many logprobs (an
item's closing ones) are built off the event loop, as the chat endpoint's large bodies are. An
error after the stream started
ends it with an `error` event and a `response.failed` carrying the error; a client that goes away
closes the deltas, which aborts the engine request.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from radixserve.chat.tools import ToolSpec
from radixserve.core import Usage
from radixserve.server.api_errors import report_error
from radixserve.server.http_util import sse
from radixserve.server.metrics import ServerMetrics
from radixserve.server.pipeline.logprobs import OFFLOAD_ENTRIES
from radixserve.server.pipeline.prediction import speculation_json
from radixserve.server.responses.input import ResponsesAsk
from radixserve.server.validation import ApiError


def usage_object(u: Usage, reasoning_tokens: int = 0) -> dict[str, Any]:
    return {"input_tokens": u.prompt_tokens, "output_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            # cache writes are OpenAI's explicit caching; the radix cache is implicit
            "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0,
                                     "host_cached_tokens": u.host_cached_tokens},
            # speculation: what speculative decoding drafted and kept, this server's extension as on chat
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens,
                                      "speculation": speculation_json(u.speculation)}}


def _failure(err: ApiError) -> dict[str, Any]:
    """ResponseError: its `code` is one of OpenAI's few; ours goes in `type`."""
    code = "rate_limit_exceeded" if err.status == 429 else "server_error" if err.status >= 500 else "invalid_prompt"
    return {"code": code, "message": err.message, "param": err.param, "type": err.code}


def _tool_json(t: ToolSpec) -> dict[str, Any]:
    """A function tool as the Responses API echoes it."""
    return {"type": "function", "name": t.name, "description": t.description or None, "parameters": t.parameters,
            "strict": t.strict}


def text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


@dataclass
class OutputItem:
    """One output item of a response: a run of reasoning ("reasoning") or of answer ("message"), or a
    call ("function_call": `text` is its arguments)."""

    kind: str
    id: str
    text: str = ""
    call_id: str = ""  # a function_call's
    name: str = ""
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # a message's tokens', when asked

    def json(self, status: str, whole: bool = True) -> dict[str, Any]:
        """The item; without its text part (a call: its arguments) when not `whole`, as output_item.added
        shows it."""
        if self.kind == "reasoning":
            return {"type": "reasoning", "id": self.id, "summary": [], "encrypted_content": None,
                    "content": [reasoning_part(self.text)] if whole else [], "status": status}
        if self.kind == "function_call":
            return {"type": "function_call", "id": self.id, "call_id": self.call_id, "name": self.name,
                    "arguments": self.text if whole else "", "status": status}
        return {"type": "message", "id": self.id, "status": status, "role": "assistant",
                "content": [text_part(self.text, self.logprobs)] if whole else []}

    def chat_call(self) -> dict[str, Any]:
        """A function_call as a chat message's call (what a stored response keeps)."""
        return {"id": self.call_id, "type": "function", "function": {"name": self.name, "arguments": self.text}}

    def part(self, text: str) -> dict[str, Any]:
        return reasoning_part(text) if self.kind == "reasoning" else text_part(text)


@dataclass(frozen=True)
class ItemText:
    """A piece of text that went to output item `index` (`new`: it opened the item)."""

    index: int
    item: OutputItem
    new: bool
    text: str
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # its tokens' (a message's, when asked)


@dataclass
class OutputItems:
    """A reply's output items in the order it wrote them: the text goes to the newest item, and a piece
    of the other kind opens a new one. The first message's id is the response head's."""

    message_id: str
    items: list[OutputItem] = field(default_factory=list)

    def add(self, kind: str, text: str, logprobs: list[dict[str, Any]] | None = None) -> ItemText | None:
        """Text of a reasoning or message item (a message's with its tokens' `logprobs`), or the next piece
        of the arguments of the call last opened."""
        if not text:
            return None
        new = not self.items or self.items[-1].kind != kind
        if new:
            first_message = kind == "message" and not any(i.kind == "message" for i in self.items)
            item_id = self.message_id if first_message else f"{'msg' if kind == 'message' else 'rs'}_" \
                + secrets.token_hex(24)
            self.items.append(OutputItem(kind, item_id))
        item = self.items[-1]
        item.text += text
        item.logprobs += logprobs or ()
        return ItemText(len(self.items) - 1, item, new, text, logprobs or [])

    def call(self, call_id: str, name: str, arguments: str) -> ItemText:
        """A new function_call item (with the first piece of its arguments)."""
        self.items.append(OutputItem("function_call", "fc_" + secrets.token_hex(24), arguments, call_id, name))
        return ItemText(len(self.items) - 1, self.items[-1], True, arguments)

    @property
    def content(self) -> str:
        """The answer: the text of the message items."""
        return "".join(i.text for i in self.items if i.kind == "message")

    def chat_calls(self) -> list[dict[str, Any]]:
        return [i.chat_call() for i in self.items if i.kind == "function_call"]

    @property
    def calls(self) -> int:
        """The function_call items so far."""
        return sum(i.kind == "function_call" for i in self.items)

    def output(self, status: str) -> list[dict[str, Any]]:
        """The items as a finished response holds them (the last one `status`, the others completed)."""
        items = self.items or [OutputItem("message", self.message_id)]
        return [item.json(status if k == len(items) - 1 else "completed") for k, item in enumerate(items)]


@dataclass(frozen=True)
class ResponseHead:
    """What a response object says that is fixed once its request is read."""

    id: str
    item_id: str  # its first output message's
    created_at: int
    ask: ResponsesAsk
    temperature: float  # the values used, as OpenAI echoes them
    top_p: float

    def body(self, status: str, output: OutputItems | None = None, usage: Usage | None = None,
             error: ApiError | None = None, reasoning_tokens: int = 0) -> dict[str, Any]:
        """The response object: `output` empty until the reply is whole (queued, in progress, failed);
        a cancelled one's is what it wrote until then (its last item incomplete)."""
        a, incomplete = self.ask, status == "incomplete"
        last = "incomplete" if status in ("incomplete", "cancelled") else "completed"
        cut = output is None or (status == "cancelled" and not output.items)
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": a.background, "error": _failure(error) if error is not None else None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": a.instructions, "max_output_tokens": a.sampling.max_tokens,
            "max_tool_calls": a.max_tool_calls, "metadata": a.metadata, "model": a.model,
            "output": [] if cut or output is None else output.output(last),
            "parallel_tool_calls": a.parallel_tool_calls, "previous_response_id": a.previous_id,
            "reasoning": {"effort": a.effort, "summary": a.summary}, "store": a.store,
            "temperature": self.temperature, "text": a.text, "tool_choice": a.tool_choice,
            "tools": [_tool_json(t) for t in a.tools.tools] if a.tools is not None else [],
            "top_logprobs": a.top_logprobs, "top_p": self.top_p, "truncation": a.truncation,
            "usage": usage_object(usage, reasoning_tokens) if usage is not None else None, "user": None,
        }


class _Numbered:
    """SSE events of one stream, numbered in the order they are sent."""

    def __init__(self) -> None:
        self.next = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        event = {"type": kind, "sequence_number": self.next, **fields}
        self.next += 1
        return f"event: {kind}\n{sse(event)}"


async def response_events(head: ResponseHead, deltas: AsyncGenerator[ItemText, None],
                          final: Callable[[], dict[str, Any]], metrics: ServerMetrics) -> AsyncGenerator[str, None]:
    """The stream of one response: `deltas` its text as it comes, item by item, then `final()` its
    response object."""
    ev = _Numbered()
    yield ev("response.created", response=head.body("in_progress"))
    yield ev("response.in_progress", response=head.body("in_progress"))
    opened: ItemText | None = None  # the item being streamed
    try:
        async with aclosing(deltas) as pieces:
            async for piece in pieces:
                if piece.new:
                    if opened is not None:
                        done = opened.item.json("completed")
                        for event in await _built(partial(_closing, ev, opened.index, done), [done]):
                            yield event
                    opened = piece
                    yield ev("response.output_item.added", output_index=piece.index,
                             item=piece.item.json("in_progress", whole=False))
                    if piece.item.kind != "function_call":
                        yield ev("response.content_part.added", **_where(piece.index, piece.item.id),
                                 part=piece.item.part(""))
                if piece.item.kind == "function_call":
                    if piece.text:
                        yield ev("response.function_call_arguments.delta", item_id=piece.item.id,
                                 output_index=piece.index, delta=piece.text)
                    continue
                kind = "reasoning_text" if piece.item.kind == "reasoning" else "output_text"
                yield ev(f"response.{kind}.delta", **_where(piece.index, piece.item.id), delta=piece.text,
                         **({"logprobs": piece.logprobs} if kind == "output_text" else {}))
    except Exception as e:  # the stream has started: the error is its last events
        err = report_error(e, metrics)
        yield ev("error", code=err.code, message=err.message, param=err.param)
        yield ev("response.failed", response=head.body("failed", error=err))
        return
    body = final()
    last = len(body["output"]) - 1
    if opened is None:  # an empty reply: its one message item opens and closes here
        item = body["output"][last]
        yield ev("response.output_item.added", output_index=last, item={**item, "status": "in_progress",
                                                                        "content": []})
        yield ev("response.content_part.added", **_where(last, item["id"]), part=text_part(""))
    ending = "response.completed" if body["status"] == "completed" else "response.incomplete"
    for event in await _built(lambda: [*_closing(ev, last, body["output"][last]), ev(ending, response=body)],
                              body["output"]):
        yield event


def logprob_entries(output: list[dict[str, Any]]) -> int:
    """The logprob entries (a token's, and each of its alternatives) that output items' parts hold."""
    return sum(1 + len(lp["top_logprobs"]) for item in output if item["type"] == "message"
               for part in item["content"] for lp in part["logprobs"])


async def _built(make: Callable[[], list[str]], output: list[dict[str, Any]]) -> list[str]:
    """Events that carry `output` items: built off the event loop when their logprobs make megabytes of
    JSON (as the chat endpoint builds its large bodies), so no other client waits on one stream."""
    return await asyncio.to_thread(make) if logprob_entries(output) > OFFLOAD_ENTRIES else make()


def _where(index: int, item_id: str) -> dict[str, Any]:
    return {"item_id": item_id, "output_index": index, "content_index": 0}


def _closing(ev: _Numbered, index: int, item: dict[str, Any]) -> list[str]:
    """The events that close output item `index` (`item` as it is when done)."""
    if item["type"] == "function_call":
        return [ev("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                   arguments=item["arguments"]),
                ev("response.output_item.done", output_index=index, item=item)]
    part = item["content"][0]
    where = _where(index, item["id"])
    text_done = ev("response.reasoning_text.done", **where, text=part["text"]) if item["type"] == "reasoning" \
        else ev("response.output_text.done", **where, text=part["text"], logprobs=part["logprobs"])
    return [text_done, ev("response.content_part.done", **where, part=part),
            ev("response.output_item.done", output_index=index, item=item)]
