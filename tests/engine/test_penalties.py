"""Presence, frequency and repetition penalties and logit_bias (engine/penalties.py, applied by the
sampler), against a float64 reference of their formulas written here, then through the engine on the
tiny random-weight model against transformers.

Covered: each penalty alone and all together on fixed logits and counts, with negative logits under
repetition, an unpenalised row in the same batch left bit for bit; greedy and sampled draws mixed in
one batch give the tokens the reference's penalised logits give; logit_bias -100 bans the argmax and
+100 forces a token; counts follow commits (forced tokens added, void draws taken away). Through the
engine: greedy equals transformers plus the reference formula, overlap on and off; the device counts
equal every live sequence's generated tokens (the draw in flight included) after every step, with
n = 2 forks, a grammar's forced tokens under overlap and preemption by recompute and by swap; seeded
samples are the same alone and in a mixed batch.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from tiny_models import hf_model, tiny_chat_model_dir

from radixserve.config import EngineConfig
from radixserve.core import PENDING_TOKEN, Request, Sequence
from radixserve.engine.engine import LLMEngine
from radixserve.engine.penalties import PenaltyBook, apply_penalties
from radixserve.engine.sampler import Draw, Sampler
from radixserve.sampling_params import SamplingParams
from radixserve.scheduler.step_results import Launch, TokenCommit
from radixserve.structured import StructuredOutput

CPU = torch.device("cpu")
VOCAB = 40
# distinct logits, a third of them negative, in scrambled order
LOGITS = torch.tensor([(7 * i % VOCAB - 13) * 0.37 + 0.01 * i for i in range(VOCAB)])
PROMPT = [3, 5, 5, 11, 20, 33]
GENERATED = [5, 7, 7, 7, 20, 21, 39, 0]
EVERYTHING = dict(presence_penalty=0.6, frequency_penalty=0.45, repetition_penalty=1.7, logit_bias={7: 2.5, 30: -4.0, 2: 1.0})


def reference(logits: torch.Tensor, prompt: list[int], generated: list[int], p: SamplingParams) -> torch.Tensor:
    """The penalised row in float64: logit_bias, then repetition over prompt and output, then
    frequency and presence over the output's counts."""
    x = logits.double().clone()
    for token, bias in p.logit_bias.items():
        x[token] += bias
    counts = Counter(generated)
    for token in set(prompt) | set(counts):
        if p.repetition_penalty != 1.0:
            x[token] = x[token] / p.repetition_penalty if x[token] > 0 else x[token] * p.repetition_penalty
    for token, count in counts.items():
        x[token] -= p.frequency_penalty * count + p.presence_penalty
    return x


def sequence(params: SamplingParams, prompt: list[int] = PROMPT, generated: list[int] = GENERATED) -> Sequence:
    req = Request(f"r{id(params)}", list(prompt), params)
    seq = Sequence(req, 0, list(prompt) + list(generated) + [PENDING_TOKEN], len(prompt))
    req.sequences.append(seq)
    return seq


def at(seqs: list[Sequence]) -> list[int]:
    """Each sequence's draw position: its pending slot, the last of its tokens."""
    return [len(s.token_ids) - 1 for s in seqs]


def book_of(seqs: list[Sequence]) -> PenaltyBook:
    book = PenaltyBook(VOCAB, CPU)
    for req in dict.fromkeys(s.request for s in seqs):
        if req.params.has_penalties:
            book.begin(req)
    return book


CASES = [dict(presence_penalty=1.5), dict(frequency_penalty=-0.8), dict(repetition_penalty=1.9),
         dict(repetition_penalty=0.6), dict(logit_bias={0: -100.0, 12: 100.0, 5: 0.5}), EVERYTHING]


def test_each_penalty_matches_its_formula_and_leaves_other_rows_alone() -> None:
    plain = SamplingParams(temperature=0.0)
    params = [SamplingParams(**case) for case in CASES] + [plain]
    # outputs of different lengths: a shorter row sees only its own tokens of the step's token lists
    outputs = [GENERATED[:len(GENERATED) - 3 * (i % 3)] for i in range(len(params))]
    seqs = [sequence(p, generated=g) for p, g in zip(params, outputs)]
    book = book_of(seqs)
    step = book.step(seqs, at(seqs))
    assert step is not None and step.draws.tolist() == list(range(len(CASES)))
    x = LOGITS.repeat(len(seqs), 1)
    apply_penalties(x, step)
    for row, p, generated in zip(x, params, outputs):
        want = reference(LOGITS, PROMPT, generated, p)
        torch.testing.assert_close(row.double(), want, rtol=1e-6, atol=1e-5)
        assert not torch.equal(want, LOGITS.double()) or p is plain
    assert torch.equal(x[-1], LOGITS)  # the unpenalised row, bit for bit
    # repetition reached negative logits of the prompt and output both ways (divided and multiplied)
    assert any(LOGITS[t] < 0 for t in set(PROMPT) | set(GENERATED)) and any(LOGITS[t] > 0 for t in PROMPT)


def test_no_penalised_request_no_work() -> None:
    book = PenaltyBook(VOCAB, CPU)
    seqs = [sequence(SamplingParams())]
    assert not book and book.step(seqs, at(seqs)) is None
    assert book.counts.shape[0] == 0  # no row was taken


def test_greedy_and_sampled_draws_in_one_batch_follow_the_penalised_logits() -> None:
    """Each draw of a mixed batch (greedy and temperature / top-p / top-k, penalised and not, one of
    them a fork sharing its parent's logits row) gets the token the reference's penalised row gives
    it when sampled alone without penalties, with the same key and position."""
    sampler = Sampler(CPU)
    rows = torch.stack([LOGITS, LOGITS.flip(0), LOGITS * 0.5])
    cases: list[tuple[int, dict[str, Any]]] = [
        (0, dict(temperature=0.0, **EVERYTHING)), (0, dict(temperature=0.0)), (1, dict(temperature=0.0, **EVERYTHING)),
        (1, dict(temperature=0.9, top_p=0.8, **EVERYTHING)), (2, dict(temperature=1.0, repetition_penalty=1.4)),
        (2, dict(temperature=1.0, top_k=5, frequency_penalty=1.2)), (2, dict(temperature=1.0)),
        (0, dict(temperature=1.3, min_p=0.05, presence_penalty=-1.0))]
    for position in range(40):  # 40 random numbers per draw
        params = [SamplingParams(**kw) for _, kw in cases]
        seqs = [sequence(p) for p in params]
        step = book_of(seqs).step(seqs, at(seqs))
        draws = [Draw(row, p, 1000 + i, position) for i, ((row, _), p) in enumerate(zip(cases, params))]
        got, usable, _ = sampler.sample(rows, draws, [step]).host()
        assert all(usable)
        for i, ((row, _), p) in enumerate(zip(cases, params)):
            penalised = reference(rows[row], PROMPT, GENERATED, p).float()[None]
            alone, _, _ = sampler.sample(penalised, [Draw(0, SamplingParams(**{**cases[i][1], **_OFF}), 1000 + i,
                                                          position)]).host()
            assert got[i] == alone[0], (i, position)
            if p.greedy:
                assert got[i] == int(penalised.argmax())


_OFF = dict(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, logit_bias={})


def test_logit_bias_bans_and_forces_a_token() -> None:
    sampler = Sampler(CPU)
    top = int(LOGITS.argmax())
    n = 4000

    def draws_of(params: SamplingParams) -> list[int]:
        seq = sequence(params)
        step = book_of([seq]).step([seq] * n, at([seq]) * n)
        return sampler.sample(LOGITS[None], [Draw(0, params, 77, i) for i in range(n)], [step]).host()[0]

    free = Counter(draws_of(SamplingParams(temperature=1.0, logit_bias={3: 0.0})))
    assert free[top] > n // 10  # the top token is drawn often without the ban
    assert Counter(draws_of(SamplingParams(temperature=1.0, logit_bias={top: -100.0})))[top] == 0
    weakest = int(LOGITS.argmin())
    assert set(draws_of(SamplingParams(temperature=0.0, logit_bias={weakest: 100.0}))) == {weakest}


def test_counts_follow_sampling_forced_tokens_and_void_draws() -> None:
    """A penalised sequence at its first draw (nothing generated), then a commit whose grammar forced
    two tokens while the sequence's next draw was in flight: that draw is void, uncounted, and its
    place in the token list is the first forced token's."""
    seq, other = sequence(SamplingParams(frequency_penalty=1.0), generated=[]), \
        sequence(SamplingParams(presence_penalty=0.5), generated=[4, 4])
    book = book_of([seq, other])
    n, m = len(seq.token_ids) - 1, len(other.token_ids) - 1  # their pending slots
    first = book.step([seq, other], [n, m])
    assert first is not None and book.counts_of(seq) == Counter() and book.counts_of(other) == Counter({4: 2})
    assert book.tokens_of(other, m) == other.token_ids[:m]
    book.count_sampled(first, torch.tensor([9, 6]))
    later = book.step([other, seq], [m + 1, n + 1])  # the next step, launched before the first one commits
    assert later is not None
    book.count_sampled(later, torch.tensor([8, 30]))
    assert book.counts_of(seq) == Counter({9: 1, 30: 1}) and book.counts_of(other) == Counter({4: 2, 6: 1, 8: 1})
    launch = Launch(owners=[seq, other], rows=[0, 1], positions=[n, m])
    in_flight = Launch(owners=[other, seq], rows=[0, 1], positions=[m + 1, n + 1])
    book.committed(launch, [TokenCommit((9, 12, 12), replaces_in_flight=True), TokenCommit((6,))],
                   {(seq.seq_id, n + 1)}, (in_flight, torch.tensor([8, 30])))
    assert book.counts_of(seq) == Counter({9: 1, 12: 2}) and book.counts_of(other) == Counter({4: 2, 6: 1, 8: 1})
    assert book.tokens_of(seq, n + 3) == PROMPT + [9, 12, 12]
    assert book.tokens_of(other, m + 2) == PROMPT + [4, 4, 6, 8]
    book.release(seq.request)
    assert book.counts_of(seq) is None and book  # `other` is still live


# -- through the engine -----------------------------------------------------------------------------
def engine(**overrides: Any) -> LLMEngine:
    config = dict(model=str(tiny_chat_model_dir("llama")), num_blocks=128, max_num_seqs=16)
    return LLMEngine(EngineConfig(**{**config, **overrides}))


def check_counts(e: LLMEngine) -> int:
    """Every live penalised sequence's device counts and token list equal its tokens, the draw still
    in flight included; returns how many sequences were checked."""
    flight, pending = e._in_flight, {}
    if flight is not None and flight.step.sampled is not None:
        ids = flight.step.sampled.host()[0]
        pending = {s.seq_id: ids[i] for i, s in enumerate(flight.step.launch.owners)}
    checked = 0
    for seq in e.live_sequences():
        got = e.penalties.counts_of(seq)
        if got is not None:
            listed = [pending[seq.seq_id] if t == PENDING_TOKEN else t for t in seq.token_ids]
            assert got == Counter(listed[seq.num_prompt_tokens:]), seq.seq_id
            assert e.penalties.tokens_of(seq, len(listed)) == listed, seq.seq_id
            checked += 1
    return checked


def run(e: LLMEngine, asks: dict[str, tuple[list[int], SamplingParams]]) -> dict[tuple[str, int], list[int]]:
    ids = {e.add_request(prompt, p, request_id=name): name for name, (prompt, p) in asks.items()}
    tokens: dict[tuple[str, int], list[int]] = {}
    checked = 0
    while e.has_unfinished():
        for out in e.step():
            assert out.error is None, out.error
            for c in out.outputs:
                tokens.setdefault((ids[out.request_id], c.index), []).extend(c.token_ids)
        checked += check_counts(e)
    e.check_integrity()
    assert e.leaked_blocks() == 0 and not e.penalties
    assert (checked > 0) == any(p.has_penalties for _, p in asks.values())
    return tokens


def oracle(prompt: list[int], p: SamplingParams) -> list[int]:
    """transformers' last-position logits each step (fp32), penalised by `reference`, argmax."""
    model, out = hf_model(tiny_chat_model_dir("llama")), []
    with torch.no_grad():
        for _ in range(p.max_tokens):
            logits = model(torch.tensor([prompt + out])).logits[0, -1]
            out.append(int(reference(logits, prompt, out, p).argmax()))
    return out


GREEDY = dict(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = {"freq": [1, 40, 41, 42, 43, 44], "pres": [1, 50, 51, 50, 51], "rep": [1, 60, 61, 62, 63, 64, 65],
           "all": [1, 70, 71, 72], "none": [1, 40, 41, 42, 43, 44]}
PENALTIES = {"freq": dict(frequency_penalty=1.1), "pres": dict(presence_penalty=1.8), "rep": dict(repetition_penalty=1.8),
             "all": dict(frequency_penalty=0.5, presence_penalty=0.5, repetition_penalty=1.3,
                         logit_bias={63: 3.0, 96: -100.0, 300: 2.0}), "none": {}}


@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_equals_transformers_with_the_formula(overlap: bool) -> None:
    asks = {name: (prompt, SamplingParams(**GREEDY, **PENALTIES[name])) for name, prompt in PROMPTS.items()}
    got = run(engine(overlap=overlap), asks)
    for name, (prompt, p) in asks.items():
        assert got[(name, 0)] == oracle(prompt, p), name
    assert got[("freq", 0)] != got[("none", 0)]  # same prompt: the penalty changed the reply


def test_seeded_samples_are_the_same_alone_and_in_a_mixed_batch() -> None:
    """A penalised n = 2 request and an unpenalised one, each alone, then together in a batch of
    greedy and sampled, penalised and plain requests: every sample draws the same tokens."""
    strong = dict(EVERYTHING, frequency_penalty=2.0, presence_penalty=2.0, repetition_penalty=2.0)
    asks = {"x": ([1, 80, 81, 82], SamplingParams(max_tokens=24, n=2, seed=7, temperature=1.5, ignore_eos=True, **strong)),
            "y": ([1, 80, 81, 82], SamplingParams(max_tokens=24, n=2, seed=7, temperature=1.5, ignore_eos=True))}
    alone = {key: tokens for name in asks for key, tokens in run(engine(overlap=True), {name: asks[name]}).items()}
    crowd = {f"g{i}": ([1, 90 + i, 5], SamplingParams(**GREEDY, **PENALTIES[k])) for i, k in enumerate(PENALTIES)}
    crowd["s"] = ([1, 80, 81], SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, frequency_penalty=2.0))
    mixed = run(engine(overlap=True), {**crowd, **asks})
    assert {key: mixed[key] for key in alone} == alone
    assert alone[("x", 0)] != alone[("x", 1)] and alone[("x", 0)] != alone[("y", 0)]  # forks differ; penalties count


FIXED_KEYS = {"type": "object", "additionalProperties": False, "required": ["colour", "size", "shape"],
              "properties": {"colour": {"enum": ["red", "blue"]}, "size": {"enum": ["small", "large"]},
                             "shape": {"enum": ["round", "square"]}}}


def test_forced_tokens_are_counted_the_same_with_overlap_on_and_off() -> None:
    """A grammar forces most of the reply: with overlap each forced run replaces a draw in flight,
    whose count is taken away again; the counts and the sampled replies equal overlap off's."""
    p = SamplingParams(max_tokens=80, temperature=1.0, seed=3, frequency_penalty=2.0, presence_penalty=1.0,
                       repetition_penalty=1.5, structured=StructuredOutput(json=FIXED_KEYS))
    replies = []
    for overlap in (False, True):
        e = engine(overlap=overlap)
        replies.append(run(e, {f"r{i}": ([1, 100 + i], p) for i in range(4)}))
        assert e.stats().forced_tokens > 0
    assert replies[0] == replies[1]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_the_counts(mode: str) -> None:
    asks = {f"r{i}": ([1, 110 + i, 111 + i, 112 + i], SamplingParams(**GREEDY, **PENALTIES[k]))
            for i, k in enumerate(["freq", "pres", "rep", "all"] * 2)}
    roomy = run(engine(overlap=True), asks)
    e = engine(overlap=True, num_blocks=20, block_size=4, max_num_seqs=8, preemption_mode=mode,
               host_cache_mb=4.0 if mode == "swap" else 0.0, new_token_ratio=0.0)
    assert run(e, asks) == roomy
    assert e.stats().preemptions > 0
