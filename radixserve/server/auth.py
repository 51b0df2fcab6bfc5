"""Access checks: the optional API key (Bearer header, WebSocket query parameter or auth frame) and the
WebSocket Origin check (same origin by default; --allowed-origins widens it, "*" allows any).

Keys are compared in constant time. Requests without an Origin header (non-browser clients) pass the
Origin check; browsers always send one on WebSocket upgrades, which is what the check protects.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from urllib.parse import urlsplit

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


def origin_allowed(headers: Mapping[str, str], allowed: list[str]) -> bool:
    origin = headers.get("origin")
    if origin is None:
        return True
    origin = origin.rstrip("/")
    if "*" in allowed or origin in allowed:
        return True
    host = headers.get("host")
    parts = urlsplit(origin)
    return host is not None and parts.scheme in ("http", "https") and parts.netloc.lower() == host.lower()
