"""Chat sessions: the exact token IDs of a conversation plus its messages, shared by REST and WebSocket.

Invariants: `tokens` is always a closed conversation in chat-template form (every message ends the
way the template ends it); messages[i].token_start/token_end index that list, so a fork at message k
copies tokens[:messages[k].token_start] and its next prompt hits the parent's cached blocks. At most
one generation per session (`busy`). Ids come from secrets.token_urlsafe, so they cannot be guessed.
Ownership: every session belongs to one Owner (the digest of a client's secret, see owners.py);
get, list, delete and fork take the caller's Owner and treat a session of another owner (or a
caller without one) exactly as an unknown one, without touching it (it neither moves in the LRU
order nor lives longer). A fork belongs to the parent's owner, who is the caller.
Capacity: at `max_sessions`, creating another evicts the least recently used idle session; if every
session is busy generating, creation fails with 429. Sessions idle for longer than `ttl_s` expire.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from radixserve.server.chat_template import ChatFormatter
from radixserve.server.owners import NOBODY, Owner
from radixserve.server.validation import ApiError

PREVIEW_CHARS = 80


@dataclass
class Message:
    role: str  # "user" | "assistant"
    content: str
    token_start: int
    token_end: int
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
    timing: dict[str, float] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        for name in ("usage", "timing", "finish_reason"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


@dataclass
class Session:
    id: str
    system_prompt: str | None
    sampling: dict[str, Any]
    created: float  # wall clock, for display
    last_used: float  # monotonic, for expiry
    owner: bytes  # Owner.digest of the creator's secret; never sent to clients
    tokens: list[int] = field(default_factory=list)
    system_len: int = 0  # tokens[:system_len] is the rendered system prompt
    messages: list[Message] = field(default_factory=list)
    busy: str | None = None  # gen_id of the generation in flight

    def template_messages(self, upto: int | None = None) -> list[dict[str, str]]:
        msgs = [{"role": "system", "content": self.system_prompt}] if self.system_prompt is not None else []
        return msgs + [{"role": m.role, "content": m.content} for m in self.messages[:upto]]

    def preview(self) -> str:
        first = next((m.content for m in self.messages if m.role == "user"), "")
        return first[:PREVIEW_CHARS]

    def summary(self) -> dict[str, Any]:
        return {"id": self.id, "system_prompt": self.system_prompt, "created": self.created,
                "num_messages": len(self.messages), "preview": self.preview(), "busy": self.busy is not None}

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "system_prompt": self.system_prompt, "sampling": dict(self.sampling),
                "created": self.created, "messages": [m.to_json() for m in self.messages],
                "num_tokens": len(self.tokens), "busy": self.busy is not None}


class SessionStore:
    def __init__(self, formatter: ChatFormatter, max_sessions: int, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.formatter = formatter
        self.max_sessions, self.ttl_s, self.clock = max_sessions, ttl_s, clock
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self.evicted = 0
        self.expired = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def create(self, system_prompt: str | None, sampling: dict[str, Any], owner: Owner) -> Session:
        self.expire()
        if len(self._sessions) >= self.max_sessions:
            self._evict_one()
        s = Session(id=secrets.token_urlsafe(18), system_prompt=system_prompt, sampling=dict(sampling),
                    created=time.time(), last_used=self.clock(), owner=owner.digest)
        if system_prompt is not None:
            s.tokens = self.formatter.encode(self.formatter.render(s.template_messages(), add_generation_prompt=False))
            s.system_len = len(s.tokens)
        self._sessions[s.id] = s
        return s

    def get(self, session_id: Any, owner: Owner | None) -> Session:
        """The caller's session; unknown_session (404) when it does not exist, has expired, or is not theirs."""
        s = self._sessions.get(session_id) if isinstance(session_id, str) else None
        if s is not None and s.busy is None and self.clock() - s.last_used > self.ttl_s:
            del self._sessions[s.id]
            self.expired += 1
            s = None
        # always one constant-time comparison: a miss, a foreign session and no secret answer alike
        matches = (owner if owner is not None else NOBODY).owns(s.owner if s is not None else NOBODY.digest)
        if s is None or owner is None or not matches:
            raise ApiError("unknown_session", "unknown, deleted or expired session", 404)
        self.touch(s)
        return s

    def touch(self, s: Session) -> None:
        s.last_used = self.clock()
        if s.id in self._sessions:
            self._sessions.move_to_end(s.id)

    def list(self, owner: Owner | None) -> list[Session]:
        """The caller's sessions, newest first (none for a caller without an owner secret)."""
        self.expire()
        if owner is None:
            return []
        mine = [s for s in self._sessions.values() if owner.owns(s.owner)]
        return sorted(mine, key=lambda s: s.created, reverse=True)

    def delete(self, session_id: Any, owner: Owner | None) -> Session:
        s = self.get(session_id, owner)
        del self._sessions[s.id]
        return s

    def fork(self, session_id: Any, at_message: int, owner: Owner | None) -> Session:
        parent = self.get(session_id, owner)
        if not 0 <= at_message <= len(parent.messages):
            raise ApiError("invalid_field", f"at_message must be in [0, {len(parent.messages)}], got {at_message}",
                           param="at_message")
        cut = parent.messages[at_message].token_start if at_message < len(parent.messages) else len(parent.tokens)
        tokens, messages = list(parent.tokens[:cut]), [Message(**vars(m)) for m in parent.messages[:at_message]]
        # may evict the parent when the cap is 1; the child is the caller's, who owns the parent
        child = self.create(parent.system_prompt, parent.sampling, Owner(parent.owner))
        child.tokens, child.messages, child.system_len = tokens, messages, parent.system_len
        return child

    def expire(self) -> int:
        now, gone = self.clock(), 0
        for s in list(self._sessions.values()):
            if s.busy is None and now - s.last_used > self.ttl_s:
                del self._sessions[s.id]
                gone += 1
        self.expired += gone
        return gone

    def _evict_one(self) -> None:
        victim = next((s for s in self._sessions.values() if s.busy is None), None)
        if victim is None:
            raise ApiError("too_many_sessions", f"all {self.max_sessions} sessions are generating; try again later",
                           429)
        del self._sessions[victim.id]
        self.evicted += 1
