"""`Ask`: one generation request as every API hands it to the pipeline, whatever its body looked like.

An API's parser reads its own body (field names, shapes, defaults, its own refusals) into an Ask;
from there on nothing depends on which API it came from but the names refusals give a field (`api`)
and the metrics label. The pipeline (plan.py) turns an Ask into checked engine requests.

What it asks to generate from is one of three prompt kinds:
- `ChatPrompt`: chat-template messages (OpenAI chat, Anthropic Messages), rendered with `tools`;
- `TextPrompts`: /v1/completions' prompts, strings or token ids, each its own engine request;
- `TokenPrompt`: a prompt the API built itself (a Responses continuation, a session's turn), with
  the tokens and text of its system prompt for the per-tenant figures.

Invariants: `sampling` holds every sampling field the body set (the table's, the structured-output
constraint, a prediction as text until the pipeline tokenizes it) and nothing the body did not set;
the cache namespace is made from `tenant` and `cache_salt` by the pipeline alone. `variables` are
the template variables a ChatPrompt renders with, already merged and checked (pipeline/reasoning.py);
`reasoning` is the model's reasoning format, with which its replies are read (None: as text).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from radixserve.chat.reasoning import ReasoningFormat
from radixserve.chat.template import Message
from radixserve.chat.tool_calls import ChatTools
from radixserve.sampling_fields import Api, SamplingFields


@dataclass(frozen=True)
class ChatPrompt:
    messages: list[Message]  # the chat template's (OpenAI roles and tool shapes)


@dataclass(frozen=True)
class TextPrompts:
    items: list[str | list[int]]  # each a non-empty string or list of token ids: one engine request each


@dataclass(frozen=True)
class TokenPrompt:
    tokens: list[int]
    system_tokens: Sequence[int] = ()  # its system prompt's tokens (the tenant figures' key); () when none
    system_text: str | None = None


PromptSource = ChatPrompt | TextPrompts | TokenPrompt


@dataclass(frozen=True)
class LogprobBudget:
    """What a request's reply carries of logprobs, bounded by --max-logprob-entries before it runs
    (pipeline/logprobs.py). `top`: alternatives per generated token (None: no generated-token
    logprobs); `prompt_lists`: k of each prompt-logprob list the reply carries per prompt;
    `per_choice`: those lists repeat in every choice (completions) rather than once (chat);
    `param` / `prompt_param`: the fields a refusal names."""

    top: int | None = None
    prompt_lists: tuple[int | None, ...] = ()
    per_choice: bool = False
    param: str = "top_logprobs"
    prompt_param: str = "prompt_logprobs"


@dataclass
class Ask:
    api: Api  # names fields in refusals (sampling_fields' per-API names) and labels the metrics
    prompt: PromptSource
    sampling: SamplingFields
    tenant: str  # the caller's (a session's: its creator's); its figures count the request
    cache_salt: str | None = None  # narrows the cached prefixes it may hit within its tenant (callers.py)
    tools: ChatTools | None = None  # rendered into a ChatPrompt; a forced call constrains the reply
    n: int = 1  # choices per prompt
    priority: int = 0  # lower runs first under --policy priority
    logprobs: LogprobBudget = field(default_factory=LogprobBudget)
    default_max_tokens: int | None = None  # an unset max_tokens; None: the context left
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    engine_checks: bool = True  # False: a beam search, whose driver checks each step's requests itself
    refusal_param: str | None = None  # what an engine refusal naming no field is about ("prompt")
    variables: dict[str, Any] = field(default_factory=dict)  # template variables of a ChatPrompt
    reasoning: ReasoningFormat | None = None  # how the replies' reasoning is told from their answers
