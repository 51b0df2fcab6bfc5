"""How an error reaches a client: the one place error bodies, frames and events are built.

Owns the OpenAI-shaped JSON error body, {"error": {"message", "type", "param", "code"}}, used by
every HTTP endpoint so one client-side parser fits them all, except under the Anthropic Messages API
(/v1/messages*), whose clients parse Anthropic's {"type": "error", "error": {"type", "message"}}: the
path a response answers picks the shape (`error_response`'s `path`), so every refusal on those paths
(the API key, the Host/Origin guard, the generation caps, a too-large body, a 500) is in Anthropic's.
An error may carry Anthropic's machine-readable `error.details` (`DetailedApiError`: an `error_code`
Anthropic's clients act on, such as the SDK's fallback from server-held threads); the OpenAI shape
leaves them out. Also the JSON error response; the app's exception handler for ApiError; and the error payloads of the
streams (the WebSocket `error` frame, the session SSE `error` event, the OpenAI and Anthropic SSE
errors). Every one of them goes through `report_error`, so each error a client is told about counts
once in the api_errors metric.

Route handlers raise ApiError and never catch it to answer: `api_error_handler` (registered in
build_app) turns it into the JSON response. Only code that answers outside routing (middleware) or
after a response has started (stream producers, the WebSocket frame loop) calls the functions here.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.requests import HTTPConnection
from starlette.responses import JSONResponse, Response

from radixserve.server.metrics import ServerMetrics
from radixserve.server.pipeline.stream import api_error_from
from radixserve.server.validation import ApiError

_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                409: "conflict_error", 413: "invalid_request_error", 429: "rate_limit_error"}


# Anthropic's error types; 413 is its `request_too_large`, 503 (a cap, loading, shutdown) its overloaded_error,
# a timeout (408, 504) its timeout_error; any other 4xx is an invalid_request_error, any other 5xx an api_error
_ANTHROPIC_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                    408: "timeout_error", 409: "conflict_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error", 504: "timeout_error"}
ANTHROPIC_PREFIX = "/v1/messages"


class DetailedApiError(ApiError):
    """An ApiError whose Anthropic body also carries `error.details` ({"error_code": ..., ...})."""

    def __init__(self, code: str, message: str, details: Mapping[str, Any], status: int = 400,
                 param: str | None = None) -> None:
        super().__init__(code, message, status, param=param)
        self.details = dict(details)


def speaks_anthropic(path: str | None) -> bool:
    """Whether `path` is under the Anthropic Messages API (its errors are in Anthropic's shape)."""
    return path is not None and (path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/"))


def anthropic_error_body(e: ApiError) -> dict[str, Any]:
    """Anthropic's error body; also the payload of its stream's `error` event."""
    kind = _ANTHROPIC_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    details = {"details": e.details} if isinstance(e, DetailedApiError) else {}
    return {"type": "error", "error": {"type": kind, "message": e.message, **details}}


def error_body(e: ApiError) -> dict[str, Any]:
    """The OpenAI-shaped error body; also the payload of an OpenAI SSE error."""
    kind = _ERROR_TYPES.get(e.status, "server_error" if e.status >= 500 else "invalid_request_error")
    return {"error": {"message": e.message, "type": kind, "param": e.param, "code": e.code}}


def report_error(exc: BaseException, metrics: ServerMetrics | None) -> ApiError:
    """The client-facing error for `exc` (api_error_from logs an unexpected one), counted once. Called
    directly only where a refusal carries no payload (a WebSocket upgrade closed before accepting)."""
    err = api_error_from(exc)
    if metrics is not None:
        metrics.api_errors.labels(err.code).inc()
    return err


def error_response(e: ApiError, metrics: ServerMetrics | None = None,
                   headers: Mapping[str, str] | None = None, path: str | None = None) -> JSONResponse:
    """The JSON error response to a request for `path` (its shape: see the module docstring); counted
    when `metrics` is given (routing's own 404/405 are not)."""
    err = report_error(e, metrics)
    extra = {"WWW-Authenticate": "Bearer"} if err.status == 401 else {}
    if err.retry_after is not None:  # a 429 that says when to come back (rate limits, session shares)
        extra["Retry-After"] = str(err.retry_after)
    body = anthropic_error_body(err) if speaks_anthropic(path) else error_body(err)
    return JSONResponse(body, status_code=err.status, headers={**extra, **(headers or {})} or None)


def api_error_handler(metrics: ServerMetrics) -> Callable[[HTTPConnection, Exception], Awaitable[Response]]:
    """The app's exception handler for ApiError, raised by a route before its response started (an
    EventStream never lets one escape; the WebSocket answers with frames and never lets one escape)."""
    async def handle(conn: HTTPConnection, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return error_response(exc, metrics, path=conn.url.path)

    return handle


def error_frame(exc: BaseException, metrics: ServerMetrics, gen_id: str | None = None, req: Any = None,
                has_req: bool = False) -> dict[str, Any]:
    """The WebSocket `error` frame, also the session SSE `error` event:
    {"type":"error","code","message","gen_id"?,"req"?,"retry_after"?} (`req` only when the client sent
    one; `retry_after`, in seconds, as the Retry-After header of the same refusal over HTTP)."""
    err = report_error(exc, metrics)
    frame: dict[str, Any] = {"type": "error", "code": err.code, "message": err.message}
    if err.retry_after is not None:
        frame["retry_after"] = err.retry_after
    if gen_id is not None:
        frame["gen_id"] = gen_id
    if has_req:
        frame["req"] = req
    return frame


def openai_stream_error(exc: BaseException, metrics: ServerMetrics) -> dict[str, Any]:
    """The error event of an OpenAI chat-completion stream: the same body as the JSON error."""
    return error_body(report_error(exc, metrics))


def anthropic_stream_error(exc: BaseException, metrics: ServerMetrics) -> dict[str, Any]:
    """The `error` event of an Anthropic Messages stream: the same body as the JSON error."""
    return anthropic_error_body(report_error(exc, metrics))
