"""The Caller of each request: resolved once from its API key, read by every route.

The HTTP middleware (app.ApiKeyMiddleware) resolves the caller of every request under the API and
stores it in the ASGI scope's state (`request.state.caller`); the WebSocket handler stores the one its
query parameter or auth frame resolves. `caller_of` reads it back, and resolves it from the request's
headers where nothing stored one (a path the middleware does not cover), so a route never runs with
a caller its key does not give.

Invariants: on a server with keys (ServerConfig.tenant_keys) a caller is always authenticated; on an
open one every caller is OPEN_CALLER, an unauthenticated admin of DEFAULT_TENANT, whatever key it
sends. Admin-only endpoints call `require_admin`, which answers a `user` key with 403.

Also what a caller's tenant scopes: the session owner an owner secret names (`session_owner`: the
same secret is another owner under another tenant, so sessions never cross tenants) and the cache
namespace of a request (`request_namespace`: its tenant, narrowed by the body's `cache_salt`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from starlette.requests import HTTPConnection

from radixserve.server.auth import request_key
from radixserve.server.config import ServerConfig
from radixserve.server.owners import Owner
from radixserve.server.tenants import DEFAULT_TENANT, Caller, Role, cache_namespace, find_caller, validate_cache_salt
from radixserve.server.validation import ApiError

OPEN_CALLER = Caller(DEFAULT_TENANT, Role.ADMIN, authenticated=False)
SCOPE_KEY = "caller"  # its name in the ASGI scope's state
UNAUTHORIZED = "missing or invalid API key: send Authorization: Bearer <key> (or x-api-key: <key>)"


def resolve_caller(key: object, config: ServerConfig) -> Caller | None:
    """The caller presenting `key` (None when it presents none); None when the server has keys and this
    is none of them."""
    keys = config.tenant_keys()
    if not keys:
        return OPEN_CALLER
    return find_caller(key, keys)


def caller_of(conn: HTTPConnection) -> Caller:
    """The caller of a request or WebSocket; 401 when the server has keys and it presents none of them."""
    state = conn.scope.setdefault("state", {})
    caller = state.get(SCOPE_KEY)
    if isinstance(caller, Caller):
        return caller
    caller = resolve_caller(request_key(conn.headers), conn.app.state.server.config)
    if caller is None:
        raise ApiError("unauthorized", UNAUTHORIZED, 401)
    state[SCOPE_KEY] = caller
    return caller


def set_caller(conn: HTTPConnection, caller: Caller) -> None:
    conn.scope.setdefault("state", {})[SCOPE_KEY] = caller


def require_admin(caller: Caller) -> None:
    """403 `forbidden` unless the caller holds an admin key (or the server is open)."""
    if not caller.is_admin:
        raise ApiError("forbidden", "this endpoint needs an admin key; this key's role is user", 403)


def sees_previews(caller: Caller, config: ServerConfig) -> bool:
    """Whether system-prompt text may be shown to this caller: a key's holder sees its own tenant's
    (an admin: every tenant's); on an open server only with --show-prompt-previews (loopback only)."""
    return caller.authenticated or config.show_prompt_previews


def session_owner(secret: str | None, caller: Caller) -> Owner | None:
    """The owner an owner secret names for this caller (None without a secret): see `tenant_bound`."""
    return tenant_bound(Owner.of(secret), caller.tenant) if secret is not None else None


def tenant_bound(owner: Owner, tenant: str) -> Owner:
    """`owner` bound to `tenant`: the same secret is another owner under another tenant, so nothing a
    secret owns is found from another tenant. DEFAULT_TENANT's owners are the plain digests, as before
    there were tenants."""
    if tenant == DEFAULT_TENANT:
        return owner
    return Owner(hashlib.sha256(b"tenant\0" + tenant.encode("utf-8") + b"\0" + owner.digest).digest())


def cache_salt_of(body: Mapping[str, Any], param: str = "cache_salt") -> str | None:
    """The request's `cache_salt` (vLLM's field), None when absent; 400 invalid_field when malformed."""
    try:
        return validate_cache_salt(body.get(param), param)
    except ValueError as e:
        raise ApiError("invalid_field", f"{e} (it narrows which cached prefixes this request may hit: "
                       "requests hit only prefixes cached with the same salt)", param=param) from None


def namespace_for(caller: Caller, salt: str | None, config: ServerConfig) -> str:
    """SamplingParams.cache_namespace of a request of `caller` with `salt`."""
    return cache_namespace(caller.tenant, salt, config.cache_sharing)


def request_namespace(conn: HTTPConnection, body: Mapping[str, Any]) -> str:
    """The cache namespace of an API request: its caller's tenant and its body's `cache_salt`."""
    return namespace_for(caller_of(conn), cache_salt_of(body), conn.app.state.server.config)
