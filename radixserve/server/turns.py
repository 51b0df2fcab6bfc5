"""One chat turn of a session: prompt from the session's tokens, streamed events, turn closed after.

The prompt is session.tokens + the new user message's tokens + the generation prompt (see
chat_template). Preparing a turn validates everything and marks the session busy; its events are
`start`, `delta`s and `done` (the WebSocket frames, minus transport details). Whatever happens
afterwards the turn ends in exactly one of two ways: nothing was generated and the user message is
rolled back, or the reply (possibly partial, finish_reason "abort") is appended with the tokens the
model produced and the template's end-of-turn tokens. Either way the session is free again.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncGenerator
from contextlib import aclosing, suppress
from typing import Any

from radixserve.core import RequestOutput
from radixserve.server.generation import SystemPromptRef, admit_prompt, stream_request
from radixserve.server.sessions import MESSAGE_OVERHEAD_BYTES, TOKEN_BYTES, Message, Session
from radixserve.server.state import ServerState
from radixserve.server.validation import ApiError, build_sampling_params


def usage_json(out: RequestOutput) -> dict[str, int]:
    u = out.usage
    return {"prompt_tokens": u.prompt_tokens, "cached_tokens": u.cached_tokens,
            "host_cached_tokens": u.host_cached_tokens, "completion_tokens": u.completion_tokens}


def timing_json(out: RequestOutput) -> dict[str, float]:
    t = out.timing
    return {"queue_ms": round(t.queue_ms, 2), "ttft_ms": round(t.ttft_ms, 2),
            "tokens_per_s": round(out.tokens_per_s(), 2), "total_ms": round(t.total_ms, 2),
            "mean_itl_ms": round(t.mean_itl_ms, 2), "max_itl_ms": round(t.max_itl_ms, 2)}


class SessionTurn:
    def __init__(self, state: ServerState, session: Session, content: str, sampling: dict[str, Any],
                 gen_id: str, priority: int = 0) -> None:
        formatter, store = state.require_chat()
        engine = state.require_engine()
        if session.busy is not None:
            raise ApiError("session_busy", f"session is already generating ({session.busy!r}); cancel it or wait",
                           409)
        self.state, self.session, self.gen_id, self.priority = state, session, gen_id, priority
        self.history = session.template_messages() + [{"role": "user", "content": content}]
        turn = formatter.append_user(session.template_messages(), content)
        self.user_tokens, self.gen_prompt = turn.user, turn.generation_prompt
        self.prompt = session.tokens.tolist() + turn.user + turn.generation_prompt  # the engine takes a list
        admit_prompt(state, len(self.prompt))
        cfg = state.config
        merged = {"temperature": cfg.default_temperature, "top_p": cfg.default_top_p, **session.sampling, **sampling}
        self.params = build_sampling_params(merged, prompt_len=len(self.prompt), max_model_len=engine.max_model_len,
                                            default_max_tokens=cfg.default_max_tokens)
        self.system = SystemPromptRef.of(session.tokens[:session.system_len], session.system_prompt,
                                         formatter.implicit_prefix_len)
        self.end_ids = tuple(engine.eos_token_ids) + tuple(self.params.stop_token_ids)
        message = Message("user", content, len(session.tokens), len(session.tokens) + len(turn.user))
        store.make_room(sys.getsizeof(content) + MESSAGE_OVERHEAD_BYTES + TOKEN_BYTES * len(turn.user), keep=session)
        # committed: from here on the turn must end in _rollback or _close
        session.tokens.extend(turn.user)
        session.messages.append(message)
        session.busy = gen_id
        store.account(session)
        store.touch(session)
        self.request_id = f"{session.id[:8]}-{gen_id[:16]}-{id(self):x}"
        self.cancelled = False
        self.generated: list[int] = []
        self.text: list[str] = []
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
            stream = stream_request(self.state, self.prompt, self.params, self.system, "session", self.request_id,
                                    cancelled=lambda: self.cancelled, priority=self.priority,
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
                        if o.text:
                            self.text.append(o.text)
                            yield {"type": "delta", "gen_id": self.gen_id, "text": o.text}
                        finish = o.finish_reason or finish
        except BaseException:  # refused, failed, cancelled or closed by the consumer
            self._end(finish or "abort")
            raise
        index = self._end(finish or "abort")
        assert self.last is not None and index is not None
        yield {"type": "done", **base, "finish_reason": finish or "abort", "message_index": index,
               "usage": usage_json(self.last), "timing": timing_json(self.last)}

    def _end(self, finish_reason: str) -> int | None:
        """Roll back (nothing generated) or close the turn; idempotent. Returns the reply's message index."""
        if self._ended:
            return len(self.session.messages) - 1
        self._ended = True
        s = self.session
        s.busy = None
        self.state.session_generations.pop(s.id, None)
        store = self.state.sessions
        if store is not None:
            store.touch(s)
        if self.last is None:
            s.messages.pop()
            del s.tokens[len(s.tokens) - len(self.user_tokens):]
            if store is not None:
                store.account(s)
            return None
        assert self.state.formatter is not None
        closing = self.state.formatter.close_assistant(self.history, self.generated, self.end_ids)
        start = len(s.tokens)
        s.tokens.extend(self.gen_prompt + self.generated + closing)
        s.messages.append(Message("assistant", "".join(self.text), start, len(s.tokens), finish_reason,
                                  usage_json(self.last), timing_json(self.last)))
        if store is not None:
            store.account(s)
            with suppress(ApiError):  # over budget with only busy sessions left: the next create sheds it
                store.make_room(0, keep=s)
        return len(s.messages) - 1
