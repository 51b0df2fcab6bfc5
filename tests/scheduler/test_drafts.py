"""The draft sources (the radix tree's continuation, a prediction, prompt lookup), how k adapts, and
the verification rule's distribution: exact speculative sampling for a point-mass draft, checked
against the softmax it must reproduce (total-variation bound) over thousands of keys."""

from __future__ import annotations

import itertools

import torch

from radixserve.cache.block_pool import BlockPool
from radixserve.cache.radix_tree import RadixTree
from radixserve.core import PENDING_TOKEN, Batch, Request, Sequence
from radixserve.engine.features import SamplingStep
from radixserve.engine.sampler import Sampler
from radixserve.engine.speculation import DraftVerifier
from radixserve.engine.stats import EngineStats
from radixserve.sampling_params import SamplingParams
from radixserve.scheduler.drafts import (
    MAX_COOLDOWN,
    MISS_LIMIT,
    PAYING_RATE,
    PREDICTION_RETRY,
    DraftProposer,
    from_prediction,
    prompt_lookup,
)
from radixserve.scheduler.step_results import Launch

_ids = itertools.count()


def seq_of(tokens: list[int], prompt: int, params: SamplingParams | None = None,
           prediction: tuple[int, ...] = ()) -> Sequence:
    req = Request(f"r{next(_ids)}", tokens[:prompt], params or SamplingParams(max_tokens=64), prediction_ids=prediction)
    seq = Sequence(req, 0, list(tokens), prompt)
    req.sequences.append(seq)
    return seq


def test_prompt_lookup_takes_the_longest_most_recent_ngram() -> None:
    assert prompt_lookup([1, 2, 3, 9, 9, 1, 2, 3, 7, 1, 2, 3], 4) == [7, 1, 2, 3]  # the later 1 2 3
    assert prompt_lookup([5, 6, 1, 2, 8, 4, 2], 3) == []  # a single token does not match
    assert prompt_lookup([5, 1, 2, 8, 4, 0, 1, 2], 2) == [8, 4]  # a bigram
    assert prompt_lookup([1, 2], 4) == []


def test_a_prediction_drafts_from_where_the_output_is_in_it() -> None:
    prediction = (10, 11, 12, 13, 14, 11, 12, 15, 16)
    assert from_prediction([], prediction, 0) == 0
    assert from_prediction([10], prediction, 0) == 1
    # "11 12" occurs twice: the first occurrence at or after where the output left the prediction
    assert from_prediction([3, 4, 11, 12], prediction, 0) == 3
    assert from_prediction([3, 4, 11, 12], prediction, 5) == 7
    assert from_prediction([10, 11, 12, 13, 14, 11, 12], prediction, 7) == 7
    assert from_prediction([3, 4, 11, 12], prediction, 9) == 7  # behind the cursor: the last occurrence
    assert from_prediction([10], prediction, 4) == 1  # the output's first token
    assert from_prediction([3, 10], prediction, 0) is None  # later, a single token is too weak a match
    assert from_prediction([99], prediction, 0) is None


def test_a_prediction_draft_moves_the_place_in_the_prediction_past_what_was_kept() -> None:
    drafts = DraftProposer(None, num_tokens=4, max_batch=8, max_seq_len=64)
    s = seq_of([9, 8, 7, 10], 3, prediction=(10, 11, 12, 13, 14, 15))
    draft = drafts.propose(s, budget=8)
    assert draft is not None and (draft.tokens, draft.source) == ([11, 12, 13, 14], "prediction")
    s.draft_source = draft.source
    drafts.verified(s, 4, 2)
    assert s.spec.prediction_at == 3


def test_the_tree_continues_a_cached_path_along_its_most_recent_branch() -> None:
    pool = BlockPool(32, 4)
    tree = RadixTree(pool)
    old, new = [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9]
    for path in (old, new):
        blocks = pool.allocate(2)
        assert blocks is not None
        tree.insert(path, blocks)
        pool.release(blocks)
    assert tree.continuation([1, 2], 3) == [3, 4, 9]  # `new` was used last
    tree.match([1, 2, 3, 4, 5, 6, 7, 8])  # now `old` is
    assert tree.continuation([1, 2], 10) == [3, 4, 5, 6, 7, 8]
    assert tree.continuation([1, 2, 3, 4, 5], 2) == [6, 7]  # ends inside an edge
    assert tree.continuation([1, 2, 7], 2) == []  # diverges
    assert tree.continuation(old, 2) == []  # nothing follows
    nodes = tree.num_nodes
    tree.continuation([1, 2, 3], 4)
    assert tree.num_nodes == nodes  # a query: no split


def test_proposals_try_the_tree_then_the_prediction_then_lookup_within_the_limits() -> None:
    pool = BlockPool(32, 4)
    tree = RadixTree(pool)
    blocks = pool.allocate(2)
    assert blocks is not None
    tree.insert([1, 2, 3, 4, 5, 6, 7, 8], blocks)
    drafts = DraftProposer(tree, num_tokens=4, max_batch=8, max_seq_len=64)
    draft = drafts.propose(seq_of([1, 2, 3], 2), budget=10)
    assert draft is not None and (draft.tokens, draft.source) == ([4, 5, 6, 7], "tree")
    draft = drafts.propose(seq_of([9, 2, 3], 2, prediction=(3, 30, 31)), budget=10)
    assert draft is not None and (draft.tokens, draft.source) == ([30, 31], "prediction")
    draft = drafts.propose(seq_of([1, 2, 3], 2, prediction=(3, 30, 31)), budget=10)  # before the tree
    assert draft is not None and draft.source == "prediction"
    draft = drafts.propose(seq_of([9, 4, 5, 6, 9, 4], 4), budget=10)
    assert draft is not None and (draft.tokens, draft.source) == ([5, 6, 9, 4], "lookup")
    # max_tokens 3, one generated: the draft and the token after it fit in the two left
    draft = drafts.propose(seq_of([1, 2, 3], 2, SamplingParams(max_tokens=3)), budget=10)
    assert draft is not None and draft.tokens == [4]
    assert drafts.propose(seq_of([1, 2, 3], 2), budget=2) is not None
    penalised = seq_of([1, 2, 3], 2, SamplingParams(max_tokens=64, presence_penalty=1.0))
    assert drafts.eligible(penalised)  # no veto yet: the engine hands its features' (tests/engine/test_logits_features.py)
    drafts.forbid_drafts([lambda params: params.has_penalties])
    assert not drafts.eligible(penalised) and drafts.eligible(seq_of([1, 2, 3], 2))
    assert not DraftProposer(tree, 0, 8, 64).eligible(seq_of([1, 2, 3], 2))


def test_k_adapts_to_what_verifications_keep() -> None:
    drafts = DraftProposer(None, num_tokens=8, max_batch=8, max_seq_len=64)
    seq = seq_of([1, 2, 3, 1, 2, 3, 1, 2], 2)
    seq.spec.k = 8
    drafts.verified(seq, 8, 3)
    assert seq.spec.k == 4 and seq.spec.hot
    drafts.verified(seq, 4, 4)
    assert seq.spec.k == 6
    for _ in range(MISS_LIMIT):
        drafts.verified(seq, 1, 0)
    assert seq.spec.k == 1 and not seq.spec.hot and seq.spec.cooldown == min(MAX_COOLDOWN, 2 ** MISS_LIMIT)
    for _ in range(seq.spec.cooldown):
        assert drafts.propose(seq, 8) is None  # cooling down
    assert drafts.propose(seq, 8) is not None


def test_verification_samples_exactly_the_distribution_without_drafts() -> None:
    """Row 0's distribution, with draft d1 its second most likely token: the first committed token is
    distributed as p0 (d1 kept with probability p0(d1)), and, where d1 was kept, the second as p1."""
    vocab, draws_n = 8, 6000
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, vocab, generator=g) * 1.5  # the rows of the last token, d1 and d2
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=8)
    probs = filtered_probs(logits, params)
    d1, d2 = int(probs[0].argsort(descending=True)[1]), int(probs[1].argmax())
    sampler = Sampler(torch.device("cpu"))
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    launch = Launch()
    seqs = [seq_of([5, 6, 7, d1, d2, -1], 3, params) for _ in range(draws_n)]
    for i, seq in enumerate(seqs):
        seq.noise_key = i * 7919 + 13
        seq.num_drafts, seq.draft_source = 2, "tree"
        launch.owners.append(seq)
        launch.rows.append(0)
        launch.positions.append(5)
        launch.drafts.append(2)
    step, verifier = SamplingStep(Batch(), lambda seq: None), DraftVerifier(EngineStats())
    step.launched(launch, {})
    verifier.contribute(step)  # each draw's two extra rows, after the launch's draws
    step.sampled = sampler.sample(logits, step.draws)
    step.to_host()
    verifier.resolve(step)
    assert verifier.totals.spec_verify_draws == draws_n
    for commit in step.commits:
        first[commit.tokens[0]] += 1
        if len(commit.tokens) > 1:
            second[commit.tokens[1]] += 1
    kept = first[d1].item()
    assert 0.5 * (first / draws_n - probs[0]).abs().sum() < 0.03
    assert 0.5 * (second / kept - probs[1]).abs().sum() < 0.05
    assert abs(kept / draws_n - probs[0, d1].item()) < 0.02
    assert all(c.drafts == 2 and (len(c.tokens) == 1 or c.tokens[0] == d1) for c in step.commits)


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampler's distribution: temperature, then top-p over the sorted probabilities."""
    probs = torch.softmax(logits / params.temperature, dim=-1)
    out = torch.zeros_like(probs)
    for r in range(probs.shape[0]):
        values, order = probs[r].sort(descending=True)
        before = values.cumsum(0) - values
        keep = before < params.top_p
        out[r, order[keep]] = values[keep] / values[keep].sum()
    return out


def test_with_overlap_a_sequence_waits_for_its_token_only_where_drafts_are_likely() -> None:
    drafts = DraftProposer(None, num_tokens=4, max_batch=8, max_seq_len=64)
    plain = seq_of([9, 8, 7, 6], 3)
    assert drafts.waits_for_token(plain)  # its first decode: try
    assert drafts.propose(plain, 4) is None  # nothing to draft ...
    assert not any(drafts.waits_for_token(plain) for _ in range(20))  # ... so it decodes on
    predicted = seq_of([9, 8, 7, 6], 3, prediction=(1, 2, 3))
    assert drafts.propose(predicted, 4) is None
    waits = [drafts.waits_for_token(predicted) for _ in range(2 * PREDICTION_RETRY)]
    assert waits.count(True) == 2 and waits[PREDICTION_RETRY - 1]  # every PREDICTION_RETRY steps
    predicted.spec.cooldown = 3
    assert not any(drafts.waits_for_token(predicted) for _ in range(3)) and predicted.spec.cooldown == 0


def prompt_rows(n: int):
    """A step with n rows of prompt, as the scheduler counts them (never past the limit asked)."""
    return lambda limit: min(n, limit)


def test_the_rows_knee_holds_until_recent_drafts_are_mostly_kept() -> None:
    drafts = DraftProposer(None, num_tokens=4, max_batch=8, max_seq_len=64, max_rows=10)
    assert drafts.room(3, prompt_rows(0)) == 7 and drafts.room(3, prompt_rows(5)) == 2
    assert drafts.room(3, prompt_rows(20)) == 0
    assert drafts.room(9, prompt_rows(0)) == 0  # the batch cap
    seq = seq_of([1, 2, 3, 1, 2, 3, 1, 2], 2)
    seq.spec.k = 4
    for _ in range(40):
        drafts.verified(seq, 4, 1)  # a quarter kept: the knee holds
    assert abs(drafts.kept_rate - 0.25) < 0.01 and drafts.room(3, prompt_rows(5)) == 2
    while drafts.kept_rate < PAYING_RATE:
        drafts.verified(seq, 4, 4)
    assert drafts.room(3, prompt_rows(20)) == 3 * 4  # past the knee: every decoding sequence its full k
    assert drafts.room(9, prompt_rows(0)) == 0
    assert DraftProposer(None, 0, 8, 64, max_rows=10).room(1, prompt_rows(0)) == 0


def test_without_a_knee_the_prompt_rows_are_never_counted() -> None:
    def counted(limit: int) -> int:
        raise AssertionError("prompt rows counted without a knee")

    assert DraftProposer(None, num_tokens=4, max_batch=8, max_seq_len=64).room(3, counted) == 12


def test_a_steps_room_is_shared_a_draft_token_at_a_time_most_tokens_left_first() -> None:
    """Sequences started together finish with the slowest: the room goes round one token at a time,
    to the sequences with the most tokens left first, never past a sequence's k or its max_tokens."""
    drafts = DraftProposer(None, num_tokens=4, max_batch=8, max_seq_len=256)
    # max_tokens 64 after a 2-token prompt: 60, 50, 40 and 30 tokens left
    behind, second, third, ahead = seqs = [seq_of(list(range(2 + out)), 2) for out in (4, 14, 24, 34)]
    want = {behind: 2, second: 2, third: 1, ahead: 1}
    assert drafts.shares(seqs, 6) == want
    assert drafts.shares(list(reversed(seqs)), 6) == want  # the running order does not matter
    assert drafts.shares(seqs, 2) == {behind: 1, second: 1}
    assert drafts.shares(seqs, 100) == dict.fromkeys(seqs, 4)  # room for every k
    ahead.spec.k = 1
    assert drafts.shares(seqs, 11) == {behind: 4, second: 3, third: 3, ahead: 1}
    last = seq_of(list(range(2 + 61)), 2)  # 3 tokens left: 2 drafts and the token sampled after them
    assert drafts.shares([last], 8) == {last: 2}


def test_a_share_skips_sequences_that_cannot_draft_now() -> None:
    """Cooling down (counted down, as a proposal would), waiting for its pending token, or with
    forks still to copy its tokens: no share, and the room goes to the others; nor one whose
    max_tokens leaves no room for a draft and the token after it."""
    drafts = DraftProposer(None, num_tokens=4, max_batch=8, max_seq_len=256)
    cooling, pending, forking, free = seqs = [seq_of(list(range(10)), 2) for _ in range(4)]
    cooling.spec.cooldown = pending.spec.cooldown = 2
    pending.token_ids.append(PENDING_TOKEN)
    forking.pending_forks = 1
    assert drafts.shares(seqs, 3) == {free: 3}
    # a pending token's wait counts its cool-down down (`waits_for_token`), not the shares
    assert cooling.spec.cooldown == 1 and pending.spec.cooldown == 2
    assert drafts.shares(seqs, 8) == {free: 4}
    assert drafts.shares(seqs, 8) == {cooling: 4, free: 4}  # its cool-down is over
    assert DraftProposer(None, num_tokens=4, max_batch=8, max_seq_len=256,
                         ).shares([seq_of([1, 2, 3], 2, SamplingParams(max_tokens=1))], 8) == {}
