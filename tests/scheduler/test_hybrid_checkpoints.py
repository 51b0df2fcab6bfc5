"""The scheduler's recurrent-state slots and checkpoints (hybrid models), against a ghost model: each
slot's "state" is the exact token sequence it has consumed. Every step the ghost runs the batch's
state copies in order, then checks that each item's slot holds exactly its sequence's tokens before
the item (or that the item starts at position 0), and consumes the item's tokens. So a checkpoint
restored at a position other than its own, a state written at an unaligned offset by a batched
prefill, a copy that runs after the working state moved on, a fork sharing a slot, or a rejected draft
left in the state all fail here. A hypothesis state machine drives random requests sharing prefixes,
aborts, forks, drafts verified with random acceptance, a small block pool (preemption, eviction) and
few state slots (checkpoint eviction, waiting for a slot), under each checkpoint policy, with
`check_integrity()` after every step and nothing leaked at the end."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from test_step_commit import script_drafts

from radixserve.cache.block_pool import BlockPool
from radixserve.cache.radix_tree import RadixTree
from radixserve.config import STATE_CHECKPOINT_POLICIES, STATE_EVICTIONS, EngineConfig
from radixserve.core import Batch, CopyKind, Request, Sequence
from radixserve.sampling_params import SamplingParams
from radixserve.scheduler.scheduler import Scheduler
from radixserve.scheduler.step_results import TokenCommit

BLOCK = 4
_orders = itertools.count()


def make(num_blocks: int = 64, slots: int = 8, max_num_seqs: int = 4, drafts: int = 0,
         policy: str = "branches", eviction: str = "lru", lookahead: int = 64) -> Scheduler:
    config = EngineConfig(block_size=BLOCK, max_num_seqs=max_num_seqs, max_num_batched_tokens=16,
                          num_blocks=num_blocks, num_speculative_tokens=drafts, state_checkpoints=policy,
                          state_eviction=eviction, eviction_lookahead=lookahead)
    pool, states = BlockPool(num_blocks, BLOCK), BlockPool(slots, 1)
    return Scheduler(config, pool, RadixTree(pool, None, states), states=states)


def add(sched: Scheduler, prompt: list[int], max_tokens: int = 8, n: int = 1) -> Request:
    order = next(_orders)
    req = Request(f"r{order}", prompt, SamplingParams(max_tokens=max_tokens, n=n), order=order)
    sched.add(Sequence(req, 0, list(prompt), len(prompt), pending_forks=n - 1))
    return req


class Ghost:
    """What each state slot would hold: the tokens consumed into it."""

    def __init__(self) -> None:
        self.slots: dict[int, tuple[int, ...]] = {}

    def run(self, sched: Scheduler, batch: Batch) -> None:
        for copy in batch.copies:
            if copy.kind is CopyKind.STATE:
                self.slots[copy.dst] = self.slots.get(copy.src, ("garbage",))  # type: ignore[assignment]
        for node in sched.tree.nodes() if sched.tree is not None else ():  # every checkpoint: exactly its path's state
            if node.state >= 0:
                assert self.slots.get(node.state) == RadixTree.path_tokens(node), f"checkpoint of node {node.id}"
        for item in batch.items:
            seq, start, n = item.seq, item.start, item.num_tokens
            before = () if start == 0 else self.slots.get(seq.state_slot)
            assert before == tuple(seq.token_ids[:start]), \
                f"sequence {seq.seq_id} resumes at {start} from a state of {None if before is None else len(before)}"
            self.slots[seq.state_slot] = tuple(seq.token_ids[:start + n])


def step(sched: Scheduler, ghost: Ghost, tokens: list[int], stop: int | None = None,
         keep: list[int] | None = None) -> None:
    """One step; a verifying draw keeps keep[i] of its drafts (cycled; all of them without `keep`)."""
    batch = sched.schedule()
    ghost.run(sched, batch)
    launch = sched.launched(batch, (), lambda r, i: i)
    sched.check_integrity()
    picks, kept = itertools.cycle(tokens), itertools.cycle(keep or [1 << 30])
    commits = []
    for seq, position, k in zip(launch.owners, launch.positions, launch.drafts):
        drafts = seq.token_ids[position - k:position]
        commits.append(TokenCommit((*drafts[:min(k, next(kept))], next(picks)), drafts=k))
    sched.commit(launch, commits, (), lambda s, t: stop is not None and t == stop and s.num_generated > 1)
    sched.check_integrity()


def drain(sched: Scheduler, ghost: Ghost, limit: int = 200) -> None:
    for _ in range(limit):
        if not sched.has_work():
            return
        step(sched, ghost, [7])
    raise AssertionError("the scheduler did not finish its work")


def test_a_multi_turn_conversation_resumes_from_its_reply_end() -> None:
    sched, ghost = make(), Ghost()
    first = add(sched, [1, 2, 3, 4, 5, 6], max_tokens=5)
    drain(sched, ghost)
    turn2 = first.sequences[0].token_ids + [9, 9]
    req = add(sched, turn2, max_tokens=3)
    drain(sched, ghost)
    # the first reply's last token was sampled, never consumed: the checkpoint ends just before it
    assert req.cached_tokens == len(first.sequences[0].token_ids) - 1
    assert sched.cache.recomputed_state_tokens == 0


def test_with_no_reuse_the_cache_changes_nothing_a_step_computes() -> None:
    """Prompts that share no prefix, arriving while others run: with the cache on, every step computes the
    same items as with it off (no prefill is cut at a branch point, nothing waits for a checkpoint), and
    the cache adds no state copy (a finished sequence's own slot becomes its checkpoint). So the cache
    costs a workload without reuse only its bookkeeping."""
    def run(cache: bool) -> tuple[list[list[tuple[int, int, int]]], int]:
        config = EngineConfig(block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=16, num_blocks=64,
                              num_speculative_tokens=0)
        pool, states = BlockPool(64, BLOCK), BlockPool(8, 1)
        sched = Scheduler(config, pool, RadixTree(pool, None, states) if cache else None, states=states)
        ghost, steps, copies, first = Ghost(), [], 0, None

        def one_step() -> None:
            nonlocal copies
            batch = sched.schedule()
            steps.append([(item.seq.request.order - first, item.start, item.num_tokens) for item in batch.items])
            copies += sum(copy.kind is CopyKind.STATE for copy in batch.copies)
            ghost.run(sched, batch)
            launch = sched.launched(batch, (), lambda r, i: i)
            sched.commit(launch, [TokenCommit((7,)) for _ in launch.owners], (), lambda s, t: False)
            sched.check_integrity()

        for i in range(8):  # distinct first tokens; the next request arrives two steps later, while others run
            request = add(sched, [100 + i] + [i % 5 + 1] * (3 + 4 * i), max_tokens=3 + i % 4)
            first = request.order if first is None else first
            for _ in range(2):
                if sched.has_work():
                    one_step()
        for _ in range(200):
            if not sched.has_work():
                break
            one_step()
        assert not sched.has_work()
        return steps, copies

    with_cache, copies = run(True)
    without, _ = run(False)
    assert with_cache == without and copies == 0


def test_a_shared_prefix_is_checkpointed_where_a_second_prompt_leaves_it() -> None:
    sched, ghost = make(), Ghost()
    shared = [1, 2, 3, 4, 5, 6, 7]
    add(sched, shared + [8, 8, 8], max_tokens=2)
    drain(sched, ghost)
    second = add(sched, shared + [9, 9], max_tokens=2)
    drain(sched, ghost)
    assert second.cached_tokens == 0  # no state at the branch point yet: it stops there to take one
    assert sched.cache.recomputed_state_tokens == len(shared)
    third = add(sched, shared + [5, 5, 5], max_tokens=2)
    drain(sched, ghost)
    assert third.cached_tokens == len(shared)


def test_prompts_arriving_together_share_their_prefix_through_a_checkpoint_the_first_takes() -> None:
    sched, ghost = make(), Ghost()
    shared = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    first, second = add(sched, shared + [8, 8], max_tokens=2), add(sched, shared + [9, 9], max_tokens=2)
    drain(sched, ghost)
    assert first.cached_tokens == 0 and second.cached_tokens == len(shared)  # it waited for the first's checkpoint
    assert sched.cache.recomputed_state_tokens == 0


def test_request_ends_only_checkpoints_no_branch_point() -> None:
    sched, ghost = make(policy="request-ends"), Ghost()
    shared = [1, 2, 3, 4, 5, 6, 7]
    add(sched, shared + [8, 8, 8], max_tokens=2)
    drain(sched, ghost)
    second = add(sched, shared + [9, 9], max_tokens=2)
    drain(sched, ghost)
    third = add(sched, shared + [5, 5, 5], max_tokens=2)
    together = [add(sched, shared + [k, k], max_tokens=2) for k in (6, 7)]
    drain(sched, ghost)
    assert [r.cached_tokens for r in (second, third, *together)] == [0, 0, 0, 0]
    assert sched.cache.recomputed_state_tokens == 4 * len(shared)
    assert sched.cache.checkpoints_taken == 5  # one per request end


def test_what_a_hit_cannot_resume_is_counted_once_however_often_admission_is_tried() -> None:
    sched, ghost = make(num_blocks=8, policy="request-ends"), Ghost()
    shared = [1, 2, 3, 4, 5, 6, 7]
    add(sched, shared + [8], max_tokens=2)  # cached, with its only checkpoint past `shared`
    drain(sched, ghost)
    add(sched, [9] * 9, max_tokens=12)  # its growth holds back the next admission for a while
    step(sched, ghost, [7])
    second = add(sched, shared + [5, 5], max_tokens=2)
    drain(sched, ghost)
    # each try took the prefix, found no checkpoint in it and gave it back; one admission computed it again
    assert sched.admission_blocked["watermark"] > 1 and second.cached_tokens == 0
    assert sched.cache.recomputed_state_tokens == len(shared)


def test_every_block_checkpoints_each_block_boundary_of_a_prompt() -> None:
    sched, ghost = make(policy="every-block"), Ghost()
    first = add(sched, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], max_tokens=2)
    drain(sched, ghost)
    assert sched.tree is not None
    ends = sorted(n.end for n in sched.tree.nodes() if n.state >= 0)
    assert ends == [4, 8, len(first.sequences[0].token_ids) - 1]  # two boundaries and the reply's end
    second = add(sched, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0], max_tokens=2)
    drain(sched, ghost)
    assert second.cached_tokens == 8 and sched.cache.recomputed_state_tokens == 2


def test_saved_compute_eviction_keeps_a_long_prefix_over_a_recent_short_step() -> None:
    # three slots, one sequence at a time: a branch point 8 tokens in with two reply ends below it,
    # then two unrelated prompts whose own checkpoints need slots
    hits = {}
    for eviction in STATE_EVICTIONS:
        sched, ghost = make(slots=3, max_num_seqs=1, eviction=eviction), Ghost()
        shared = [1, 2, 3, 4, 5, 6, 7, 8]
        for prompt in (shared + [9, 9], shared + [3, 3], [5, 5, 5, 5], [6, 6, 6, 6, 6, 6]):
            add(sched, prompt, max_tokens=2)
            drain(sched, ghost)
        hits[eviction] = add(sched, shared + [7, 7], max_tokens=2)
        drain(sched, ghost)
    # lru dropped the branch point, the least recently used; saved-compute checkpoints a few tokens below it
    assert hits["lru"].cached_tokens == 0 and hits["saved-compute"].cached_tokens == 8


@pytest.mark.parametrize("lookahead", [0, 64])
@pytest.mark.parametrize("eviction", STATE_EVICTIONS)
def test_a_checkpoint_a_waiting_sequence_resumes_from_goes_last(eviction: str, lookahead: int) -> None:
    # three slots, one sequence at a time: conversations a and b leave checkpoints, c one more; d, a fresh
    # prompt, then needs a slot while a's next turn waits behind it to resume from a's, the oldest
    sched, ghost = make(slots=3, max_num_seqs=1, eviction=eviction, lookahead=lookahead), Ghost()
    for prompt in ([1, 2, 3, 4, 5, 6], [2, 2, 2, 2, 2], [3, 3, 3, 3, 3, 3, 3]):
        add(sched, prompt, max_tokens=2)
        drain(sched, ghost)
    add(sched, [4, 4, 4, 4], max_tokens=2)
    turn = add(sched, [1, 2, 3, 4, 5, 6, 7, 7, 9, 9], max_tokens=2)
    drain(sched, ghost)
    # lookahead 0: d's slot is the checkpoint the turn was to resume from (the least recently used, and
    # saved-compute's lowest utility); else the turn resumes at its reply's end
    assert turn.cached_tokens == (7 if lookahead else 0)
    assert sched.tree is not None and sched.tree.checkpoints_evicted == (2 if lookahead else 3)


def test_with_one_slot_per_running_sequence_checkpoints_are_evicted_and_work_waits() -> None:
    sched, ghost = make(slots=2, max_num_seqs=4), Ghost()
    for k in range(4):
        add(sched, [1, 2, 3, k + 4, 5], max_tokens=4)
    drain(sched, ghost)
    assert sched.tree is not None and sched.tree.checkpoints_evicted > 0
    assert sched.leaked_blocks() == 0


def test_a_fork_without_a_state_slot_waits_and_computes_its_prompt() -> None:
    sched, ghost = make(slots=1, max_num_seqs=1), Ghost()
    req = add(sched, [1, 2, 3, 4, 5], max_tokens=3, n=2)
    drain(sched, ghost)
    assert len(req.sequences) == 2 and all(s.num_generated == 3 for s in req.sequences)


def test_rejected_drafts_put_the_state_back_and_the_kept_tokens_are_computed_again() -> None:
    sched, ghost = make(drafts=4), Ghost()
    req = add(sched, [1, 2, 3, 4, 5], max_tokens=12)
    seq = req.sequences[0]
    for _ in range(3):
        step(sched, ghost, [7])
    script_drafts(sched, {seq.seq_id: [8, 9, 10]})
    before = seq.num_computed
    step(sched, ghost, [6], keep=[1])  # one draft kept, two rejected
    assert seq.num_computed == before  # back to before the verification: its state is there again
    assert seq.state_backup == -1
    drain(sched, ghost)
    assert seq.token_ids[before + 1:before + 3] == [8, 6]


def test_a_prompt_matching_unverified_drafts_does_not_cut_their_verification() -> None:
    """A prompt equal to a running sequence's tokens with its drafts is no branch of a prefill:
    the drafts are unverified, and a verifying item is never cut short (once a hypothesis find)."""
    sched, ghost, proposals = make(num_blocks=24, slots=5, drafts=4), Ghost(), {}
    script_drafts(sched, proposals)
    verifier = add(sched, [1, 1], max_tokens=5).sequences[0]  # room for its token, 3 drafts and the one after
    step(sched, ghost, [1])
    proposals[verifier.seq_id] = [1, 1, 1]
    add(sched, [1] * 6, max_tokens=1)
    planned = []
    schedule = sched.schedule
    sched.schedule = lambda: planned.append(schedule()) or planned[-1]  # type: ignore[method-assign]
    step(sched, ghost, [7], keep=[1])  # (the ghost and check_integrity see the step too)
    first = planned[0].items[0]
    assert (first.seq, first.num_tokens) == (verifier, 4)  # its token and all 3 drafts
    drain(sched, ghost)


class HybridMachine(RuleBasedStateMachine):
    """Random requests sharing prefixes, aborts, forks, drafts verified with random acceptance, a
    small block pool and few state slots; the ghost checks every state every step."""

    def __init__(self) -> None:
        super().__init__()
        self.ghost = Ghost()
        self.proposals: dict[int, list[int]] = {}

    @initialize(policy=st.sampled_from(STATE_CHECKPOINT_POLICIES), eviction=st.sampled_from(STATE_EVICTIONS))
    def start(self, policy: str, eviction: str) -> None:
        self.sched = make(num_blocks=24, slots=5, drafts=4, policy=policy, eviction=eviction)
        script_drafts(self.sched, self.proposals)

    @rule(prompt=st.lists(st.integers(1, 3), min_size=1, max_size=14), max_tokens=st.integers(1, 8),
          n=st.integers(1, 2))
    def arrive(self, prompt: list[int], max_tokens: int, n: int) -> None:
        if len(self.sched.waiting) + len(self.sched.running) < 6:
            add(self.sched, prompt, max_tokens, n)

    @precondition(lambda self: self.sched.running)
    @rule(which=st.integers(0, 7))
    def abort(self, which: int) -> None:
        self.sched.end(self.sched.running[which % len(self.sched.running)].request, "abort")

    @precondition(lambda self: self.sched.running)
    @rule(which=st.integers(0, 7), drafts=st.lists(st.integers(1, 3), min_size=1, max_size=4))
    def draft(self, which: int, drafts: list[int]) -> None:
        self.proposals[self.sched.running[which % len(self.sched.running)].seq_id] = drafts

    @precondition(lambda self: self.sched.has_work())
    @rule(tokens=st.lists(st.integers(1, 3), min_size=1, max_size=4), stop=st.sampled_from([None, 1, 2]),
          keep=st.lists(st.integers(0, 4), min_size=1, max_size=3))
    def step(self, tokens: list[int], stop: int | None, keep: list[int]) -> None:
        step(self.sched, self.ghost, tokens, stop, keep)

    @invariant()
    def integrity(self) -> None:
        self.sched.check_integrity()

    def teardown(self) -> None:
        for seq in list(self.sched.live_sequences()):
            self.sched.finish(seq, "abort")
        assert self.sched.leaked_blocks() == 0
        assert self.sched.states is not None and self.sched.tree is not None
        assert self.sched.states.num_free + self.sched.tree.num_checkpoints == self.sched.states.num_blocks


TestHybridMachine = HybridMachine.TestCase
TestHybridMachine.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
