"""The sampling fields every API takes, as one declarative table, and the typed object that carries
them from an API's parser to SamplingParams.

Each `SamplingField` row says: its name (the `SamplingFields` / SamplingParams attribute), the name
each API reads it under (a tuple when an API takes aliases, the first one set wins; an API missing
from `names` cannot express it), its JSON kind and range, its neutral value (SamplingParams'
default: the value that asks nothing of the sampler) and the features it cannot be combined with
at any other value (an `Exclusion`: beam search is deterministic and ranks beams by the model's own
log-probabilities). Everything else is generated from the rows: `read_fields` checks one JSON object
under one API's names (one check and one message per field wherever it arrives, a FieldError naming
the API's name for it), `api_names` is an API's accepted set (a session's `sampling` allow-list,
Anthropic's extensions), `PASSED` what reaches SamplingParams, `excluded_by` a feature's exclusions.

Ranges (the APIs', narrower than what SamplingParams takes offline): temperature [0, 2] (OpenAI's; the
Anthropic API's own [0, 1] is widened to it here, so one range holds on every API), top_p (0, 1],
top_k >= 0, min_p [0, 1]; presence/frequency penalties [-2, 2] (OpenAI's); repetition_penalty
[0.01, 2] (sampling_params.py says why the floor); logit_bias an object of token id (a decimal
string, as JSON keys are) -> bias in [-100, 100], at most 300 entries; seed a signed 64-bit integer
(vLLM's range); max_tokens >= 1; min_tokens >= 0; stop at most 8 strings of 1..256 characters;
bad_words at most MAX_BAD_WORDS strings of 1..MAX_BAD_WORD_CHARS characters; stop_token_ids and
allowed_token_ids token ids in [0, MAX_TOKEN_ID] (ids past the vocabulary are the engine's to
refuse), allowed_token_ids non-empty (nothing could be sampled); ignore_eos a boolean.

Invariants: a field that is absent, null, or an empty list/object where empty means "none" (stop,
logit_bias, bad_words, stop_token_ids) reads as None, never as a value; every row's name is a
`SamplingFields` attribute, and every name in PASSED a SamplingParams one (tests/server/test_sampling_table.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from radixserve.errors import FieldError
from radixserve.sampling_params import (
    LOGIT_BIAS_RANGE,
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_REPETITION_PENALTY,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOKEN_ID,
    MIN_REPETITION_PENALTY,
    PENALTY_RANGE,
)
from radixserve.structured import StructuredOutput

SEED_RANGE = (-(2**63), 2**63 - 1)
_TOKEN_ID_DIGITS = 12  # no vocabulary has a trillion tokens; bounds int() on a client's string


class Api(str, Enum):
    """The request shapes that carry sampling fields."""

    CHAT = "chat"  # POST /v1/chat/completions
    COMPLETIONS = "completions"  # POST /v1/completions
    RESPONSES = "responses"  # POST /v1/responses
    ANTHROPIC = "anthropic"  # POST /v1/messages
    SESSION = "session"  # a session's or a turn's `sampling` object (REST and WebSocket)


class Feature(str, Enum):
    """Request features some sampling fields cannot go with; the value is the field asking for it."""

    BEAM_SEARCH = "use_beam_search"


class Kind(Enum):
    """A field's JSON shape, and so its check."""

    FLOAT = "a number"
    INT = "an integer"
    BOOL = "a boolean"
    STRINGS = "a string or a list of strings"  # stop sequences
    WORDS = "a list of strings"  # bad_words
    TOKEN_IDS = "a list of token ids"
    LOGIT_BIAS = "an object of token id -> bias"


@dataclass(frozen=True)
class Exclusion:
    """`feature` refuses the field at any value but `allowed` (the field's neutral one when None)."""

    feature: Feature
    why: str
    allowed: object = None


@dataclass(frozen=True)
class SamplingField:
    name: str
    kind: Kind
    neutral: object
    names: Mapping[Api, tuple[str, ...]]
    low: float | None = None
    high: float | None = None
    low_open: bool = False  # (low, high] rather than [low, high]
    may_be_empty: bool = True  # an empty list means "none"; False: it would allow nothing, a 400
    excludes: tuple[Exclusion, ...] = ()

    def read(self, value: Any, param: str) -> Any:
        """`value` checked and normalised; None when it asks for nothing. FieldError naming `param`."""
        if value is None:
            return None
        return _READERS[self.kind](self, value, param)

    def range_text(self) -> str:
        low = "-inf" if self.low is None else _number(self.low)
        high = "inf" if self.high is None else _number(self.high)
        return f"{'(' if self.low_open else '['}{low}, {high}]"

    def in_range(self, x: float) -> bool:
        return (self.low is None or x > self.low or (x == self.low and not self.low_open)) \
            and (self.high is None or x <= self.high)


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def is_int(x: object) -> bool:
    """A JSON integer (a bool is not one, though Python says so)."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: object) -> bool:
    """A finite JSON number."""
    return (is_int(x) or isinstance(x, float)) and math.isfinite(x)  # type: ignore[arg-type]


def _read_float(f: SamplingField, v: Any, param: str) -> float:
    if not is_number(v):
        raise FieldError(param, f"{param!r} must be a finite number")
    if not f.in_range(v):
        raise FieldError(param, f"{param!r} must be in {f.range_text()}, got {v}")
    return float(v)


def _read_int(f: SamplingField, v: Any, param: str) -> int:
    if not is_int(v):
        raise FieldError(param, f"{param!r} must be an integer, got {type(v).__name__}")
    if not f.in_range(v):
        raise FieldError(param, f"{param!r} must be in {f.range_text()}, got {v}")
    return int(v)


def _read_bool(f: SamplingField, v: Any, param: str) -> bool:
    if not isinstance(v, bool):
        raise FieldError(param, f"{param!r} must be a boolean")
    return v


def _read_strings(f: SamplingField, v: Any, param: str, *, limit: int, chars: int, single: bool) -> list[str] | None:
    items = [v] if single and isinstance(v, str) else v
    shape = "a non-empty string or a list of non-empty strings" if single else "a list of non-empty strings"
    if not isinstance(items, list) or not all(isinstance(s, str) and 0 < len(s) <= chars for s in items):
        raise FieldError(param, f"{param!r} must be {shape} of at most {chars} characters")
    if len(items) > limit:
        raise FieldError(param, f"{param!r} takes at most {limit} strings")
    return list(items) or None


def _read_stop(f: SamplingField, v: Any, param: str) -> list[str] | None:
    return _read_strings(f, v, param, limit=MAX_STOP_STRINGS, chars=MAX_STOP_CHARS, single=True)


def _read_words(f: SamplingField, v: Any, param: str) -> list[str] | None:
    return _read_strings(f, v, param, limit=MAX_BAD_WORDS, chars=MAX_BAD_WORD_CHARS, single=False)


def _read_token_ids(f: SamplingField, v: Any, param: str) -> list[int] | None:
    if not isinstance(v, list) or not all(is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in v):
        raise FieldError(param, f"{param!r} must be a list of token ids (integers in [0, {MAX_TOKEN_ID}])")
    if not v and not f.may_be_empty:
        raise FieldError(param, f"{param!r} must not be empty")
    return list(v) or None


def _read_logit_bias(f: SamplingField, v: Any, param: str) -> dict[int, float] | None:
    if not isinstance(v, dict):
        raise FieldError(param, f"{param!r} must be an object of token id -> bias")
    if len(v) > MAX_LOGIT_BIAS_ENTRIES:
        raise FieldError(param, f"{param!r} takes at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(v)}")
    low, high = LOGIT_BIAS_RANGE
    out: dict[int, float] = {}
    for key, bias in v.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= _TOKEN_ID_DIGITS):
            raise FieldError(param, f"{param!r} keys must be token ids (non-negative integers), got {key!r}")
        if not is_number(bias) or not low <= bias <= high:
            raise FieldError(param, f"{param}[{key!r}] must be a number in [{low:g}, {high:g}], got {bias!r}")
        out[int(key)] = float(bias)
    return out or None


_READERS = {Kind.FLOAT: _read_float, Kind.INT: _read_int, Kind.BOOL: _read_bool, Kind.STRINGS: _read_stop,
            Kind.WORDS: _read_words, Kind.TOKEN_IDS: _read_token_ids, Kind.LOGIT_BIAS: _read_logit_bias}


def _everywhere(name: str, **renamed: tuple[str, ...]) -> dict[Api, tuple[str, ...]]:
    """`name` on every API, but for those `renamed` (an empty tuple: that API cannot express it)."""
    out = {api: renamed.get(api.value, (name,)) for api in Api}
    return {api: names for api, names in out.items() if names}


_DETERMINISTIC = "beam search is deterministic"
_RANKED = "beams are ranked by the model's own log-probabilities"
_UNMASKED = "the beams' steps apply no token masks"

TABLE: tuple[SamplingField, ...] = (
    SamplingField("temperature", Kind.FLOAT, 1.0, _everywhere("temperature"), 0.0, 2.0,
                  excludes=(Exclusion(Feature.BEAM_SEARCH, _DETERMINISTIC, allowed=0.0),)),
    SamplingField("top_p", Kind.FLOAT, 1.0, _everywhere("top_p"), 0.0, 1.0, low_open=True,
                  excludes=(Exclusion(Feature.BEAM_SEARCH, _DETERMINISTIC),)),
    SamplingField("top_k", Kind.INT, 0, _everywhere("top_k"), 0,
                  excludes=(Exclusion(Feature.BEAM_SEARCH, _DETERMINISTIC),)),
    SamplingField("min_p", Kind.FLOAT, 0.0, _everywhere("min_p"), 0.0, 1.0,
                  excludes=(Exclusion(Feature.BEAM_SEARCH, _DETERMINISTIC),)),
    SamplingField("seed", Kind.INT, None, _everywhere("seed"), *SEED_RANGE),  # beams: accepted, no effect
    SamplingField("max_tokens", Kind.INT, None, _everywhere("max_tokens", chat=("max_completion_tokens", "max_tokens"),
                                                            responses=("max_output_tokens",)), 1),
    SamplingField("stop", Kind.STRINGS, [], _everywhere("stop", anthropic=("stop_sequences",)),
                  excludes=(Exclusion(Feature.BEAM_SEARCH, "beams end only on tokens"),)),
    SamplingField("presence_penalty", Kind.FLOAT, 0.0, _everywhere("presence_penalty"), *PENALTY_RANGE,
                  excludes=(Exclusion(Feature.BEAM_SEARCH, _RANKED),)),
    SamplingField("frequency_penalty", Kind.FLOAT, 0.0, _everywhere("frequency_penalty"), *PENALTY_RANGE,
                  excludes=(Exclusion(Feature.BEAM_SEARCH, _RANKED),)),
    SamplingField("repetition_penalty", Kind.FLOAT, 1.0, _everywhere("repetition_penalty"),
                  MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY, excludes=(Exclusion(Feature.BEAM_SEARCH, _RANKED),)),
    SamplingField("logit_bias", Kind.LOGIT_BIAS, {}, _everywhere("logit_bias"),
                  excludes=(Exclusion(Feature.BEAM_SEARCH, _RANKED),)),
    SamplingField("min_tokens", Kind.INT, 0, _everywhere("min_tokens"), 0,
                  excludes=(Exclusion(Feature.BEAM_SEARCH, _UNMASKED),)),
    SamplingField("bad_words", Kind.WORDS, [], _everywhere("bad_words"),
                  excludes=(Exclusion(Feature.BEAM_SEARCH, _UNMASKED),)),
    SamplingField("allowed_token_ids", Kind.TOKEN_IDS, None, _everywhere("allowed_token_ids"), may_be_empty=False,
                  excludes=(Exclusion(Feature.BEAM_SEARCH, _UNMASKED),)),
    SamplingField("stop_token_ids", Kind.TOKEN_IDS, [], _everywhere("stop_token_ids")),  # beams end on them too
    SamplingField("ignore_eos", Kind.BOOL, False, _everywhere("ignore_eos")),  # beams: EOS does not end one
)
FIELDS = {f.name: f for f in TABLE}


@dataclass(frozen=True)
class SamplingFields:
    """What a request asks of sampling, from any API: the table's fields (None: not asked, the
    default applies) and the fields each API reads its own way (logprobs, structured output,
    special tokens, a prediction). Made by an API's parser, read by build_sampling_params."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    max_tokens: int | None = None
    stop: list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    min_tokens: int | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    # read by each API its own way, not through the table
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: StructuredOutput | None = None
    skip_special_tokens: bool | None = None
    # text as sent; token ids once the server tokenized it (server/pipeline/prediction.py)
    prediction: str | list[int] | None = None

    def asked(self) -> dict[str, Any]:
        """The table's fields this request sets, by name."""
        return {f.name: v for f in TABLE if (v := getattr(self, f.name)) is not None}

    def with_defaults(self, base: SamplingFields) -> SamplingFields:
        """These fields, each table field left unset taken from `base` (a turn's over its session's)."""
        return replace(self, **{k: v for k, v in base.asked().items() if getattr(self, k) is None})

    def to_json(self) -> dict[str, Any]:
        """The table's fields set, under a session's names (what a session shows of its sampling)."""
        return {FIELDS[name].names[Api.SESSION][0]: value for name, value in self.asked().items()}


# SamplingParams fields a SamplingFields passes on when set: the table's (but max_tokens, which
# build_sampling_params clamps to the context) and the API-read ones
PASSED = tuple(f.name for f in TABLE if f.name != "max_tokens") + (
    "logprobs", "prompt_logprobs", "structured", "skip_special_tokens", "prediction")


def api_names(api: Api) -> tuple[str, ...]:
    """Every name `api` reads a table field under (its accepted set), in table order."""
    return tuple(name for f in TABLE for name in f.names.get(api, ()))


def api_name(api: Api, name: str) -> str:
    """The name `api` gives the table field `name` (its first alias), or `name` itself when the API
    cannot express it or it is not a table field."""
    row = FIELDS.get(name)
    return row.names[api][0] if row is not None and api in row.names else name


def read_fields(obj: Mapping[str, Any], api: Api) -> dict[str, Any]:
    """The table's fields `obj` sets under `api`'s names, checked and normalised, by field name
    (FieldError naming the API's name for the first bad one); of aliases, every one is checked and
    the first set wins. Names `api` cannot express are not read."""
    out: dict[str, Any] = {}
    for f in TABLE:
        for name in f.names.get(api, ()):
            value = f.read(obj.get(name), name)
            if value is not None:
                out.setdefault(f.name, value)
    return out


def excluded_by(feature: Feature, sampling: SamplingFields, api: Api) -> None:
    """FieldError naming the first field `sampling` sets to a value `feature` cannot go with."""
    for f in TABLE:
        value = getattr(sampling, f.name)
        for ex in f.excludes:
            allowed = f.neutral if ex.allowed is None else ex.allowed
            if ex.feature is feature and value is not None and value != allowed:
                name = api_name(api, f.name)
                raise FieldError(name, f"{name!r} must be {allowed!r} or absent with {feature.value!r} ({ex.why}), "
                                       f"got {value!r}")
