"""Tool calling in the offline API (`LLM.chat(..., tools=...)`, `LLM.session(..., tools=...)`): what a
call asks of tools, resolved once (`ChatTools`), and outputs with the calls a reply made
(`ToolCallOutput`: a CompletionOutput with `content` and `tool_calls`).

The same rules as the server's OpenAI endpoint (server/openai_chat/tools.py): tools are rendered into the
prompt unless tool_choice is "none"; `required` and a named function constrain the reply with the
format's grammar (SamplingParams.structured), so the call parses and its arguments validate; a reply
with calls has finish_reason "tool_calls"; without parallel calls only the first call is kept; a call
cut by max_tokens (finish_reason "length") is neither a call nor content.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from radixserve.chat.tools import ParsedReply, ToolCall, ToolCallFormat, ToolChoice, ToolSpec
from radixserve.core import CompletionOutput, RequestOutput
from radixserve.sampling_params import SamplingParams
from radixserve.structured import StructuredOutput

ToolLike = ToolSpec | dict[str, Any]  # a ToolSpec, or an OpenAI tool {"type": "function", "function": {...}}


@dataclass
class ToolCallOutput(CompletionOutput):
    """A chat reply read for tool calls: `text` as generated, `content` the text outside calls (None
    when the reply only calls), `tool_calls` the calls it made."""

    content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class ChatTools:
    tools: tuple[ToolSpec, ...]
    choice: ToolChoice
    parallel: bool
    format: ToolCallFormat

    @classmethod
    def of(cls, tools: Sequence[ToolLike], tool_choice: Any, parallel: bool, fmt: ToolCallFormat) -> ChatTools:
        """`tools` as ToolSpecs or OpenAI dicts; `tool_choice` a ToolChoice or OpenAI's value (None: auto
        with tools); `fmt` the model's tool-call format (its ChatFormatter's). ValueError names what is wrong."""
        specs = tuple(t if isinstance(t, ToolSpec) else ToolSpec.from_openai(t, f"tools[{i}]")
                      for i, t in enumerate(tools))
        choice = tool_choice if isinstance(tool_choice, ToolChoice) else ToolChoice.from_openai(tool_choice, list(specs))
        if choice.mode == "named" and choice.name not in {t.name for t in specs}:
            raise ValueError(f"tool_choice names {choice.name!r}, which is not among the tools")
        return cls(specs, choice, parallel, fmt)

    def with_choice(self, tool_choice: Any, parallel: bool) -> ChatTools:
        """The same tools under another choice (None: auto) and parallel-calls setting."""
        choice = tool_choice if isinstance(tool_choice, ToolChoice) else ToolChoice.from_openai(tool_choice, list(self.tools))
        return dataclasses.replace(self, choice=choice, parallel=parallel)

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.choice.mode != "none"

    def template_tools(self) -> list[ToolSpec] | None:
        """The tools the chat template renders: none under "none", so the model is not told of them."""
        return list(self.tools) if self.active else None

    @property
    def keeps_special_tokens(self) -> bool:
        """Replies are decoded with special tokens: the format's call marker is one (Mistral's)."""
        return self.active and self.format.needs_special_tokens

    def constraint(self) -> StructuredOutput | None:
        """The reply's constraint this choice asks for (required, named, or auto with strict tools)."""
        return self.format.constraint(list(self.tools), self.choice, self.parallel) if self.active else None

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """`params` with the choice's constraint and decoding (a copy; the same object when nothing changes)."""
        if self.keeps_special_tokens:
            params = dataclasses.replace(params, skip_special_tokens=False)
        c = self.constraint()
        if c is None:
            return params
        if params.structured is not None:
            raise ValueError("params.structured cannot be combined with a required or named tool_choice (or strict "
                             "tools): both constrain the reply")
        return dataclasses.replace(params, structured=c)

    def parse(self, text: str, cut: bool = False) -> ParsedReply:
        """A reply (`cut`: by max_tokens) split into text and calls (only the first call without parallel
        calls)."""
        if not self.active:
            return ParsedReply(text, [])
        parsed = self.format.parse(text, cut)
        return parsed if self.parallel or len(parsed.calls) <= 1 else ParsedReply(parsed.content, parsed.calls[:1])

    def read(self, out: RequestOutput) -> RequestOutput:
        """`out` with each sample replaced by its ToolCallOutput (in place; returned for chaining)."""
        out.outputs = [self.read_one(o) for o in out.outputs]
        return out

    def read_one(self, o: CompletionOutput) -> ToolCallOutput:
        fields = {f.name: getattr(o, f.name) for f in dataclasses.fields(CompletionOutput)}
        if not self.active:
            return ToolCallOutput(**fields, content=o.text)
        parsed = self.parse(o.text, cut=o.finish_reason == "length")
        calls = parsed.calls
        if calls and fields["finish_reason"] == "stop":
            fields["finish_reason"] = "tool_calls"
        return ToolCallOutput(**fields, content=(parsed.content or None) if calls else parsed.content,
                              tool_calls=list(calls))


def call_message(o: ToolCallOutput) -> dict[str, Any]:
    """A reply as the assistant message of a chat history (OpenAI's shape, calls included)."""
    if not o.tool_calls:
        return {"role": "assistant", "content": o.content if o.content is not None else o.text}
    return {"role": "assistant", "content": o.content, "tool_calls": [c.openai_dict() for c in o.tool_calls]}
