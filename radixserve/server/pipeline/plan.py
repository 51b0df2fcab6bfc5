"""The one path from an `Ask` to checked engine requests: plan → admit (this module) → stream (stream.py).

`plan(state, ask)` runs, in this order, for every API:
1. tokenize the prompt (a chat prompt through the template with its tools, text through the
   tokenizer; long ones on the PromptWorker, off the event loop) and refuse one over
   --max-prompt-tokens or while the server drains (`admit_prompt`), before anything costly;
2. bound the reply's logprob entries (--max-logprob-entries); an unset max_tokens defaults to what fits;
3. the prediction's text becomes token ids (off the loop when long); before all of these,
   `with_tools` joined the tool choice's constraint to the structured output (ChatTools.constraint:
   under `auto` a JSON answer or calls, under a forced call the call; a regex, choice or grammar
   beside active tools is a 400 naming its field);
4. compile the structured output on a worker thread under the client's compile slots
   (structured.compile_off_loop), so the engine's check finds it compiled and never compiles on the loop;
5. `admit` each prompt: SamplingParams built from the typed SamplingFields (build_sampling_params,
   the cache namespace of the Ask's tenant and salt set) and the engine's one check (its intake).

A session turn runs the same steps in two halves around the session's own tokenizing, because its
check and its commit to the session must not be separated by an await (sessions/turns.py): `prepare`
(tools, prediction, compile) first, `admit` in the turn's constructor.

Invariants: every refusal is an ApiError raised before any response starts (a JSON error, never an
opened stream); a field is named as the Ask's API names it; nothing here depends on which API the
Ask came from. A reply is read by `Plan.reader` for every API alike: its reasoning (the Ask's
reasoning format, from where its prompt left it: `Planned.opened`), then its answer, for tool calls
when tools are active; replies are decoded with special tokens kept when either reads markers that
are special tokens (`with_tools`).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, replace

from radixserve.chat.reasoning import ReplyStream
from radixserve.chat.tool_calls import ChatTools, ConstraintConflict
from radixserve.core import RequestOutput
from radixserve.engine.intake import ValidatedRequest
from radixserve.errors import RequestError
from radixserve.sampling_params import SamplingParams
from radixserve.server.pipeline.ask import Ask, TextPrompts, TokenPrompt
from radixserve.server.pipeline.logprobs import cap_logprob_entries, entries
from radixserve.server.pipeline.prediction import tokenize_prediction
from radixserve.server.pipeline.sampling import build_sampling_params
from radixserve.server.pipeline.stream import (
    METRIC_LABELS,
    SystemPromptRef,
    api_error_from,
    refuse_if_draining,
    stream_request,
)
from radixserve.server.pipeline.structured import compile_off_loop
from radixserve.server.state import ServerState
from radixserve.server.tenants import cache_namespace
from radixserve.server.validation import ApiError
from radixserve.structured import StructuredOutput


@dataclass
class Planned:
    """One prompt of an Ask, ready for the engine."""

    tokens: list[int]
    params: SamplingParams
    checked: ValidatedRequest | None  # the engine's check; None when the Ask skips it (a beam search)
    opened: bool = False  # the prompt leaves the reply inside the reasoning (its template opened it)


@dataclass
class Plan:
    ask: Ask
    prompts: list[Planned]  # one per prompt (several only for TextPrompts)
    system: SystemPromptRef  # the system prompt the tenant figures count it under

    @property
    def params(self) -> SamplingParams:
        """The SamplingParams every prompt shares (they differ only in the max_tokens clamped to each)."""
        return self.prompts[0].params

    @property
    def tokens(self) -> list[int]:
        """The (first) prompt's tokens."""
        return self.prompts[0].tokens

    def stream(self, state: ServerState, index: int = 0, request_id: str | None = None,
               cancelled: Callable[[], bool] | None = None,
               affinity: str | None = None) -> AsyncGenerator[RequestOutput, None]:
        """Prompt `index`'s engine outputs (stream.stream_request: closed however it ends, recorded
        once under the Ask's API)."""
        checked = self.prompts[index].checked
        assert checked is not None, "a beam search is run by its driver, not streamed"
        return stream_request(state, checked, self.system, METRIC_LABELS[self.ask.api], request_id, cancelled,
                              affinity)

    def reader(self, index: int = 0, tools: bool = True) -> ReplyStream:
        """A reader of one reply to prompt `index`: its reasoning with the Ask's reasoning format, then its
        answer, read for tool calls when `tools` and the Ask's tools are active (else as text)."""
        ask, fmt = self.ask, self.ask.reasoning
        reasoning = fmt.stream(self.prompts[index].opened, fully_constrained(ask)) if fmt is not None else None
        calls = ask.tools.format.stream() if tools and ask.tools is not None and ask.tools.active else None
        return ReplyStream(reasoning, calls)


def fully_constrained(ask: Ask) -> bool:
    """Whether a grammar writes the reply from its first token (a JSON schema, a forced call, a JSON answer
    or calls; not the free text of `auto` with strict tools, which a call ends)."""
    structured = ask.sampling.structured
    tools = ask.tools
    # only the tools' own lazy grammar is named "tools" under auto (an answer beside calls names both)
    lazy = tools is not None and tools.active and tools.choice.mode == "auto" and structured is not None \
        and structured.field == "tools"
    return structured is not None and not lazy


@dataclass(frozen=True)
class Tokenized:
    prompts: list[list[int]]
    system: SystemPromptRef


async def plan(state: ServerState, ask: Ask) -> Plan:
    """The Ask's prompts tokenized, admitted, bounded, compiled and checked by the engine."""
    ask = with_tools(ask)  # a contradiction of tool choice and structured output costs no tokenizing
    tokenized = await tokenize(state, ask)
    for tokens in tokenized.prompts:
        admit_prompt(state, len(tokens))
    default_max_tokens = logprob_budget(state, ask, tokenized.prompts)
    ask = replace(ask, sampling=await tokenize_prediction(state, ask.sampling))
    await compile_structured(state, ask)  # the checks below then find it compiled
    several = len(tokenized.prompts) > 1
    prompts = [admit(state, ask, tokens, default_max_tokens, index=i if several else None)
               for i, tokens in enumerate(tokenized.prompts)]
    return Plan(ask, prompts, tokenized.system)


async def tokenize(state: ServerState, ask: Ask) -> Tokenized:
    """The Ask's prompt(s) as token ids, and its system prompt as the tenant figures count it."""
    source = ask.prompt
    if isinstance(source, TokenPrompt):
        formatter, _ = state.require_chat()
        return Tokenized([source.tokens], SystemPromptRef.of(source.system_tokens, source.system_text,
                                                             formatter.implicit_prefix_len, ask.tenant))
    if isinstance(source, TextPrompts):
        return Tokenized([await _text_tokens(state, item) for item in source.items], SystemPromptRef.none(ask.tenant))
    formatter, _ = state.require_chat()
    template_tools = ask.tools.template_tools() if ask.tools is not None else None
    prompt, system_tokens = await state.require_prompts().chat_tokens(source.messages, template_tools, ask.variables)
    first_system = next((m["content"] for m in source.messages if m["role"] == "system"), None)
    return Tokenized([prompt], SystemPromptRef.of(system_tokens, first_system, formatter.implicit_prefix_len,
                                                  ask.tenant))


async def _text_tokens(state: ServerState, item: str | list[int]) -> list[int]:
    if not isinstance(item, str):
        return item
    if state.require_engine().tokenizer is None:
        raise ApiError("unsupported", "this model has no tokenizer: send the prompt as token ids", param="prompt")
    return await state.require_prompts().encode(item)  # a long one off the event loop


def admit_prompt(state: ServerState, prompt_len: int) -> None:
    """Refusals that must come before any response starts (so streams never open for them)."""
    limit = state.config.max_prompt_tokens
    if limit is not None and prompt_len > limit:
        raise ApiError("context_too_long", f"prompt of {prompt_len} tokens exceeds the server's limit of "
                       f"{limit} prompt tokens (--max-prompt-tokens)")
    refuse_if_draining(state)


def logprob_budget(state: ServerState, ask: Ask, prompts: Sequence[list[int]]) -> int | None:
    """Refuse a reply with more logprob entries than --max-logprob-entries; the max_tokens an unset
    one defaults to (what fits the bound, else the Ask's default)."""
    budget = ask.logprobs
    prompt_len = sum(len(tokens) for tokens in prompts)
    spent = sum(entries(prompt_len, k) for k in budget.prompt_lists) * (ask.n if budget.per_choice else 1)
    fits = cap_logprob_entries(ask.n * len(prompts), ask.sampling.max_tokens or ask.default_max_tokens, budget.top,
                               state.config.max_logprob_entries, spent=spent, param=budget.param,
                               prompt_param=budget.prompt_param)
    return fits if fits is not None else ask.default_max_tokens


async def prepare(state: ServerState, ask: Ask) -> Ask:
    """What a session turn does before its prompt exists: `with_tools`, the prediction's text made
    token ids, the structured output compiled off the loop."""
    ask = with_tools(ask)
    ask = replace(ask, sampling=await tokenize_prediction(state, ask.sampling))
    await compile_structured(state, ask)
    return ask


def with_tools(ask: Ask) -> Ask:
    """The Ask with its tools' effect on sampling: the tool choice's constraint joined to the structured
    output (`tool_constraint`), special tokens kept when the tool format or the reasoning format reads
    them. Apply once."""
    tools = ask.tools
    keep = ask.reasoning is not None and ask.reasoning.needs_special_tokens
    if tools is None:
        return replace(ask, sampling=replace(ask.sampling, skip_special_tokens=False)) if keep else ask
    return replace(ask, sampling=replace(ask.sampling, structured=tool_constraint(tools, ask.sampling.structured),
                                         skip_special_tokens=not (keep or tools.keeps_special_tokens)))


def tool_constraint(tools: ChatTools | None, structured: StructuredOutput | None,
                    param: str | None = None) -> StructuredOutput | None:
    """The request's output constraint with its tool choice's joined (ChatTools.constraint, as the offline
    API joins them): under `auto` a JSON schema / json_object answer or calls, under a forced call the
    call. A structured output that cannot join (a regex, choice or grammar beside active tools) is a 400
    naming `param`, else its own field."""
    if tools is None:
        return structured
    try:
        return tools.constraint(structured)
    except ConstraintConflict as e:
        raise ApiError("invalid_field", str(e), param=param or e.field) from None


def namespace(state: ServerState, ask: Ask) -> str:
    """SamplingParams.cache_namespace of the Ask: its tenant's, narrowed by its cache_salt."""
    return cache_namespace(ask.tenant, ask.cache_salt, state.config.cache_sharing)


async def compile_structured(state: ServerState, ask: Ask) -> None:
    """The Ask's structured output compiled off the event loop (a no-op when none or cached)."""
    await compile_off_loop(state, ask.sampling.structured, namespace(state, ask))


def admit(state: ServerState, ask: Ask, tokens: list[int], default_max_tokens: int | None = None,
          index: int | None = None) -> Planned:
    """One prompt's SamplingParams and the engine's check of it (synchronous: a session commits its
    turn right after, with no await between). `default_max_tokens`: an unset max_tokens' (else the
    Ask's); `index`: which of several prompts, for the refusal's message."""
    admit_prompt(state, len(tokens))
    engine = state.require_engine()
    params = build_sampling_params(ask.sampling, prompt_len=len(tokens), max_model_len=engine.max_model_len,
                                   default_max_tokens=default_max_tokens if default_max_tokens is not None
                                   else ask.default_max_tokens, n=ask.n, api=ask.api)
    params.cache_namespace = namespace(state, ask)
    opened = False
    if ask.reasoning is not None and state.formatter is not None:
        opened = ask.reasoning.opens_in(state.formatter.prompt_tail(tokens))
    if not ask.engine_checks:
        return Planned(tokens, params, None, opened)
    try:
        checked = engine.intake.check(tokens, params, ask.priority)
    except RequestError as e:
        error = api_error_from(e)
        if error.param is None and ask.refusal_param is not None:  # a refusal of the prompt itself
            error.param = ask.refusal_param
            if index is not None:
                error.message = f"{ask.refusal_param}[{index}]: {error.message}"
        raise error from None
    return Planned(tokens, params, checked, opened)
