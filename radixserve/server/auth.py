"""The optional API key: Bearer header over HTTP, query parameter or auth frame on the WebSocket.

Keys are compared in constant time. Host and Origin checks live in request_guard, which runs first.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping

PUBLIC_PATHS = ("/health",)


def key_matches(given: object, expected: str | None) -> bool:
    if expected is None:
        return True
    if not isinstance(given, str):
        return False
    return secrets.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode("utf-8"))


def bearer_token(headers: Mapping[str, str]) -> str | None:
    value = headers.get("authorization")
    if value is None:
        return None
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def needs_key(path: str) -> bool:
    """The API and metrics need the key; the static UI and /health stay public."""
    return (path.startswith("/v1/") or path == "/v1" or path == "/metrics") and path not in PUBLIC_PATHS
