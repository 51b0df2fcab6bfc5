"""Errors the engine raises for bad requests; the server maps them to HTTP 400 / error frames."""

from __future__ import annotations


class RequestError(ValueError):
    """A request the engine refuses; `code` is machine-readable."""

    code = "invalid_request"


class PromptTooLongError(RequestError):
    code = "context_too_long"

    def __init__(self, prompt_tokens: int, max_tokens: int, limit: int) -> None:
        self.prompt_tokens, self.max_tokens, self.limit = prompt_tokens, max_tokens, limit
        super().__init__(
            f"prompt of {prompt_tokens} tokens (+ max_tokens {max_tokens}) exceeds the model's "
            f"context length of {limit} tokens"
        )


class EngineStoppedError(RuntimeError):
    code = "engine_stopped"


class RequestFailedError(RuntimeError):
    """A request that failed while running (the model or sampler could not serve it); the engine
    failed only this request, and the message names no library internals."""

    code = "generation_failed"


class ConstraintError(RequestError):
    """A structured-output constraint the engine cannot compile: `param` is the API parameter path
    it came from (StructuredOutput.field), and the message starts with it."""

    code = "invalid_field"

    def __init__(self, param: str, message: str) -> None:
        self.param = param
        super().__init__(f"{param}: {message}")


class BusyError(RequestError):
    """A request refused for now because a shared resource is busy (every grammar compile worker):
    the server answers 429 with a retry hint; the same request may succeed later."""

    code = "rate_limited"


class FieldError(RequestError):
    """A request field the engine refuses (a logit_bias id outside the vocabulary): `param` names it,
    as the API's 400 does."""

    code = "invalid_field"

    def __init__(self, param: str, message: str) -> None:
        self.param = param
        super().__init__(message)


class TokenRefused(Exception):
    """A stop test's refusal of a committed token (a grammar that does not allow it): the request
    ends with this message, an expected outcome rather than a fault."""
