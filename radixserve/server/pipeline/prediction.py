"""Speculative decoding as the APIs show it: the `prediction` a request sends (OpenAI's Predicted
Outputs) and the speculation figures its reply's usage reports.

Request: `prediction` is OpenAI's `{"type": "content", "content": str | [{"type": "text", "text": str},
...]}` (text parts are joined), read by `prediction_text` wherever it arrives: /v1/chat/completions,
/v1/completions, WebSocket chat frames and session messages (the frame or body, beside `sampling`).
A prediction never changes what is generated, only how fast, so it goes with any other parameter (n,
logprobs, tools, structured output; beam search ignores it). Its text is tokenized here, as the
engine's intake tokenizes a text prediction and off the event loop when long (PromptWorker), and the
engine gets the token ids (SamplingParams.prediction). Refusals, each a 400 `invalid_field` whose
param starts with `prediction`: not an object, a `type` other than "content", a content that is
neither a string nor a list of text parts, more than MAX_PREDICTION_LENGTH characters, or more tokens
than the model's context (no reply can be that long). An empty content is no prediction.

Reply: `speculation_json` is one request's drafts (core.DraftCounts) as JSON, every source of
core.DRAFT_SOURCES present, zeros when nothing was drafted: `{"proposed", "accepted", "verify_steps",
"prediction_tokens", "by_source": {source: {"proposed", "accepted"}}}`. OpenAI usage carries it in
`completion_tokens_details.speculation`, beside OpenAI's `accepted_prediction_tokens` (the
prediction's tokens drafted and kept) and `rejected_prediction_tokens` (the rest of the prediction);
WebSocket `done` frames, session replies and the Responses API carry it too.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from radixserve.core import DRAFT_SOURCES, DraftCounts, Usage
from radixserve.sampling_fields import SamplingFields
from radixserve.sampling_params import MAX_PREDICTION_LENGTH
from radixserve.server.state import ServerState
from radixserve.server.validation import ApiError

FIELD = "prediction"
PREDICTION_TYPES = ("content",)  # OpenAI's only type


def prediction_text(body: dict[str, Any]) -> str | None:
    """The text of `body`'s `prediction`, checked (ApiError naming it otherwise); None when absent,
    null or empty."""
    value = body.get(FIELD)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ApiError("invalid_field", f"{FIELD!r} must be an object {{\"type\": \"content\", \"content\": ...}}, "
                       f"got {type(value).__name__}", param=FIELD)
    kind = value.get("type")
    if kind not in PREDICTION_TYPES:
        raise ApiError("invalid_field", f"'{FIELD}.type' must be one of {list(PREDICTION_TYPES)}, got {kind!r}",
                       param=f"{FIELD}.type")
    text = _content(value.get("content"))
    if len(text) > MAX_PREDICTION_LENGTH:
        raise ApiError("invalid_field", f"'{FIELD}.content' is {len(text)} characters; at most "
                       f"{MAX_PREDICTION_LENGTH}", param=f"{FIELD}.content")
    return text or None


def _content(content: Any) -> str:
    where = f"{FIELD}.content"
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError("invalid_field", f"{where!r} must be a string or a list of text parts, got "
                       f"{type(content).__name__}", param=where)
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ApiError("invalid_field", f"'{where}[{i}]' must be a text part {{\"type\": \"text\", \"text\": "
                           "str}", param=f"{where}[{i}]")
        texts.append(part["text"])
    return "".join(texts)


def with_prediction(sampling: SamplingFields, body: dict[str, Any]) -> SamplingFields:
    """`sampling` plus `body`'s prediction text (tokenized later by `tokenize_prediction`); unchanged
    when the body sends none."""
    text = prediction_text(body)
    return sampling if text is None else replace(sampling, prediction=text)


async def tokenize_prediction(state: ServerState, sampling: SamplingFields) -> SamplingFields:
    """`sampling` with its prediction text made token ids (what build_sampling_params passes on);
    refused when it has more tokens than the model's context."""
    text = sampling.prediction
    if not isinstance(text, str):
        return sampling
    engine = state.require_engine()
    if engine.tokenizer is None:
        raise ApiError("unsupported", "this model has no tokenizer, so a text prediction cannot be used",
                       param=FIELD)
    ids = await state.require_prompts().encode_prediction(text)
    if len(ids) > engine.max_model_len:
        raise ApiError("invalid_field", f"'{FIELD}' is {len(ids)} tokens, longer than the model's context of "
                       f"{engine.max_model_len} tokens (no reply can be that long)", param=FIELD)
    return replace(sampling, prediction=ids or None)


def speculation_json(drafts: DraftCounts | None) -> dict[str, Any]:
    """One request's drafts, every source present (0 when it drafted nothing from it)."""
    d = drafts or DraftCounts()
    sources = [*DRAFT_SOURCES, *sorted(set(d.by_source) - set(DRAFT_SOURCES))]
    by_source = {s: dict(zip(("proposed", "accepted"), d.by_source.get(s, (0, 0)))) for s in sources}
    return {"proposed": d.proposed, "accepted": d.accepted, "verify_steps": d.verify_steps,
            "prediction_tokens": d.prediction_tokens, "by_source": by_source}


def completion_tokens_details(u: Usage) -> dict[str, Any]:
    """OpenAI's `usage.completion_tokens_details`: the prediction's tokens drafted and kept, and the
    rest of them (0 and 0 without one), and this server's `speculation` figures."""
    return {**prediction_counts([u.speculation]), "speculation": speculation_json(u.speculation)}


def prediction_counts(parts: Iterable[DraftCounts | None]) -> dict[str, int]:
    """OpenAI's two prediction counts, summed over requests (each request's are its own: a sum of
    DraftCounts would not keep them)."""
    drafted = [d for d in parts if d is not None]
    return {"accepted_prediction_tokens": sum(d.prediction_accepted for d in drafted),
            "rejected_prediction_tokens": sum(d.prediction_rejected for d in drafted)}


def merged_drafts(parts: Iterable[DraftCounts | None]) -> DraftCounts | None:
    """Several requests' drafts summed (a /v1/completions request of several prompts); None if none
    drafted or predicted. Its prediction counts are not the requests' summed: see prediction_counts."""
    total = DraftCounts()
    for d in parts:
        if d is None:
            continue
        total.proposed += d.proposed
        total.accepted += d.accepted
        total.verify_steps += d.verify_steps
        total.prediction_tokens += d.prediction_tokens
        for source, (proposed, accepted) in d.by_source.items():
            pair = total.by_source.setdefault(source, [0, 0])
            pair[0] += proposed
            pair[1] += accepted
    return total if total.proposed or total.verify_steps or total.prediction_tokens else None
