"""Caps on generations in flight, server-wide and per client, taken before a request costs anything
(its prompt is not tokenized yet).

Owns: `GenerationLimits` (the counts, on ServerState), `Slot` (one held place) and
`ReleaseSlotsMiddleware` (which gives back an HTTP request's slots when its response has ended).

A slot is one API request that generates: an OpenAI chat completion (whatever its `n` or beam
width), a REST session message, a WebSocket `chat` frame; and an Anthropic count_tokens, which
tokenizes a whole prompt on the same worker as generations do. A client is its peer address; behind a
reverse proxy every client has the proxy's address, so raise --max-generations-per-client there.

Invariants:
- A request that would take a client past `max_generations_per_client` is refused with 429
  `too_many_generations`; one that would take the server past `max_concurrent_generations` with 503
  `overloaded`. Both carry Retry-After (the WebSocket error frame: `retry_after`), before any
  response starts.
- A slot is held until the request's response has ended (HTTP: the ASGI call returns, after a
  stream too, or when the client left; WebSocket: the generation's task ends) and is released
  exactly once, so the counts never leak.
- The caps are read from the config per call, so they can be changed on a running server.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Receive, Scope, Send

from radixserve.server.validation import ApiError

if TYPE_CHECKING:
    from radixserve.server.config import ServerConfig

RETRY_AFTER_S = 1  # generations take seconds; a refused client may try again this soon
SLOTS_KEY = "radixserve.generation_slots"  # the scope entry listing an HTTP request's slots


class Slot:
    def __init__(self, limits: GenerationLimits, client: str) -> None:
        self.limits, self.client = limits, client
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.limits._give_back(self.client)


REFUSAL_REASONS = ("client_cap", "server_cap")


class GenerationLimits:
    def __init__(self) -> None:
        self.total = 0
        self.per_client: dict[str, int] = {}  # only clients holding slots: bounded by the server-wide cap
        self.refused = dict.fromkeys(REFUSAL_REASONS, 0)  # requests refused, by cap (a metric)

    def acquire(self, client: str | None, config: ServerConfig) -> Slot:
        key = client or "unknown"
        held, cap = self.per_client.get(key, 0), config.max_generations_per_client
        if held >= cap:
            self.refused["client_cap"] += 1
            raise ApiError("too_many_generations", f"this client already has {held} generations running, the most "
                           f"allowed (--max-generations-per-client); retry in {RETRY_AFTER_S} s", 429,
                           retry_after=RETRY_AFTER_S)
        if self.total >= config.max_concurrent_generations:
            self.refused["server_cap"] += 1
            raise ApiError("overloaded", f"the server is running {self.total} generations, the most it takes "
                           f"(--max-concurrent-generations); retry in {RETRY_AFTER_S} s", 503,
                           retry_after=RETRY_AFTER_S)
        self.total += 1
        self.per_client[key] = held + 1
        return Slot(self, key)

    def _give_back(self, key: str) -> None:
        self.total -= 1
        left = self.per_client[key] - 1
        if left:
            self.per_client[key] = left
        else:
            del self.per_client[key]


def client_of(conn: HTTPConnection) -> str | None:
    return conn.client.host if conn.client is not None else None


def hold_generation(conn: HTTPConnection, limits: GenerationLimits, config: ServerConfig) -> None:
    """Take a slot for this HTTP request (ApiError when over a cap); ReleaseSlotsMiddleware gives it back."""
    slots = conn.scope.get(SLOTS_KEY)
    assert isinstance(slots, list), "ReleaseSlotsMiddleware must be installed"
    slots.append(limits.acquire(client_of(conn), config))


class ReleaseSlotsMiddleware:
    """Releases the slots an HTTP request took once the app is done with it, however it ended."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        slots: list[Slot] = []
        scope[SLOTS_KEY] = slots  # a list: a copied scope still shares it
        try:
            await self.app(scope, receive, send)
        finally:
            for slot in slots:
                slot.release()
