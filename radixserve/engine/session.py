"""`ChatSession`: an offline multi-turn conversation over `LLM`, kept as exact token ids.

The same scheme as the server's sessions (server/sessions.py, server/turns.py): the next prompt is
the previous prompt + the reply's exact generated token ids + the template's end-of-turn tokens +
the new user message's tokens + the generation prompt, all from `ChatFormatter`; the history is never
re-tokenized. So turn k's prompt starts with turn k-1's prompt and reply exactly, and the prefix
cache serves all of it (everything but a last reply token that was sampled and never fed).

Invariants: `token_ids` is always a closed conversation in chat-template form (it ends the way the
template ends an assistant message, or with the system prompt, or is empty); `messages` is the same
conversation as text. A turn that fails (the engine refuses or fails the request) leaves both as
they were. Where the reply text round-trips through the tokenizer, `token_ids` equals the template
rendering of `messages` tokenized whole, so a reply matches what `LLM.chat` gives for the same
conversation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixserve.core import RequestOutput
from radixserve.errors import RequestFailedError
from radixserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from radixserve.engine.llm import LLM


class ChatSession:
    def __init__(self, llm: LLM, system: str | None = None, params: SamplingParams | None = None,
                 priority: int = 0) -> None:
        self.llm, self.params, self.priority = llm, params or SamplingParams(), priority
        self.formatter = llm.formatter
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system is not None else []
        self.token_ids: list[int] = self.formatter.system_tokens(self.messages) if system is not None else []
        self.system_len = len(self.token_ids)  # token_ids[:system_len] is the rendered system prompt

    def send(self, content: str, params: SamplingParams | None = None, priority: int | None = None) -> RequestOutput:
        """Append a user message, generate the reply (one sample) and append it; returns its output."""
        params = params or self.params
        if params.n != 1:
            raise ValueError("a chat session continues one reply: n must be 1")
        turn = self.formatter.append_user(self.messages, content)
        prompt = self.token_ids + turn.user + turn.generation_prompt
        out = self.llm.generate(prompt, params, self.priority if priority is None else priority)[0]
        if out.error is not None:
            raise RequestFailedError(out.error)
        reply = out.outputs[0]
        history = self.messages + [{"role": "user", "content": content}]
        end_ids = tuple(self.llm.engine.eos_token_ids) + tuple(params.stop_token_ids)
        closing = self.formatter.close_assistant(history, reply.token_ids, end_ids)
        self.token_ids = prompt + reply.token_ids + closing
        self.messages = history + [{"role": "assistant", "content": reply.text}]
        return out
