"""The pipeline's last step: a request the engine checked (plan.py), streamed from the engine, with
request-id bookkeeping, error mapping and metrics.

A request is checked once, by the engine's intake (in plan.admit, before any response starts, so a
refusal is a plain error response and never an opened stream); the server's own checks are of its
API's fields and limits, never the engine's again. Every generation the server starts then goes
through `stream_request` with what that check returned, so (a) engine errors become ApiErrors,
(b) the request is always closed — a consumer that stops iterating aborts it and the engine frees its
blocks — and (c) latency histograms and the per-system-prompt counters are recorded exactly once per
request, under the API's metrics label (`METRIC_LABELS`).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from radixserve.chat.template import token_hash
from radixserve.core import Placement, RequestOutput, Usage
from radixserve.engine.intake import ValidatedRequest
from radixserve.errors import BusyError, EngineStoppedError, RequestError, RequestFailedError
from radixserve.sampling_fields import Api
from radixserve.server.replica_header import note_replica
from radixserve.server.system_prompts import NONE_KEY
from radixserve.server.validation import ApiError

if TYPE_CHECKING:
    from radixserve.server.state import ServerState

log = logging.getLogger("radixserve.server")
# the `api` label of the server's request metrics, per API (the dashboards' names, older than Api's)
METRIC_LABELS = {Api.CHAT: "openai", Api.COMPLETIONS: "completions", Api.RESPONSES: "responses",
                 Api.ANTHROPIC: "anthropic", Api.SESSION: "session"}
PREVIEW_CHARS = 80


@dataclass(frozen=True)
class SystemPromptRef:
    """A request's system prompt as its tenant's figures count it (tenant_stats.py)."""

    key: str  # hash of the system prompt's token IDs, or "none"
    preview: str
    length: int  # tokens
    tenant: str  # the caller's: its request counts in this tenant's figures only

    @classmethod
    def of(cls, tokens: Sequence[int], text: str | None, implicit_len: int, tenant: str) -> SystemPromptRef:
        """`implicit_len`: the template's own preamble length, used when there is no system prompt."""
        if not tokens or text is None:
            return cls(NONE_KEY, "", implicit_len, tenant)
        return cls(token_hash(tokens), " ".join(text.split())[:PREVIEW_CHARS], len(tokens), tenant)

    @classmethod
    def none(cls, tenant: str) -> SystemPromptRef:
        """A prompt without a system prompt to count (a plain-text completion)."""
        return cls(NONE_KEY, "", 0, tenant)


def api_error_from(exc: BaseException) -> ApiError:
    """The client-facing error for an exception. Only radixserve's own request errors keep their
    message; anything unexpected is logged here, once, with its traceback under a fresh id, and the
    client gets that id and nothing of the exception's text (it may quote library internals)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, EngineStoppedError):
        return ApiError("unavailable", "the engine is shutting down", 503)
    if isinstance(exc, RequestFailedError):
        return ApiError("generation_failed", f"generation failed: {exc}", 500)
    if isinstance(exc, BusyError):
        return ApiError("rate_limited", str(exc), 429, retry_after=1)  # a compile worker frees within its timeout
    if isinstance(exc, RequestError):
        code = "context_too_long" if exc.code == "context_too_long" else "invalid_field"
        # a ConstraintError names the API parameter its constraint came from (StructuredOutput.field)
        return ApiError(code, str(exc), 400, param=getattr(exc, "param", None))
    error_id = uuid.uuid4().hex[:12]
    log.error("internal error (request id %s)", error_id, exc_info=exc)
    return ApiError("internal", f"internal error; see the server log (request id {error_id})", 500)


def refuse_if_draining(state: ServerState) -> None:
    if state.draining:
        raise ApiError("unavailable", "the server is shutting down", 503)


async def stream_request(state: ServerState, request: ValidatedRequest, system: SystemPromptRef, api: str,
                         request_id: str | None = None, cancelled: Callable[[], bool] | None = None,
                         affinity: str | None = None) -> AsyncGenerator[RequestOutput, None]:
    """Yield the engine's incremental outputs for one request the engine's check accepted (plan.admit); raises
    ApiError for refused requests. `cancelled`: see AsyncEngine.generate_validated (a cancel that came
    before the request reached the engine); `affinity`: a key (the chat session's id) whose requests a
    multi-replica engine keeps on one replica."""
    engine, metrics = state.require_engine(), state.metrics
    refuse_if_draining(state)  # again: shutdown may have begun since the caller checked
    rid = request_id or uuid.uuid4().hex
    state.inflight.add(rid)
    placement = Placement(affinity=affinity)
    agen = cast(AsyncGenerator[RequestOutput, None],
                engine.generate_validated(request, request_id=rid, cancelled=cancelled, placement=placement))
    last: RequestOutput | None = None
    last_token_at: float | None = None
    try:
        try:
            first = await agen.__anext__()
        except StopAsyncIteration:
            return
        except Exception as e:
            raise api_error_from(e) from None
        if placement.replica is not None:
            note_replica(placement.replica)
        out: RequestOutput | None = first
        while out is not None:
            now = time.monotonic()
            if any(o.token_ids for o in out.outputs):
                if last_token_at is not None:
                    metrics.itl.observe(now - last_token_at)
                last_token_at = now
            last = out
            yield out
            if out.finished:
                break
            try:
                out = await agen.__anext__()
            except StopAsyncIteration:
                out = None
            except Exception as e:
                raise api_error_from(e) from None
    finally:
        await agen.aclose()  # aborts the request if it has not finished
        state.inflight.discard(rid)
        if last is not None:
            _record(state, last, system, api, placement.replica)


def record_system_prompt(state: ServerState, system: SystemPromptRef, usage: Usage, replica: str | None) -> None:
    """One finished request in its tenant's figures and system-prompt table, and in its replica's
    table when it has one."""
    m = state.metrics
    m.tenants.record(system.tenant, system.key, system.preview, system.length, usage)
    if replica is not None:
        m.replica_prompts(replica).record(system.key, system.preview, system.length, usage.prompt_tokens,
                                          usage.cached_tokens)


def _record(state: ServerState, out: RequestOutput, system: SystemPromptRef, api: str, replica: str | None) -> None:
    m = state.metrics
    record_system_prompt(state, system, out.usage, replica)
    t = out.timing
    if not out.finished:
        m.server_requests.labels(api, "abort").inc()
        return
    reason = next((o.finish_reason for o in out.outputs if o.finish_reason), None) or "abort"
    m.server_requests.labels(api, reason).inc()
    if t.first_scheduled is not None:
        m.queue.observe(t.queue_ms / 1000.0)
    if t.first_token is not None:
        m.ttft.observe(t.ttft_ms / 1000.0)
    if t.finished is not None:
        m.e2e.observe(t.total_ms / 1000.0)
