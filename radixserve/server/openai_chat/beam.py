"""The OpenAI extension for beam search in /v1/chat/completions: `use_beam_search: true`.

Fields: `n` is how many beams come back as choices (best first, 1..32, default 1); `beam_width`
(extension, 1..32) is how many beams are searched, default `n`, and must be at least `n`;
`length_penalty` (extension, default 1.0) divides a finished beam's summed logprob by its length to
that power; `max_tokens` / `max_completion_tokens` as usual. The search equals transformers'
`generate(num_beams=beam_width, do_sample=False, early_stopping=True)` (engine/beam_search.py).

Beam search is deterministic and whole-sequence, so what cannot apply is refused with a 400 rather
than ignored: the sampling fields the table (radixserve/sampling_fields.py) marks as excluded by
beam search, at any value but their neutral one (`temperature` > 0, `top_p` < 1, `top_k` > 0,
`min_p` > 0, `stop` strings, penalties and `logit_bias`, which would rewrite the raw log-probabilities
beams are ranked by, and the token masks `min_tokens`, `bad_words`, `allowed_token_ids`), and
`logprobs` and `stream` (the beams are only known at the end, as with vLLM, which does not stream
them either). `ignore_eos` and `stop_token_ids` end beams as they end samples; `seed` is accepted
and has no effect. Nothing here touches the engine except through the driver.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from radixserve.core import Placement
from radixserve.engine.beam_search import MAX_BEAM_WIDTH, BeamSearchOutput, BeamSearchParams
from radixserve.sampling_fields import Api, Feature, SamplingFields
from radixserve.sampling_params import SamplingParams
from radixserve.server.pipeline.sampling import refuse_with
from radixserve.server.pipeline.stream import SystemPromptRef, api_error_from, record_system_prompt
from radixserve.server.replica_header import note_replica
from radixserve.server.state import ServerState
from radixserve.server.validation import ApiError, get_bool, get_float, get_int

MAX_LENGTH_PENALTY = 10.0
_CONSTRAINTS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


@dataclass(frozen=True)
class BeamAsk:
    n: int  # choices returned
    beam_width: int
    length_penalty: float

    def params(self, sampling: SamplingParams, cache_namespace: str) -> BeamSearchParams:
        """`sampling`: the request's (its max_tokens and what ends a beam); `cache_namespace`: the
        request's (every step's requests read and write it)."""
        return BeamSearchParams(beam_width=self.beam_width, max_tokens=sampling.max_tokens,
                                length_penalty=self.length_penalty, ignore_eos=sampling.ignore_eos,
                                stop_token_ids=list(sampling.stop_token_ids), cache_namespace=cache_namespace)


def beam_fields(body: dict[str, Any], sampling: SamplingFields) -> BeamAsk | None:
    """The beam-search fields of a chat completion body (`sampling`: its sampling fields, read);
    None unless `use_beam_search` is true."""
    if not get_bool(body, "use_beam_search"):
        for name in ("beam_width", "length_penalty"):
            if body.get(name) is not None:
                raise ApiError("invalid_field", f"{name!r} is only allowed with 'use_beam_search': true", param=name)
        return None
    n = get_int(body, "n", minimum=1, maximum=MAX_BEAM_WIDTH) or 1
    width = get_int(body, "beam_width", minimum=1, maximum=MAX_BEAM_WIDTH)
    if width is None:
        width = n
    elif n > width:
        raise ApiError("invalid_field", f"'n' ({n}) must not exceed 'beam_width' ({width})", param="n")
    penalty = get_float(body, "length_penalty", -MAX_LENGTH_PENALTY, MAX_LENGTH_PENALTY)
    refuse_with(Feature.BEAM_SEARCH, sampling, Api.CHAT)
    for name in ("logprobs", "stream", "tools", *_CONSTRAINTS):
        if body.get(name):
            raise ApiError("invalid_field", f"{name!r} is not supported with 'use_beam_search'", param=name)
    if body.get("prompt_logprobs") is not None:  # the search's steps are requests of their own
        raise ApiError("invalid_field", "'prompt_logprobs' is not supported with 'use_beam_search'",
                       param="prompt_logprobs")
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type", "text") != "text":
        # beams are ranked by the model's own log-probabilities; a grammar would have to mask every beam
        raise ApiError("invalid_field", "structured output is not supported with 'use_beam_search'",
                       param="response_format")
    return BeamAsk(n, width, 1.0 if penalty is None else penalty)


async def run_beam_search(state: ServerState, prompt: list[int], params: BeamSearchParams, n: int,
                          system: SystemPromptRef, priority: int = 0) -> BeamSearchOutput:
    """Run one beam search on the server's engine and keep its `n` best beams (usage counts their
    tokens); engine errors become ApiErrors. A client that goes away cancels this coroutine, which
    aborts the step's requests."""
    engine = state.require_engine()
    placement = Placement()
    rid = f"beam-{uuid.uuid4().hex}"
    state.inflight.add(rid)  # shutdown waits for it like any generation (its step requests end with the engine)
    try:
        out = await engine.beam_search(prompt, params, priority, placement)
    except Exception as e:
        raise api_error_from(e) from None
    finally:
        state.inflight.discard(rid)
    out.beams = out.beams[:n]
    out.usage.completion_tokens = sum(len(b.token_ids) for b in out.beams)
    if placement.replica is not None:
        note_replica(placement.replica)
    record_system_prompt(state, system, out.usage, placement.replica)
    reason = out.beams[0].finish_reason if out.beams else None
    state.metrics.server_requests.labels("openai", reason or "abort").inc()
    return out


def beam_choices(out: BeamSearchOutput) -> list[dict[str, Any]]:
    """The beams as chat completion choices, best first."""
    return [{"index": i, "message": {"role": "assistant", "content": b.text}, "logprobs": None,
             "finish_reason": b.finish_reason or "length"} for i, b in enumerate(out.beams)]
