"""What the waiting sequences will read from the cache, in the order they will read it: the part of the
future an eviction can know.

A sequence waiting for admission has its prompt already, so the cached prefix it will take is known,
and so is when, roughly: the scheduler admits in its policy's order. LRU alone evicts exactly those
prefixes first when requests queue for a pool too small for them all (agents taking turns, a burst of
long conversations): each waits longest since its path was last used, so its path is the least
recently used, and every turn starts cold (docs/bench/hybrid.md, "A working set larger than the
pool"). Evictions therefore take what no waiting sequence reads before anything one does, and among
those read, the one read last first (Belady's rule over the queue; `radixserve_bench/belady.py`
simulates the rule over a whole trace). The tree's KV eviction, the window blocks' and the state
checkpoints' each order their victims by it.

Looking ahead costs a match per waiting sequence, so it stops after a number of sequences
(`--eviction-lookahead`, 0 for least recently used alone) or a pool's worth of prompt tokens: by the
time later ones are admitted the pool will have turned over.

A query of the tree (`cached_path`): building one changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from radixserve.cache.radix_tree import RadixNode, RadixTree


@dataclass(frozen=True)
class Read:
    """A waiting sequence's cached prefix: the nodes it passes through (the last maybe in part) and its length."""
    path: list[RadixNode]
    length: int


@dataclass
class NextReads:
    matches: list[Read] = field(default_factory=list)  # the waiting sequences' cached prefixes, soonest first
    first_read: dict[int, int] = field(default_factory=dict)  # node id -> index of the first match reading it

    @classmethod
    def of(cls, tree: RadixTree, prompts: Iterable[tuple[list[int], str]], token_limit: int,
           max_prompts: int) -> NextReads:
        """The matches of `prompts` ((tokens, namespace) in admission order) until `max_prompts` of them
        were looked at or prompts of `token_limit` tokens in all."""
        reads = cls()
        tokens = looked_at = 0
        for prompt, namespace in prompts:
            if looked_at == max_prompts or tokens >= token_limit:
                break
            tokens += len(prompt)
            looked_at += 1
            path, length = tree.cached_path(prompt, namespace)
            if not length:
                continue
            for node in path:
                reads.first_read.setdefault(node.id, len(reads.matches))
            reads.matches.append(Read(path, length))
        return reads
