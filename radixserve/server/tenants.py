"""Who is calling: API keys mapped to tenants and roles, and the cache namespace a tenant's request
reads and writes.

`--api-keys FILE` lists one `KEY TENANT ROLE` per line (whitespace-separated, `#` starts a comment,
ROLE `admin` or `user`). `--api-key KEY` is one admin key of DEFAULT_TENANT; with no key at all the
server is open and every caller is an unauthenticated admin of DEFAULT_TENANT (the operator's own
machine), which may still not see prompt previews unless the operator allows them on loopback.

Cache namespaces (SamplingParams.cache_namespace): under `--cache-sharing tenant` (the default) a
request's namespace is its tenant's, so it can only hit what its own tenant cached; under `global`
every tenant shares one. A request's `cache_salt` narrows it further inside either. The namespace
string is built only here (`cache_namespace`) and read back only here (`namespace_tenant`).

Invariants: keys are compared in constant time against every configured key (the time to reject
does not depend on which key came close); a key appears once in the file; tenant names are
printable, without whitespace or the namespace separator.
"""

from __future__ import annotations

import enum
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TENANT = "default"
SHARING_MODES = ("tenant", "global")
MAX_CACHE_SALT_CHARS = 256
_SEPARATOR = "\x1f"  # between tenant and salt in a namespace: no tenant name may contain it
_TENANT_NAME = re.compile(r"[A-Za-z0-9_.:@+-]{1,64}")


class Role(str, enum.Enum):
    ADMIN = "admin"
    USER = "user"


@dataclass(frozen=True)
class Caller:
    tenant: str
    role: Role
    authenticated: bool = True  # False on an open server (no key configured)

    @property
    def is_admin(self) -> bool:
        return self.role is Role.ADMIN


@dataclass(frozen=True)
class TenantKey:
    key: str
    caller: Caller


def parse_api_keys(text: str, source: str = "api keys") -> list[TenantKey]:
    """The keys of an --api-keys file's text; ValueError naming the line of the first mistake."""
    keys: list[TenantKey] = []
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) != 3:
            raise ValueError(f"{source} line {number}: expected KEY TENANT ROLE, got {len(fields)} fields")
        key, tenant, role = fields
        if role not in {r.value for r in Role}:
            raise ValueError(f"{source} line {number}: ROLE must be admin or user, got {role!r}")
        if _TENANT_NAME.fullmatch(tenant) is None:
            raise ValueError(f"{source} line {number}: TENANT must be 1 to 64 of A-Z a-z 0-9 _ . : @ + -, got {tenant!r}")
        if key in seen:
            raise ValueError(f"{source} line {number}: a key appears twice")
        seen.add(key)
        keys.append(TenantKey(key, Caller(tenant, Role(role))))
    return keys


def load_api_keys(path: str | Path) -> list[TenantKey]:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot read --api-keys file {p}: {e.strerror}") from None
    keys = parse_api_keys(text, str(p))
    if not keys:
        raise ValueError(f"--api-keys file {p} lists no keys")
    return keys


def find_caller(given: object, keys: list[TenantKey]) -> Caller | None:
    """The caller whose key is `given`, None if it is none of them; compares against every key."""
    if not isinstance(given, str):
        return None
    raw = given.encode("utf-8", "surrogatepass")
    found = None
    for k in keys:
        if secrets.compare_digest(raw, k.key.encode("utf-8")):
            found = k.caller
    return found


def validate_cache_salt(salt: object, param: str = "cache_salt") -> str | None:
    """A request's cache_salt: None when absent; ValueError unless a non-empty string of at most
    MAX_CACHE_SALT_CHARS characters."""
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt or len(salt) > MAX_CACHE_SALT_CHARS:
        raise ValueError(f"{param} must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters")
    return salt


def cache_namespace(tenant: str, cache_salt: str | None, sharing: str) -> str:
    """The namespace of a request from `tenant` with `cache_salt` under the sharing mode."""
    if sharing not in SHARING_MODES:
        raise ValueError(f"cache sharing must be one of {SHARING_MODES}, got {sharing!r}")
    owner = tenant if sharing == "tenant" else ""
    return owner if cache_salt is None else f"{owner}{_SEPARATOR}{cache_salt}"


def namespace_tenant(namespace: str) -> str:
    """The tenant a namespace belongs to ("" for the shared one under global sharing)."""
    return namespace.split(_SEPARATOR, 1)[0]


def is_salted(namespace: str) -> bool:
    return _SEPARATOR in namespace
