"""The sampling fields every API reads, in one place: their names, types, ranges and defaults.

`sampling_values` reads them from any JSON object (an OpenAI body, a WebSocket frame's or a session
message's `sampling` object, a Responses or Anthropic body, under that API's names), so each field
has one check and one error wherever it arrives. `build_sampling_params` turns the values into
SamplingParams, clamping an unset max_tokens to the context left.

Ranges: temperature [0, 2], top_p (0, 1], top_k >= 0, min_p [0, 1]; presence_penalty and
frequency_penalty [-2, 2] (OpenAI's); repetition_penalty [0.01, 2] (vLLM's takes any positive value,
but the sampler divides float32 logits by it, and below the floor that overflows: 1e-300 is 0 in
float32), 1 is off; every range is one float32 holds (sampling_params.py); logit_bias an
object of token id (a decimal string, as JSON keys are, or an integer) -> bias in [-100, 100], at most
300 entries (OpenAI's limits; ids past the vocabulary are the engine's to refuse); seed a signed
64-bit integer, [-2**63, 2**63 - 1] (vLLM's range; the engine takes it modulo 2**64).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from radixserve.sampling_params import (
    LOGIT_BIAS_RANGE,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
    PENALTY_RANGE,
    SamplingParams,
)
from radixserve.server.validation import ApiError, get_float, get_int, get_stop, is_number

SEED_RANGE = (-(2**63), 2**63 - 1)
PENALTY_KEYS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")
# a WebSocket frame's and a session message's `sampling` object: exactly these
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "seed", "stop", *PENALTY_KEYS)
_TOKEN_ID_DIGITS = 12  # no vocabulary has a trillion tokens; bounds int() on a client's string


def sampling_values(obj: Mapping[str, Any], *, stop_name: str = "stop") -> dict[str, Any]:
    """The sampling fields present in `obj`, checked (ApiError naming the field otherwise), unset
    ones left out. `max_tokens` is not read here: each API names it differently."""
    low, high = PENALTY_RANGE
    fields = dict(obj)  # the getters take a dict
    out: dict[str, Any] = {
        "temperature": get_float(fields, "temperature", 0.0, 2.0),
        "top_p": get_float(fields, "top_p", 0.0, 1.0, lo_open=True),
        "top_k": get_int(fields, "top_k", minimum=0),
        "min_p": get_float(fields, "min_p", 0.0, 1.0),
        "seed": get_int(fields, "seed", minimum=SEED_RANGE[0], maximum=SEED_RANGE[1]),
        "stop": get_stop(fields, stop_name) or None,
        "presence_penalty": get_float(fields, "presence_penalty", low, high),
        "frequency_penalty": get_float(fields, "frequency_penalty", low, high),
        "repetition_penalty": get_float(fields, "repetition_penalty", MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY),
        "logit_bias": logit_bias(fields.get("logit_bias")),
    }
    return {k: v for k, v in out.items() if v is not None}


def logit_bias(value: Any, param: str = "logit_bias") -> dict[int, float] | None:
    """OpenAI's `logit_bias`: {"token id": bias}; None when absent or empty."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ApiError("invalid_field", f"{param!r} must be an object of token id -> bias", param=param)
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise ApiError("invalid_field", f"{param!r} takes at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(value)}",
                       param=param)
    low, high = LOGIT_BIAS_RANGE
    out: dict[int, float] = {}
    for key, bias in value.items():
        token = _token_id(key)
        if token is None:
            raise ApiError("invalid_field", f"{param!r} keys must be token ids (non-negative integers), got {key!r}",
                           param=param)
        if not is_number(bias) or not low <= bias <= high:
            raise ApiError("invalid_field", f"{param}[{key!r}] must be a number in [{low:g}, {high:g}], got {bias!r}",
                           param=param)
        out[token] = float(bias)
    return out or None


def _token_id(key: Any) -> int | None:
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= _TOKEN_ID_DIGITS:
        return int(key)
    return None


def parse_sampling(x: Any, name: str = "sampling") -> dict[str, Any]:
    """A session/WebSocket `sampling` object, validated and normalised (unset keys dropped)."""
    if x is None:
        return {}
    if not isinstance(x, dict):
        raise ApiError("invalid_field", f"{name!r} must be an object", param=name)
    unknown = sorted(set(x) - set(SAMPLING_KEYS))
    if unknown:
        raise ApiError("invalid_field", f"unknown {name} field(s) {unknown}; known: {list(SAMPLING_KEYS)}", param=name)
    out = sampling_values(x)
    max_tokens = get_int(x, "max_tokens", minimum=1)
    return out if max_tokens is None else {**out, "max_tokens": max_tokens}


# SamplingParams fields a sampling dict may set, with their defaults when unset
_PASSED = ("temperature", "top_p", "top_k", "min_p", "seed", "logprobs", "prompt_logprobs", "structured",
           "skip_special_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
           "prediction")  # prediction: token ids (server/speculation_api.py reads and tokenizes it)


def build_sampling_params(sampling: dict[str, Any], *, prompt_len: int, max_model_len: int,
                          default_max_tokens: int | None, n: int = 1) -> SamplingParams:
    """SamplingParams for one request. An unset max_tokens is clamped to what the context has left;
    an explicit one that does not fit is refused, naming the limit (as vLLM does). A prompt that
    leaves no room at all is the engine's to refuse (engine/intake.py), so it gets max_tokens 1 here."""
    max_tokens = sampling.get("max_tokens")
    room = max_model_len - prompt_len
    if max_tokens is None:
        max_tokens = max(1, room if default_max_tokens is None else min(default_max_tokens, room))
    elif max_tokens > room:
        raise ApiError("context_too_long", f"prompt of {prompt_len} tokens + max_tokens {max_tokens} exceeds the "
                       f"model's context length of {max_model_len} tokens", param="max_tokens")
    passed = {k: sampling[k] for k in _PASSED if sampling.get(k) is not None}
    try:
        return SamplingParams(max_tokens=max_tokens, n=n, stop=list(sampling.get("stop") or []), **passed)
    except ValueError as e:
        raise ApiError("invalid_field", str(e)) from None
