"""Per-client slots for grammar compiles: one client's structured-output requests may hold at most
`ServerConfig.max_compiles_per_client` of the engine's compile workers (engine/grammar/workers.py) at once, so its
slow grammars queue behind each other, never in front of another client's.

Owns `CompileSlots` (the compiles in flight per client address) and `CLIENT`, the address of the
connection a request came on, set by the API middleware (app.ApiKeyMiddleware) for every HTTP request
and WebSocket, so each API's compile (structured.compile_off_loop) finds its client without being
handed it.

Invariants: a client over its slots gets 429 `rate_limited` with `retry_after`, before any work; a
slot is held only while its compile runs and is released however the compile ends; an address with no
compile in flight has no entry, so memory is bounded by the compiles in flight. Behind a reverse
proxy every client has the proxy's address: raise the limit there.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from radixserve.server.validation import ApiError

CLIENT: ContextVar[str | None] = ContextVar("radixserve_client", default=None)


class CompileSlots:
    def __init__(self) -> None:
        self.refused = 0
        self._busy: dict[str, int] = {}

    def busy(self, client: str) -> int:
        return self._busy.get(client, 0)

    @contextmanager
    def hold(self, client: str | None, per_client: int) -> Iterator[None]:
        """One of `client`'s `per_client` compile slots (the event loop's: not thread-safe, and need not
        be) for the block's duration; ApiError 429 when none is free. No address (an in-process caller):
        no limit."""
        if client is None:
            yield
            return
        if self._busy.get(client, 0) >= per_client:
            self.refused += 1
            raise ApiError("rate_limited", f"this client already has {per_client} grammar compile(s) in "
                           "flight; retry when it ends", 429, retry_after=1)
        self._busy[client] = self._busy.get(client, 0) + 1
        try:
            yield
        finally:
            left = self._busy[client] - 1
            if left:
                self._busy[client] = left
            else:
                del self._busy[client]
