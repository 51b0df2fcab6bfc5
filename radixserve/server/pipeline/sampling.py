"""The sampling fields of a request body, read under its API's names into the typed SamplingFields,
and SamplingFields made into SamplingParams.

The fields, their names on each API, their ranges and what excludes them are the core table's
(radixserve/sampling_fields.py); this module only turns its FieldErrors into the APIs' 400
`invalid_field` naming the API's name for the field. `read_sampling` reads any JSON object (an
OpenAI, Responses or Anthropic body, a session's or a turn's `sampling` object), so each field has
one check and one error wherever it arrives. `build_sampling_params` turns SamplingFields into
SamplingParams, clamping an unset max_tokens to the context left; a SamplingParams refusal (a
min_tokens above max_tokens) names the field by the API's name too.

An explicit max_tokens past the context left is refused (as vLLM does), except on the APIs in
`CLAMPS_MAX_TOKENS`, whose clients expect it clamped to the room left: Anthropic's Messages, whose
reply then ends with stop_reason "model_context_window_exceeded" when it stops at that clamp
(anthropic/reply.py tells it from the caller's max_tokens).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from radixserve.errors import FieldError
from radixserve.sampling_fields import PASSED, Api, Feature, SamplingFields, api_name, api_names, excluded_by, read_fields
from radixserve.sampling_params import SamplingParams
from radixserve.server.validation import ApiError

# a session's or a turn's `sampling` object: exactly these
SAMPLING_KEYS = api_names(Api.SESSION)
_PARAMS_FIELDS = {f.name for f in fields(SamplingParams)}
# APIs whose explicit max_tokens past the context left is clamped to it rather than refused
CLAMPS_MAX_TOKENS = frozenset({Api.ANTHROPIC})


def read_sampling(obj: Mapping[str, Any], api: Api) -> SamplingFields:
    """The table's fields `obj` sets under `api`'s names, checked (ApiError naming the field)."""
    try:
        return SamplingFields(**read_fields(obj, api))
    except FieldError as e:
        raise ApiError("invalid_field", str(e), param=e.param) from None


def refuse_with(feature: Feature, sampling: SamplingFields, api: Api) -> None:
    """A 400 naming the first field `sampling` sets to a value `feature` cannot go with."""
    try:
        excluded_by(feature, sampling, api)
    except FieldError as e:
        raise ApiError("invalid_field", str(e), param=e.param) from None


def parse_sampling(x: Any, name: str = "sampling") -> SamplingFields:
    """A session's or a turn's `sampling` object, validated (unknown keys refused, naming `name`)."""
    if x is None:
        return SamplingFields()
    if not isinstance(x, dict):
        raise ApiError("invalid_field", f"{name!r} must be an object", param=name)
    unknown = sorted(set(x) - set(SAMPLING_KEYS))
    if unknown:
        raise ApiError("invalid_field", f"unknown {name} field(s) {unknown}; known: {list(SAMPLING_KEYS)}", param=name)
    return read_sampling(x, Api.SESSION)


def build_sampling_params(sampling: SamplingFields, *, prompt_len: int, max_model_len: int,
                          default_max_tokens: int | None, n: int = 1, api: Api = Api.CHAT) -> SamplingParams:
    """SamplingParams for one request. An unset max_tokens is clamped to what the context has left;
    an explicit one that does not fit is refused, naming the limit (as vLLM does), or on an API of
    CLAMPS_MAX_TOKENS clamped too. A prompt that leaves no room at all is the engine's to refuse
    (engine/intake.py), so it gets max_tokens 1 here. Refusals name the field as `api` names it."""
    max_tokens = sampling.max_tokens
    room = max_model_len - prompt_len
    if max_tokens is None:
        max_tokens = max(1, room if default_max_tokens is None else min(default_max_tokens, room))
    elif max_tokens > room and api in CLAMPS_MAX_TOKENS:
        max_tokens = max(1, room)
    elif max_tokens > room:
        raise ApiError("context_too_long", f"prompt of {prompt_len} tokens + max_tokens {max_tokens} exceeds the "
                       f"model's context length of {max_model_len} tokens", param=api_name(api, "max_tokens"))
    passed = {k: v for k in PASSED if (v := getattr(sampling, k)) is not None}
    try:
        return SamplingParams(max_tokens=max_tokens, n=n, **passed)
    except ValueError as e:  # its messages start with the field they refuse
        field = next((k for k in sorted(_PARAMS_FIELDS, key=len, reverse=True) if str(e).startswith(k)), None)
        raise ApiError("invalid_field", str(e), param=None if field is None else api_name(api, field)) from None
