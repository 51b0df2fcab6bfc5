"""Tool calling in the offline API (`LLM.chat(..., tools=...)`, `LLM.session(..., tools=...)`): what a
call asks of tools, resolved once (`ChatTools`), and outputs with the calls a reply made
(`ToolCallOutput`: a CompletionOutput with `content` and `tool_calls`).

The same rules as the server's OpenAI endpoint (server/openai_chat/tools.py): tools are rendered into the
prompt unless tool_choice is "none"; `required` and a named function constrain the reply with the
format's grammar (SamplingParams.structured), so the call parses and its arguments validate; a reply
with calls has finish_reason "tool_calls"; without parallel calls only the first call is kept; a call
cut by max_tokens (finish_reason "length") is neither a call nor content.

A structured final answer beside tools (chat's `response_format`, Responses' `text.format`, Anthropic's
`output_config.format`, the offline `params.structured`) is joined to the tool choice here, in
`ChatTools.constraint`, the one place every API and the offline API take it from, as OpenAI allows it:

- `auto` (strict tools or not) with a JSON schema or `json_object`: one grammar of EITHER one or more
  calls (one without parallel calls) in the format's syntax from the first token OR the answer's JSON
  (the engine's JSON layout, objects closed as the `json` constraints have them). No text before a
  call: the reply is an answer or it is calls. A JSON answer is content (finish_reason "stop"), calls
  are calls ("tool_calls"); where a format's calls could read like an answer, the format says how it
  tells them apart (chat/tools/llama3.py).
- `required` / a named function: the forced call's grammar alone. The reply is a call, not the final
  answer; the schema applies to the final answer a later turn gives (under `auto` or `none`).
- `none` (or no tools): the answer's constraint alone.
- A regex, choice or grammar constrains the whole reply, calls included, so it joins no active tool
  choice: `ConstraintConflict` (the server's 400 naming the field).

The combined grammar constrains the reply from its first token, as the answer's constraint alone does:
a thinking model's reply under it has no reasoning (chat/reasoning.py, `constrained`).
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
ANSWER_KINDS = ("json", "json_object")  # the structured outputs that are a final answer beside calls


class ConstraintConflict(ValueError):
    """A structured output that cannot join the request's tool choice; `field` is its API parameter path."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


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

    def constraint(self, answer: StructuredOutput | None = None) -> StructuredOutput | None:
        """The reply's constraint: the choice's own (required, named, or auto with strict tools) joined to
        `answer`, the request's structured output, as the module docstring says; ConstraintConflict
        when they cannot be joined."""
        if not self.active:
            return answer
        tools = list(self.tools)
        if answer is None or self.choice.mode != "auto":
            if answer is not None and answer.kind not in ANSWER_KINDS:
                raise self._conflict(answer)
            # a forced call wins over the answer's schema: this reply is the call, the answer comes later
            return self.format.constraint(tools, self.choice, self.parallel)
        if answer.kind not in ANSWER_KINDS:
            raise self._conflict(answer)
        try:
            grammar = self.format.answer_or_calls(self.choice.offered(tools), self.parallel, answer)
        except ValueError as e:
            raise ConstraintConflict(str(e), answer.field) from None
        # compile errors name both: the grammar holds the answer's schema and every tool's parameters
        return StructuredOutput(grammar=grammar, field=f"{answer.field}, tools")

    def _conflict(self, answer: StructuredOutput) -> ConstraintConflict:
        choice = "a named function" if self.choice.mode == "named" else repr(self.choice.mode)
        return ConstraintConflict(
            f"{answer.field!r} asks for a {answer.kind}, which constrains the whole reply and cannot be combined "
            f"with tools under tool_choice {choice} (a call is a reply too); a JSON schema or json_object can, as "
            "the final answer beside calls; or send tool_choice 'none'", answer.field)

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """`params` with the choice's constraint joined to `params.structured` (`constraint`) and its
        decoding (a copy; the same object when nothing changes). ConstraintConflict (a ValueError) when
        they cannot be joined."""
        if self.keeps_special_tokens:
            params = dataclasses.replace(params, skip_special_tokens=False)
        c = self.constraint(params.structured)
        return params if c is params.structured else dataclasses.replace(params, structured=c)

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
