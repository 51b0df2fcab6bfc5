"""Pending tokens: every rule of overlap scheduling about a sampled id the host does not know yet.

With overlap, the engine launches step N before step N-1's sampled ids reach the host. Each sampling
row of a launched step leaves a slot, `PENDING_TOKEN`, at the end of its sequence's `token_ids`; the
runner reads that token's id from the previous step's sampled ids on the device, so no host round
trip sits between two steps. The scheduler's commit fills the slot once the id is known (through
`step_results.append_tokens`, the one write path for generated tokens).

Invariants (the scheduler is the only caller of these functions):
- slots are only at the end of `token_ids`: at most two per sequence, the one being committed and the
  one launched meanwhile; a slot is filled at the position its launch returned;
- a slot counts as computed (`num_computed`) once the step that reads it is launched, but nothing
  pending is ever put into the tree: caching stops at `num_resolved` (see `SequenceCache`), and a
  slot is filled before the blocks around it are cached;
- a launch whose slot reaches a length limit marks the sequence `final_token_pending`: it is not
  scheduled again and ends when the slot is committed (the length is known at launch, the stop only
  at commit);
- a sequence that finishes (a stop, an abort, an error) drops its slots first: the device's ids for
  them are never read, and what it caches is only tokens known on the host;
- a sequence preempted with a slot pending is not admitted again until the slot is committed;
- a verifying step's drafts sit just before its slot; the sequence is not scheduled again until that
  slot is committed (the commit decides how many of them stay, so later positions are unknown);
- a commit that `replaces_in_flight` (a grammar's forced tokens) voids the later slot: its draw is
  ignored when its step commits, and the sequence may be scheduled again at once.
"""

from __future__ import annotations

from radixserve.core import PENDING_TOKEN, Sequence


def add_slots(seqs: list[Sequence], max_seq_len: int) -> list[int]:
    """A launched step samples the next token of each of `seqs` (distinct): hold their places; returns
    the slots' positions, in order. (One call per step, not per sequence: it runs for every draw.)"""
    positions = []
    for seq in seqs:
        tokens = seq.token_ids
        tokens.append(PENDING_TOKEN)
        size = len(tokens)
        # the length limits, counting this slot and one still pending before it
        seq.final_token_pending = size >= seq.length_limit or size >= max_seq_len
        positions.append(size - 1)
    return positions


def drop_slots(seq: Sequence) -> None:
    """Forget the ids still on the device for `seq` (it finished): they will never be read; drafts
    being verified go with them."""
    del seq.token_ids[seq.num_resolved:]
    seq.num_drafts = 0


def void_later(seq: Sequence, position: int) -> list[int]:
    """The slot at `position` takes several tokens while a later step of `seq` is in flight: drop the
    later slots (their draws are void) and return their positions. The step that drew them computed
    the K/V up to `position`, which `num_computed` already counts."""
    later = list(range(position + 1, len(seq.token_ids)))
    assert all(seq.token_ids[p] == PENDING_TOKEN for p in later), "only pending slots follow a slot"
    del seq.token_ids[position + 1:]
    seq.final_token_pending = False  # the limit a void slot reached is checked again as tokens commit
    return later


def split_running(running: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
    """The running sequences that may decode (one token to compute, and no length limit reached by a
    launch still in flight) and those that prefill (more than one), each in running order."""
    decodes, prefills = [], []
    for seq in running:
        left = len(seq.token_ids) - seq.num_computed
        if left == 1:
            if not seq.final_token_pending and not seq.num_drafts:  # (drafts: a verification in flight)
                decodes.append(seq)
        elif left > 1:
            prefills.append(seq)
    return decodes, prefills


def may_admit(seq: Sequence) -> bool:
    """A waiting sequence whose last token is still on the device must wait for its commit."""
    return not seq.has_pending_token
