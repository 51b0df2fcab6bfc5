"""`ChatSession`: an offline multi-turn conversation over `LLM`, kept as exact token ids.

The same scheme as the server's sessions (server/sessions/store.py, server/sessions/turns.py): the next prompt is
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

Tools (`LLM.session(tools=...)`): the tools are rendered into the first tokens with the system prompt
(fixed for the session's life, as its tokens are never re-rendered); `send(..., tool_choice=...)`
returns a ToolCallOutput whose calls are kept in `messages` (their tokens are the ones generated), and
`send_tool_results({call_id: result})` appends the results as tool messages and generates the next reply.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from radixserve.chat.tool_calls import ChatTools, ToolLike, call_message
from radixserve.core import RequestOutput
from radixserve.errors import RequestFailedError
from radixserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from radixserve.engine.llm import LLM


class ChatSession:
    def __init__(self, llm: LLM, system: str | None = None, params: SamplingParams | None = None,
                 priority: int = 0, tools: list[ToolLike] | None = None) -> None:
        self.llm, self.params, self.priority = llm, params or SamplingParams(), priority
        self.formatter = llm.formatter
        self.tools = llm.chat_tools(tools, None) if tools else None  # rendered with the system prompt, fixed
        self._rendered = list(self.tools.tools) if self.tools is not None else None
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system is not None else []
        started = system is not None or self._rendered
        self.token_ids: list[int] = self.formatter.system_tokens(self.messages, self._rendered) if started else []
        self.system_len = len(self.token_ids)  # token_ids[:system_len] is the rendered system prompt (and tools)

    def send(self, content: str, params: SamplingParams | None = None, priority: int | None = None,
             tool_choice: Any = None, parallel_tool_calls: bool = True) -> RequestOutput:
        """Append a user message, generate the reply (one sample) and append it; returns its output (with
        tools, its sample is a ToolCallOutput; `tool_choice` as LLM.chat takes it, default auto)."""
        return self._turn([{"role": "user", "content": content}], params, priority, tool_choice, parallel_tool_calls)

    def send_tool_results(self, results: Mapping[str, str], params: SamplingParams | None = None,
                          priority: int | None = None, tool_choice: Any = None,
                          parallel_tool_calls: bool = True) -> RequestOutput:
        """Answer the last reply's calls ({call id: result text}) and generate the next reply."""
        last = self.messages[-1] if self.messages else {}
        open_ids = [c["id"] for c in last.get("tool_calls") or ()]
        unknown = [i for i in results if i not in open_ids]
        if not results or unknown:
            raise ValueError(f"results must answer calls of the last reply ({', '.join(open_ids) or 'none'}); "
                             f"got {', '.join(unknown) or 'none'}")
        inputs = [{"role": "tool", "tool_call_id": i, "content": text} for i, text in results.items()]
        return self._turn(inputs, params, priority, tool_choice, parallel_tool_calls)

    def _turn(self, inputs: list[dict[str, Any]], params: SamplingParams | None, priority: int | None,
              tool_choice: Any, parallel: bool) -> RequestOutput:
        params = params or self.params
        if params.n != 1:
            raise ValueError("a chat session continues one reply: n must be 1")
        tools: ChatTools | None = None
        if self.tools is not None:
            tools = self.tools.with_choice(tool_choice, parallel)
            params = tools.constrain(params)
        turn = self.formatter.append_messages(self.messages, inputs, self._rendered)
        prompt = self.token_ids + turn.user + turn.generation_prompt
        out = self.llm.generate(prompt, params, self.priority if priority is None else priority)[0]
        if out.error is not None:
            raise RequestFailedError(out.error)
        reply = out.outputs[0]
        history = self.messages + inputs
        end_ids = tuple(self.llm.engine.eos_token_ids) + tuple(params.stop_token_ids)
        self.token_ids = prompt + self.formatter.closed_reply(history, reply.token_ids, end_ids, self._rendered)
        if tools is None:
            self.messages = history + [{"role": "assistant", "content": reply.text}]
            return out
        read = tools.read_one(reply)
        out.outputs = [read]
        self.messages = history + [call_message(read)]
        return out
