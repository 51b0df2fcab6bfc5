"""Chat sessions: the exact token IDs of a conversation plus its messages, shared by REST and WebSocket.

Invariants: `tokens` is always a closed conversation in chat-template form (every message ends the
way the template ends it); messages[i].token_start/token_end index that list, so a fork at message k
copies tokens[:messages[k].token_start] and its next prompt hits the parent's cached blocks. At most
one generation per session (`busy`). Ids come from secrets.token_urlsafe, so they cannot be guessed.
Ownership: every session belongs to one Owner (the digest of a client's secret, see owners.py);
get, list, delete and fork take the caller's Owner and treat a session of another owner (or a
caller without one) exactly as an unknown one, without touching it (it neither moves in the LRU
order nor lives longer). A fork belongs to the parent's owner, who is the caller.

Reasoning: an assistant message keeps the reasoning its reply wrote (`reasoning`, shown as
`reasoning_content`; its tokens are in `tokens` as generated) and gives it to the template as
`reasoning_content`, so the template sees what the tokens hold. A session's `template_vars` (its
`chat_template_kwargs`, merged over the operator's) rendered its first tokens and render every turn
(a turn may add its own).

Tool calling (tools.py): a session's `tools` are rendered into its first tokens with the
system prompt and kept with it (forks share them); an assistant message may carry `tool_calls` (its
tokens are the ones the model generated, calls included) and `tool` messages carry the results the
client sent, rendered as the template renders them. Consecutive tool results are appended as one
block (a template may merge them into one turn), so they share one token span and a fork may cut only
before the first of them.

Memory: tokens are an array('i') (4 bytes per token, not a list of Python ints at ~36 bytes each);
they become a list only at the engine boundary, for the duration of one request. Text is held once
(the system prompt and each message's content); nothing keeps the rendered template text.
`Session.footprint()` estimates a session's bytes, and the store keeps `total_bytes`, the sum over
its sessions, current at every change (`account`).

Capacity: at `max_sessions`, or when a new session (or a turn's new message) would take
`total_bytes` over `max_bytes`, idle sessions are evicted; if only sessions busy generating are
left, the request fails with 429. A session larger than the whole budget is refused with 413. A
reply is accounted when its turn ends, evicting others if needed (never the session itself), so the
budget can be exceeded by at most the replies still being generated. Sessions idle for longer than
`ttl_s` expire.

Fairness: every owner has a share, `owner_share` of both `max_sessions` and `max_bytes`, and the
store keeps each owner's (count, bytes) current with `total_bytes`. An owner may go past its share
while there is room; once there is none, the victim is the least recently used idle session of the
owner most over its share (the larger of its count and bytes as fractions of the share; ties go to
the least recently used), counting what the requester is adding. An owner over its share never
displaces an owner within it: it is refused with 429 and `retry_after` instead. So one owner's flood
evicts its own sessions, not everyone else's; a lone owner still uses the whole store, least
recently used first. Many owners each within their share compete by LRU: minting secrets is cheap,
which the per-client creation rate (rate_limit.py) bounds.

Tenants (tenants.py): an Owner is bound to its caller's tenant (callers.session_owner), so the same
secret names a different owner under another tenant and a session of another tenant is unknown to
the caller like any other owner's, listing included. A session keeps its `tenant` and `cache_salt`
(every turn's cache namespace derives from them); a fork inherits both.

Stored responses (/v1/responses, responses/store.py) are entries of this store too, a Session
subclass: one count, byte budget, owner shares, LRU and TTL for both. An entry is found only as its
own kind (`find`), so a session id is unknown to the Responses API and a response id to the session
endpoints; `len` counts both. Both are charged to the same per-client creation rate (rate_limit.py).
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
from typing import Any, TypeVar

from radixserve.chat.template import ChatFormatter
from radixserve.chat.tools import ToolSpec
from radixserve.sampling_fields import SamplingFields
from radixserve.server.owners import NOBODY, Owner
from radixserve.server.tenants import DEFAULT_TENANT
from radixserve.server.validation import ApiError

PREVIEW_CHARS = 80
TOKEN_BYTES = 4
MESSAGE_OVERHEAD_BYTES = 256  # a Message object, its usage/timing dicts and list slot, roughly
SPECULATION_BYTES = 1024  # a reply's usage.speculation: five small dicts (server/pipeline/prediction.py), roughly
RoomCheck = Callable[[int], None]  # raises when a prompt of that many tokens could not be served
RETRY_AFTER_S = 5  # a refused create may retry once generations end or the client deletes sessions
S = TypeVar("S", bound="Session")


def token_array(ids: Any = ()) -> array[int]:
    return array("i", ids)


@dataclass(slots=True)
class Message:
    role: str  # "user" | "assistant" | "tool"
    content: str
    token_start: int
    token_end: int
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None  # a reply's (turns.usage_json)
    timing: dict[str, float] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls, OpenAI's shape
    tool_call_id: str | None = None  # the call a tool message answers
    reasoning: str | None = None  # an assistant reply's reasoning (thinking models)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.reasoning is not None:
            out["reasoning_content"] = self.reasoning
        for name in ("tool_calls", "tool_call_id", "usage", "timing", "finish_reason"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    def template(self) -> dict[str, Any]:
        """This message as the chat template takes it."""
        thought = {"reasoning_content": self.reasoning} if self.reasoning else {}
        if self.tool_calls:
            return {"role": self.role, "content": self.content or None, **thought, "tool_calls": self.tool_calls}
        if self.tool_call_id is not None:
            return {"role": self.role, "tool_call_id": self.tool_call_id, "content": self.content}
        return {"role": self.role, "content": self.content, **thought}

    def size(self) -> int:
        """Bytes this message holds beyond MESSAGE_OVERHEAD_BYTES: its text, its calls as their JSON would
        be, and its usage's speculation figures."""
        calls = sum(len(c["function"]["name"]) + len(c["function"]["arguments"]) + 64 for c in self.tool_calls or ())
        drafts = SPECULATION_BYTES if self.usage is not None and "speculation" in self.usage else 0
        thought = sys.getsizeof(self.reasoning) if self.reasoning is not None else 0
        return sys.getsizeof(self.content) + calls + drafts + thought


@dataclass
class Session:
    id: str
    system_prompt: str | None
    sampling: SamplingFields  # its turns' defaults; a turn's own fields override them
    created: float  # wall clock, for display
    last_used: float  # monotonic, for expiry
    owner: bytes  # Owner.digest of the creator's secret; never sent to clients
    tokens: array[int] = field(default_factory=token_array)
    system_len: int = 0  # tokens[:system_len] is the rendered system prompt
    messages: list[Message] = field(default_factory=list)
    busy: str | None = None  # gen_id of the generation in flight
    counted_bytes: int = 0  # this session's share of SessionStore.total_bytes
    tools: tuple[ToolSpec, ...] = ()  # rendered into tokens[:system_len]; fixed once the session has messages
    tenant: str = DEFAULT_TENANT  # the tenant of the key that created it (its owner is bound to it too)
    cache_salt: str | None = None  # its turns' cache_salt (tenants.cache_namespace), unless a turn names its own
    template_vars: dict[str, Any] = field(default_factory=dict)  # rendered its first tokens; every turn's too

    def footprint(self) -> int:
        """Approximate bytes this session holds: its tokens, its texts and per-message overhead."""
        text = sys.getsizeof(self.system_prompt) if self.system_prompt is not None else 0
        text += len(repr(self.template_vars)) if self.template_vars else 0
        return (TOKEN_BYTES * len(self.tokens) + text
                + sum(len(str(t.parameters)) + len(t.description) for t in self.tools)
                + sum(m.size() + MESSAGE_OVERHEAD_BYTES for m in self.messages))

    def template_messages(self, upto: int | None = None) -> list[dict[str, Any]]:
        msgs: list[dict[str, Any]] = [{"role": "system", "content": self.system_prompt}] if self.system_prompt is not None else []
        return msgs + [m.template() for m in self.messages[:upto]]

    def template_tools(self) -> list[ToolSpec] | None:
        return list(self.tools) or None

    def preview(self) -> str:
        first = next((m.content for m in self.messages if m.role == "user"), "")
        return first[:PREVIEW_CHARS]

    def summary(self) -> dict[str, Any]:
        return {"id": self.id, "system_prompt": self.system_prompt, "created": self.created,
                "num_messages": len(self.messages), "preview": self.preview(), "busy": self.busy is not None}

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "system_prompt": self.system_prompt, "sampling": self.sampling.to_json(),
                "created": self.created, "messages": [m.to_json() for m in self.messages],
                "num_tokens": len(self.tokens), "busy": self.busy is not None,
                "tools": [t.openai_dict() for t in self.tools]}


class SessionStore:
    def __init__(self, formatter: ChatFormatter, max_sessions: int, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic, max_bytes: int = 256 * 2**20,
                 owner_share: float = 1.0) -> None:
        self.formatter = formatter
        self.max_sessions, self.ttl_s, self.clock, self.max_bytes = max_sessions, ttl_s, clock, max_bytes
        self.owner_share = owner_share  # of max_sessions and of max_bytes, per owner; read at each eviction
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self._usage: dict[bytes, list[int]] = {}  # owner digest -> [sessions, counted bytes]
        self.total_bytes = 0
        self.evicted = 0
        self.expired = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[Session]:
        """Every session, whoever owns it (accounting and tests; clients list through `list`)."""
        return iter(list(self._sessions.values()))

    def create(self, system_prompt: str | None, sampling: SamplingFields, owner: Owner,
               room: RoomCheck | None = None, tools: tuple[ToolSpec, ...] = (), tenant: str = DEFAULT_TENANT,
               cache_salt: str | None = None, template_vars: dict[str, Any] | None = None) -> Session:
        """A new session; `room` is given the shortest prompt it could ever send (system prompt and
        tools + a one-token message + the generation prompt) and raises if that cannot be served."""
        s = self._new(system_prompt, sampling, owner)
        s.tools, s.tenant, s.cache_salt, s.template_vars = tools, tenant, cache_salt, dict(template_vars or {})
        if system_prompt is not None or tools:
            self.render_start(s)
            if room is not None:
                turn = self.formatter.append_messages(s.template_messages(), [{"role": "user", "content": "x"}],
                                                      s.template_tools(), s.template_vars)
                room(s.system_len + len(turn.user) + len(turn.generation_prompt))
        return self.insert(s)

    def render_start(self, s: Session) -> None:
        """Set the tokens of a session without messages: its system prompt and tools as rendered."""
        assert not s.messages
        s.tokens = token_array(self.formatter.system_tokens(s.template_messages(), s.template_tools(),
                                                            s.template_vars))
        s.system_len = len(s.tokens)

    def _new(self, system_prompt: str | None, sampling: SamplingFields, owner: Owner) -> Session:
        return Session(id=secrets.token_urlsafe(18), system_prompt=system_prompt, sampling=sampling,
                       created=time.time(), last_used=self.clock(), owner=owner.digest)

    def insert(self, s: S) -> S:
        """Add a new entry, evicting idle ones to make room (429 or 413 when that cannot be done)."""
        self.expire()
        need = s.footprint()
        if need > self.max_bytes:
            raise ApiError("too_large", f"this session needs about {need} bytes, more than the server's whole "
                           f"session memory budget of {self.max_bytes} bytes", 413)
        self._make_room(s.owner, 1, need, None)
        self._sessions[s.id] = s
        self._usage.setdefault(s.owner, [0, 0])[0] += 1
        self.account(s)
        return s

    def account(self, s: Session) -> None:
        """Bring total_bytes (and its owner's bytes) up to date after `s` changed (its tokens or messages)."""
        if s.id in self._sessions:
            new = s.footprint()
            self.total_bytes += new - s.counted_bytes
            self._usage[s.owner][1] += new - s.counted_bytes
            s.counted_bytes = new

    def owner_usage(self, owner: Owner) -> tuple[int, int]:
        """(sessions, bytes) the owner holds."""
        count, size = self._usage.get(owner.digest, (0, 0))
        return count, size

    def make_room(self, extra_bytes: int, keep: Session | None = None) -> None:
        """Evict idle sessions (never `keep`) until `extra_bytes` more, added to `keep`, fit in the budget;
        429 if that cannot be done (see _make_room)."""
        self._make_room(keep.owner if keep is not None else None, 0, extra_bytes, keep)

    def _make_room(self, requester: bytes | None, extra_count: int, extra_bytes: int, keep: Session | None) -> None:
        """Evict until `extra_count` more sessions and `extra_bytes` more bytes of `requester` fit."""
        while (len(self._sessions) + extra_count > self.max_sessions
               or self.total_bytes + extra_bytes > self.max_bytes):
            self._remove(self._victim(requester, extra_count, extra_bytes, keep))
            self.evicted += 1

    def _victim(self, requester: bytes | None, extra_count: int, extra_bytes: int, keep: Session | None) -> Session:
        """The least recently used idle session of the owner most over its share; ApiError(429) if there
        is none, or if the requester is over its share and every owner with an idle session is within it."""
        oldest: dict[bytes, Session] = {}  # owner -> its least recently used idle session
        for s in self._sessions.values():  # least recently used first
            if s.busy is None and s is not keep and s.owner not in oldest:
                oldest[s.owner] = s
        share_count = max(1.0, self.max_sessions * self.owner_share)
        share_bytes = max(1.0, self.max_bytes * self.owner_share)

        def over(owner: bytes | None) -> float:
            count, size = self._usage.get(owner, (0, 0)) if owner is not None else (0, 0)
            if owner == requester:
                count, size = count + extra_count, size + extra_bytes
            return max(count / share_count, size / share_bytes)

        full = (f"all {self.max_sessions} sessions are held" if len(self._sessions) + extra_count > self.max_sessions
                else f"session memory is full ({self.total_bytes} of {self.max_bytes} bytes)")
        if not oldest:
            raise ApiError("too_many_sessions", f"{full} and every other session is generating; try again later",
                           429, retry_after=RETRY_AFTER_S)
        worst = max(oldest, key=over)  # the first of equals: the least recently used
        if worst != requester and over(worst) <= 1.0 < over(requester):
            raise ApiError("too_many_sessions", f"{full}, and this owner holds more than its share "
                           f"({self.owner_share:g} of the sessions and of their memory) while its other sessions "
                           "are generating; delete some of its sessions or try again later", 429,
                           retry_after=RETRY_AFTER_S)
        return oldest[worst]

    def get(self, session_id: Any, owner: Owner | None) -> Session:
        """The caller's session; unknown_session (404) when it does not exist, has expired, or is not theirs."""
        s = self.find(session_id, owner, Session)
        if s is None:
            raise ApiError("unknown_session", "unknown, deleted or expired session", 404)
        return s

    def find(self, entry_id: Any, owner: Owner | None, kind: type[S]) -> S | None:
        """The caller's entry of exactly the type `kind`, touched; None when it does not exist, has expired,
        is of another kind or is not theirs."""
        s = self._sessions.get(entry_id) if isinstance(entry_id, str) else None
        if s is not None and type(s) is not kind:
            s = None
        if s is not None and s.busy is None and self.clock() - s.last_used > self.ttl_s:
            self._remove(s)
            self.expired += 1
            s = None
        # always one constant-time comparison: a miss, a foreign session and no secret answer alike
        matches = (owner if owner is not None else NOBODY).owns(s.owner if s is not None else NOBODY.digest)
        if s is None or owner is None or not matches:
            return None
        self.touch(s)
        return s

    def touch(self, s: Session) -> None:
        s.last_used = self.clock()
        if s.id in self._sessions:
            self._sessions.move_to_end(s.id)

    def count(self, tenant: str) -> int:
        """Sessions and stored responses of `tenant`."""
        return sum(1 for s in self._sessions.values() if s.tenant == tenant)

    def list(self, owner: Owner | None) -> list[Session]:
        """The caller's sessions, newest first (none for a caller without an owner secret)."""
        self.expire()
        if owner is None:
            return []
        mine = [s for s in self._sessions.values() if type(s) is Session and owner.owns(s.owner)]
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
        if 0 < at_message < len(parent.messages) and parent.messages[at_message].role == "tool" \
                and parent.messages[at_message - 1].role == "tool":
            raise ApiError("invalid_field", f"message {at_message} is a tool result appended with the one before it "
                           "(one token span); fork before the first of them or after the reply", param="at_message")
        cut = parent.messages[at_message].token_start if at_message < len(parent.messages) else len(parent.tokens)
        child = self._new(parent.system_prompt, parent.sampling, Owner(parent.owner))  # the caller's
        child.tokens, child.system_len, child.tools = parent.tokens[:cut], parent.system_len, parent.tools
        child.tenant, child.cache_salt = parent.tenant, parent.cache_salt  # its cached prefix is the parent's
        child.template_vars = parent.template_vars  # rendered its first tokens; never changed in place
        child.messages = [dataclasses.replace(m) for m in parent.messages[:at_message]]  # texts are shared
        return self.insert(child)  # may evict the parent when the cap is 1

    def expire(self) -> int:
        now, gone = self.clock(), 0
        for s in list(self._sessions.values()):
            if s.busy is None and now - s.last_used > self.ttl_s:
                self._remove(s)
                gone += 1
        self.expired += gone
        return gone

    def remove(self, s: Session) -> None:
        """Drop `s` if the store still holds it (it may have been deleted or expired meanwhile)."""
        if self._sessions.get(s.id) is s:
            self._remove(s)

    def _remove(self, s: Session) -> None:
        del self._sessions[s.id]
        self.total_bytes -= s.counted_bytes
        usage = self._usage[s.owner]
        usage[0] -= 1
        usage[1] -= s.counted_bytes
        if usage[0] == 0:
            del self._usage[s.owner]
        s.counted_bytes = 0
