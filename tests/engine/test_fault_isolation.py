"""Fault isolation: one request's values or failures never fail the other requests of its batch.

Sampling values at the edges of what validation accepts are served (a temperature below the minimum
is greedy; any integer seed is reduced into 64 bits). A forward pass that fails on one
request's input, or logits that come back non-finite for one row, fail that request alone with
finish_reason "error"; the others finish exactly as they would have without it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from tiny_models import tiny_model_dir

from radixserve import LLM, AsyncEngine, SamplingParams
from radixserve.core import Batch
from radixserve.engine.engine import FORWARD_FAILED, INVALID_LOGITS
from radixserve.errors import RequestFailedError
from radixserve.sampling_params import MIN_TEMPERATURE, SEED_MODULUS

POISON = 7  # a token id the faulty runners below refuse
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[11, 12, 13, 14, 15], [21, 22, 23, POISON, 25, 26], [31, 32, 33]]


def make_llm(**kw: Any) -> LLM:
    return LLM(model=str(tiny_model_dir("llama")), **({"block_size": 4, "num_blocks": 64} | kw))


def clean_outputs(params: SamplingParams) -> list[list[int]]:
    llm = make_llm()
    return [llm.generate([p], params)[0].outputs[0].token_ids for p in PROMPTS]


class ForwardFailsOnPoison:
    """Wraps the runner: a forward whose batch holds the poison token raises, as a kernel fault would."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.batched_failures = inner, 0

    def run(self, batch: Batch, pending: Any = None, asked: Any = None) -> torch.Tensor:
        if any(POISON in it.seq.token_ids[it.start:it.start + it.num_tokens] for it in batch.items):
            self.batched_failures += len(batch.items) > 1
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
        return self.inner.run(batch, pending, asked)

    def run_each(self, batch: Batch, pending: Any = None, asked: Any = None) -> list[torch.Tensor | None]:
        return type(self.inner).run_each(self, batch, pending, asked)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class NanLogitsOnPoison(ForwardFailsOnPoison):
    """Wraps the runner: the sampled row of a sequence holding the poison token comes back NaN."""

    def run(self, batch: Batch, pending: Any = None, asked: Any = None) -> torch.Tensor:
        logits = self.inner.run(batch, pending, asked).clone()  # an inference tensor: not writable outside inference mode
        sampling = [it for it in batch.items if it.samples]
        for row, it in enumerate(sampling):
            if POISON in it.seq.token_ids:
                logits[row] = float("nan")
        return logits


@pytest.mark.parametrize("temperature", [1e-300, 1e-45, MIN_TEMPERATURE / 2])
def test_temperature_below_the_minimum_is_greedy(temperature: float) -> None:
    """Issue reproduction 2a: float32 rounded 1e-300 to 0 and the probabilities to NaN, and the step
    raised for every request in it."""
    llm = make_llm()
    tiny = SamplingParams(temperature=temperature, max_tokens=6, ignore_eos=True)
    assert tiny.greedy
    outs = llm.generate(PROMPTS, tiny)
    assert [o.outputs[0].token_ids for o in outs] == clean_outputs(GREEDY)
    llm.engine.check_integrity()


def test_seed_at_the_top_of_its_range_with_n_2_is_served() -> None:
    """Issue reproduction 2b: `seed + index` overflowed the generator for n=2, seed=2**64-1."""
    llm = make_llm()
    top = SamplingParams(temperature=1.0, max_tokens=5, n=2, seed=2**64 - 1, ignore_eos=True)
    out = llm.generate([PROMPTS[0]], top)[0]
    assert [c.finish_reason for c in out.outputs] == ["length", "length"]
    assert llm.generate([PROMPTS[0]], top)[0].outputs == out.outputs  # still reproducible
    # sample i draws from seed (seed + i) mod 2**64
    assert top.sample_seed(1) == 0 and SamplingParams(seed=-1).sample_seed(0) == SEED_MODULUS - 1


@pytest.mark.parametrize("faulty", [ForwardFailsOnPoison, NanLogitsOnPoison])
def test_a_failing_request_fails_alone(faulty: type[ForwardFailsOnPoison]) -> None:
    llm = make_llm()
    llm.engine.runner = faulty(llm.engine.runner)  # type: ignore[assignment]
    outs = llm.generate(PROMPTS, GREEDY)
    expected = clean_outputs(GREEDY)
    for i, out in enumerate(outs):
        if i == 1:
            assert out.finished and out.outputs[0].finish_reason == "error"
            assert out.error == (FORWARD_FAILED if faulty is ForwardFailsOnPoison else INVALID_LOGITS)
            assert "CUDA" not in out.error
        else:
            assert out.error is None and out.outputs[0].token_ids == expected[i]
    if faulty is ForwardFailsOnPoison:
        assert llm.engine.runner.batched_failures > 0  # type: ignore[attr-defined]
    assert llm.engine.stats().requests_finished["error"] == 1
    llm.engine.check_integrity()
    assert llm.engine.leaked_blocks() == 0 and llm.engine.stats().blocks_used == 0
    # and the engine keeps serving afterwards
    assert llm.generate([PROMPTS[0]], GREEDY)[0].outputs[0].token_ids == expected[0]


def test_prompt_logprobs_beside_a_failing_request_come_from_the_one_by_one_rerun() -> None:
    """The batched forward fails on the poison prompt: the rerun item by item still computes the
    others' prompt logprobs, equal to a clean run's; the poisoned request fails alone, without them."""
    asking = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    clean = make_llm().generate(PROMPTS, asking)
    llm = make_llm()
    llm.engine.runner = ForwardFailsOnPoison(llm.engine.runner)  # type: ignore[assignment]
    outs = llm.generate(PROMPTS, asking)
    assert llm.engine.runner.batched_failures > 0  # type: ignore[attr-defined]
    for i, (out, reference) in enumerate(zip(outs, clean)):
        if i == 1:
            assert out.outputs[0].finish_reason == "error" and out.prompt_logprobs is None
            continue
        assert out.error is None and out.prompt_logprobs is not None and reference.prompt_logprobs is not None
        assert len(out.prompt_logprobs) == len(PROMPTS[i])
        for got, want in zip(out.prompt_logprobs[1:], reference.prompt_logprobs[1:]):
            assert got is not None and want is not None and got.token_id == want.token_id
            assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
            assert [t for t, _ in got.top] == [t for t, _ in want.top]
    llm.engine.check_integrity()
    assert llm.engine.leaked_blocks() == 0


def test_a_failed_request_raises_in_its_own_caller_only() -> None:
    async def main() -> tuple[Any, list[int]]:
        engine = AsyncEngine(engine=make_llm().engine)
        engine.engine.runner = ForwardFailsOnPoison(engine.engine.runner)  # type: ignore[assignment]

        async def collect(prompt: list[int]) -> Any:
            tokens: list[int] = []
            try:
                async for out in engine.generate(prompt, GREEDY):
                    tokens += out.outputs[0].token_ids
            except RequestFailedError as e:
                return e
            return tokens

        try:
            bad, good = await asyncio.gather(collect(PROMPTS[1]), collect(PROMPTS[0]))
        finally:
            await engine.shutdown()
        return bad, good

    bad, good = asyncio.run(main())
    assert isinstance(bad, RequestFailedError) and str(bad) == FORWARD_FAILED
    assert good == clean_outputs(GREEDY)[0]
