"""Offline API: `LLM(...).generate(prompts, params)`, `.chat(messages, params)` and `.session(system)`
(a multi-turn `ChatSession` that appends exact token ids), synchronous. `chat` and `session` take
`tools=` (OpenAI function tools) and a `tool_choice`; their outputs are then ToolCallOutputs with the
calls each reply made (chat/tool_calls.py).

Every prompt (and its priority) is checked once, by the engine's intake, before any is queued, so one
bad prompt rejects the call without leaving half a batch in the engine. `priority` is one integer for
every prompt or one per prompt; lower runs first under `--policy priority`, fcfs, cache-aware and sjf
ignore it.
"""

from __future__ import annotations

from typing import Any, cast

from radixserve.chat.session import ChatSession
from radixserve.chat.template import ChatFormatter
from radixserve.chat.tool_calls import ChatTools, ToolLike
from radixserve.config import EngineConfig
from radixserve.core import CompletionOutput, RequestOutput
from radixserve.engine.beam_drivers import run_beam_search
from radixserve.engine.beam_search import BeamSearchOutput, BeamSearchParams
from radixserve.engine.engine import LLMEngine
from radixserve.engine.intake import tokenize
from radixserve.sampling_params import SamplingParams

Prompt = str | list[int]
Priority = int | list[int]


class LLM:
    def __init__(self, model: str | None = None, **config: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **config))
        self.tokenizer = self.engine.tokenizer
        self.intake = self.engine.intake
        self._formatter: ChatFormatter | None = None

    def generate(self, prompts: Prompt | list[Prompt], params: SamplingParams | None = None,
                 priority: Priority = 0) -> list[RequestOutput]:
        params = params or SamplingParams()
        listed = _as_prompt_list(prompts)
        checked = [self.intake.check(p, params, pr) for p, pr in zip(listed, _priorities(priority, len(listed)))]
        request_ids = [self.engine.add_validated(r) for r in checked]
        results: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                _accumulate(results, out)
        return [results[i] for i in request_ids]

    @property
    def formatter(self) -> ChatFormatter:
        """The chat formatter (built on first use): the model's template, or ChatML when it ships none."""
        if self._formatter is None:
            if self.tokenizer is None:
                raise ValueError("this model directory has no tokenizer, so it has no chat template")
            # tool parameters closed or open as the engine compiles JSON schemas (open_json_objects)
            self._formatter = ChatFormatter(self.tokenizer, open_objects=self.engine.grammars.open_objects)
        return self._formatter

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             params: SamplingParams | None = None, priority: Priority = 0, tools: list[ToolLike] | None = None,
             tool_choice: Any = None, parallel_tool_calls: bool = True) -> list[RequestOutput]:
        """Chat completions through the same ChatFormatter as the server and the terminal chat (the
        model's template, or ChatML when it ships none; message content is always tokenized as text).
        With `tools` (ToolSpecs or OpenAI tool dicts) and `tool_choice` (OpenAI's values or a ToolChoice;
        default auto) each output is a ToolCallOutput: `content` and the `tool_calls` it made; messages
        may hold earlier calls (assistant `tool_calls`) and their results (role "tool")."""
        one = bool(messages) and isinstance(messages[0], dict)
        conversations = [cast(list[dict[str, Any]], messages)] if one else cast(list[list[dict[str, Any]]], messages)
        chat_tools = self.chat_tools(tools, tool_choice, parallel_tool_calls)
        if chat_tools is None:
            plain: list[Prompt] = [self.formatter.prompt_tokens(c) for c in conversations]
            return self.generate(plain, params, priority)
        rendered = chat_tools.template_tools()
        prompts: list[Prompt] = [self.formatter.prompt_tokens(c, rendered) for c in conversations]
        outs = self.generate(prompts, chat_tools.constrain(params or SamplingParams()), priority)
        return [chat_tools.read(o) for o in outs]

    def chat_tools(self, tools: list[ToolLike] | None, tool_choice: Any = None,
                   parallel_tool_calls: bool = True) -> ChatTools | None:
        """What a chat call asks of tools (None: nothing), in the format the model's template implies."""
        if tools is None and tool_choice is None:
            return None
        return ChatTools.of(tools or [], tool_choice, parallel_tool_calls, self.formatter.tool_format)

    def session(self, system: str | None = None, params: SamplingParams | None = None,
                priority: int = 0, tools: list[ToolLike] | None = None) -> ChatSession:
        """A multi-turn conversation that appends each turn's exact token ids, as the server's sessions
        do, so every turn hits the whole conversation before it in the cache. `tools` are rendered into
        its first tokens; each `send` may pick a tool_choice, `send_tool_results` answers calls."""
        return ChatSession(self, system, params, priority, tools)

    def beam_search(self, prompts: Prompt | list[Prompt], params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search, one output per prompt with its best beams first; equals transformers'
        `generate(num_beams=k, do_sample=False, early_stopping=True)` (engine/beam_search.py)."""
        return run_beam_search(self.engine, [tokenize(self.engine.tokenizer, p) for p in _as_prompt_list(prompts)], params)


def _as_prompt_list(prompts: Prompt | list[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, list) or not prompts:
        raise ValueError("prompts must be a string, a token-id list, or a non-empty list of those")
    if all(isinstance(t, int) for t in prompts):
        return [[t for t in prompts if isinstance(t, int)]]  # one prompt given as token ids
    return [p for p in prompts if not isinstance(p, int)]


def _priorities(priority: Priority, count: int) -> list[int]:
    """One priority per prompt, from a single one or a list of one per prompt (the intake checks each)."""
    if isinstance(priority, list):
        if len(priority) != count:
            raise ValueError(f"priority lists {len(priority)} values for {count} prompts; give one per prompt")
        return priority
    return [priority] * count


def _accumulate(results: dict[str, RequestOutput], out: RequestOutput) -> None:
    """Fold streamed deltas into whole outputs, one CompletionOutput per sample in index order."""
    whole = results.setdefault(out.request_id, RequestOutput(out.request_id, [], out.usage, out.timing,
                                                             prompt_token_ids=out.prompt_token_ids))
    by_index = {c.index: c for c in whole.outputs}
    for delta in out.outputs:
        c = by_index.setdefault(delta.index, CompletionOutput(delta.index))
        c.token_ids.extend(delta.token_ids)
        c.text += delta.text
        if delta.logprobs is not None:
            c.logprobs = (c.logprobs or []) + delta.logprobs
        c.finish_reason = delta.finish_reason or c.finish_reason
        c.stop_reason = delta.stop_reason if delta.stop_reason is not None else c.stop_reason
    whole.outputs = [by_index[i] for i in sorted(by_index)]
    whole.usage, whole.timing, whole.finished = out.usage, out.timing, out.finished
    whole.error = out.error or whole.error
    whole.prompt_logprobs = whole.prompt_logprobs or out.prompt_logprobs  # carried by the first output only
