"""Chat sessions: the exact token IDs of a conversation plus its messages, shared by REST and WebSocket.

Invariants: `tokens` is always a closed conversation in chat-template form (every message ends the
way the template ends it); messages[i].token_start/token_end index that list, so a fork at message k
copies tokens[:messages[k].token_start] and its next prompt hits the parent's cached blocks. At most
one generation per session (`busy`). Ids come from secrets.token_urlsafe, so they cannot be guessed.
Ownership: every session belongs to one Owner (the digest of a client's secret, see owners.py);
get, list, delete and fork take the caller's Owner and treat a session of another owner (or a
caller without one) exactly as an unknown one, without touching it (it neither moves in the LRU
order nor lives longer). A fork belongs to the parent's owner, who is the caller.

Memory: tokens are an array('i') (4 bytes per token, not a list of Python ints at ~36 bytes each);
they become a list only at the engine boundary, for the duration of one request. Text is held once
(the system prompt and each message's content); nothing keeps the rendered template text.
`Session.footprint()` estimates a session's bytes, and the store keeps `total_bytes`, the sum over
its sessions, current at every change (`account`).

Capacity: at `max_sessions`, or when a new session (or a turn's new message) would take
`total_bytes` over `max_bytes`, the least recently used idle sessions are evicted; if only sessions
busy generating are left, the request fails with 429. A session larger than the whole budget is
refused with 413. A reply is accounted when its turn ends, evicting others if needed (never the
session itself), so the budget can be exceeded by at most the replies still being generated.
Sessions idle for longer than `ttl_s` expire.
"""

from __future__ import annotations

import dataclasses
import secrets
import sys
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from radixserve.engine.chat_template import ChatFormatter
from radixserve.server.owners import NOBODY, Owner
from radixserve.server.validation import ApiError

PREVIEW_CHARS = 80
TOKEN_BYTES = 4
MESSAGE_OVERHEAD_BYTES = 256  # a Message object, its usage/timing dicts and list slot, roughly
RoomCheck = Callable[[int], None]  # raises when a prompt of that many tokens could not be served


def token_array(ids: Any = ()) -> array[int]:
    return array("i", ids)


@dataclass(slots=True)
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
    tokens: array[int] = field(default_factory=token_array)
    system_len: int = 0  # tokens[:system_len] is the rendered system prompt
    messages: list[Message] = field(default_factory=list)
    busy: str | None = None  # gen_id of the generation in flight
    counted_bytes: int = 0  # this session's share of SessionStore.total_bytes

    def footprint(self) -> int:
        """Approximate bytes this session holds: its tokens, its texts and per-message overhead."""
        text = sys.getsizeof(self.system_prompt) if self.system_prompt is not None else 0
        return (TOKEN_BYTES * len(self.tokens) + text
                + sum(sys.getsizeof(m.content) + MESSAGE_OVERHEAD_BYTES for m in self.messages))

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
                 clock: Callable[[], float] = time.monotonic, max_bytes: int = 256 * 2**20) -> None:
        self.formatter = formatter
        self.max_sessions, self.ttl_s, self.clock, self.max_bytes = max_sessions, ttl_s, clock, max_bytes
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self.total_bytes = 0
        self.evicted = 0
        self.expired = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[Session]:
        """Every session, whoever owns it (accounting and tests; clients list through `list`)."""
        return iter(list(self._sessions.values()))

    def create(self, system_prompt: str | None, sampling: dict[str, Any], owner: Owner,
               room: RoomCheck | None = None) -> Session:
        """A new session; `room` is given the shortest prompt it could ever send (system prompt + a
        one-token message + the generation prompt) and raises if that cannot be served."""
        s = self._new(system_prompt, sampling, owner)
        if system_prompt is not None:
            s.tokens = token_array(self.formatter.system_tokens(s.template_messages()))
            s.system_len = len(s.tokens)
            if room is not None:
                turn = self.formatter.append_user(s.template_messages(), "x")
                room(s.system_len + len(turn.user) + len(turn.generation_prompt))
        return self._insert(s)

    def _new(self, system_prompt: str | None, sampling: dict[str, Any], owner: Owner) -> Session:
        return Session(id=secrets.token_urlsafe(18), system_prompt=system_prompt, sampling=dict(sampling),
                       created=time.time(), last_used=self.clock(), owner=owner.digest)

    def _insert(self, s: Session) -> Session:
        self.expire()
        need = s.footprint()
        if need > self.max_bytes:
            raise ApiError("too_large", f"this session needs about {need} bytes, more than the server's whole "
                           f"session memory budget of {self.max_bytes} bytes", 413)
        if len(self._sessions) >= self.max_sessions:
            self._evict_one()
        self.make_room(need)
        self._sessions[s.id] = s
        self.account(s)
        return s

    def account(self, s: Session) -> None:
        """Bring total_bytes up to date after `s` changed (its tokens or messages)."""
        if s.id in self._sessions:
            new = s.footprint()
            self.total_bytes += new - s.counted_bytes
            s.counted_bytes = new

    def make_room(self, extra_bytes: int, keep: Session | None = None) -> None:
        """Evict least recently used idle sessions (never `keep`) until `extra_bytes` more fit in the
        budget; 429 if the idle ones do not free enough."""
        while self.total_bytes + extra_bytes > self.max_bytes:
            victim = next((s for s in self._sessions.values() if s.busy is None and s is not keep), None)
            if victim is None:
                raise ApiError("too_many_sessions", f"session memory is full ({self.total_bytes} of "
                               f"{self.max_bytes} bytes) and every other session is generating; try again later",
                               429)
            self._remove(victim)
            self.evicted += 1

    def get(self, session_id: Any, owner: Owner | None) -> Session:
        """The caller's session; unknown_session (404) when it does not exist, has expired, or is not theirs."""
        s = self._sessions.get(session_id) if isinstance(session_id, str) else None
        if s is not None and s.busy is None and self.clock() - s.last_used > self.ttl_s:
            self._remove(s)
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
        self._remove(s)
        return s

    def fork(self, session_id: Any, at_message: int, owner: Owner | None) -> Session:
        parent = self.get(session_id, owner)
        if not 0 <= at_message <= len(parent.messages):
            raise ApiError("invalid_field", f"at_message must be in [0, {len(parent.messages)}], got {at_message}",
                           param="at_message")
        cut = parent.messages[at_message].token_start if at_message < len(parent.messages) else len(parent.tokens)
        child = self._new(parent.system_prompt, parent.sampling, Owner(parent.owner))  # the caller's
        child.tokens, child.system_len = parent.tokens[:cut], parent.system_len
        child.messages = [dataclasses.replace(m) for m in parent.messages[:at_message]]  # texts are shared
        return self._insert(child)  # may evict the parent when the cap is 1

    def expire(self) -> int:
        now, gone = self.clock(), 0
        for s in list(self._sessions.values()):
            if s.busy is None and now - s.last_used > self.ttl_s:
                self._remove(s)
                gone += 1
        self.expired += gone
        return gone

    def _remove(self, s: Session) -> None:
        del self._sessions[s.id]
        self.total_bytes -= s.counted_bytes
        s.counted_bytes = 0

    def _evict_one(self) -> None:
        victim = next((s for s in self._sessions.values() if s.busy is None), None)
        if victim is None:
            raise ApiError("too_many_sessions", f"all {self.max_sessions} sessions are generating; try again later",
                           429)
        self._remove(victim)
        self.evicted += 1
