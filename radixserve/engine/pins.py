"""Pinned prefixes: prompts an operator keeps in the device pool whatever else runs (a long system
prompt every chat starts with), prefilled once and never evicted while pinned.

A pin holds its path of the radix tree through the scheduler, the cache's one writer
(`Scheduler.hold_prefix`, `release_prefix`): held nodes are locked on the device, so eviction passes
them by, and they are drawn as pinned. This registry only names the pins, reads the tree (budget,
hits) and keeps the budget. Pins share a budget, `pin_budget` of the
device pool's blocks (EngineConfig), so they can never take the blocks running sequences need: a pin
that would pass it is refused with a PinError saying how much is left.

Invariants: the registry is touched only on the engine thread; every pin holds exactly one hold on
its node (the node ending at its last token, which a later split above it never moves);
`used_blocks` is the number of distinct device blocks on pinned paths; unpinning releases the hold,
after which the prefix is an ordinary LRU entry.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass

from radixserve.cache.radix_tree import RadixNode
from radixserve.errors import RequestError
from radixserve.scheduler import Scheduler


class PinError(RequestError):
    """A pin refused: over the budget, the cache is off, or the prefix could not be kept."""


@dataclass(frozen=True)
class PinInfo:
    id: str
    namespace: str
    tokens: int  # the prefix's length
    blocks: int  # device blocks its path holds (shared ones counted once per pin)
    hits: int  # requests whose cached prefix covered the whole pin since it was made
    hit_tokens: int  # their tokens of it served from the cache
    created: float  # time.time() when it was made
    label: str  # what the operator called it (the start of the system prompt, by default)


@dataclass(frozen=True)
class PinBudget:
    used_blocks: int
    budget_blocks: int


@dataclass(eq=False)
class _Pin:
    id: str
    node: RadixNode
    namespace: str
    tokens: int
    created: float
    label: str
    hits_at_start: int


def pin_budget_blocks(fraction: float, num_blocks: int, max_seq_len: int, block_size: int) -> int:
    """The blocks pins may hold: `fraction` of the pool, less where the longest sequence (and one block
    it may copy on write) would not fit beside them. A pool of one longest sequence allows no pins."""
    longest = -(-max_seq_len // block_size) + 1
    return max(0, min(int(fraction * num_blocks), num_blocks - longest))


class PinRegistry:
    def __init__(self, scheduler: Scheduler, budget_blocks: int) -> None:
        self.scheduler = scheduler
        self.tree = scheduler.tree  # read only: every change goes through the scheduler
        self.budget_blocks = budget_blocks if self.tree is not None else 0
        self._pins: dict[str, _Pin] = {}
        self._ids = itertools.count(1)

    def used_blocks(self) -> int:
        return len(self._blocks_of((p.node, p.node.end) for p in self._pins.values()))

    def budget(self) -> PinBudget:
        return PinBudget(self.used_blocks(), self.budget_blocks)

    def check_size(self, num_tokens: int) -> None:
        """Refuse at once a prefix that could never fit the budget (before anything is prefilled)."""
        if self.tree is None:
            raise PinError("the prefix cache is off (--no-prefix-cache): there is nothing to pin into")
        if self.budget_blocks == 0:
            raise PinError("pinning is off: the pin budget is 0 blocks (--pin-budget 0, or a pool that holds no "
                           "more than the longest sequence: raise --num-blocks or lower --max-model-len)")
        need = -(-num_tokens // self.tree.block_size)
        left = self.budget_blocks - self.used_blocks()
        if need > left:
            raise PinError(f"pinning {num_tokens} tokens needs {need} blocks but only {left} of the pin budget's "
                           f"{self.budget_blocks} are left (pin_budget, --pin-budget); unpin something first")

    def pin(self, tokens: list[int], namespace: str, label: str) -> PinInfo | None:
        """Hold the cached path of `tokens` in `namespace`; None if it is not wholly on the device
        (the caller prefills it and tries again). PinError past the budget. Changes the cache."""
        tree = self.tree
        if tree is None:
            raise PinError("the prefix cache is off (--no-prefix-cache): there is nothing to pin into")
        cached = tree.match(tokens, split=False, namespace=namespace)
        if cached.length < len(tokens) or cached.host_tokens:
            return None
        tips = [(p.node, p.node.end) for p in self._pins.values()]
        last = cached.path[-1] if cached.path else cached.node  # the node `tokens` end in, maybe mid-edge
        used, after = len(self._blocks_of(tips)), len(self._blocks_of([*tips, (last, len(tokens))]))
        if after > self.budget_blocks:
            raise PinError(f"pinning {len(tokens)} tokens needs {after - used} more blocks but only "
                           f"{self.budget_blocks - used} of the pin budget's {self.budget_blocks} are left "
                           "(pin_budget, --pin-budget); unpin something first")
        node = self.scheduler.hold_prefix(tokens, namespace)
        assert node is not None, "a prefix wholly on the device a moment ago is held"
        pin = _Pin(f"pin-{next(self._ids)}", node, namespace, len(tokens), time.time(), label, node.hits)
        self._pins[pin.id] = pin
        return self._info(pin)

    def unpin(self, pin_id: str) -> PinInfo | None:
        """Release a pin (its prefix becomes evictable again); None if there is no such pin. Changes
        the cache."""
        pin = self._pins.pop(pin_id, None)
        if pin is None:
            return None
        info = self._info(pin)
        self.scheduler.release_prefix(pin.node)
        return info

    def unpin_all(self) -> None:
        for pin_id in list(self._pins):
            self.unpin(pin_id)

    def entries(self) -> list[PinInfo]:
        return [self._info(p) for p in self._pins.values()]

    def held_nodes(self) -> list[RadixNode]:
        return [p.node for p in self._pins.values()]

    def _info(self, pin: _Pin) -> PinInfo:
        hits = pin.node.hits - pin.hits_at_start
        return PinInfo(pin.id, pin.namespace, pin.tokens, len(self._blocks_of([(pin.node, pin.node.end)])), hits,
                       hits * pin.tokens, pin.created, pin.label)

    def _blocks_of(self, tips: Iterable[tuple[RadixNode, int]]) -> set[int]:
        """The distinct device blocks listed on each path from the root down to a (node, end) tip, where
        the path is cut at token `end` (the blocks of a prefix ending inside `node`'s edge are those a
        split there would leave above it: what holding that prefix keeps alive)."""
        if self.tree is None:  # the prefix cache is off: nothing was pinned
            return set()
        bs = self.tree.block_size
        blocks: set[int] = set()
        for node, end in tips:
            n: RadixNode | None = node
            while n is not None and n.parent is not None:
                blocks.update(n.blocks[:(min(n.end, end) - 1) // bs - n.start // bs + 1])
                n = n.parent
        return blocks
