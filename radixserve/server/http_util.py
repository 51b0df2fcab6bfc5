"""HTTP plumbing shared by the REST and OpenAI endpoints: bounded JSON bodies, SSE, disconnects.

Error bodies are built in api_errors. A generation never outlives its HTTP client: streaming or not,
`until_done_or_gone` watches for the client going away and then cancels the work, which aborts the
engine request and frees its blocks. `InternalErrorMiddleware` turns any exception a handler lets
escape into a generic JSON 500 (the traceback goes to the log once, under the id the client sees);
an ApiError never gets that far, the app's exception handler (api_errors) answers it.

Strict JSON: every frame, SSE event and body the server writes is standard JSON. `dumps` (WebSocket
frames, SSE events) refuses NaN and infinities with ValueError instead of writing the non-JSON
`NaN`/`Infinity` tokens, as Starlette's JSONResponse (every other body) does; such a value reaching
them is a bug, answered as an internal error, never sent. Inputs cannot smuggle one in: parse_json_text
refuses non-finite numbers.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Callable, Coroutine
from contextlib import suppress
from typing import Any, TypeVar

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixserve.server.admission import hold_generation
from radixserve.server.api_errors import error_response
from radixserve.server.metrics import ServerMetrics
from radixserve.server.pipeline.stream import api_error_from
from radixserve.server.validation import ApiError, parse_json_text, require_object

T = TypeVar("T")


def dumps(obj: Any) -> str:
    """Compact, strict JSON: ValueError on a non-finite float (strict parsers reject NaN/Infinity)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


async def read_json_object(request: Request, limit: int) -> dict[str, Any]:
    """The request body as a JSON object, refusing bodies over `limit` bytes before reading them whole."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError("too_large", f"request body of {declared} bytes exceeds the limit of {limit} bytes", 413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError("too_large", f"request body exceeds the limit of {limit} bytes", 413)
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise ApiError("bad_json", "request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError("bad_json", "request body is not UTF-8") from None
    return require_object(parse_json_text(text, limit))


class ClientGone(Exception):
    """The HTTP client disconnected before the response was ready."""


async def until_done_or_gone(receive: Receive, work: Coroutine[Any, Any, T]) -> T:
    """Run `work` while watching `receive` for http.disconnect (the request body must be read
    already). If the client goes first, `work` is cancelled — closing its generation aborts the
    engine request — and ClientGone is raised; otherwise `work`'s result or exception is returned."""
    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watcher):
            t.cancel()
        for t in (task, watcher):
            with suppress(asyncio.CancelledError, Exception):
                await t
    if task.cancelled():
        raise ClientGone
    return task.result()


async def reply_unless_gone(receive: Receive, work: Coroutine[Any, Any, Response]) -> Response:
    """`work`'s response, or 499 when the client left first (then `work` was cancelled, which aborted
    its engine requests: nobody reads the reply)."""
    try:
        return await until_done_or_gone(receive, work)
    except ClientGone:
        return Response(status_code=499)


async def respond(receive: Receive, stream: bool, events: Callable[[], Response],
                  whole: Callable[[], Coroutine[Any, Any, Response]]) -> Response:
    """The streamed reply (`events`: its response, which closes the generation when the client goes)
    or the whole one, built unless the client leaves first (`reply_unless_gone`)."""
    if stream:
        return events()
    return await reply_unless_gone(receive, whole())


async def generation_body(request: Request) -> dict[str, Any]:
    """The JSON body of a request that generates, bounded by --max-message-bytes, then a generation
    slot held for it (429/503 over a cap: admission.py): both before anything is tokenized."""
    config = request.app.state.server.config
    body = await read_json_object(request, config.max_message_bytes)
    hold_generation(request, request.app.state.server.generations, config)
    return body


class EventStream(Response):
    """text/event-stream of `data: ...` lines; the producer is cancelled when the client disconnects."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[str, None]) -> None:
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def produce() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk.encode("utf-8"), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await until_done_or_gone(receive, produce())
        except (ClientGone, OSError):
            pass  # nobody is listening any more
        finally:
            with suppress(Exception):
                await self.events.aclose()


def sse(obj: Any) -> str:
    return f"data: {dumps(obj)}\n\n"


class InternalErrorMiddleware:
    """Any exception an HTTP handler lets escape: a generic JSON 500 if the response has not started
    (api_error_from logs the traceback once, under the id the client is given). It swallows the
    exception, so Starlette's ServerErrorMiddleware (outermost, whose handler would re-raise and have
    the server log the traceback a second time) only sees failures of the middleware outside this one."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except ClientDisconnect:
            pass  # the client left mid-request (or its body timed out, connections.py): nobody to answer, no fault of ours
        except Exception as exc:
            err = api_error_from(exc)
            if not started:
                await error_response(err, self.metrics, path=scope["path"])(scope, receive, send)
