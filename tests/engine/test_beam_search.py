"""Beam search against transformers as the oracle: every returned beam (tokens and score) equals
`generate(num_beams=k, do_sample=False, early_stopping=True, length_penalty=lp, max_new_tokens=m,
num_return_sequences=k)` in fp32, on the tiny random-weight models of every architecture and on the
embedded SmolLM2, with and without an EOS that the model actually emits. Also: no block leaks, the
prompt is computed once and its blocks are shared by every beam (refcounts checked mid-step), and
bad parameters are refused before anything is queued.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from tiny_models import hf_model, tiny_model_dir

from radixserve import LLM, BeamSearchParams
from radixserve.engine.beam_search import BeamSearchOutput

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
# tokens each tiny model emits within a few steps of beam search on PROMPTS: made extra EOS tokens,
# so some beams finish early and EOS handling (finish only in the top k, score by length) is exercised
EMITTED = {"llama": [70, 170], "qwen2": [452], "qwen3": [113, 62], "mistral": [266]}
MAX_TOKENS = 12


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 500, (n,), generator=g).tolist() for n in lengths]


PROMPTS = random_prompts([7, 20, 33])


@functools.cache
def tiny_llm(arch: str) -> LLM:
    return LLM(model=str(tiny_model_dir(arch)), block_size=16, num_blocks=256)


def reference(model: Any, prompt: list[int], k: int, lp: float, m: int, eos: list[int] | None) -> list[tuple]:
    """transformers' k returned beams: (generated tokens, score), best first."""
    r = model.generate(torch.tensor([prompt]), num_beams=k, do_sample=False, early_stopping=True, length_penalty=lp,
                       max_new_tokens=m, num_return_sequences=k, eos_token_id=eos, pad_token_id=0,
                       return_dict_in_generate=True, output_scores=True)
    lengths = (r.beam_indices != -1).sum(dim=1).tolist()  # a beam's generated length (EOS included)
    return [(r.sequences[i, len(prompt):len(prompt) + n].tolist(), float(r.sequences_scores[i]))
            for i, n in enumerate(lengths)]


def assert_equal_to_reference(model: Any, prompts: list[list[int]], outs: list[BeamSearchOutput], k: int, lp: float,
                              m: int, eos: list[int] | None) -> None:
    for p, o in zip(prompts, outs):
        ref = reference(model, p, k, lp, m, eos)
        assert [b.token_ids for b in o.beams] == [t for t, _ in ref]
        assert [b.score for b in o.beams] == pytest.approx([s for _, s in ref], abs=1e-4)
        for b in o.beams:
            assert b.finish_reason == ("stop" if eos and b.token_ids[-1] in eos else "length")
        assert o.usage.completion_tokens == sum(len(b.token_ids) for b in o.beams)


def assert_clean(llm: LLM) -> None:
    llm.engine.check_integrity()
    assert llm.engine.leaked_blocks() == 0
    assert llm.engine.stats().blocks_used == 0
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("arch", ARCHS)
def test_beams_equal_transformers_without_eos(arch: str, k: int) -> None:
    llm = tiny_llm(arch)
    outs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=k, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert_equal_to_reference(hf_model(tiny_model_dir(arch)), PROMPTS, outs, k, 1.0, MAX_TOKENS, None)
    assert all(len(o.beams) == k and all(len(b.token_ids) == MAX_TOKENS for b in o.beams) for o in outs)
    assert_clean(llm)


@pytest.mark.parametrize("lp", [1.0, 0.5, 2.0])
@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("arch", ARCHS)
def test_beams_equal_transformers_with_eos(arch: str, k: int, lp: float) -> None:
    """The model's own EOS tokens plus tokens it does emit, ending beams early."""
    llm = tiny_llm(arch)
    params = BeamSearchParams(beam_width=k, max_tokens=MAX_TOKENS, length_penalty=lp, stop_token_ids=EMITTED[arch])
    outs = llm.beam_search(PROMPTS, params)
    eos = sorted(llm.engine.eos_token_ids | set(EMITTED[arch]))
    assert_equal_to_reference(hf_model(tiny_model_dir(arch)), PROMPTS, outs, k, lp, MAX_TOKENS, eos)
    assert_clean(llm)


def test_eos_really_ends_beams() -> None:
    """The EOS cases above are not vacuous: some returned beams end at an EOS before max_tokens."""
    stopped = 0
    for arch in ARCHS:
        for k in (2, 4):
            outs = tiny_llm(arch).beam_search(PROMPTS, BeamSearchParams(beam_width=k, max_tokens=MAX_TOKENS,
                                                                        stop_token_ids=EMITTED[arch]))
            stopped += sum(b.finish_reason == "stop" for o in outs for b in o.beams)
    assert stopped >= 8


def test_wide_beams_beyond_the_logprobs_cap() -> None:
    """k + |EOS| above the API's 20 logprobs: the beam steps ask for more internally and still match."""
    llm = tiny_llm("llama")
    params = BeamSearchParams(beam_width=24, max_tokens=5, stop_token_ids=EMITTED["llama"])
    outs = llm.beam_search(PROMPTS[:2], params)
    eos = sorted(llm.engine.eos_token_ids | set(EMITTED["llama"]))
    assert_equal_to_reference(hf_model(tiny_model_dir("llama")), PROMPTS[:2], outs, 24, 1.0, 5, eos)
    assert_clean(llm)


def test_prompt_computed_once_and_its_blocks_shared_by_every_beam() -> None:
    """Mid-step, every beam's sequence lists the same physical blocks for the prompt's full blocks, each
    held by all k beams plus the tree; the prompt is computed once and each step computes one token a beam."""
    llm = LLM(model=str(tiny_model_dir("qwen2")), block_size=16, num_blocks=256)
    engine, k, m = llm.engine, 4, 8
    prompt = random_prompts([40], seed=3)[0]  # two full blocks and a partial one
    seen: list[tuple[list[list[int]], list[int]]] = []
    schedule = engine.scheduler.schedule

    def spy():  # noqa: ANN202
        batch = schedule()
        seqs = engine.live_sequences()
        if len(seqs) == k:
            tables = [s.block_table[:2] for s in seqs]
            seen.append((tables, [engine.pool.refcount[b] for b in tables[0]]))
        return batch

    engine.scheduler.schedule = spy  # type: ignore[method-assign]
    before = engine.stats().computed_tokens
    out = llm.beam_search([prompt], BeamSearchParams(beam_width=k, max_tokens=m, ignore_eos=True))[0]
    assert len(seen) >= m - 1
    for tables, refs in seen:
        assert all(t == tables[0] for t in tables) and refs == [k + 1, k + 1]
    assert engine.stats().computed_tokens - before == len(prompt) + (m - 1) * k
    assert out.usage.prompt_tokens == len(prompt) and out.usage.cached_tokens == 0
    assert_clean(llm)
    again = llm.beam_search([prompt], BeamSearchParams(beam_width=k, max_tokens=m, ignore_eos=True))[0]
    assert again.beams == out.beams and again.usage.cached_tokens == len(prompt) - 1
    assert_clean(llm)


def test_tiny_pool_with_preemption_still_matches() -> None:
    """Beams compete for a pool that cannot hold them all: evictions recompute, results are unchanged."""
    llm = LLM(model=str(tiny_model_dir("llama")), block_size=16, num_blocks=12, max_num_batched_tokens=32)
    outs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert_equal_to_reference(hf_model(tiny_model_dir("llama")), PROMPTS, outs, 4, 1.0, MAX_TOKENS, None)
    assert_clean(llm)


@pytest.mark.parametrize("field, value", [("beam_width", 0), ("beam_width", 33), ("beam_width", True),
                                          ("beam_width", 2.0), ("max_tokens", 0), ("length_penalty", float("nan")),
                                          ("ignore_eos", 1), ("stop_token_ids", [-1])])
def test_bad_params_are_refused(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        BeamSearchParams(**{"beam_width": 2, field: value})  # type: ignore[arg-type]


def test_bad_prompts_leave_nothing_queued() -> None:
    llm = tiny_llm("llama")
    with pytest.raises(ValueError, match="context length"):
        llm.beam_search([[5, 6], [7] * 1000], BeamSearchParams(beam_width=2, max_tokens=100))
    with pytest.raises(ValueError, match="vocabulary"):
        llm.beam_search([[5, 6], [600]], BeamSearchParams(beam_width=2))
    assert_clean(llm)


CHATS = [[{"role": "user", "content": "Name three primes."}],
         [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is the capital of Italy?"}]]


@pytest.mark.slow
def test_embedded_model_chat_equals_transformers() -> None:
    from transformers import AutoModelForCausalLM

    from radixserve.chat.template import ChatFormatter
    from radixserve.model.embedded import embedded_model_dir

    llm = LLM(kv_cache_memory_mb=256, quantized_activations="float32",  # transformers' fp32 model, exactly,
              kv_cache_dtype="model")  # with K/V in its fp32 (a GGUF's cache is fp16 by default)
    model = AutoModelForCausalLM.from_pretrained(embedded_model_dir(), dtype=torch.float32).eval()
    prompts = [ChatFormatter(llm.tokenizer).prompt_tokens(c) for c in CHATS]
    eos = sorted(llm.engine.eos_token_ids)
    for k in (2, 4):
        outs = llm.beam_search(prompts, BeamSearchParams(beam_width=k, max_tokens=24))
        assert_equal_to_reference(model, prompts, outs, k, 1.0, 24, eos)
        assert all(o.beams[0].text for o in outs)
        assert_clean(llm)
