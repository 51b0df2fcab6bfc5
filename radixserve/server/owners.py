"""Session owner secrets: who may list, read, message, fork, delete and resume a session.

A client identifies itself with an owner secret: the `X-Session-Owner` header over REST, an `owner`
field on the WebSocket's session.create / session.resume / chat frames (browsers cannot set headers
on a WebSocket upgrade, and query parameters end up in logs). Creating a session without one mints
a fresh secret (secrets.token_urlsafe) and returns it; creating one with a secret binds the session
to it, so all of a client's sessions share one secret and listing finds them.

Invariants: a session stores only the SHA-256 digest of its owner's secret, never the secret;
digests are compared in constant time; a missing or wrong secret is answered exactly like an
unknown session (SessionStore raises the same `unknown_session`), so session ids cannot be probed.
A malformed secret (wrong type, length or characters) is a 400 `invalid_field`: that says nothing
about any session. A secret must carry at least 128 bits: MIN_SECRET_CHARS characters of URL-safe
base64 (6 bits each; what secrets.token_urlsafe(16) makes), so a client cannot pick a guessable one.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from radixserve.server.validation import ApiError

OWNER_HEADER = "X-Session-Owner"
OWNER_FIELD = "owner"
MIN_SECRET_BITS = 128
MIN_SECRET_CHARS, MAX_SECRET_CHARS = -(-MIN_SECRET_BITS // 6), 256  # 22 base64 characters hold 132 bits
# URL-safe base64 (what token_urlsafe makes) plus a few more unreserved characters; nothing that
# could split a header or a log line
_SECRET = re.compile(rf"[A-Za-z0-9_.~+/=-]{{{MIN_SECRET_CHARS},{MAX_SECRET_CHARS}}}")


@dataclass(frozen=True)
class Owner:
    """A client identity as the server keeps it: the digest of its secret."""

    digest: bytes

    @classmethod
    def of(cls, secret: str) -> Owner:
        return cls(hashlib.sha256(secret.encode("ascii")).digest())

    def owns(self, digest: bytes) -> bool:
        return secrets.compare_digest(self.digest, digest)


# compared against when a session id is unknown, so a miss costs what a wrong owner costs
NOBODY = Owner.of(secrets.token_urlsafe(32))


def mint_secret() -> str:
    return secrets.token_urlsafe(24)


def parse_secret(value: Any, param: str) -> str | None:
    """A well-formed secret, None when absent; ApiError(invalid_field) when malformed."""
    if value is None:
        return None
    if not isinstance(value, str) or _SECRET.fullmatch(value) is None:
        raise ApiError("invalid_field", f"{param} must be a string of {MIN_SECRET_CHARS} to {MAX_SECRET_CHARS} "
                       f"URL-safe characters, at least {MIN_SECRET_BITS} bits (the 'owner' a session create "
                       "returned, or secrets.token_urlsafe(16) or longer)", param=param)
    return value


def secret_from_headers(headers: Mapping[str, str]) -> str | None:
    return parse_secret(headers.get(OWNER_HEADER.lower()), OWNER_HEADER)


def secret_from_frame(frame: Mapping[str, Any]) -> str | None:
    return parse_secret(frame.get(OWNER_FIELD), OWNER_FIELD)


def owner_of(secret: str | None) -> Owner | None:
    return Owner.of(secret) if secret is not None else None
