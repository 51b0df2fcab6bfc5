"""The OpenAI request and reply pieces its three endpoints share (chat, completions, Responses):
the message roles, `stream_options`, and the `usage` object.

Invariants: `stream_options` is only allowed with `stream: true` (OpenAI answers 400 otherwise);
usage.prompt_tokens_details.cached_tokens is the prefix-cache hit, and the extension
host_cached_tokens the part of it loaded back from the host-memory tier; completion_tokens_details
carries OpenAI's reasoning and prediction counts and the extension `speculation` (pipeline/prediction.py).
"""

from __future__ import annotations

from typing import Any

from radixserve.core import RequestOutput, Usage
from radixserve.server.pipeline.prediction import completion_tokens_details
from radixserve.server.validation import ApiError, get_bool

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def stream_include_usage(body: dict[str, Any], stream: bool) -> bool:
    """`stream_options.include_usage`; `stream_options` is only allowed with `stream: true`."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise ApiError("invalid_field", "'stream_options' is only allowed when 'stream' is true", param="stream_options")
    if not isinstance(options, dict):
        raise ApiError("invalid_field", "'stream_options' must be an object", param="stream_options")
    return get_bool(options, "include_usage")


def usage_body(out: RequestOutput, reasoning_tokens: int = 0) -> dict[str, Any]:
    return usage_dict(out.usage, reasoning_tokens)


def usage_dict(u: Usage, reasoning_tokens: int = 0) -> dict[str, Any]:
    """`reasoning_tokens`: the completion tokens the replies spent inside their reasoning (chat/reasoning.py)."""
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            # host_cached_tokens is our extension: the part of cached_tokens loaded back from the host tier
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens, "host_cached_tokens": u.host_cached_tokens},
            # OpenAI's reasoning and prediction counts, and our extension `speculation`
            # (server/pipeline/prediction.py)
            "completion_tokens_details": {"reasoning_tokens": reasoning_tokens, **completion_tokens_details(u)}}
