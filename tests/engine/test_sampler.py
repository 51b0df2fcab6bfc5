"""The batched sampler (radixserve/engine/sampler.py) on CPU, against a float64 reference in this file.

Covered:
- sampled frequencies match the filtered, renormalized distribution (temperature 0.7 and 1.3, top-k,
  top-p, min-p, and temperature + min-p + top-k + top-p together), checked with a total-variation bound
  derived for the sample size; the same check rejects wrong distributions (a shifted temperature,
  top-p without renormalizing after min-p / top-k, a filter left out), so it can fail;
- tokens outside the kept set (nucleus, top-k, min-p) never appear, also for u at its extremes;
- temperature 0 and temperatures below MIN_TEMPERATURE are the argmax, and so is a tiny valid
  temperature when one token clearly wins;
- a 5000-token vocabulary through every CPU path: the top-256 candidates (peaked rows), the wider
  top-4096 (flat rows whose kept set runs past 256) and the full sort (a near-uniform row whose
  nucleus runs past 4096), by rank-binned frequencies;
  and a mixed batch (greedy, top-p, top-k, min-p, plain temperature, combined rows) gives each draw the
  token it gets when its row is sampled alone;
- seeded reproducibility: a draw's token is a function of (logits row, settings, key, position);
- non-finite rows (NaN, +inf, all -inf) are unusable with token 0 and leave the other rows alone;
- logprobs are log-softmax of the raw logits, with each draw's own number of alternatives;
- `uniform(key, position)` stays in [0, 1 - 2**-23] and is roughly uniform.

The reference never calls the sampler's internals: it sorts the whole row in float64.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from radixserve.engine import sampler as sampler_module
from radixserve.engine.sampler import CANDIDATES, Draw, Sampler, uniform
from radixserve.sampling_params import MIN_TEMPERATURE, SamplingParams

SAMPLER = Sampler(torch.device("cpu"))
KEY = 0x5EED_1234_ABCD_0001

# 24 distinct logits in scrambled vocabulary order (the argmax is token 13), so sorted order differs
# from vocabulary order and a mix-up of ranks and token ids shows.
SMALL = torch.tensor([2.4, -2.0, -4.5, -0.8, 1.9, -0.4, -6.0, -3.5, 2.2, -2.4, 0.0, -1.1, 1.5, 4.0, 1.2, 0.6, 3.1,
                      -1.5, 3.3, 3.6, -3.0, 0.3, 2.8, 1.0])
SMALL_DRAWS = 30_000
LARGE_VOCAB = 5000
LARGE_DRAWS = 3000


# ---------------------------------------------------------------- reference and statistics


@dataclass
class Reference:
    probs: torch.Tensor  # [V] float64: the filtered, renormalized distribution (0 outside the kept set)
    order: torch.Tensor  # [V] token ids, most likely first
    kept: int  # the kept set is order[:kept]
    margin: float  # how far the min-p / top-p decisions are from their thresholds (float32 slack)

    @property
    def kept_ids(self) -> set[int]:
        return set(self.order[:self.kept].tolist())


def reference(logits: torch.Tensor, params: SamplingParams, renormalize_before_top_p: bool = True) -> Reference:
    """The distribution `params` asks for, by a full float64 sort: temperature, then min-p, top-k and
    top-p, each renormalizing. `renormalize_before_top_p=False` is a deliberately wrong variant (top-p
    measured against the whole distribution's mass) that the negative test uses."""
    x = logits.double()
    assert x.unique().numel() == x.numel(), "ties would make the kept set ambiguous"
    probs = torch.softmax(x / params.temperature, dim=0)
    order = torch.sort(probs, descending=True, stable=True).indices
    p = probs[order].tolist()
    kept, margin = len(p), math.inf
    if params.min_p:
        kept = sum(q >= params.min_p * p[0] for q in p)  # a prefix: p is sorted
        margin = min(abs(q / p[0] - params.min_p) for q in p)
    if params.top_k:
        kept = min(kept, params.top_k)
    if params.top_p < 1.0:
        total = math.fsum(p[:kept]) if renormalize_before_top_p else 1.0
        cumulative = (torch.tensor(p[:kept], dtype=torch.float64).cumsum(0) / total).tolist()
        margin = min(margin, *(abs(c - params.top_p) for c in cumulative))
        # the smallest prefix whose mass reaches top_p (at least one token)
        kept = next((i + 1 for i, c in enumerate(cumulative) if c >= params.top_p), kept)
    out = torch.zeros_like(probs)
    out[order[:kept]] = probs[order[:kept]] / probs[order[:kept]].sum()
    return Reference(out, order, kept, margin)


def sample_tokens(logits: torch.Tensor, params: SamplingParams, n: int, key: int = KEY, chunk: int = 50_000) -> torch.Tensor:
    """`n` draws from one logits row at positions 0..n-1 (independent random numbers), `chunk` draws
    per `sample` call."""
    row = logits.reshape(1, -1)
    out: list[int] = []
    for start in range(0, n, chunk):
        ids, usable, _ = SAMPLER.sample(row, [Draw(0, params, key, p) for p in range(start, min(n, start + chunk))]).host()
        assert all(usable)
        out.extend(ids)
    return torch.tensor(out)


def frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / tokens.numel()


def total_variation(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * float((p - q).abs().sum())


def tv_bound(expected: torch.Tensor, n: int, delta: float = 1e-6) -> float:
    """A total-variation distance that n independent draws from `expected` exceed with probability
    below `delta` (scipy is not installed, so no chi-square quantiles).

    E|f_i - p_i| <= sqrt(p_i (1 - p_i) / n) for a bin's frequency f_i (Jensen on its variance), so
    E[TV] <= 1/2 sum_i sqrt(p_i (1 - p_i) / n) -- at most 1/2 sqrt((K - 1) / n) over K bins, e.g.
    0.014 for K = 24 and n = 30k. TV is a function of the n draws that one draw moves by at most 1/n,
    so McDiarmid's inequality gives P(TV >= E[TV] + t) <= exp(-2 n t^2); t = sqrt(ln(1/delta) / (2n)) is
    0.015 for n = 30k and delta = 1e-6. Together 0.019 - 0.026 for the small-vocabulary cases here
    (the sampler lands at 0.005 - 0.011), while the wrong distributions the negative test tries are
    0.05 - 0.16 away from its samples. The keys are fixed, so the tests are deterministic; delta bounds
    the chance that the fixed draws were an unlucky sample. The draws' random numbers come from a hash,
    not a true random source: a flawed hash would show up here as a failure, which is intended."""
    p = expected[expected > 0]
    return 0.5 * float((p * (1 - p) / n).sqrt().sum()) + math.sqrt(math.log(1 / delta) / (2 * n))


# ---------------------------------------------------------------- 1, 2: frequencies and kept sets

SMALL_CASES = {
    "temperature 0.7": SamplingParams(temperature=0.7),
    "temperature 1.3": SamplingParams(temperature=1.3),
    "top-k 5": SamplingParams(top_k=5),
    "top-p 0.8": SamplingParams(top_p=0.8),
    "min-p 0.1": SamplingParams(min_p=0.1),
    # all four filters; min-p and top-k both cut a prefix, so only the stricter one of them binds:
    # here top-k (7 tokens; min-p keeps 10), then top-p keeps 3 of the 7 renormalized
    "combined, top-k binds": SamplingParams(temperature=0.8, min_p=0.02, top_k=7, top_p=0.7),
    # here min-p (6 tokens; top-k keeps 8), then top-p keeps 5 of the 6 renormalized
    "combined, min-p binds": SamplingParams(temperature=0.9, min_p=0.15, top_k=8, top_p=0.9),
}


@functools.cache
def small_samples(case: str) -> torch.Tensor:
    return sample_tokens(SMALL, SMALL_CASES[case], SMALL_DRAWS)


@pytest.mark.parametrize("case", list(SMALL_CASES))
def test_frequencies_match_the_filtered_distribution(case: str) -> None:
    ref = reference(SMALL, SMALL_CASES[case])
    assert ref.margin > 1e-3  # no kept-set decision within float32 rounding of its threshold
    freq = frequencies(small_samples(case), SMALL.numel())
    assert total_variation(freq, ref.probs) < tv_bound(ref.probs, SMALL_DRAWS), (freq, ref.probs)


@pytest.mark.parametrize("case", [c for c in SMALL_CASES if not c.startswith("temperature")])
def test_tokens_outside_the_kept_set_never_appear(case: str) -> None:
    ref = reference(SMALL, SMALL_CASES[case])
    assert ref.kept < SMALL.numel()
    seen = set(small_samples(case).tolist())
    assert seen <= ref.kept_ids, seen - ref.kept_ids
    assert seen == ref.kept_ids  # every kept token (>= 3% here) shows up in 30k draws


def test_the_combined_cases_exercise_every_filter() -> None:
    """Dropping the temperature, top-p, or the binding one of min-p / top-k changes the distribution."""
    for case, binding in [("combined, top-k binds", "top_k"), ("combined, min-p binds", "min_p")]:
        params = SMALL_CASES[case]
        probs = reference(SMALL, params).probs
        changes: list[dict[str, Any]] = [{"temperature": 1.0}, {"top_p": 1.0}, {binding: 0}]
        for change in changes:
            assert total_variation(probs, reference(SMALL, dataclasses.replace(params, **change)).probs) > 0.04


@pytest.mark.parametrize(("case", "wrong"), [
    ("temperature 0.7", lambda p: reference(SMALL, dataclasses.replace(p, temperature=0.8))),
    ("temperature 0.7", lambda p: reference(SMALL, dataclasses.replace(p, temperature=0.6))),
    ("top-p 0.8", lambda p: reference(SMALL, dataclasses.replace(p, top_p=1.0))),
    ("min-p 0.1", lambda p: reference(SMALL, dataclasses.replace(p, min_p=0.0))),
    ("top-k 5", lambda p: reference(SMALL, dataclasses.replace(p, top_k=6))),
    ("combined, top-k binds", lambda p: reference(SMALL, p, renormalize_before_top_p=False)),
    ("combined, min-p binds", lambda p: reference(SMALL, p, renormalize_before_top_p=False)),
    ("combined, min-p binds", lambda p: reference(SMALL, dataclasses.replace(p, temperature=1.0))),
])
def test_the_frequency_check_rejects_wrong_distributions(case: str, wrong: Callable[[SamplingParams], Reference]) -> None:
    """The check above has power: the same samples fail it against a wrong reference (by 1.4x - 6x)."""
    probs = wrong(SMALL_CASES[case]).probs
    freq = frequencies(small_samples(case), SMALL.numel())
    assert total_variation(freq, probs) > tv_bound(probs, SMALL_DRAWS)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(top_p=0.8), SamplingParams(top_k=3, min_p=0.05)])
def test_extreme_random_numbers_stay_inside_the_kept_set(params: SamplingParams, monkeypatch: pytest.MonkeyPatch) -> None:
    """u = 0 and u = its cap (1 - 2**-23) pick the first and last token the inverse CDF can reach:
    never one outside the kept set, nor a zero-probability (-inf) token, nor one out of range."""
    logits = SMALL.clone()
    masked = torch.tensor([0, 5, 23])  # the last vocabulary entry has probability 0
    logits[masked] = -math.inf
    finite = logits.clone()
    finite[masked] = torch.tensor([-1e4, -1e4 - 1, -1e4 - 2])  # probability 0 in float64 too, no ties
    ref = reference(finite, params)
    for u in (0.0, 1.0 - 2.0**-23):
        monkeypatch.setattr(sampler_module, "uniform", lambda key, position, u=u: u)
        token = int(sample_tokens(logits, params, 1)[0])
        assert token in ref.kept_ids and logits[token].isfinite()


# ---------------------------------------------------------------- 3: temperature -> 0


def clear_winner_logits() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 64, generator=g) * 3
    for r, winner in enumerate([7, 0, 63, 31]):
        logits[r, winner] = logits[r].max() + 0.5  # at temperature 1e-3 the runner-up is e^-500 as likely
    return logits


@pytest.mark.parametrize("temperature", [0.0, 1e-9, MIN_TEMPERATURE / 2, MIN_TEMPERATURE * 0.999])
@pytest.mark.parametrize("filters", [{}, {"top_p": 0.5}, {"top_k": 3, "min_p": 0.5}])
def test_temperatures_below_the_minimum_are_the_argmax(temperature: float, filters: dict[str, Any]) -> None:
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 50, generator=g)  # no clear winner: only an exact argmax passes
    params = SamplingParams(temperature=temperature, **filters)
    assert params.greedy
    draws = [Draw(r, params, KEY + p, p) for r in range(6) for p in range(20)]
    ids, usable, _ = SAMPLER.sample(logits, draws).host()
    assert all(usable)
    assert ids == [int(logits[d.row].argmax()) for d in draws]


@pytest.mark.parametrize("temperature", [1e-3, MIN_TEMPERATURE])
@pytest.mark.parametrize("filters", [{}, {"top_p": 0.9}, {"top_k": 5, "min_p": 0.01}])
def test_a_tiny_valid_temperature_picks_a_clear_winner(temperature: float, filters: dict[str, Any]) -> None:
    logits = clear_winner_logits()
    params = SamplingParams(temperature=temperature, **filters)
    assert not params.greedy
    draws = [Draw(r, params, KEY, p) for r in range(4) for p in range(200)]
    ids, usable, _ = SAMPLER.sample(logits, draws).host()
    assert all(usable)
    assert ids == [int(logits[d.row].argmax()) for d in draws]


# ---------------------------------------------------------------- 4: large vocabulary, both CPU paths


def large_row(kind: str) -> torch.Tensor:
    """A 5000-token logits row in scrambled vocabulary order.

    peaked: 10 head tokens (logits 10 .. 8.2) hold ~95% of the mass over a tail uniform in [-1, 1], so
        top-p 0.9 and top-k 100 close inside the first CANDIDATES tokens.
    flat: 10 head tokens (logits 4 .. 3.1) hold ~31%, 600 middle tokens (logits in [0, 0.5]) ~68% and
        4390 tail tokens (logits in [-6, -5.5]) ~1%, so the kept sets below (~510 and 610 tokens) run
        past the first candidates and the row takes the wider top-k.
    wide: 4500 tokens with logits in [0, 0.3] (within 0.74x of the most likely) over 500 at -5: min-p
        0.1 keeps the 4500, past every candidate width, so the row is sorted in full."""
    if kind == "wide":
        row = torch.cat([torch.linspace(0.0, 0.3, 4500), torch.linspace(-5.0, -4.9, 500)])
        return row[torch.randperm(LARGE_VOCAB, generator=torch.Generator().manual_seed(12))]
    head = 10.0 - 0.2 * torch.arange(10.0) if kind == "peaked" else 4.0 - 0.1 * torch.arange(10.0)
    rest = [torch.linspace(-1.0, 1.0, 4990)] if kind == "peaked" else \
        [torch.linspace(0.0, 0.5, 600), torch.linspace(-6.0, -5.5, 4390)]  # evenly spaced: no ties
    perm = torch.randperm(LARGE_VOCAB, generator=torch.Generator().manual_seed(11))
    return torch.cat([head, *rest])[perm]


LARGE_CASES = {  # name: (row kind, params, the widths the CPU path must try, in order)
    "peaked top-p": ("peaked", SamplingParams(top_p=0.9), [256]),
    "peaked top-k": ("peaked", SamplingParams(top_k=100, temperature=1.2), [256]),
    "flat top-p": ("flat", SamplingParams(top_p=0.9), [256, 4096]),  # nucleus of ~510 tokens
    "flat min-p": ("flat", SamplingParams(min_p=0.005), [256, 4096]),  # keeps the 610 head + middle tokens
    "wide min-p": ("wide", SamplingParams(min_p=0.1), [256, 4096, 5000]),  # 4500 kept: a full sort
}  # (an open-ended top-k takes the same branch as min-p; the mixed-batch test has one)


def rank_bins(ref: Reference) -> torch.Tensor:
    """Each token's summary bin: its rank for the 10 most likely, then ranks [10, CANDIDATES[0]),
    [CANDIDATES[0], kept) and outside the kept set (bins 10, 11, 12)."""
    rank = torch.empty_like(ref.order)
    rank[ref.order] = torch.arange(ref.order.numel())
    bins = rank.clamp(max=10)
    bins[rank >= CANDIDATES[0]] = 11
    bins[rank >= ref.kept] = 12
    return bins


@pytest.mark.parametrize("case", list(LARGE_CASES))
def test_large_vocabulary_matches_the_reference_on_both_paths(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    kind, params, path = LARGE_CASES[case]
    assert CANDIDATES == (256, 4096) and LARGE_VOCAB == 5000  # the cases are built for these widths
    falls_back = len(path) > 1
    logits = large_row(kind)
    ref = reference(logits, params)
    assert ref.margin > 1e-4  # far above float32 rounding of the cumulative mass
    assert (ref.kept > CANDIDATES[0]) == falls_back and (ref.kept > CANDIDATES[1]) == (len(path) > 2)

    widths: list[tuple[int, int]] = []  # (width, rows) of each pick: which path ran
    real_pick = sampler_module.pick

    def spy(scaled: torch.Tensor, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        widths.append((args[-1], scaled.shape[0]))
        return real_pick(scaled, *args)

    monkeypatch.setattr(sampler_module, "pick", spy)
    tokens = sample_tokens(logits, params, LARGE_DRAWS, chunk=1000)
    chunks = LARGE_DRAWS // 1000
    assert widths == [(w, 1000) for w in path] * chunks

    bins = rank_bins(ref)
    expected = torch.zeros(13, dtype=torch.float64).index_add_(0, bins, ref.probs)
    observed = torch.bincount(bins[tokens], minlength=13).double() / LARGE_DRAWS
    assert observed[12] == 0  # nothing outside the kept set
    if falls_back:
        assert expected[11] > 0.1  # a real share of the mass lies past the candidates
    assert total_variation(observed, expected) < tv_bound(expected, LARGE_DRAWS), (observed, expected)


def test_a_mixed_batch_gives_each_row_the_tokens_it_gets_alone() -> None:
    """One call with greedy, top-p (fallback), top-k, min-p (fallback), plain temperature and combined
    rows, in interleaved order, gives every draw the token of sampling its row alone with the same key
    and position."""
    rows = [
        (large_row("peaked"), SamplingParams(temperature=0)),
        (large_row("flat"), SamplingParams(top_p=0.9)),
        (large_row("peaked"), SamplingParams(top_k=100, temperature=1.2)),
        (large_row("flat"), SamplingParams(min_p=0.005)),
        (large_row("flat"), SamplingParams(temperature=0.8)),
        (large_row("peaked"), SamplingParams(temperature=1.5, top_p=0.95)),
        (large_row("flat"), SamplingParams(temperature=1.3, min_p=0.002, top_k=350, top_p=0.8)),
        (large_row("peaked") * 0.3, SamplingParams()),
    ]
    logits = torch.stack([r for r, _ in rows])
    positions = range(100, 130)
    draws = [Draw(r, params, KEY + 17 * r, p) for p in positions for r, (_, params) in enumerate(rows)]
    together, usable, _ = SAMPLER.sample(logits, draws).host()
    assert all(usable)
    for r, (row, params) in enumerate(rows):
        alone, _, _ = SAMPLER.sample(row[None], [Draw(0, params, KEY + 17 * r, p) for p in positions]).host()
        mine = [t for t, d in zip(together, draws) if d.row == r]
        assert mine == alone, f"row {r} ({params}) depends on what shares its batch"
        if r == 0:
            assert set(alone) == {int(row.argmax())}
        else:
            assert len(set(alone)) > 1  # really sampled


# ---------------------------------------------------------------- 5: reproducibility


def test_the_same_key_and_position_give_the_same_token() -> None:
    params = SamplingParams(top_p=0.95)
    first = sample_tokens(SMALL, params, 500)
    assert torch.equal(first, sample_tokens(SMALL, params, 500))
    # reversed order inside a batch, alongside draws of other keys, and a key beyond 64 bits reduced
    draws = [Draw(0, params, KEY, p) for p in reversed(range(500))] + [Draw(0, params, KEY + 1, p) for p in range(500)]
    ids, _, _ = SAMPLER.sample(SMALL[None], draws).host()
    assert ids[:500][::-1] == first.tolist()
    wrapped, _, _ = SAMPLER.sample(SMALL[None], [Draw(0, params, KEY + 2**64, p) for p in range(500)]).host()
    assert wrapped == first.tolist()


def test_different_positions_and_keys_give_different_draws() -> None:
    params = SamplingParams(temperature=1.5)  # close to uniform over a few tokens
    tokens = sample_tokens(SMALL, params, 1000)
    assert len(set(tokens.tolist())) >= 15
    repeats = int((tokens[1:] == tokens[:-1]).sum())
    assert repeats < 250  # independent draws repeat at ~sum(p_i^2) ~ 0.1 of the steps
    other_key = sample_tokens(SMALL, params, 1000, key=KEY + 1)
    assert int((tokens != other_key).sum()) > 700
    assert len({uniform(KEY, p) for p in range(10_000)}) == 10_000


# ---------------------------------------------------------------- 6: non-finite rows


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.7, top_p=0.8)],
                         ids=["unfiltered", "filtered"])
def test_non_finite_rows_are_unusable_and_leave_the_others_alone(params: SamplingParams) -> None:
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(5, 300, generator=g) * 2  # 300 > CANDIDATES[0]: the fallback can run too
    logits[1, 17] = math.nan
    logits[2, 250] = math.inf
    logits[3] = -math.inf
    logits[4, ::2] = -math.inf  # masked tokens: still usable, never drawn
    good = [0, 4]
    samplers = [params, SamplingParams(temperature=0), SamplingParams(top_k=4, logprobs=2)]
    draws = [Draw(r, s, KEY + r, p) for p in range(50) for r in range(5) for s in samplers]
    ids, usable, logprobs = SAMPLER.sample(logits, draws).host()
    for i, d in enumerate(draws):
        assert usable[i] == (d.row in good)
        if d.row not in good:
            assert ids[i] == 0
    assert all(ids[i] % 2 == 1 for i, d in enumerate(draws) if d.row == 4)
    # the good rows' tokens are those of a call without the bad rows
    clean = [Draw(good.index(d.row), d.params, d.key, d.position) for d in draws if d.row in good]
    clean_ids, clean_usable, clean_logprobs = SAMPLER.sample(logits[good], clean).host()
    assert all(clean_usable)
    assert [t for t, d in zip(ids, draws) if d.row in good] == clean_ids
    assert [v for i, v in sorted(logprobs.items()) if draws[i].row in good] == \
        [v for _, v in sorted(clean_logprobs.items())]


def test_an_all_minus_infinity_row_is_unusable_alone() -> None:
    logits = torch.full((1, 40), -math.inf)
    for params in [SamplingParams(), SamplingParams(temperature=0), SamplingParams(top_p=0.5, min_p=0.1)]:
        ids, usable, _ = SAMPLER.sample(logits, [Draw(0, params, KEY, 0)]).host()
        assert (ids, usable) == ([0], [False])


# ---------------------------------------------------------------- 7: logprobs


def test_logprobs_are_the_raw_log_softmax_with_each_draws_own_top() -> None:
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(3, 300, generator=g) * 3
    draws = [
        Draw(0, SamplingParams(temperature=0.5, top_k=4, logprobs=3), KEY, 0),
        Draw(1, SamplingParams(logprobs=0), KEY, 1),
        Draw(0, SamplingParams(), KEY, 2),  # no logprobs
        Draw(2, SamplingParams(temperature=0, logprobs=5), KEY, 3),
        Draw(1, SamplingParams(temperature=1.7, top_p=0.9, min_p=0.01, logprobs=20), KEY, 4),
        Draw(2, SamplingParams(temperature=0.3), KEY, 5),  # no logprobs
        Draw(0, SamplingParams(temperature=2.0, logprobs=1), KEY, 6),
    ]
    ids, usable, logprobs = SAMPLER.sample(logits, draws).host()
    assert all(usable)
    assert set(logprobs) == {i for i, d in enumerate(draws) if d.params.logprobs is not None}
    raw = torch.log_softmax(logits.double(), dim=-1)
    for i, lp in logprobs.items():
        d, k = draws[i], draws[i].params.logprobs
        assert k is not None
        assert lp.token_id == ids[i]
        assert lp.logprob == pytest.approx(float(raw[d.row, ids[i]]), abs=1e-5)
        assert len(lp.top) == k
        values, top_ids = raw[d.row].topk(k)
        assert [t for t, _ in lp.top] == top_ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-5)
        assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:]))
    assert logprobs[1].top == ()


# ---------------------------------------------------------------- 8: uniform


def test_uniform_stays_in_range_and_is_roughly_uniform() -> None:
    values = torch.tensor([uniform(key, p) for key in (0, 2**64 - 1) for p in range(50_000)], dtype=torch.float64)
    assert float(values.min()) >= 0.0 and float(values.max()) <= 1.0 - 2.0**-23
    assert abs(float(values.mean()) - 0.5) < 0.01
    deciles = torch.histc(values, bins=10, min=0.0, max=1.0) / values.numel()
    assert float((deciles - 0.1).abs().max()) < 0.01  # ~10 standard deviations of a bin's share


def test_uniform_is_capped_below_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sampler_module, "_mix64", lambda x: (1 << 64) - 1)  # the largest hash
    assert uniform(KEY, 0) == 1.0 - 2.0**-23
