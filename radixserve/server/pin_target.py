"""What an operator asks to pin, as the pins API's body or a `--pin FILE` line names it: the
messages a chat begins with (`{"system": ...}` or `{"messages": [...]}`), for which tenant, under
which label. Parsed and checked here, before any model is loaded (a bad --pin file fails the start).

`--pin FILE` is JSON lines: one object per line, as the POST /v1/cache/pins body (`system` or
`messages`, optional `tenant` (default: DEFAULT_TENANT) and `label`); blank lines and lines starting
with `#` are skipped.

Invariants: a target has at least one message, each a system, user or assistant turn of text (and
a system prompt is not empty); a label is at most MAX_LABEL_CHARS characters; every mistake is a
ValueError naming the field (and, in a file, the line).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixserve.chat.template import Message
from radixserve.server.tenants import DEFAULT_TENANT, TenantKey

ROLES = ("system", "user", "assistant")
MAX_LABEL_CHARS = 200
LABEL_CHARS = 80  # of the first message, when a pin is given no label (as the stats' previews)


@dataclass(frozen=True)
class PinTarget:
    """A prefix to pin: the messages a chat begins with, for `tenant` (None: the caller's)."""

    messages: tuple[Message, ...]
    tenant: str | None
    label: str = ""  # "" -> the start of the first message (`label_or_default`)

    def label_or_default(self) -> str:
        return self.label or " ".join(str(self.messages[0]["content"]).split())[:LABEL_CHARS]


def parse_target(body: Any, where: str = "") -> PinTarget:
    """`{"system": str}` or `{"messages": [...]}` (one of them), optional `tenant` and `label`;
    ValueError naming the field (after `where`, e.g. "--pin f line 3: ") on a mistake."""
    if not isinstance(body, dict):
        raise ValueError(f"{where}a pin is a JSON object with 'system' or 'messages'")
    unknown = sorted(set(body) - {"system", "messages", "tenant", "label"})
    if unknown:
        raise ValueError(f"{where}unknown field {unknown[0]!r} (a pin takes system or messages, tenant, label)")
    system, raw = body.get("system"), body.get("messages")
    if (system is None) == (raw is None):
        raise ValueError(f"{where}give exactly one of 'system' (a system prompt) or 'messages' (the turns a "
                         "chat begins with)")
    if system is not None:
        if not isinstance(system, str) or not system:
            raise ValueError(f"{where}'system' must be a non-empty string")
        messages: tuple[Message, ...] = ({"role": "system", "content": system},)
    else:
        messages = _messages(raw, where)
    tenant, label = body.get("tenant"), body.get("label", "")
    if tenant is not None and (not isinstance(tenant, str) or not tenant):
        raise ValueError(f"{where}'tenant' must be a non-empty string")
    if not isinstance(label, str) or len(label) > MAX_LABEL_CHARS:
        raise ValueError(f"{where}'label' must be a string of at most {MAX_LABEL_CHARS} characters")
    return PinTarget(messages, tenant, label)


def _messages(raw: Any, where: str) -> tuple[Message, ...]:
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{where}'messages' must be a non-empty list")
    out: list[Message] = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or set(m) != {"role", "content"} or m["role"] not in ROLES \
                or not isinstance(m["content"], str):
            raise ValueError(f"{where}messages[{i}] must be {{\"role\": one of {list(ROLES)}, \"content\": str}}")
        out.append({"role": m["role"], "content": m["content"]})
    return tuple(out)


def parse_pin_file(text: str, source: str) -> list[PinTarget]:
    targets = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{source} line {number}: "
        try:
            body = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}not a JSON object ({e.msg} at column {e.colno}); the file is JSON lines, "
                             "one pin per line") from None
        target = parse_target(body, where)
        targets.append(PinTarget(target.messages, target.tenant or DEFAULT_TENANT, target.label))
    return targets


def load_pin_file(path: str | Path) -> list[PinTarget]:
    """The pins a --pin file lists; ValueError naming the file (and line) of the first mistake."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read --pin file {p}: {getattr(e, 'strerror', None) or e}") from None
    targets = parse_pin_file(text, f"--pin file {p}")
    if not targets:
        raise ValueError(f"--pin file {p} lists no pins")
    return targets


def known_tenants(keys: list[TenantKey]) -> set[str]:
    """The tenants a pin may be for: those of the server's keys, and DEFAULT_TENANT (an open server's)."""
    return {DEFAULT_TENANT, *(k.caller.tenant for k in keys)}


def check_tenant(tenant: str, known: set[str]) -> None:
    """ValueError for a pin of a tenant no key belongs to (no request could ever hit it)."""
    if tenant not in known:
        raise ValueError(f"tenant {tenant!r}: no API key belongs to it, so no request could hit its pin (known: "
                         f"{', '.join(sorted(known))})")
