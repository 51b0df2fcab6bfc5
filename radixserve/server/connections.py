"""Connection limits below the app: how many sockets may be open, and how long a client may take to
send a request. uvicorn has neither (its keep-alive timeout starts only after a first response), so
a client could hold silent, header-trickling or body-trickling sockets forever and, past the
process's file-descriptor limit, stop the server from accepting anyone, /health included.

Owns: `ConnectionGuard` (the open connections, shared by one server's protocols), the uvicorn HTTP
protocol class it runs (`guarded_http_protocol`, a subclass of uvicorn's own) and the WebSocket
protocol subclass that keeps an upgraded connection counted until it closes.

Invariants:
- At most `cap` connections are open, HTTP and upgraded WebSockets together, and `cap` leaves
  FD_RESERVE descriptors of the process's limit free (`connection_cap`). A connection beyond the cap
  first evicts the connection that has waited longest for a request head (fresh, trickling or idle
  between requests): holding one costs an attacker nothing, and a real client sends its head at
  once. When every open connection is busy (a request in flight, a WebSocket), the new one gets a
  canned 503 with Retry-After and is closed (after reading its request for at most LINGER_S, so the
  close sends no RST that would hide the 503; at most LINGER_MAX do that at once, within FD_RESERVE).
  So the server never runs out of descriptors and keeps accepting; nothing of a refused request is
  parsed.
- A request head must be complete within `header_timeout_s` of the connection opening (or of the
  previous response ending), however it trickles in, and its body within `body_timeout_s` of the
  head; past either deadline the client gets a 408 and the socket is closed. Once a request is
  complete the time is the app's (a generation may run long); an idle keep-alive connection is
  closed by uvicorn after `timeout_keep_alive`.
- Refusals and timeouts are decided on the event loop with O(1) work per connection; the JSON bodies
  are the server's error format (api_errors.error_body; Anthropic's shape for a body timing out under
  /v1/messages).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, ClassVar

from radixserve.server.api_errors import anthropic_error_body, error_body, speaks_anthropic
from radixserve.server.validation import ApiError

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _UvicornHTTP
except ImportError:  # pragma: no cover - httptools is an optional speed-up of uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol as _UvicornHTTP  # type: ignore[assignment]

log = logging.getLogger("radixserve.server")
FD_RESERVE = 64  # descriptors kept free beyond the cap: model files, the engine, logging, the listener
RETRY_AFTER_S = 1  # what a refused client is told to wait, in seconds
WARN_EVERY_S = 10.0  # at most one log line per this many seconds about refusals and timeouts
LINGER_S, LINGER_MAX = 1.0, 16  # a refused connection reads its request this long; at most this many at once
HEAD, BODY, BUSY = "head", "body", "busy"


def _canned(status: int, reason: str, error: ApiError, extra: str = "", path: str | None = None) -> bytes:
    """A whole HTTP response of `error`, in the shape of the API `path` is under (OpenAI's when unknown)."""
    body = json.dumps(anthropic_error_body(error) if speaks_anthropic(path) else error_body(error)).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"{extra}connection: close\r\n\r\n")
    return head.encode("latin-1") + body


def open_fd_count() -> int:
    for d in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(d))
        except OSError:
            continue
    return 32  # unknown platform: a guess


def connection_cap(max_connections: int) -> int:
    """The connections this process can hold: `max_connections`, less whatever the descriptor limit
    cannot hold beside the descriptors already open and FD_RESERVE. The soft limit is raised toward
    what the cap needs when the hard limit allows (never lowered)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return max_connections
    in_use = open_fd_count()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + in_use + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < want:
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return max_connections
    return max(1, min(max_connections, soft - in_use - FD_RESERVE))


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    header_timeout_s: float
    body_timeout_s: float


class ConnectionGuard:
    """The open connections of one server, keyed by transport (an upgraded WebSocket keeps its
    transport, not its protocol object), and the ones waiting for a request head, oldest first."""

    def __init__(self, limits: ConnectionLimits, cap: int | None = None) -> None:
        self.limits = limits
        self.cap = cap if cap is not None else connection_cap(limits.max_connections)
        self.open: set[Any] = set()
        self.waiting: OrderedDict[Any, GuardedHTTPProtocol] = OrderedDict()  # transport -> protocol in HEAD
        self.refused = self.evicted = self.timed_out = 0
        self.lingering = 0  # refused connections still reading their request before they close
        self._ws_classes: dict[type, type] = {}
        self._warned_at = -WARN_EVERY_S

    def admit(self, transport: Any) -> bool:
        """Count a new connection in, evicting the longest-waiting idle one at the cap; False: refuse it."""
        if len(self.open) >= self.cap:
            if not self.waiting:
                self.refused += 1
                self._warn("refusing connections: all %d are busy (--max-connections)", self.cap)
                return False
            _, oldest = self.waiting.popitem(last=False)
            self.evicted += 1
            self._warn("at the cap of %d connections: closing the ones idle longest (--max-connections)", self.cap)
            oldest.evict()
        self.open.add(transport)
        return True

    def release(self, transport: Any) -> None:
        """Idempotent: a connection's end, whichever protocol saw it."""
        self.open.discard(transport)
        self.waiting.pop(transport, None)

    def closed_by_reason(self) -> dict[str, int]:
        """Connections the guard refused or closed, by why (a metric)."""
        return {"refused_over_cap": self.refused, "evicted_idle": self.evicted, "timed_out": self.timed_out}

    def ws_class(self, base: type) -> type:
        """`base` (uvicorn's WebSocket protocol) whose connection_lost releases the connection."""
        if base not in self._ws_classes:
            guard = self

            class GuardedWebSocket(base):
                def connection_lost(self, exc: Exception | None) -> None:
                    try:
                        super().connection_lost(exc)
                    finally:
                        guard.release(self.transport)

            self._ws_classes[base] = GuardedWebSocket
        return self._ws_classes[base]

    def _warn(self, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            log.warning(msg, *args)


OVER_CAP = _canned(503, "Service Unavailable", ApiError(
    "overloaded", "the server has too many open connections; retry later", 503), f"retry-after: {RETRY_AFTER_S}\r\n")


class GuardedHTTPProtocol(_UvicornHTTP):
    """uvicorn's HTTP protocol under a ConnectionGuard: the cap at connection_made, and one deadline
    per phase (HEAD: header timeout, BODY: body timeout, BUSY: none), re-armed on each phase change."""

    guard: ClassVar[ConnectionGuard]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.ws_protocol_class is not None:
            self.ws_protocol_class = self.guard.ws_class(self.ws_protocol_class)
        self._admitted = self._lingering = False
        self._phase: str | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if not self.guard.admit(transport):
            self._refuse(transport)
            return
        self._admitted = True
        super().connection_made(transport)
        self._update()

    def _refuse(self, transport: asyncio.Transport) -> None:
        """The canned 503, then FIN. Closing while the client's request sits unread would send a RST,
        which makes the client drop the 503 unread, so the request is read and dropped for at most
        LINGER_S first; past LINGER_MAX such sockets (a flood) the rest are closed at once."""
        self.transport = transport
        transport.write(OVER_CAP)
        if self.guard.lingering >= LINGER_MAX or not transport.can_write_eof():
            transport.close()
            return
        self.guard.lingering += 1
        self._lingering = True
        transport.write_eof()
        self._timer = self.loop.call_later(LINGER_S, transport.close)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._admitted:  # refused: uvicorn never saw it
            if self._timer is not None:
                self._timer.cancel()
            if self._lingering:
                self.guard.lingering -= 1
            return
        self._set_phase(None)
        self.guard.release(self.transport)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._admitted:
            return  # a refused connection's request: read only so that closing sends no RST
        super().data_received(data)
        self._update()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._update()

    def handle_websocket_upgrade(self, *args: Any) -> None:
        self._set_phase(None)  # the WebSocket protocol owns the transport now; it stays counted until closed
        super().handle_websocket_upgrade(*args)

    def evict(self) -> None:
        """Closed to make room (the guard has already released it)."""
        self._set_phase(None)
        self.transport.abort()

    # -- phases ------------------------------------------------------------------------------------
    def _current_phase(self) -> str | None:
        t = self.transport
        if t is None or t.is_closing() or t.get_protocol() is not self:
            return None
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            return HEAD
        return BODY if cycle.more_body else BUSY

    def _update(self) -> None:
        phase = self._current_phase()
        if phase != self._phase:
            self._set_phase(phase)

    def _set_phase(self, phase: str | None) -> None:
        self._phase = phase
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        limits, key = self.guard.limits, self.transport
        if phase == HEAD:
            self.guard.waiting[key] = self
            self.guard.waiting.move_to_end(key)
        else:
            self.guard.waiting.pop(key, None)
        timeout = {HEAD: limits.header_timeout_s, BODY: limits.body_timeout_s}.get(phase or "")
        if phase is not None and timeout is not None:
            self._timer = self.loop.call_later(timeout, self._expire, phase)

    def _expire(self, phase: str) -> None:
        self._timer = None
        if self._current_phase() != phase:  # a transition nobody reported: start the new phase's clock
            self._update()
            return
        self.guard.timed_out += 1
        what = "request head" if phase == HEAD else "request body"
        timeout = self.guard.limits.header_timeout_s if phase == HEAD else self.guard.limits.body_timeout_s
        self.guard._warn("closing connections whose %s did not arrive within %.0f s", what, timeout)
        self._set_phase(None)
        # the app's request (BODY) sees a disconnect; a 408 only where no response has begun
        if phase == HEAD or not self.cycle.response_started:
            error = ApiError("request_timeout", f"the {what} did not arrive within {timeout:g} s", 408)
            path = self.cycle.scope.get("path") if phase == BODY and self.cycle is not None else None
            self.transport.write(_canned(408, "Request Timeout", error, path=path))
        self.transport.close()


def guarded_http_protocol(guard: ConnectionGuard) -> type[asyncio.Protocol]:
    """The protocol class to give uvicorn.Config(http=...) for a server guarded by `guard`."""
    return type("GuardedHTTPProtocol", (GuardedHTTPProtocol,), {"guard": guard})
