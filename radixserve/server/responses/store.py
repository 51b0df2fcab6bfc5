"""Stored responses of /v1/responses: each one's whole conversation as the exact token ids the model
saw and produced, kept in the chat SessionStore (sessions/store.py) so they share its accounting.

A StoredResponse is a Session: `tokens` is its conversation closed the way the chat template closes
an assistant turn (the instructions' system message, the inputs of every request in its chain,
every reply), `system_prompt` the instructions it was rendered with, `messages` its messages (the
inputs of one request share one token span) and `body` the response object GET returns. A
follow-up naming it in `previous_response_id` starts from those tokens and APPENDS its input's
tokens and the generation prompt, never re-tokenizing the history, so its prompt hits the radix
cache on all of them: the sessions' rule. Each stored response holds its own copy of the tokens
(4 bytes each), so evicting or deleting one never breaks another; a chain of k responses holds
O(k²) token ids, all of them counted in the byte budget.

Instructions: as OpenAI does, a request's `instructions` are its own and not carried over from the
previous response. When they differ from those the stored conversation was rendered with, or its
template variables do (`chat_template_kwargs`, `reasoning.effort`: gpt-oss writes the effort into
its system message), or its tools (templates render them with the system prompt), its history is
rendered again after the new system message (the replies
re-tokenized from their text, their reasoning as `reasoning_content`), so the cache misses from the
system prompt on. A reply's reasoning stays in the stored tokens as generated either way.

Truncation: with `truncation: "auto"` a conversation (the chain and the input) whose prompt does not
fit — its tokens over --max-prompt-tokens, or with the reply's max_output_tokens (at least one)
over the context — loses its oldest turns (a turn starts at a user message; system messages in it
are kept, and so are the instructions) until it fits: the fewest turns dropped, found by a binary
search of renders. The rest is rendered again after the system message (a cache miss from there
on, as OpenAI's truncation re-reads the conversation), and the stored response keeps that
truncated conversation. A conversation that fits is never rendered again (the exact-token rule
above); one that cannot fit even with only its newest turn goes on to the usual refusal, as with
"disabled".

Budget: stored responses are SessionStore entries — one count (--max-sessions), one byte budget
(--max-session-bytes-total), the owner shares, LRU eviction of idle entries and the TTL, together
with the chat sessions; the session endpoints never see them (SessionStore.find looks up one kind). A
body's logprob entries (`include: ["message.output_text.logprobs"]`) count at LOGPROB_ENTRY_BYTES each.
Creating one is charged to the client address's session creation rate (rate_limit.py), so minting
a fresh owner secret per request cannot flood the store past everyone's shares faster than creating
sessions could (run.prepare).

Ownership: the `X-Session-Owner` secret when the client sends one, else the caller's API key
(Bearer) when it sends one, else one anonymous owner, for whom the unguessable id (192 bits) alone
is the capability; each bound to the caller's tenant (callers.tenant_bound), so no response, and no
`previous_response_id`, crosses tenants. Another owner's id is answered exactly like an unknown one
(404 not_found), without touching the entry.

Lifecycle: a response to keep (`store`, the default) is inserted busy before its response starts
(so a full store answers 429 or 413, never an opened stream); GET returns it `in_progress` until it
ends, and a follow-up naming it meanwhile is a 409 `response_in_progress`, not a wait (a client
has the id that early only from a stream it is still reading). Completed or incomplete
(max_output_tokens) it is kept; failed or aborted (client gone, shutdown) it is removed — except a
background response (background.py; while it runs, its entry's `background` is its run), which has
no client to tell: it is kept "failed" or "cancelled" for its poller, and naming it as
previous_response_id is a 400. DELETE removes it at once, even while it generates: that generation
still answers its client, unkept (a background one is cancelled: nobody would read it).
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, Protocol

from radixserve.chat.template import ChatFormatter, TurnTokens
from radixserve.chat.tools import ToolSpec
from radixserve.sampling_fields import SamplingFields
from radixserve.server.auth import request_key
from radixserve.server.callers import tenant_bound
from radixserve.server.owners import Owner, secret_from_headers
from radixserve.server.responses.events import logprob_entries
from radixserve.server.responses.input import ResponsesAsk
from radixserve.server.sessions.store import Message, Session, SessionStore, token_array
from radixserve.server.state import ServerState
from radixserve.server.tenants import Caller
from radixserve.server.validation import ApiError

BODY_OVERHEAD_BYTES = 1024  # the response object's dicts beside the texts the messages hold
LOGPROB_ENTRY_BYTES = 320  # one logprob entry of a body, as Python holds it (its dict, token, bytes list)
ANONYMOUS = Owner.of(secrets.token_urlsafe(32))  # drawn per process: no client can present its secret


def response_owner(headers: Mapping[str, str], caller: Caller) -> Owner:
    """Whose responses a request reaches (see the module docstring), bound to the caller's tenant; 400
    for a malformed owner secret."""
    secret = secret_from_headers(headers)
    if secret is not None:
        return tenant_bound(Owner.of(secret), caller.tenant)
    key = request_key(headers)
    if key:  # domain-separated from owner secrets; a key need not be ASCII
        return tenant_bound(Owner(hashlib.sha256(b"api-key\0" + key.encode("utf-8", "surrogatepass")).digest()),
                            caller.tenant)
    return tenant_bound(ANONYMOUS, caller.tenant)


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


class BackgroundHandle(Protocol):
    """A background response's run, as the endpoints reach it (background.BackgroundRun)."""

    async def cancel(self) -> None: ...


UNFINISHED = ("failed", "cancelled")  # statuses of kept background responses that cannot be continued


@dataclass
class StoredResponse(Session):
    body: dict[str, Any] = field(default_factory=dict)  # the response object, as GET returns it
    background: BackgroundHandle | None = None  # a background response's run, while it runs (background.py)
    logprob_entries: int = 0  # those the body's output holds (`include` logprobs): counted in its bytes

    def footprint(self) -> int:
        metadata = self.body.get("metadata") or {}
        return super().footprint() + BODY_OVERHEAD_BYTES + sum(len(k) + len(v) for k, v in metadata.items()) \
            + LOGPROB_ENTRY_BYTES * self.logprob_entries

    def keep(self, body: dict[str, Any]) -> None:
        """The body GET returns from now on (the caller accounts for its bytes)."""
        self.body, self.logprob_entries = body, logprob_entries(body["output"])


def find_response(store: SessionStore, response_id: Any, owner: Owner, param: str | None = None) -> StoredResponse:
    """The caller's stored response; 404 not_found when unknown, deleted, expired, not stored or not theirs."""
    found = store.find(response_id, owner, StoredResponse)
    if found is None:
        raise ApiError("not_found", "no such response (unknown, deleted, expired, or created with store: false)",
                       404, param=param)
    return found


def previous_response(store: SessionStore, ask: ResponsesAsk, owner: Owner) -> StoredResponse | None:
    if ask.previous_id is None:
        return None
    previous = find_response(store, ask.previous_id, owner, "previous_response_id")
    if previous.busy is not None:
        raise ApiError("response_in_progress", "the previous response is still being generated; send this once it "
                       "has completed", 409, param="previous_response_id")
    if previous.body.get("status") in UNFINISHED:  # a background response that has no reply to continue from
        raise ApiError("invalid_field", f"the previous response {previous.body['status']}; only a completed or "
                       "incomplete response can be continued", param="previous_response_id")
    return previous


@dataclass
class Prompt:
    """A new response's prompt: `head` (the conversation it continues, closed, or the instructions'
    system tokens) + the turn's tokens (its inputs, then the generation prompt)."""

    head: list[int]
    system_len: int  # head[:system_len]: the instructions' system message
    turn: TurnTokens
    messages: list[Message]  # the conversation's, the new inputs last; spans index head + turn.user
    history: list[dict[str, Any]]  # the conversation as the template takes it, inputs included

    def tokens(self) -> list[int]:
        return self.head + self.turn.user + self.turn.generation_prompt


async def build_prompt(state: ServerState, ask: ResponsesAsk, previous: StoredResponse | None) -> Prompt:
    tools = ask.tools.template_tools() if ask.tools is not None else None  # rendered with the instructions
    conversation = ([m.template() for m in previous.messages] if previous is not None else []) + ask.inputs
    _check_results(conversation, len(conversation) - len(ask.inputs))
    appends = previous is not None and previous.system_prompt == ask.instructions \
        and previous.template_vars == ask.variables and previous.tools == tuple(tools or ())
    if previous is not None and appends:
        # the exact tokens the model saw and produced: only the new input is tokenized
        prompt = await _prompt(state, ask, previous.tokens.tolist(), previous.system_len, list(previous.messages),
                               previous.template_messages(), ask.inputs)
        if ask.truncation == "disabled" or _fits(state, ask, prompt):
            return prompt
    # a first response, new instructions, variables or tools, or a truncation: all after the system message is
    # rendered again
    system = [{"role": "system", "content": ask.instructions}] if ask.instructions is not None else []
    head = await state.require_prompts().system_tokens(system, ask.variables, tools)

    async def rendered(cut: int) -> Prompt:
        kept = [m for m in conversation[:cut] if m["role"] == "system"] + conversation[cut:]
        return await _prompt(state, ask, head, len(head), [], system, kept)

    if not appends:
        prompt = await rendered(0)
        if ask.truncation == "disabled" or _fits(state, ask, prompt):
            return prompt
    cuts = _turn_starts(conversation)
    lo, hi = 1, len(cuts)  # dropping the turns before cuts[k - 1]: the smallest k that fits
    best, last = None, prompt
    while lo <= hi:
        mid = (lo + hi) // 2
        last = await rendered(cuts[mid - 1])
        if _fits(state, ask, last):
            best, hi = last, mid - 1
        else:
            lo = mid + 1
    # none fits: the newest turn alone (the last one tried) goes on to the usual refusal
    return best if best is not None else last


async def _prompt(state: ServerState, ask: ResponsesAsk, head: list[int], system_len: int, kept: list[Message],
                  history: list[dict[str, Any]], added: list[dict[str, Any]]) -> Prompt:
    """The prompt of `added` appended to `history` (whose tokens are `head`, its messages `kept`)."""
    tools = ask.tools.template_tools() if ask.tools is not None else None
    turn = await state.require_prompts().append_messages(history, added, tools, ask.variables)
    span = (len(head), len(head) + len(turn.user))
    messages = kept + [Message(m["role"], m["content"] or "", *span, tool_calls=m.get("tool_calls"),
                               tool_call_id=m.get("tool_call_id"), reasoning=m.get("reasoning_content"))
                       for m in added]
    return Prompt(head, system_len, turn, messages, history + added)


def _fits(state: ServerState, ask: ResponsesAsk, prompt: Prompt) -> bool:
    """Whether the prompt passes the length checks plan.py makes: --max-prompt-tokens, and the context
    with room for the reply's max_output_tokens (at least one token)."""
    n, limit = len(prompt.tokens()), state.config.max_prompt_tokens
    return (limit is None or n <= limit) and n + (ask.sampling.max_tokens or 1) <= state.require_engine().max_model_len


def _turn_starts(conversation: list[dict[str, Any]]) -> list[int]:
    """Where the turns after the first start (their user messages): the places truncation may cut."""
    return [k for k, m in enumerate(conversation) if k > 0 and m["role"] == "user"]


def _check_results(conversation: list[dict[str, Any]], first_input: int) -> None:
    """Each function_call_output of the request answers a call made before it (in the input or the
    conversation it continues): a result the model never asked for would be rendered as if it had."""
    called: set[str] = set()
    for k, m in enumerate(conversation):
        called |= {c["id"] for c in m.get("tool_calls") or ()}
        if m["role"] == "tool" and k >= first_input and m["tool_call_id"] not in called:
            raise ApiError("invalid_field", f"input: a function_call_output answers call_id {m['tool_call_id']!r}, "
                           "which no function_call before it made", param="input")


def open_entry(store: SessionStore, response_id: str, owner: Owner, instructions: str | None, prompt: Prompt,
               body: dict[str, Any], tenant: str, variables: dict[str, Any] | None = None,
               tools: tuple[ToolSpec, ...] = ()) -> StoredResponse:
    """Insert the response (busy, `body` in progress) before it generates; 429/413 when it cannot fit.
    `variables` and `tools`: the template variables and tools its prompt was rendered with."""
    entry = StoredResponse(id=response_id, system_prompt=instructions, sampling=SamplingFields(), created=time.time(),
                           last_used=store.clock(), owner=owner.digest, tokens=token_array(prompt.head + prompt.turn.user),
                           system_len=prompt.system_len, messages=prompt.messages, busy=response_id, body=body,
                           tenant=tenant, template_vars=dict(variables or {}), tools=tools)
    return store.insert(entry)


def close_entry(store: SessionStore, formatter: ChatFormatter, entry: StoredResponse, prompt: Prompt,
                generated: list[int], end_ids: tuple[int, ...], text: str, finish_reason: str,
                body: dict[str, Any], reasoning: str | None = None,
                tool_calls: list[dict[str, Any]] | None = None) -> None:
    """The reply appended as the template closes an assistant turn (the tokens a follow-up starts from);
    `text` is its answer, `reasoning` its reasoning (None: the model writes none), `tool_calls` the calls
    it made (OpenAI's chat shape)."""
    closed = formatter.closed_reply(prompt.history, generated, end_ids, list(entry.tools) or None,
                                    entry.template_vars)
    start = len(entry.tokens)
    entry.tokens.extend(prompt.turn.generation_prompt + closed)
    entry.messages.append(Message("assistant", text, start, len(entry.tokens), finish_reason,
                                  tool_calls=tool_calls or None, reasoning=reasoning or None))
    entry.keep(body)
    entry.busy = None
    store.touch(entry)
    store.account(entry)
    with suppress(ApiError):  # over budget with only busy entries left: the next insert sheds it
        store.make_room(0, keep=entry)
