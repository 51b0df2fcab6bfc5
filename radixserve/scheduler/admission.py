"""Output-aware admission: keep free blocks for what the running sequences will still generate.

Admitting a request only by the blocks its prompt needs now lets a burst of long replies fill the
pool with prompts, and then every sequence grows into a preemption storm. Like vLLM's and SGLang's
new-token ratio, the scheduler reserves, for each running sequence, `ratio * (tokens it may still
generate)` worth of blocks, and admits a waiting sequence only if the blocks free or evictable after
its first chunk still cover that reserve plus its own. The ratio starts at `new_token_ratio`
(expect that fraction of `max_tokens` to be generated), decays by `new_token_ratio_decay` per step
towards `new_token_ratio_min` while nothing is preempted (most replies stop early), and jumps back
to the start on a preemption for lack of blocks. `new_token_ratio = 0` turns the reserve off.

Liveness: the reserve never stops the first admission when nothing runs, so a request that fits the
pool alone still runs; it only delays admissions behind running work, which finishes.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.core import Sequence


@dataclass
class GrowthReserve:
    start: float  # the ratio after a preemption, and at first
    minimum: float
    decay: float  # per scheduler step
    block_size: int
    ratio: float = 0.0
    reserved_blocks: int = 0  # the reserve the last admission pass worked with (a metric)

    def __post_init__(self) -> None:
        self.ratio = self.start

    def step(self) -> None:
        self.ratio = max(min(self.minimum, self.start), self.ratio - self.decay)

    def preempted(self) -> None:
        self.ratio = self.start

    def blocks(self, seq: Sequence) -> int:
        """Blocks `seq` is expected to still need for the tokens it may generate."""
        to_generate = max(0, seq.request.params.max_tokens - seq.num_generated)
        return -(-int(self.ratio * to_generate) // self.block_size)

    def total(self, running: list[Sequence]) -> int:
        self.reserved_blocks = sum(self.blocks(s) for s in running) if self.ratio > 0 else 0
        return self.reserved_blocks
