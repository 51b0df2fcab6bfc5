"""Where a request's API key is: `Authorization: Bearer` or `x-api-key` (Anthropic's header) over
HTTP, query parameter or auth frame on the WebSocket; which paths need one; and the priorities a key
may send.

Which caller (tenant, role) a key is, is callers.py's (over tenants.py's constant-time comparison of
every configured key). Host and Origin checks live in request_guard, which runs first. Each
`--priority-api-key` is an admin key of the default tenant whose holder may send any `priority`;
everyone else is held to `--priority-range`.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping

from radixserve.engine.intake import PRIORITY_LIMIT
from radixserve.server.config import ServerConfig

PUBLIC_PATHS = ("/health",)


def key_matches(given: object, expected: str) -> bool:
    if not isinstance(given, str):
        return False
    return secrets.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode("utf-8"))


def is_priority_key(given: object, config: ServerConfig) -> bool:
    return any(key_matches(given, key) for key in config.priority_api_keys)


def priority_bounds(given: object, config: ServerConfig) -> tuple[int, int]:
    """The `priority` values a caller presenting `given` (a key, or None) may send."""
    return (-PRIORITY_LIMIT, PRIORITY_LIMIT) if is_priority_key(given, config) else config.priority_range


def bearer_token(headers: Mapping[str, str]) -> str | None:
    value = headers.get("authorization")
    if value is None:
        return None
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def request_key(headers: Mapping[str, str]) -> str | None:
    """The key an HTTP request presents: its `x-api-key` header when it sends one (Anthropic's clients
    can), else its Bearer token. `headers` must look names up in lower case (ASGI's, Starlette's)."""
    key = headers.get("x-api-key")
    return key.strip() if key else bearer_token(headers)


def needs_key(path: str) -> bool:
    """The API and metrics need the key; the static UI and /health stay public."""
    return (path.startswith("/v1/") or path == "/v1" or path == "/metrics") and path not in PUBLIC_PATHS
