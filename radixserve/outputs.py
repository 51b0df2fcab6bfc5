"""What the engine hands back to callers: incremental per-sample deltas plus usage and timing.

A streamed RequestOutput carries only what is new since the previous one (token ids and a text delta
that never splits a UTF-8 character); `finished` is True exactly once, on the last output of a request.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (not recomputed)
    completion_tokens: int = 0


@dataclass
class Timing:
    arrival: float = 0.0  # time.monotonic() when the request entered the engine
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None

    @property
    def queue_ms(self) -> float:
        return _ms(self.arrival, self.first_scheduled)

    @property
    def ttft_ms(self) -> float:
        return _ms(self.arrival, self.first_token)

    @property
    def total_ms(self) -> float:
        return _ms(self.arrival, self.finished)


def _ms(start: float, end: float | None) -> float:
    return 0.0 if end is None else max(0.0, (end - start) * 1000.0)


@dataclass
class CompletionOutput:
    index: int  # which of the request's n samples
    token_ids: list[int] = field(default_factory=list)  # new tokens (streaming) or all (offline)
    text: str = ""  # text delta (streaming) or the whole text (offline)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running


@dataclass
class RequestOutput:
    request_id: str
    outputs: list[CompletionOutput]
    usage: Usage
    timing: Timing
    finished: bool = False
    prompt_token_ids: list[int] = field(default_factory=list)
    error: str | None = None  # set (with finish_reason "error") when this request failed on its own

    def tokens_per_s(self) -> float:
        """Decode speed after the first token, over the whole request."""
        t = self.timing
        if t.first_token is None or t.finished is None or self.usage.completion_tokens <= 1:
            return 0.0
        span = t.finished - t.first_token
        return (self.usage.completion_tokens - 1) / span if span > 0 else 0.0
