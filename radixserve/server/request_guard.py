"""Host and Origin checks for every request: the defence against DNS rebinding and cross-site requests.

Owns: which Host headers the server answers (the loopback names and the bound address by default,
`ServerConfig.allowed_hosts` widens it, "*" allows any) and which browser Origins may change state
(POST, PUT, PATCH, DELETE on any path) or open the WebSocket (the same origin, or one listed in
`ServerConfig.allowed_origins`, "*" for any).

Invariants:
- No request, HTTP or WebSocket, on any path (/health, /metrics and the static UI included) reaches
  the app unless its Host is allowed: a page whose DNS name was rebound to 127.0.0.1 sends its own
  name as Host, so it can read nothing. A request without a Host header is refused too, and one
  with several is a 400 (RFC 9112 section 3.2): the check and the app must not read different Hosts.
- A state-changing request or a WebSocket upgrade that carries a foreign Origin is refused whatever
  its Content-Type: a browser sends a text/plain POST cross-site without a CORS preflight, so CORS
  alone does not stop it. Requests without an Origin (curl, SDKs) pass; browsers always send one on
  these requests.
- Refusals are JSON error bodies (a WebSocket upgrade is refused before it is accepted, with the
  same body where the server supports denial responses) and are counted in the api_errors metric.
The config is read per request, so it can be changed on a running app (tests do).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Receive, Scope, Send

from radixserve.server.api_errors import error_response, report_error
from radixserve.server.hosts import host_allowed, origin_allowed
from radixserve.server.validation import ApiError

if TYPE_CHECKING:  # state imports config
    from radixserve.server.state import ServerState

STATE_CHANGING_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def refusal(scope: Scope, headers: Mapping[str, str], allowed_hosts: list[str], bind_host: str,
            allowed_origins: list[str]) -> ApiError | None:
    """Why this request must be refused, or None when it may go on."""
    if sum(1 for name, _ in scope.get("headers", ()) if name.lower() == b"host") > 1:
        return ApiError("invalid_host", "a request must carry exactly one Host header (RFC 9112); this one has "
                        "several", 400)
    host = headers.get("host")
    if not host_allowed(host, bind_host, allowed_hosts):
        shown = repr(host[:100]) if host is not None else "(none)"
        return ApiError("forbidden_host", f"this server does not answer for Host {shown}; start it with "
                        "--allowed-hosts NAME to serve other host names (see docs/server.md)", 421)
    changes_state = scope["type"] == "websocket" or scope.get("method", "GET") in STATE_CHANGING_METHODS
    scheme = "https" if scope.get("scheme") in ("https", "wss") else "http"
    if changes_state and not origin_allowed(headers.get("origin"), host, scheme, allowed_origins):
        origin = headers.get("origin", "")[:100]
        return ApiError("forbidden_origin", f"requests from the web page at origin {origin!r} are not allowed; "
                        "start the server with --allowed-origins ORIGIN to allow it (see docs/server.md)", 403)
    return None


class RequestGuardMiddleware:
    """Refuses requests with a foreign Host, and state changes or WebSocket upgrades from a foreign Origin."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        cfg = self.state.config
        error = refusal(scope, headers, cfg.allowed_hosts, cfg.host, cfg.allowed_origins)
        if error is None:
            await self.app(scope, receive, send)
        elif scope["type"] == "http" or "websocket.http.response" in (scope.get("extensions") or {}):
            # Starlette responses send the websocket.http.response.* denial messages in a WebSocket scope
            await error_response(error, self.state.metrics, path=scope["path"])(scope, receive, send)
        else:  # closing before accepting refuses the upgrade with a bare 403
            report_error(error, self.state.metrics)
            await send({"type": "websocket.close", "code": 1008})
