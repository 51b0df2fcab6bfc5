"""Where a hybrid model's prefix cache checkpoints recurrent states: the one place that decides.

A checkpoint is the recurrent state after exactly the tokens of a radix node; a hit resumes only from
one (docs/hybrid_cache.md). Three policies, chosen by `--state-checkpoints`:
- `branches` (the default): at the end of every released sequence (a reply, a preemption, an abort)
  and at branch points, where a new prompt leaves a cached path or a running prefill's prompt;
  those are where the next hit is likely to end.
- `request-ends`: at the end of every released sequence only (SGLang's default for hybrids).
- `every-block`: at the end of every released sequence and at every block boundary of a prompt,
  the prefill stopping at each (vLLM's "align" mode keeps a state per block; it computes them in one
  kernel pass, this baseline runs a forward per block, so only its hit rate and state memory compare).

Which checkpoint goes when the slots run out (`victim`), chosen by `--state-eviction`:
- `lru`: the least recently used, by when it was taken or last resumed from
  (`RadixTree.checkpoints_by_age`).
- `saved-compute` (after Marconi): the lowest utility, its recency plus the prefill it saves. Both are
  normalised to [0, 1] over the checkpoints: recency by rank from least to most recently used, the
  saving as the tokens from the nearest checkpoint above it on its path to its end (what a hit there
  would recompute without it; all checkpoints cost one slot, so this is compute saved per byte).
  A long prefix's checkpoint (a system prompt's branch point) outlives a recently used short step.

Under either, a checkpoint that a waiting sequence will resume from goes only when every other is
such a one, the one resumed from last first (cache/next_reads.py).

Invariant: a policy only chooses positions and victims; every checkpoint is taken where a sequence's
working state is exactly the state after the node's tokens (at a chunk's end or at release), so no
policy can attach a state to a position other than its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.cache.next_reads import NextReads
from radixserve.cache.radix_tree import RadixNode, RadixTree
from radixserve.config import STATE_CHECKPOINT_POLICIES as CHECKPOINT_POLICIES
from radixserve.config import STATE_EVICTIONS


@dataclass(frozen=True)
class CheckpointPolicy:
    kind: str = "branches"
    interval: int = 16  # every-block: tokens between checkpoints (the KV block size)
    eviction: str = "lru"

    def __post_init__(self) -> None:
        if self.kind not in CHECKPOINT_POLICIES:
            raise ValueError(f"state checkpoint policy {self.kind!r}; choose one of {', '.join(CHECKPOINT_POLICIES)}")
        if self.eviction not in STATE_EVICTIONS:
            raise ValueError(f"state eviction {self.eviction!r}; choose one of {', '.join(STATE_EVICTIONS)}")
        if self.interval < 1:
            raise ValueError(f"checkpoint interval must be >= 1, got {self.interval}")

    @property
    def at_branches(self) -> bool:
        """Stop prefills where a prompt leaves a cached path or a running prefill, and checkpoint there."""
        return self.kind == "branches"

    def next_stop(self, computed: int, planned: int, prompt_len: int) -> int:
        """Where a prefill that has computed `computed` tokens stops next to checkpoint, given the
        branch point it plans to (`planned`, -1 for none); -1 for nowhere up to its prompt's end."""
        stops = [planned] if planned > computed else []
        if self.kind == "every-block":
            boundary = (computed // self.interval + 1) * self.interval
            if boundary < prompt_len:
                stops.append(boundary)
        return min(stops, default=-1)

    def victim(self, tree: RadixTree, keep: RadixNode | None = None, reads: NextReads | None = None) -> RadixNode | None:
        """The checkpoint to drop for a slot, never `keep`'s (the one a sequence is about to resume
        from); None if there is no other. A checkpoint a waiting sequence will resume from (`reads`)
        goes only when no other can, the one resumed from last first. A query."""
        aged = [node for node in tree.checkpoints_by_age() if node is not keep]
        resumed: dict[int, int] = {}  # checkpoint node id -> the soonest waiting sequence resuming there
        for index, match in enumerate(reads.matches if reads is not None else []):
            node = tree.checkpoint_on(match.path, match.length)
            if node is not None:
                resumed.setdefault(node.id, index)
        unread = [node for node in aged if node.id not in resumed]
        if not unread and aged:
            return max(aged, key=lambda node: resumed[node.id])
        aged = unread
        if self.eviction == "lru" or len(aged) < 2:
            return aged[0] if aged else None
        saved = [node.end - _checkpoint_above(node) for node in aged]
        most = max(saved)
        return min(zip(aged, saved, range(len(aged))),
                   key=lambda t: t[2] / (len(aged) - 1) + t[1] / most)[0]


def _checkpoint_above(node: RadixNode) -> int:
    """Where the nearest checkpoint above `node` on its path ends (0: none)."""
    above = node.parent
    while above is not None and above.state < 0:
        above = above.parent
    return 0 if above is None else above.end
