"""Host and Origin rules as pure functions: which Host headers the server answers and which browser
Origins may act on it. No web framework here, so the server's config can validate its flags with
them without importing Starlette; the middleware that applies them is request_guard.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from urllib.parse import urlsplit

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
WILDCARD_BINDS = ("", "0.0.0.0", "::")  # bind-all addresses: never a Host a client legitimately sends
DEFAULT_PORTS = {"http": 80, "https": 443}


_HOST = re.compile(r"(?:\[(?P<v6>[0-9a-f:.]+)\]|(?P<name>[a-z0-9_.-]+)|(?P<bare_v6>[0-9a-f]*:[0-9a-f:.]+))"
                   r"(?::(?P<port>[0-9]{1,5}))?")


def split_host(value: str) -> tuple[str, int | None] | None:
    """A Host header or allow-list entry ("name", "name:port", "[v6]:port", a bare v6 address) as (lower-case
    name without brackets or trailing dot, port or None); None when it is not well formed."""
    m = _HOST.fullmatch(value.strip().lower())
    if m is None:
        return None
    if m["bare_v6"] is not None:  # greedy: a bare v6 address never carries a port ("::1:8000" is an address)
        return m["bare_v6"], None
    name = (m["v6"] or m["name"]).removesuffix(".")
    port = int(m["port"]) if m["port"] else None
    if not name or (port is not None and port > 65535):
        return None
    return name, port


def allowed_host_entries(bind_host: str, extra: Iterable[str]) -> list[tuple[str, int | None]]:
    """The allow-list: loopback names, the bound host unless it binds every address, then `extra`."""
    entries: list[tuple[str, int | None]] = [(h, None) for h in LOOPBACK_HOSTS]
    bound = bind_host.strip().lower().strip("[]")
    if bound not in WILDCARD_BINDS:
        entries.append((bound, None))
    entries += [parsed for entry in extra if (parsed := split_host(entry)) is not None]
    return entries


def host_allowed(host: str | None, bind_host: str, extra: list[str]) -> bool:
    """Is this Host header one the server answers? An entry without a port matches any port."""
    if "*" in extra:
        return True
    parsed = split_host(host) if host is not None else None
    if parsed is None:
        return False
    name, port = parsed
    return any(name == n and (p is None or p == port) for n, p in allowed_host_entries(bind_host, extra))


def origin_allowed(origin: str | None, host: str | None, scheme: str, allowed_origins: list[str]) -> bool:
    """May a browser page at `origin` act on this server? Same origin (scheme, host and port equal to this
    request's), a listed origin, or no Origin at all (not a browser)."""
    if origin is None:
        return True
    origin = origin.strip().rstrip("/").lower()
    if "*" in allowed_origins or origin in allowed_origins:
        return True
    if host is None:
        return False
    parts = urlsplit(origin)
    if parts.scheme != scheme or parts.path or parts.query or parts.fragment or parts.username is not None:
        return False
    mine, theirs = split_host(host), split_host(parts.netloc)
    if mine is None or theirs is None:
        return False
    default = DEFAULT_PORTS.get(scheme)
    return (mine[0], mine[1] or default) == (theirs[0], theirs[1] or default)
