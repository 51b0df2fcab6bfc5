"""Speculative decoding end to end: drafts from the radix tree, a prediction and prompt lookup,
verified in one step, with output identical to speculation off and to transformers (greedy, fp32),
on every cache path: cold and warm, hits ending mid-block, preemption by recompute and by swap in a
small pool, forks, overlap on and off, the host tier; seeded sampling the same alone and in a mixed
batch; beam search untouched. Every engine checks its integrity after each step (conftest.py).
"""

from __future__ import annotations

import pytest
from test_engine import assert_clean, random_prompts, reference
from tiny_models import tiny_model_dir

from radixserve import LLM, SamplingParams
from radixserve.core import RequestOutput
from radixserve.engine.beam_search import BeamSearchParams
from radixserve.scheduler.drafts import PAYING_RATE

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PATHS = [pytest.param(overlap, id="overlap" if overlap else "sync") for overlap in (False, True)]


def make(spec: bool = True, **kw: object) -> LLM:
    kw = {"block_size": 16, "num_blocks": 96, "max_num_batched_tokens": 64,
          "num_speculative_tokens": 8 if spec else 0} | kw
    return LLM(model=str(tiny_model_dir("llama")), **kw)


def tokens(outs: list[RequestOutput]) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


def spec_counts(llm: LLM) -> tuple[dict[str, int], dict[str, int]]:
    stats = llm.engine.stats()
    return dict(stats.spec_proposed), dict(stats.spec_accepted)


@pytest.mark.parametrize("overlap", PATHS)
def test_regenerated_replies_draft_from_the_tree_and_equal_transformers(overlap: bool) -> None:
    """Asked again, each prompt's reply is drafted from the cached previous one, and nearly all of it
    is accepted; both rounds equal transformers token for token. Prompt lengths end mid-block."""
    prompts = random_prompts([21, 37, 8])
    llm = make(overlap=overlap)
    for _ in range(2):
        outs = llm.generate(prompts, GREEDY)
        for p, o in zip(prompts, outs):
            assert o.outputs[0].token_ids == reference("llama", tuple(p), GREEDY.max_tokens)
    proposed, accepted = spec_counts(llm)
    assert accepted.get("tree", 0) >= 2 * GREEDY.max_tokens, (proposed, accepted)
    second = outs[0].usage.speculation
    assert second is not None and second.by_source["tree"][1] > 0
    assert llm.engine.stats().tokens_per_draw > 1.5
    assert_clean(llm)


@pytest.mark.parametrize("overlap", PATHS)
def test_greedy_is_identical_with_speculation_on_and_off(overlap: bool) -> None:
    """Repetitive prompts (prompt lookup drafts), their repeats (tree drafts), and a batch of both."""
    base = random_prompts([30, 12, 45], seed=3)
    prompts = [p[:6] * 5 for p in base] + base
    on, off = make(overlap=overlap), make(spec=False, overlap=overlap)
    for _ in range(2):
        assert tokens(on.generate(prompts, GREEDY)) == tokens(off.generate(prompts, GREEDY))
    proposed, _ = spec_counts(on)
    # with overlap a sequence waits for its pending token only where the tree or a prediction promises
    # drafts (or its drafts are being kept), so prompt lookup alone does not start it
    assert proposed.get("tree", 0) > 0 and (overlap or proposed.get("lookup", 0) > 0), proposed
    assert spec_counts(off) == ({}, {})
    assert_clean(on)


@pytest.mark.parametrize("overlap", PATHS)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_during_verification_changes_nothing(mode: str, overlap: bool) -> None:
    """A pool too small for every sequence at once: sequences are preempted, some while drafts are
    being verified (with overlap a verification is in flight while the next step is planned), and
    resume; the host tier keeps the first round's replies, which draft the second round's."""
    prompts = random_prompts([40, 33, 47, 29], seed=5)
    llm = make(num_blocks=12, preemption_mode=mode, max_num_batched_tokens=64, host_cache_mb=8, overlap=overlap,
               new_token_ratio=0.0)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for _ in range(2):
        outs = llm.generate(prompts, params)
        for p, o in zip(prompts, outs):
            assert o.outputs[0].token_ids == reference("llama", tuple(p), 20)
    assert llm.engine.stats().preemptions > 0 and spec_counts(llm)[1].get("tree", 0) > 0, llm.engine.stats()
    assert_clean(llm)


def test_drafts_come_from_the_host_tier_too() -> None:
    """The cached reply was evicted to host memory by other traffic: its tokens still draft."""
    llm = make(num_blocks=16, host_cache_mb=16)
    prompt = random_prompts([30], seed=9)[0]
    first = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    for other in random_prompts([80, 80, 80, 80], seed=10):
        llm.generate([other], SamplingParams(temperature=0.0, max_tokens=4))
    assert llm.engine.stats().host_tokens > 0
    again = llm.generate([prompt], GREEDY)[0]
    assert again.outputs[0].token_ids == first == reference("llama", tuple(prompt), GREEDY.max_tokens)
    assert again.usage.speculation is not None and again.usage.speculation.accepted > 0
    assert_clean(llm)


@pytest.mark.parametrize("block_size", [4, 16])
def test_seeded_samples_are_the_same_alone_in_a_batch_and_without_speculation(block_size: int) -> None:
    """n = 3 forks, seeded: the same tokens with speculation off, alone, and beside other requests
    (their second round drafts from the tree). With 4-token blocks a verification copies shared
    blocks and rolls back others between two padded decodes, whose device block table must follow."""
    prompt = random_prompts([26], seed=11)[0]
    seeded = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, n=3, seed=42, ignore_eos=True)
    off = tokens(make(spec=False, block_size=block_size).generate([prompt], seeded))
    on = make(block_size=block_size)
    alone = tokens(on.generate([prompt], seeded))
    mixed = tokens(on.generate([prompt] + random_prompts([15, 50], seed=12), seeded))[:1]
    assert alone == off == mixed
    assert spec_counts(on)[1].get("tree", 0) > 0
    assert_clean(on)


def test_logprobs_are_the_same_with_drafts() -> None:
    prompt = random_prompts([18], seed=13)[0]
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, ignore_eos=True)
    off = make(spec=False).generate([prompt], params)[0].outputs[0].logprobs
    on = make()
    on.generate([prompt], params)
    again = on.generate([prompt], params)[0]
    assert again.usage.speculation is not None and again.usage.speculation.accepted > 0
    got = again.outputs[0].logprobs
    assert got is not None and off is not None and len(got) == len(off)
    for a, b in zip(got, off):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_prediction_drafts_and_never_changes_the_output() -> None:
    prompt = random_prompts([20], seed=14)[0]
    reply = reference("llama", tuple(prompt), GREEDY.max_tokens)
    llm = make(enable_prefix_cache=False)  # no tree drafts: only the prediction (and lookup)
    right = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, prediction=reply)
    out = llm.generate([prompt], right)[0]
    assert out.outputs[0].token_ids == reply
    counts = out.usage.speculation
    assert counts is not None and counts.prediction_accepted >= GREEDY.max_tokens - 8
    wrong = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, prediction=[7] * 40)
    out = llm.generate([prompt], wrong)[0]
    assert out.outputs[0].token_ids == reply
    counts = out.usage.speculation
    assert counts is not None and counts.prediction_accepted == 0 and counts.prediction_rejected == 40
    assert_clean(llm)


def test_drafts_respect_max_tokens_and_stops() -> None:
    """A draft never runs past max_tokens; a stop token inside the kept drafts ends the sequence there."""
    prompt = random_prompts([22], seed=15)[0]
    reply = reference("llama", tuple(prompt), 12)
    llm = make()
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    short = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[0]
    assert short.outputs[0].token_ids == reply[:5] and short.outputs[0].finish_reason == "length"
    stop = reply[7]
    cut = reply[:reply.index(stop) + 1]
    stopped = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop]))[0]
    assert stopped.outputs[0].token_ids == cut and stopped.outputs[0].finish_reason == "stop"
    assert_clean(llm)


def test_speculation_off_and_the_batch_cap() -> None:
    prompts = random_prompts([20, 20], seed=16)
    capped = make(speculative_max_batch=1)
    for _ in range(2):
        capped.generate(prompts, GREEDY)  # two decoding sequences, cap 1: no drafts
    assert spec_counts(capped) == ({}, {})
    off = make(spec=False)
    for _ in range(2):
        off.generate(prompts, GREEDY)
    assert spec_counts(off) == ({}, {})


class StepRecorder:
    """Wraps an engine's scheduler to record each step: (decoding sequences, their rows, prompt rows,
    the kept rate of recent drafts when the step was scheduled)."""

    def __init__(self, llm: LLM) -> None:
        self.steps: list[tuple[int, int, int, float]] = []
        self.scheduler = scheduler = llm.engine.scheduler
        self._schedule = scheduler.schedule
        scheduler.schedule = self.schedule  # type: ignore[method-assign]

    def schedule(self):
        rate = self.scheduler.drafts.kept_rate
        batch = self._schedule()
        decoding = [i for i in batch.items if i.samples and i.start >= i.seq.num_prompt_tokens]
        prompt = sum(i.num_tokens for i in batch.items if i.start < i.seq.num_prompt_tokens)
        self.steps.append((len(decoding), sum(i.num_tokens for i in decoding), prompt, rate))
        return batch

    def drafting(self, paying: bool) -> list[tuple[int, int, int, float]]:
        """The steps with drafts, scheduled while recent drafts paid (or did not)."""
        return [s for s in self.steps if s[1] > s[0] and (s[3] >= PAYING_RATE) == paying]


def test_drafts_fill_the_rows_decodes_and_prompts_leave_until_they_pay() -> None:
    """`speculative_max_rows` caps a drafting step's rows while recent drafts were mostly rejected:
    three regenerated replies with a cap of 6 share 3 draft rows per step until their kept drafts lift
    the cap (still equal to transformers); with a cap of 3 they never draft; and a step that runs a
    prompt chunk as long as the cap drafts nothing."""
    prompts = random_prompts([21, 30, 18], seed=18)
    longer = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for cap in (6, 3):
        llm = make(speculative_max_rows=cap)
        recorder = StepRecorder(llm)
        for _ in range(2):
            outs = llm.generate(prompts, longer)
            for p, o in zip(prompts, outs):
                assert o.outputs[0].token_ids == reference("llama", tuple(p), longer.max_tokens)
        capped, lifted = recorder.drafting(paying=False), recorder.drafting(paying=True)
        if cap == 3:
            assert capped == lifted == [] and spec_counts(llm) == ({}, {})
        else:
            assert all(rows + prompt <= cap for _, rows, prompt, _ in capped), capped
            assert any(n == 3 and rows == cap for n, rows, _, _ in capped), capped  # reached, not undershot
            assert any(rows + prompt > cap for _, rows, prompt, _ in lifted), lifted  # tree drafts pay
        assert_clean(llm)
    llm = make(speculative_max_rows=16)
    recorder = StepRecorder(llm)
    llm.generate(prompts[:1], GREEDY)
    long_prompt = random_prompts([150], seed=19)[0]
    outs = llm.generate([prompts[0], long_prompt], GREEDY)  # a regeneration beside a long new prompt
    assert outs[1].outputs[0].token_ids == reference("llama", tuple(long_prompt), GREEDY.max_tokens)
    assert recorder.drafting(paying=False), recorder.steps
    assert all(prompt == 0 for _, _, prompt, _ in recorder.drafting(paying=False)), recorder.steps
    assert any(prompt >= 16 and n and rate < PAYING_RATE for n, _, prompt, rate in recorder.steps), recorder.steps
    assert_clean(llm)


def test_beam_search_is_untouched() -> None:
    prompt = random_prompts([16], seed=17)[0]
    params = BeamSearchParams(beam_width=3, max_tokens=8)
    on, off = make(), make(spec=False)
    for _ in range(2):
        a, b = on.beam_search([prompt], params)[0], off.beam_search([prompt], params)[0]
        assert [s.token_ids for s in a.beams] == [s.token_ids for s in b.beams]
    assert_clean(on)


def test_a_prompt_that_forks_drafts_nothing_before_its_forks() -> None:
    # the step budget leaves the repetitive prompt's last token alone, where it could draft by lookup:
    # its n = 2 forks would then copy unverified drafts as tokens of their own
    llm = LLM(model=str(tiny_model_dir("llama")), block_size=4, num_blocks=160, max_num_batched_tokens=12,
              num_speculative_tokens=4)
    prompt = [50, 60, 70, 80] * 3 + [50]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, n=2, ignore_eos=True))[0]
    assert [c.token_ids for c in out.outputs] == [reference("llama", tuple(prompt), 12)] * 2
    assert_clean(llm)
