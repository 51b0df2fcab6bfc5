"""The `x-radixserve-replica` response header: which engine replica served an HTTP request.

Only installed when the app runs over several replicas (scaleout/). The replica is known once the
request is routed, which for a stream is after the response could have started, so the middleware
holds `http.response.start` back until the first body message and adds the header then. The note
travels in a context variable; tasks the handler starts copy the context, so they share the note.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = "x-radixserve-replica"


@dataclass
class _ReplicaNote:
    replica: str | None = None


_current: ContextVar[_ReplicaNote | None] = ContextVar("radixserve_replica_note", default=None)


def note_replica(replica: str) -> None:
    """Name the replica serving the current HTTP request (the first one named wins)."""
    note = _current.get()
    if note is not None and note.replica is None:
        note.replica = replica


class ReplicaHeaderMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        note = _ReplicaNote()
        token = _current.set(note)
        held: Message | None = None

        async def send_with_header(message: Message) -> None:
            nonlocal held
            if message["type"] == "http.response.start":
                held = message
                return
            if held is not None:
                if note.replica is not None:
                    held = {**held, "headers": [*held.get("headers", []),
                                                (HEADER.encode(), note.replica.encode("latin-1"))]}
                start, held = held, None
                await send(start)
            await send(message)

        try:
            await self.app(scope, receive, send_with_header)
            if held is not None:  # a response that ended without a body message (a client gone early)
                await send(held)
        finally:
            _current.reset(token)
