"""Beam search run on the engine: every running beam of a step is one engine request of one greedy
token that reports its `BeamSearch.alternatives` most likely next tokens (the raw log-softmax, as
`logprobs` does); all beams of all prompts are submitted together and stepped as one batch.

Why requests and not long-lived sequences: the radix cache already gives beams what forks would.
A beam's request is its parent's tokens plus one, and the parent's request put those tokens in the
tree when it finished, so the new request matches all but its last token: the prompt is computed
once and every beam shares its full blocks by refcount (plus a copy-on-write copy of the block where
it diverges, even mid-block); a pruned beam's request simply ends, and its blocks stay in the tree
as evictable cache. Nothing in the scheduler or the cache knows about beams. The price is one tree
match and one copied partial block per beam per step; with `--no-prefix-cache` every step
recomputes every beam's whole sequence (correct, slow).

Invariant: when a driver returns or raises, none of its requests is left in the engine.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import ClassVar

from radixserve.core import RequestOutput
from radixserve.engine.async_engine import AsyncEngine
from radixserve.engine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams, Top
from radixserve.engine.engine import LLMEngine
from radixserve.errors import PromptTooLongError, RequestError, RequestFailedError
from radixserve.sampling_params import SamplingParams


@dataclass
class BeamStepParams(SamplingParams):
    """One beam step: the engine's sampling params, allowed as many alternatives as a beam needs."""

    logprobs_limit: ClassVar[int] = 1 << 20


def _step_params(alternatives: int, namespace: str = "") -> SamplingParams:
    return BeamStepParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=alternatives,
                          cache_namespace=namespace)


def _searches(engine: LLMEngine, prompts: list[list[int]], params: BeamSearchParams) -> list[BeamSearch]:
    """Validate every prompt before anything is queued, so a bad one leaves nothing in the engine."""
    eos = params.eos_set(engine.eos_token_ids)
    searches = [BeamSearch(p, params, eos) for p in prompts]
    for s in searches:
        if s.alternatives > engine.spec.vocab_size:
            raise RequestError(f"beam_width {params.beam_width} plus {len(eos)} EOS tokens exceeds the vocabulary")
        engine.intake.check(s.prompt, _step_params(s.alternatives))
        if len(s.prompt) + params.max_tokens > engine.max_seq_len:
            raise PromptTooLongError(len(s.prompt), params.max_tokens, engine.max_seq_len)
    return searches


def _top(out: RequestOutput) -> Top:
    if out.error is not None:
        raise RequestFailedError(out.error)
    lps = out.outputs[0].logprobs
    if not lps:
        raise RequestFailedError("a beam step ended without its token (aborted)")
    return list(lps[0].top)


def run_beam_search(engine: LLMEngine, prompts: list[list[int]], params: BeamSearchParams) -> list[BeamSearchOutput]:
    """Beam search for every prompt on a synchronous engine that has no other work queued."""
    searches = _searches(engine, prompts, params)
    first = True
    while live := [s for s in searches if not s.done]:
        asked: list[tuple[BeamSearch, str]] = [
            (s, engine.add_request(tokens, _step_params(s.alternatives, params.cache_namespace)))
            for s in live for tokens in s.pending()]
        outs: dict[str, RequestOutput] = {}
        try:
            while engine.has_unfinished():
                for out in engine.step():
                    if out.finished:
                        outs[out.request_id] = out
            for s in live:
                s.advance([_top(outs[rid]) for owner, rid in asked if owner is s])
        finally:
            for _, rid in asked:
                engine.abort(rid)  # a no-op for finished ones; ends the rest if a step failed
            while engine.has_unfinished():
                engine.step()
        if first:
            for s, rid in asked:
                s.cached_tokens = outs[rid].usage.cached_tokens
            first = False
    return [s.output(engine.tokenizer) for s in searches]


async def _one_step(engine: AsyncEngine, tokens: list[int], params: SamplingParams, priority: int) -> RequestOutput:
    last: RequestOutput | None = None
    async for out in engine.generate(tokens, params, priority=priority):
        if out.outputs and out.outputs[0].logprobs:
            last = out  # the one output with the token (overlap may send the finish separately)
        if out.finished and last is None:
            last = out
    assert last is not None
    return last


async def beam_search_async(engine: AsyncEngine, prompt: list[int], params: BeamSearchParams,
                            priority: int = 0) -> BeamSearchOutput:
    """Beam search for one prompt on the async engine, beside whatever else it runs. Cancelling the
    caller aborts the step's requests (AsyncEngine.generate does on close)."""
    (search,) = _searches(engine.engine, [prompt], params)
    step = _step_params(search.alternatives, params.cache_namespace)
    first = True
    while not search.done:
        tasks = [asyncio.ensure_future(_one_step(engine, tokens, step, priority)) for tokens in search.pending()]
        try:
            outs = await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if first:
            search.cached_tokens, first = outs[0].usage.cached_tokens, False
        search.advance([_top(o) for o in outs])
    return search.output(engine.tokenizer)
