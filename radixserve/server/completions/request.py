"""A POST /v1/completions body made into a CompletionRequest: every field checked, every prompt
tokenized, admitted and checked by the engine, all before any response starts (a refusal is a JSON
error, never an opened stream).

`prompt` is a string, a list of strings, a list of token ids or a list of such lists (at most
MAX_PROMPTS prompts); each runs as its own engine request with the same sampling parameters. Fields
read: `model` (the served one, else 404), `max_tokens` (default 16, OpenAI's and vLLM's for this
endpoint; 0 only with `echo`), `n` (best_of only equal to it), `stream`, `stream_options`, `echo`,
`logprobs` (0..5, OpenAI's limit for the legacy field), vLLM's `prompt_logprobs` (0..20, not with
stream), `priority`, `ignore_eos`, `skip_special_tokens`, every sampling field of sampling_fields.py,
the structured-output fields of structured_api.py, and `prediction` (speculation_api.py: OpenAI's
chat shape; every prompt drafts from the same prediction). `user` and other unknown fields are ignored;
UNSUPPORTED fields asking for something this server cannot do are a 400 naming them.

Invariant: every refusal is a 4xx ApiError whose `param` names the field; an engine refusal of a
prompt (empty, token ids outside the vocabulary, longer than the context) names `prompt`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from radixserve.engine.client import EngineClient
from radixserve.engine.intake import ValidatedRequest
from radixserve.sampling_params import SamplingParams
from radixserve.server.callers import cache_salt_of, namespace_for
from radixserve.server.completion_logprobs import prompt_logprobs_field
from radixserve.server.generation import SystemPromptRef, admit_prompt, check_request
from radixserve.server.logprobs import cap_logprob_entries, entries
from radixserve.server.openai_api import stream_include_usage
from radixserve.server.sampling_fields import build_sampling_params, sampling_values
from radixserve.server.speculation_api import tokenize_prediction, with_prediction
from radixserve.server.state import ServerState
from radixserve.server.structured_api import compile_off_loop, structured_output
from radixserve.server.tenants import Caller
from radixserve.server.validation import ApiError, get_bool, get_int, get_priority, get_str, is_int, refuse_unsupported

LEGACY_MAX_LOGPROBS = 5  # OpenAI's bound on the legacy `logprobs` (vLLM allows 20: prompt_logprobs does here)
DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for this endpoint (clamped to the context left)
MAX_PROMPTS = 64  # prompts in one request: each is an engine request
# vLLM's extras this server cannot honour, each with the value that asks for nothing (accepted); another is a 400
UNSUPPORTED: dict[str, Any] = {
    "suffix": "", "min_tokens": 0, "use_beam_search": False, "include_stop_str_in_output": False,
    "stop_token_ids": [], "bad_words": [], "allowed_token_ids": None, "truncate_prompt_tokens": None,
    "logits_processors": None, "prompt_embeds": None, "return_tokens_as_token_ids": False,
}
_SHAPE = "'prompt' must be a string, a list of strings, a list of token ids or a list of lists of token ids"


@dataclass
class Prompt:
    tokens: list[int]
    text: str  # what `echo` shows: the string as sent, or the token ids decoded ("" without echo)
    checked: ValidatedRequest  # what the engine's intake made of it


@dataclass
class CompletionRequest:
    model: str
    prompts: list[Prompt]
    n: int  # choices per prompt
    stream: bool
    include_usage: bool
    echo: bool
    echo_only: bool  # max_tokens 0: the engine runs one token, which the reply leaves out
    logprobs: int | None  # the legacy field's k; None: not asked
    prompt_logprobs: int | None  # vLLM's field as asked (an echo with logprobs asks the engine, not this)
    system: SystemPromptRef  # none (a plain-text prompt has no system prompt), counted as the caller's tenant's


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


async def parse_completion_request(state: ServerState, body: dict[str, Any], priority_bounds: tuple[int, int],
                                   caller: Caller) -> CompletionRequest:
    engine = state.require_engine()
    model = get_str(body, "model")
    assert model is not None
    state.require_model(model)
    refuse_unsupported(body, UNSUPPORTED)
    namespace = namespace_for(caller, cache_salt_of(body), state.config)  # the caller's tenant, its cache_salt
    stream = get_bool(body, "stream")
    include_usage = stream_include_usage(body, stream)
    echo = get_bool(body, "echo")
    n = get_int(body, "n", minimum=1, maximum=state.config.max_n) or 1
    best_of = get_int(body, "best_of", minimum=1)
    if best_of is not None and best_of != n:
        raise ApiError("unsupported", f"'best_of' must equal 'n' ({n}) when given: every sample generated is "
                       "returned", param="best_of")
    max_tokens = get_int(body, "max_tokens", minimum=0)
    if max_tokens == 0 and not echo:
        raise ApiError("invalid_field", "'max_tokens' must be at least 1 (0 only with 'echo': the prompt alone)",
                       param="max_tokens")
    top = get_int(body, "logprobs", minimum=0, maximum=LEGACY_MAX_LOGPROBS)
    prompt_top = prompt_logprobs_field(body, stream)
    echo_top = top if echo else None  # an echoed prompt's tokens get the legacy logprobs too
    asked = [k for k in (echo_top, prompt_top) if k is not None]
    sampling = with_prediction({**sampling_values(body), "logprobs": top, "structured": structured_output(body),
                                "prompt_logprobs": max(asked) if asked else None,
                                "skip_special_tokens": get_bool(body, "skip_special_tokens", True)}, body)
    if max_tokens is not None:
        sampling["max_tokens"] = max(max_tokens, 1)  # 0: the engine needs one; the reply drops it
    ignore_eos, priority = get_bool(body, "ignore_eos"), get_priority(body, priority_bounds)
    raw = parse_prompts(body.get("prompt"))
    tokens = [await _tokens(state, engine, item) for item in raw]
    for t in tokens:
        admit_prompt(state, len(t))
    sampling = await tokenize_prediction(state, sampling)  # once, for every prompt
    # bounded before anything runs: each choice repeats its prompt's lists, then its generated tokens'
    prompt_len = sum(len(t) for t in tokens)
    cap_logprob_entries(n * len(tokens), max_tokens or DEFAULT_MAX_TOKENS, None if max_tokens == 0 else top,
                        state.config.max_logprob_entries, spent=n * (entries(prompt_len, echo_top)
                                                                      + entries(prompt_len, prompt_top)),
                        param="logprobs", prompt_param="logprobs" if prompt_top is None else "prompt_logprobs")
    await compile_off_loop(state, sampling["structured"], namespace)  # the checks below then find it compiled
    prompts = []
    for i, (item, t) in enumerate(zip(raw, tokens)):
        params = build_sampling_params({k: v for k, v in sampling.items() if v is not None}, prompt_len=len(t),
                                       max_model_len=engine.max_model_len, default_max_tokens=DEFAULT_MAX_TOKENS,
                                       n=n)
        params = replace(params, ignore_eos=ignore_eos, cache_namespace=namespace)
        checked = _check(engine, t, params, priority, i if len(tokens) > 1 else None)
        text = "" if not echo else item if isinstance(item, str) else _decode(engine, t)
        prompts.append(Prompt(t, text, checked))
    return CompletionRequest(model, prompts, n, stream, include_usage, echo, max_tokens == 0, top, prompt_top,
                             SystemPromptRef.none(caller.tenant))


async def _tokens(state: ServerState, engine: EngineClient, item: str | list[int]) -> list[int]:
    if not isinstance(item, str):
        return item
    if engine.tokenizer is None:
        raise ApiError("unsupported", "this model has no tokenizer: send the prompt as token ids", param="prompt")
    return await state.require_prompts().encode(item)  # a long one off the event loop


def _check(engine: EngineClient, tokens: list[int], params: SamplingParams, priority: int,
           index: int | None) -> ValidatedRequest:
    """The engine's check of one prompt. A refusal that names no field (a FieldError does: a logit_bias
    id past the vocabulary) is of the prompt, so it names `prompt` (and which one, of several)."""
    try:
        return check_request(engine, tokens, params, priority)
    except ApiError as e:
        if e.param is None:
            e.param = "prompt"
            if index is not None:
                e.message = f"prompt[{index}]: {e.message}"
        raise


def _decode(engine: EngineClient, tokens: list[int]) -> str:
    """A token prompt's echo: its tokens' text as they are (special tokens and spaces kept), so the
    echo and its tokens' texts in the legacy logprobs agree."""
    if engine.tokenizer is None:
        return ""
    return str(engine.tokenizer.decode(tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False))
