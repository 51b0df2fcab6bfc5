"""The Responses API's bodies: the response object (`ResponseHead.body`) and the streamed events.

The response object has every field the official `openai` client's Response type declares as
required, in OpenAI's shapes: one `message` output item with one `output_text` part (the
client's `response.output_text` joins them), `usage` with `input_tokens_details.cached_tokens` (the
prefix-cache hit; `host_cached_tokens`, the part of it loaded back from the host tier, is this
server's extension as on the chat endpoint, and so is `output_tokens_details.speculation`, what
speculative decoding drafted and kept) and `status` "completed", or "incomplete" with
`incomplete_details.reason` "max_output_tokens" when the reply stopped at its length limit.

A stream is SSE with `event: <type>` and `data:` lines, as OpenAI sends them; every event carries
`type` and `sequence_number` (0, 1, ... in order): response.created, response.in_progress,
response.output_item.added, response.content_part.added, response.output_text.delta (one per piece
of text the engine hands out), response.output_text.done, response.content_part.done,
response.output_item.done, then response.completed or response.incomplete. The closing events are
cut from the final response object, so the stream and the non-streamed body (and GET) agree. An
error after the stream started ends it with an `error` event and a `response.failed` carrying the
error; a client that goes away closes the deltas, which aborts the engine request.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from radixserve.core import Usage
from radixserve.server.api_errors import report_error
from radixserve.server.http_util import sse
from radixserve.server.metrics import ServerMetrics
from radixserve.server.pipeline.prediction import speculation_json
from radixserve.server.responses.input import ResponsesAsk
from radixserve.server.validation import ApiError


def usage_object(u: Usage) -> dict[str, Any]:
    return {"input_tokens": u.prompt_tokens, "output_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            # cache writes are OpenAI's explicit caching; the radix cache is implicit
            "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0,
                                     "host_cached_tokens": u.host_cached_tokens},
            # speculation: what speculative decoding drafted and kept, this server's extension as on chat
            "output_tokens_details": {"reasoning_tokens": 0, "speculation": speculation_json(u.speculation)}}


def _failure(err: ApiError) -> dict[str, Any]:
    """ResponseError: its `code` is one of OpenAI's few; ours goes in `type`."""
    code = "rate_limit_exceeded" if err.status == 429 else "server_error" if err.status >= 500 else "invalid_prompt"
    return {"code": code, "message": err.message, "param": err.param, "type": err.code}


@dataclass(frozen=True)
class ResponseHead:
    """What a response object says that is fixed once its request is read."""

    id: str
    item_id: str  # its one output message's
    created_at: int
    ask: ResponsesAsk
    temperature: float  # the values used, as OpenAI echoes them
    top_p: float

    def item(self, status: str, text: str | None) -> dict[str, Any]:
        """The output message; no content part before the text starts."""
        content = [] if text is None else [text_part(text)]
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant", "content": content}

    def body(self, status: str, text: str | None = None, usage: Usage | None = None,
             error: ApiError | None = None) -> dict[str, Any]:
        """The response object: `text` None until the reply is whole (in progress, failed)."""
        a, incomplete = self.ask, status == "incomplete"
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": _failure(error) if error is not None else None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": a.instructions, "max_output_tokens": a.sampling.max_tokens,
            "metadata": a.metadata, "model": a.model,
            "output": [] if text is None else [self.item("incomplete" if incomplete else "completed", text)],
            "parallel_tool_calls": a.parallel_tool_calls, "previous_response_id": a.previous_id,
            "reasoning": {"effort": None, "summary": None}, "store": a.store, "temperature": self.temperature,
            "text": {"format": {"type": "text"}}, "tool_choice": a.tool_choice, "tools": [], "top_p": self.top_p,
            "truncation": "disabled", "usage": usage_object(usage) if usage is not None else None, "user": None,
        }


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class _Numbered:
    """SSE events of one stream, numbered in the order they are sent."""

    def __init__(self) -> None:
        self.next = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        event = {"type": kind, "sequence_number": self.next, **fields}
        self.next += 1
        return f"event: {kind}\n{sse(event)}"


async def response_events(head: ResponseHead, deltas: AsyncGenerator[str, None], final: Callable[[], dict[str, Any]],
                          metrics: ServerMetrics) -> AsyncGenerator[str, None]:
    """The stream of one response: `deltas` its text as it comes, then `final()` its response object."""
    ev = _Numbered()
    where = {"item_id": head.item_id, "output_index": 0, "content_index": 0}
    yield ev("response.created", response=head.body("in_progress"))
    yield ev("response.in_progress", response=head.body("in_progress"))
    yield ev("response.output_item.added", output_index=0, item=head.item("in_progress", None))
    yield ev("response.content_part.added", **where, part=text_part(""))
    try:
        async with aclosing(deltas) as pieces:
            async for delta in pieces:
                yield ev("response.output_text.delta", **where, delta=delta, logprobs=[])
    except Exception as e:  # the stream has started: the error is its last events
        err = report_error(e, metrics)
        yield ev("error", code=err.code, message=err.message, param=err.param)
        yield ev("response.failed", response=head.body("failed", error=err))
        return
    body = final()
    item = body["output"][0]
    part = item["content"][0]
    yield ev("response.output_text.done", **where, text=part["text"], logprobs=[])
    yield ev("response.content_part.done", **where, part=part)
    yield ev("response.output_item.done", output_index=0, item=item)
    yield ev("response.completed" if body["status"] == "completed" else "response.incomplete", response=body)
