"""A POST /v1/completions body read into an `Ask` of TextPrompts and planned (server/pipeline/):
every field checked, every prompt tokenized, admitted and checked by the engine, all before any
response starts (a refusal is a JSON error, never an opened stream).

`prompt` is a string, a list of strings, a list of token ids or a list of such lists (at most
MAX_PROMPTS prompts); each runs as its own engine request with the same sampling parameters. Fields
read: `model` (the served one, else 404), `max_tokens` (default 16, OpenAI's and vLLM's for this
endpoint; 0 only with `echo`), `n` (best_of only equal to it), `stream`, `stream_options`, `echo`,
`logprobs` (0..5, OpenAI's limit for the legacy field), vLLM's `prompt_logprobs` (0..20, not with
stream), `priority`, `skip_special_tokens`, every sampling field of the table (radixserve/sampling_fields.py:
`ignore_eos`, `min_tokens`, `bad_words`, `stop_token_ids`, `allowed_token_ids` among them),
the structured-output fields of pipeline/structured.py, and `prediction` (pipeline/prediction.py: OpenAI's
chat shape; every prompt drafts from the same prediction). `user` and other unknown fields are ignored;
UNSUPPORTED fields asking for something this server cannot do are a 400 naming them.

Invariant: every refusal is a 4xx ApiError whose `param` names the field; an engine refusal of a
prompt (empty, token ids outside the vocabulary, longer than the context) names `prompt`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from starlette.requests import Request

from radixserve.engine.client import EngineClient
from radixserve.sampling_fields import Api
from radixserve.server.auth import priority_bounds, request_key
from radixserve.server.callers import cache_salt_of, caller_of
from radixserve.server.completions.logprobs import prompt_logprobs_field
from radixserve.server.http_util import generation_body
from radixserve.server.openai_chat.shapes import stream_include_usage
from radixserve.server.pipeline.ask import Ask, LogprobBudget, TextPrompts
from radixserve.server.pipeline.plan import Plan, plan
from radixserve.server.pipeline.prediction import with_prediction
from radixserve.server.pipeline.sampling import read_sampling
from radixserve.server.pipeline.structured import structured_output
from radixserve.server.state import ServerState
from radixserve.server.validation import ApiError, get_bool, get_int, get_priority, get_str, is_int, refuse_unsupported

LEGACY_MAX_LOGPROBS = 5  # OpenAI's bound on the legacy `logprobs` (vLLM allows 20: prompt_logprobs does here)
DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for this endpoint (clamped to the context left)
MAX_PROMPTS = 64  # prompts in one request: each is an engine request
# vLLM's extras this server cannot honour, each with the value that asks for nothing (accepted); another is a 400
UNSUPPORTED: dict[str, Any] = {
    "suffix": "", "use_beam_search": False, "include_stop_str_in_output": False, "truncate_prompt_tokens": None,
    "logits_processors": None, "prompt_embeds": None, "return_tokens_as_token_ids": False,
}
_SHAPE = "'prompt' must be a string, a list of strings, a list of token ids or a list of lists of token ids"


@dataclass
class CompletionRequest:
    model: str
    plan: Plan  # one planned prompt per prompt of `prompt`, all with the same sampling
    echo: bool
    echo_texts: list[str]  # per prompt, what `echo` shows: the string as sent, or the ids decoded ("" without echo)
    echo_only: bool  # max_tokens 0: the engine runs one token, which the reply leaves out
    logprobs: int | None  # the legacy field's k; None: not asked
    prompt_logprobs: int | None  # vLLM's field as asked (an echo with logprobs asks the engine, not this)

    @property
    def n(self) -> int:
        return self.plan.ask.n


def parse_prompts(value: Any) -> list[str | list[int]]:
    """The prompts of `prompt`, each a non-empty string or a non-empty list of token ids."""
    if value is None:
        raise ApiError("missing_field", "missing required field 'prompt'", param="prompt")
    if isinstance(value, str) or (isinstance(value, list) and value and all(is_int(x) for x in value)):
        items = [value]
    elif isinstance(value, list) and value and (all(isinstance(x, str) for x in value)
                                                or all(isinstance(x, list) for x in value)):
        items = value
    else:  # a number, an object, an empty list, or kinds mixed in one list
        raise ApiError("invalid_field", _SHAPE, param="prompt")
    if len(items) > MAX_PROMPTS:
        raise ApiError("invalid_field", f"'prompt' holds {len(items)} prompts; at most {MAX_PROMPTS} per request",
                       param="prompt")
    for i, item in enumerate(items):
        where = "'prompt'" if len(items) == 1 else f"prompt[{i}]"
        if not item:
            raise ApiError("invalid_field", f"{where} must not be empty", param="prompt")
        if isinstance(item, list) and not all(is_int(t) and t >= 0 for t in item):
            raise ApiError("invalid_field", f"{where} must be a list of token ids (integers >= 0)", param="prompt")
    return items


async def parse_completion_request(state: ServerState, request: Request) -> CompletionRequest:
    body = await generation_body(request)  # with its generation slot, before any tokenizing
    caller = caller_of(request)
    model = get_str(body, "model")
    assert model is not None
    state.require_model(model)
    refuse_unsupported(body, UNSUPPORTED)
    stream, echo = get_bool(body, "stream"), get_bool(body, "echo")
    n = get_int(body, "n", minimum=1, maximum=state.config.max_n) or 1
    best_of = get_int(body, "best_of", minimum=1)
    if best_of is not None and best_of != n:
        raise ApiError("unsupported", f"'best_of' must equal 'n' ({n}) when given: every sample generated is "
                       "returned", param="best_of")
    # 0 only with echo: the prompt alone (the engine still runs one token, which the reply drops)
    echo_only = body.get("max_tokens") == 0 and is_int(body["max_tokens"])
    if echo_only and not echo:
        raise ApiError("invalid_field", "'max_tokens' must be at least 1 (0 only with 'echo': the prompt alone)",
                       param="max_tokens")
    top = get_int(body, "logprobs", minimum=0, maximum=LEGACY_MAX_LOGPROBS)
    prompt_top = prompt_logprobs_field(body, stream)
    echo_top = top if echo else None  # an echoed prompt's tokens get the legacy logprobs too
    asked = [k for k in (echo_top, prompt_top) if k is not None]
    sampling = with_prediction(replace(
        read_sampling({**body, "max_tokens": 1} if echo_only else body, Api.COMPLETIONS), logprobs=top,
        structured=structured_output(body), prompt_logprobs=max(asked) if asked else None,
        skip_special_tokens=get_bool(body, "skip_special_tokens", True)), body)
    # each choice repeats its prompt's lists (echoed, vLLM's), then its generated tokens'
    budget = LogprobBudget(None if echo_only else top, (echo_top, prompt_top), per_choice=True, param="logprobs",
                           prompt_param="logprobs" if prompt_top is None else "prompt_logprobs")
    items = parse_prompts(body.get("prompt"))
    priority = get_priority(body, priority_bounds(request_key(request.headers), state.config))
    ask = Ask(Api.COMPLETIONS, TextPrompts(items), sampling, caller.tenant, cache_salt_of(body), n=n, priority=priority,
              logprobs=budget, default_max_tokens=DEFAULT_MAX_TOKENS, stream=stream,
              include_usage=stream_include_usage(body, stream), refusal_param="prompt")
    planned = await plan(state, ask)
    engine = state.require_engine()
    echo_texts = [("" if not echo else item if isinstance(item, str) else _decode(engine, p.tokens))
                  for item, p in zip(items, planned.prompts)]
    return CompletionRequest(model, planned, echo, echo_texts, echo_only, top, prompt_top)


def _decode(engine: EngineClient, tokens: list[int]) -> str:
    """A token prompt's echo: its tokens' text as they are (special tokens and spaces kept), so the
    echo and its tokens' texts in the legacy logprobs agree."""
    if engine.tokenizer is None:
        return ""
    return str(engine.tokenizer.decode(tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False))
