"""One chat turn of a session: prompt from the session's tokens, streamed events, turn closed after.

The prompt is session.tokens + the new user message's tokens + the generation prompt (see
chat_template). A turn is made only by `SessionTurn.prepare`: it refuses a busy session, awaits the
message's tokens (a large history + message is tokenized on the PromptWorker thread, off the event
loop), then constructs the turn, which has the engine's intake check the prompt (once: the stream
hands the engine what that check returned) and marks the session busy with no await in between. The
await lets anything happen to the session, so the constructor checks it again: deleted, expired or
evicted meanwhile is 404 unknown_session (it is fetched again through the store as the caller's),
busy or changed meanwhile (another turn ended, so the history that was tokenized is no longer the
session's) is 409 session_busy. A refused turn leaves the session unchanged.

A turn's input is a user message or, with tools, the results of the last reply's calls; its reply
is read for calls as it streams (sessions/tools.py): `delta` events carry its content, `tool_call`
events the calls' fragments, and `done` the whole calls, which the session keeps with the reply.

Its events are `start`, `delta`s, `tool_call`s and `done` (the WebSocket frames, minus transport details).
Whatever happens after construction the turn ends in exactly one of two ways: the engine refused or
failed it before producing anything (the caller gets the error) and the user message is rolled back,
or the reply is appended with the tokens the model produced and the template's end-of-turn tokens.
An aborted turn (cancel, disconnect, deleted session, consumer gone) is always a reply, finish_reason
"abort", with whatever was generated, possibly nothing: whether the abort landed before the first
token, or even before the engine answered at all, is timing, and a client that comes back must see
the same thing either way. Either way the session is free again, and only then: `busy` is cleared
after the outcome is in the session, so a reader on another thread never sees a free session whose
turn is not yet recorded.

Its cache namespace is the session's tenant's, with the turn's `cache_salt` when it sends one, else
the session's (tenants.cache_namespace): every turn of a session hits what the turns before it cached.

Thinking models: the turn renders with the session's template variables and its own
`chat_template_kwargs` over them; its reply's reasoning streams as `delta` events carrying
`reasoning` (sessions/tools.py) and is kept on the reply's message, with `reasoning_tokens` in its
usage. The reasoning's tokens stay in the session's tokens as generated, so the next turn's prompt
still starts with everything this one computed, whatever the template does to earlier turns.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing, suppress
from dataclasses import replace
from typing import Any

from radixserve.chat.template import TurnTokens
from radixserve.core import RequestOutput
from radixserve.sampling_fields import Api, SamplingFields
from radixserve.server.callers import cache_salt_of
from radixserve.server.owners import Owner
from radixserve.server.pipeline.ask import Ask, TokenPrompt
from radixserve.server.pipeline.plan import Plan, admit, prepare
from radixserve.server.pipeline.prediction import speculation_json
from radixserve.server.pipeline.reasoning import reasoning_of, template_variables
from radixserve.server.pipeline.stream import SystemPromptRef
from radixserve.server.sessions.store import MESSAGE_OVERHEAD_BYTES, TOKEN_BYTES, Message, Session, token_array
from radixserve.server.sessions.tools import ReplyCalls, turn_inputs, turn_tools
from radixserve.server.state import ServerState
from radixserve.server.validation import ApiError


def usage_json(out: RequestOutput, reasoning_tokens: int | None = None) -> dict[str, Any]:
    """A turn's usage: prompt, cache and completion figures, and what speculative decoding drafted
    and kept (`speculation`, server/pipeline/prediction.py); a thinking model's turn also the tokens
    generated inside its reasoning (`reasoning_tokens`)."""
    u = out.usage
    thought = {"reasoning_tokens": reasoning_tokens} if reasoning_tokens is not None else {}
    return {"prompt_tokens": u.prompt_tokens, "cached_tokens": u.cached_tokens,
            "host_cached_tokens": u.host_cached_tokens, "completion_tokens": u.completion_tokens, **thought,
            "speculation": speculation_json(u.speculation)}


def timing_json(out: RequestOutput) -> dict[str, float]:
    t = out.timing
    return {"queue_ms": round(t.queue_ms, 2), "ttft_ms": round(t.ttft_ms, 2),
            "tokens_per_s": round(out.tokens_per_s(), 2), "total_ms": round(t.total_ms, 2),
            "mean_itl_ms": round(t.mean_itl_ms, 2), "max_itl_ms": round(t.max_itl_ms, 2)}


def unanswered_usage(prompt_tokens: int) -> tuple[dict[str, Any], dict[str, float]]:
    """The usage and timing of a turn aborted before the engine answered: nothing cached, scheduled or generated."""
    usage = {"prompt_tokens": prompt_tokens, "cached_tokens": 0, "host_cached_tokens": 0, "completion_tokens": 0,
             "speculation": speculation_json(None)}
    return usage, dict.fromkeys(("queue_ms", "ttft_ms", "tokens_per_s", "total_ms", "mean_itl_ms", "max_itl_ms"), 0.0)


class SessionTurn:
    @classmethod
    async def prepare(cls, state: ServerState, session_id: str, owner: Owner | None, content: str | None,
                      sampling: SamplingFields, gen_id: str, priority: int = 0,
                      body: dict[str, Any] | None = None) -> SessionTurn:
        """The caller's session's next turn, committed (ApiError when refused; the session is then unchanged).
        `content` is the user message; None when `body` (the frame or request body, read for its tool
        fields: tools, tool_choice, parallel_tool_calls, tool_results) answers tool calls instead."""
        formatter, store = state.require_chat()
        salt = cache_salt_of(body or {})  # this turn's own, else the session's
        session = store.get(session_id, owner)
        check_free(session)  # a busy session costs no tokenizing
        tools = turn_tools(state, body or {}, session)
        inputs = turn_inputs({**(body or {}), "content": content} if content is not None else body or {}, session)
        own = (body or {}).get("chat_template_kwargs")  # this turn's, over the session's
        variables = template_variables(state, own, base=session.template_vars) if own is not None \
            else session.template_vars
        # the prompt is built in the constructor, after the tokenizing below (admit takes its tokens)
        ask = Ask(Api.SESSION, TokenPrompt([]), sampling, session.tenant,
                  salt if salt is not None else session.cache_salt, tools, priority=priority,
                  default_max_tokens=state.config.default_max_tokens, variables=variables,
                  reasoning=reasoning_of(state))
        ask = await prepare(state, ask)  # a forced call's constraint, the prediction's tokens, compiled off the loop
        history = session.template_messages()
        rendered = list(tools.tools) if tools is not None and tools.tools else session.template_tools()
        # a first turn may bring the session its tools: they head its tokens, rendered with the system prompt
        start = formatter.system_tokens(history, rendered, session.template_vars) \
            if tuple(rendered or ()) != session.tools else None
        turn = await state.require_prompts().append_messages(history, inputs, rendered, variables)
        # the await may have let the session go (404 here) or move on; the constructor checks the rest
        return cls(state, store.get(session_id, owner), inputs, ask, gen_id, history, turn, start)

    def __init__(self, state: ServerState, session: Session, inputs: list[dict[str, Any]], ask: Ask, gen_id: str,
                 history: list[dict[str, Any]], turn: TurnTokens, start: list[int] | None = None) -> None:
        """Use `prepare`: `ask` is the turn's, prepared; `turn` is what `history` + `inputs` tokenize to,
        checked against the session here; `start`: the session's first tokens with the turn's tools,
        when they bring the session its tools."""
        formatter, store = state.require_chat()
        engine = state.require_engine()
        check_free(session)
        if session.template_messages() != history:  # cheap: the contents are the same string objects
            raise ApiError("session_busy", "the session changed while this message was being tokenized (another "
                           "turn ended meanwhile); send it again", 409)
        self.state, self.session, self.gen_id = state, session, gen_id
        self.history = history + inputs
        self.user_tokens, self.gen_prompt = turn.user, turn.generation_prompt
        if start is not None and session.messages:  # another turn gave the session its tools meanwhile
            raise ApiError("session_busy", "the session changed while this message was being tokenized; send it again",
                           409)
        head = start if start is not None else session.tokens.tolist()
        prompt = head + turn.user + turn.generation_prompt  # the engine takes a list
        cfg = state.config
        defaults = SamplingFields(temperature=cfg.default_temperature, top_p=cfg.default_top_p)
        # the turn's fields, else the session's, else the server's
        ask = replace(ask, sampling=ask.sampling.with_defaults(session.sampling.with_defaults(defaults)),
                      prompt=TokenPrompt(prompt, session.tokens[:session.system_len], session.system_prompt))
        planned = admit(state, ask, prompt)  # no await from here to the commit below
        assert planned.checked is not None
        self.request = planned.checked
        system = SystemPromptRef.of(session.tokens[:session.system_len], session.system_prompt,
                                    formatter.implicit_prefix_len, session.tenant)
        self.plan = Plan(ask, [planned], system)
        self.end_ids = tuple(engine.eos_token_ids) + tuple(planned.params.stop_token_ids)
        tools = ask.tools
        span = (len(head), len(head) + len(turn.user))  # consecutive tool results share one span (store.py)
        messages = [Message(m["role"], m["content"], *span, tool_call_id=m.get("tool_call_id")) for m in inputs]
        added_tokens = len(head) + len(turn.user) - len(session.tokens)
        store.make_room(sum(m.size() + MESSAGE_OVERHEAD_BYTES for m in messages) + TOKEN_BYTES * added_tokens,
                        keep=session)
        # committed: from here on the turn must end in _rollback or _close
        if start is not None and tools is not None:  # the session's first tokens, now with its tools
            session.tools = tools.tools
            session.tokens, session.system_len = token_array(start), len(start)
        session.tokens.extend(turn.user)
        session.messages.extend(messages)
        self.inputs = len(messages)
        self.reply = ReplyCalls(tools, gen_id, reader=self.plan.reader())
        self.variables = ask.variables
        session.busy = gen_id
        store.account(session)
        store.touch(session)
        self.request_id = f"{session.id[:8]}-{gen_id[:16]}-{id(self):x}"
        self.cancelled = False
        self.generated: list[int] = []
        self.finish_reason = "abort"
        self.last: RequestOutput | None = None
        self._ended = False
        state.session_generations[session.id] = self

    def cancel(self) -> None:
        """Ask the engine to stop; the events then end with finish_reason "abort" within one step."""
        self.cancelled = True
        if self.state.engine is not None:
            self.state.engine.abort(self.request_id)

    async def events(self) -> AsyncGenerator[dict[str, Any], None]:
        base = {"gen_id": self.gen_id, "session_id": self.session.id}
        finish: str | None = None
        try:
            stream = self.plan.stream(self.state, request_id=self.request_id, cancelled=lambda: self.cancelled,
                                      affinity=self.session.id)
            async with aclosing(stream) as outputs:
                async for out in outputs:
                    if self.last is None:
                        yield {"type": "start", **base, "prompt_tokens": out.usage.prompt_tokens,
                               "cached_tokens": out.usage.cached_tokens,
                               "host_cached_tokens": out.usage.host_cached_tokens}
                    self.last = out
                    for o in out.outputs[:1]:
                        self.generated += o.token_ids
                        for ev in self.reply.events(o.text, o.finish_reason is not None,  # content, call pieces
                                                    o.finish_reason == "length", len(o.token_ids)):
                            yield ev
                        finish = o.finish_reason or finish
        except Exception:  # refused or failed: the caller reports the error (rolled back if nothing came)
            self._end(finish or "abort")
            raise
        except BaseException:  # cancelled, or closed by its consumer (the client is gone): an abort
            self._end(finish or "abort", aborted=True)
            raise
        index = self._end(finish or "abort")
        assert self.last is not None and index is not None
        reply = self.session.messages[index]
        calls = reply.tool_calls
        thought = {"reasoning_content": reply.reasoning} if reply.reasoning is not None else {}
        yield {"type": "done", **base, "finish_reason": self.finish_reason, "message_index": index,
               **({"tool_calls": calls} if calls else {}), **thought,
               "usage": reply.usage if reply.usage is not None else usage_json(self.last),
               "timing": timing_json(self.last)}

    def _end(self, finish_reason: str, aborted: bool = False) -> int | None:
        """Roll back (refused or failed before the engine produced anything) or close the turn;
        idempotent. `aborted`: the turn was cancelled or its consumer went away, so it is closed as a
        reply even when the engine never answered. Returns the reply's message index."""
        if self._ended:
            return len(self.session.messages) - 1
        self._ended = True
        s = self.session
        try:
            return self._record(finish_reason, aborted)
        finally:  # free the session only once its outcome is in it (see the module docstring)
            s.busy = None
            self.state.session_generations.pop(s.id, None)
            if self.state.sessions is not None:
                self.state.sessions.touch(s)

    def _record(self, finish_reason: str, aborted: bool) -> int | None:
        s, store = self.session, self.state.sessions
        if self.last is None and not aborted:
            del s.messages[len(s.messages) - self.inputs:]
            del s.tokens[len(s.tokens) - len(self.user_tokens):]
            if store is not None:
                store.account(s)
            return None
        assert self.state.formatter is not None
        closed = self.state.formatter.closed_reply(self.history, self.generated, self.end_ids, s.template_tools(),
                                                   self.variables)
        start = len(s.tokens)
        s.tokens.extend(self.gen_prompt + closed)
        self.reply.events("", True)  # an aborted reply's held-back text (its events are not sent)
        content, calls, self.finish_reason = self.reply.reply(finish_reason)
        thinks = self.plan.ask.reasoning is not None
        usage, timing = ((usage_json(self.last, self.reply.reasoning_tokens if thinks else None),
                          timing_json(self.last)) if self.last is not None
                         else unanswered_usage(len(self.request.token_ids)))
        s.messages.append(Message("assistant", content, start, len(s.tokens), self.finish_reason,
                                  usage, timing, tool_calls=calls or None,
                                  reasoning=self.reply.reasoning if thinks else None))
        if store is not None:
            store.account(s)
            with suppress(ApiError):  # over budget with only busy sessions left: the next create sheds it
                store.make_room(0, keep=s)
        return len(s.messages) - 1


def check_free(session: Session) -> None:
    """409 session_busy while a turn of `session` is generating (one turn at a time)."""
    if session.busy is not None:
        raise ApiError("session_busy", f"session is already generating ({session.busy!r}); cancel it or wait", 409)
