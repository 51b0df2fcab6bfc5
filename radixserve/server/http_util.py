"""HTTP plumbing shared by the REST and OpenAI endpoints: bounded JSON bodies, error bodies, SSE.

Error bodies are OpenAI-shaped, {"error": {"message", "type", "param", "code"}}, everywhere, so one
client-side parser fits every endpoint. `EventStream` watches for the client going away while it
streams and, when it does, cancels the producer, which aborts the engine request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from contextlib import suppress
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from radixserve.server.validation import ApiError, parse_json_text, require_object

_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                409: "conflict_error", 413: "invalid_request_error", 429: "rate_limit_error"}


def error_body(e: ApiError) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(e.status, "server_error" if e.status >= 500 else "invalid_request_error")
    return {"error": {"message": e.message, "type": kind, "param": e.param, "code": e.code}}


def error_response(e: ApiError, metrics: Any | None = None) -> JSONResponse:
    if metrics is not None:
        metrics.api_errors.labels(e.code).inc()
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
    return JSONResponse(error_body(e), status_code=e.status, headers=headers)


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


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

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        producer, watcher = asyncio.ensure_future(produce()), asyncio.ensure_future(watch())
        try:
            await asyncio.wait({producer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (producer, watcher):
                task.cancel()
            for task in (producer, watcher):
                with suppress(asyncio.CancelledError, OSError, Exception):
                    await task
            with suppress(Exception):
                await self.events.aclose()


def sse(obj: Any) -> str:
    return f"data: {dumps(obj)}\n\n"
