"""Request validation shared by the WebSocket, session REST and OpenAI endpoints.

Every rejection is an ApiError carrying a machine-readable code, a human message and the HTTP status
it maps to; handlers turn it into an error frame or an error body. Nothing here touches the engine.

Every JSON document a client sends goes through `parse_json_text`, so what the rest of the server
sees is bounded: at most MAX_JSON_DEPTH levels of nesting (checked on the raw text, before the
recursive parser runs), no string or key holding a lone UTF-16 surrogate (JSON allows the escape
"\\ud800", but such a string cannot be encoded as UTF-8, tokenized or sent back), and only finite
numbers: NaN and Infinity are not JSON, and a literal such as 1e999 that overflows a double is refused
too, so a value a client sent (an echoed `req`) can never come back as the non-JSON `Infinity`.
Messages never quote a library's exception text.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from radixserve.engine.intake import PRIORITY_LIMIT
from radixserve.sampling_fields import is_int, is_number

MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 256
MAX_GEN_ID_CHARS = 64
MAX_JSON_DEPTH = 64  # objects/arrays nested in a request; far below the parser's recursion limit
MAX_REQ_DEPTH = 4  # `req` is echoed back on WebSocket replies: small and shallow only
MAX_REQ_BYTES = 1024
_MARKUP = re.compile(r'\\.|["\[\]{}]')  # escapes first, so an escaped quote never ends a string
_SURROGATE = re.compile("[\ud800-\udfff]")


class ApiError(Exception):
    def __init__(self, code: str, message: str, status: int = 400, param: str | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.status, self.param = code, message, status, param
        self.retry_after = retry_after  # seconds, for a 429: sent as Retry-After / `retry_after`


class _NonFinite(ValueError):
    """A JSON number (or NaN/Infinity constant) that is not a finite double."""


def parse_json_text(text: str, limit: int) -> Any:
    """Size-check then parse one JSON document; non-finite numbers (NaN, Infinity, 1e999), nesting
    deeper than MAX_JSON_DEPTH and lone surrogates are refused."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if len(text) > limit or size > limit:
        raise ApiError("too_large", f"message of {size} bytes exceeds the limit of {limit} bytes", 413)
    if json_depth(text) > MAX_JSON_DEPTH:
        raise ApiError("bad_json", f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        value = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except json.JSONDecodeError as e:
        raise ApiError("bad_json", f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except _NonFinite as e:
        raise ApiError("bad_json", f"not valid JSON: numbers must be finite, got {str(e)[:40]} (NaN, Infinity "
                       "and numbers beyond a double's range, such as 1e999, are not allowed)") from None
    except (ValueError, RecursionError):  # an integer literal longer than Python parses
        raise ApiError("bad_json", "not valid JSON: a number is too long") from None
    _refuse_surrogates(value, "")
    return value


def json_depth(text: str, stop_above: int = MAX_JSON_DEPTH) -> int:
    """How deep objects and arrays nest in `text` (brackets inside strings do not count), in one
    linear pass; stops counting once it passes `stop_above`."""
    depth = deepest = 0
    in_string = False
    for m in _MARKUP.finditer(text):
        c = m.group()
        if c == '"':
            in_string = not in_string
        elif not in_string and len(c) == 1:
            depth += 1 if c in "[{" else -1
            if depth > deepest:
                deepest = depth
                if deepest > stop_above:
                    break
    return deepest


def _refuse_surrogates(value: Any, path: str) -> None:
    """Walk a parsed document (at most MAX_JSON_DEPTH deep) for strings with lone surrogates."""
    if isinstance(value, str):
        if _SURROGATE.search(value):
            raise ApiError("invalid_field", f"{path or 'the body'!r} contains a lone UTF-16 surrogate "
                           "(an unpaired \\ud800-\\udfff escape); send valid Unicode text", param=path or None)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _refuse_surrogates(item, f"{path}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            if _SURROGATE.search(key):
                raise ApiError("invalid_field", f"a key of {path or 'the body'!r} contains a lone UTF-16 "
                               "surrogate; send valid Unicode text", param=path or None)
            _refuse_surrogates(item, f"{path}.{key}" if path else key)


def check_req(req: Any) -> None:
    """`req` on a WebSocket frame is echoed back: a scalar or a small, shallow object or array."""
    def depth(x: Any) -> int:
        children = x.values() if isinstance(x, dict) else x if isinstance(x, list) else ()
        return 1 + max((depth(c) for c in children), default=0) if isinstance(x, (dict, list)) else 0

    if depth(req) > MAX_REQ_DEPTH or len(json.dumps(req, ensure_ascii=False)) > MAX_REQ_BYTES:
        raise ApiError("invalid_field", f"'req' must be a scalar or an object/array nested at most "
                       f"{MAX_REQ_DEPTH} deep, at most {MAX_REQ_BYTES} characters as JSON", param="req")


def _reject_constant(name: str) -> float:
    raise _NonFinite(name)


def _finite_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):  # 1e999 parses to inf, which no strict JSON writer could send back
        raise _NonFinite(literal)
    return value


def require_object(x: Any, what: str = "body") -> dict[str, Any]:
    if not isinstance(x, dict):
        raise ApiError("not_an_object", f"{what} must be a JSON object, got {type(x).__name__}")
    return x


def get_str(obj: dict[str, Any], name: str, *, required: bool = True, allow_empty: bool = False,
            max_chars: int | None = None) -> str | None:
    if name not in obj or (obj[name] is None and not required):
        if required:
            raise ApiError("missing_field", f"missing required field {name!r}", param=name)
        return None
    v = obj[name]
    if not isinstance(v, str):
        raise ApiError("invalid_field", f"{name!r} must be a string, got {type(v).__name__}", param=name)
    if not allow_empty and not v:
        raise ApiError("invalid_field", f"{name!r} must not be empty", param=name)
    if max_chars is not None and len(v) > max_chars:
        raise ApiError("invalid_field", f"{name!r} must be at most {max_chars} characters", param=name)
    return v


def get_int(obj: dict[str, Any], name: str, *, minimum: int | None = None, maximum: int | None = None) -> int | None:
    v = obj.get(name)
    if v is None:
        return None
    if not is_int(v):
        raise ApiError("invalid_field", f"{name!r} must be an integer, got {type(v).__name__}", param=name)
    if (minimum is not None and v < minimum) or (maximum is not None and v > maximum):
        bounds = f"[{minimum if minimum is not None else '-inf'}, {maximum if maximum is not None else 'inf'}]"
        raise ApiError("invalid_field", f"{name!r} must be in {bounds}, got {v}", param=name)
    return v


def get_float(obj: dict[str, Any], name: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    v = obj.get(name)
    if v is None:
        return None
    if not is_number(v):
        raise ApiError("invalid_field", f"{name!r} must be a finite number", param=name)
    if v > hi or v < lo or (lo_open and v == lo):
        raise ApiError("invalid_field", f"{name!r} must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}",
                       param=name)
    return float(v)


def get_bool(obj: dict[str, Any], name: str, default: bool = False) -> bool:
    v = obj.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError("invalid_field", f"{name!r} must be a boolean", param=name)
    return v


def get_stop(obj: dict[str, Any], name: str = "stop") -> list[str]:
    v = obj.get(name)
    if v is None:
        return []
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in items):
        raise ApiError("invalid_field", f"{name!r} must be a non-empty string or a list of non-empty strings "
                       f"of at most {MAX_STOP_CHARS} characters", param=name)
    if len(items) > MAX_STOP_STRINGS:
        raise ApiError("invalid_field", f"{name!r} takes at most {MAX_STOP_STRINGS} strings", param=name)
    return list(items)


def get_priority(obj: dict[str, Any], bounds: tuple[int, int]) -> int:
    """`priority` of an OpenAI body, a chat frame or a session message: an integer (not a boolean)
    within `bounds` (what this caller may send, auth.priority_bounds), default 0; lower runs first
    under --policy priority."""
    value = get_int(obj, "priority", minimum=-PRIORITY_LIMIT, maximum=PRIORITY_LIMIT) or 0
    low, high = bounds
    if not low <= value <= high:
        raise ApiError("invalid_field", f"'priority' must be in [{low}, {high}] for this caller; wider values need "
                       "a key given to the server with --priority-api-key", param="priority")
    return value


def get_gen_id(obj: dict[str, Any]) -> str:
    gen_id = get_str(obj, "gen_id", max_chars=MAX_GEN_ID_CHARS)
    assert gen_id is not None
    return gen_id


def refuse_unsupported(body: dict[str, Any], fields: dict[str, Any]) -> None:
    """A 400 `unsupported` naming the first of `fields` that `body` sets to anything other than null or
    that field's harmless value (a feature this server cannot honour is refused, never ignored)."""
    for name, harmless in fields.items():
        if body.get(name) not in (None, harmless):
            raise ApiError("unsupported", f"{name!r} is not supported by this server", param=name)
