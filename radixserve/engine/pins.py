"""Pinned prefixes: prompts an operator keeps in the device pool whatever else runs (a long system
prompt every chat starts with), prefilled once and never evicted while pinned.

A pin holds its path of the radix tree (`RadixTree.hold`): held nodes are locked on the device, so
eviction passes them by, and they are drawn as pinned. Pins share a budget, `pin_budget` of the
device pool's blocks (EngineConfig), so they can never take the blocks running sequences need: a pin
that would pass it is refused with a PinError saying how much is left.

Invariants: the registry is touched only on the engine thread; every pin holds exactly one hold on
its node (the node ending at its last token); `used_blocks` is the number of distinct device blocks
on pinned paths; unpinning releases the hold, after which the prefix is an ordinary LRU entry.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass

from radixserve.cache.radix_tree import RadixNode, RadixTree
from radixserve.errors import RequestError


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
    def __init__(self, tree: RadixTree | None, budget_blocks: int) -> None:
        self.tree = tree
        self.budget_blocks = budget_blocks if tree is not None else 0
        self._pins: dict[str, _Pin] = {}
        self._ids = itertools.count(1)

    def used_blocks(self) -> int:
        return len(self._blocks_of(p.node for p in self._pins.values()))

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
        match = tree.match(tokens, namespace=namespace)
        if match.length < len(tokens) or match.host_tokens:
            return None
        nodes = [p.node for p in self._pins.values()]
        used, after = len(self._blocks_of(nodes)), len(self._blocks_of([*nodes, match.node]))
        if after > self.budget_blocks:
            raise PinError(f"pinning {len(tokens)} tokens needs {after - used} more blocks but only "
                           f"{self.budget_blocks - used} of the pin budget's {self.budget_blocks} are left "
                           "(pin_budget, --pin-budget); unpin something first")
        tree.hold(match.node)
        pin = _Pin(f"pin-{next(self._ids)}", match.node, namespace, len(tokens), time.time(), label,
                   match.node.hits)
        self._pins[pin.id] = pin
        return self._info(pin)

    def unpin(self, pin_id: str) -> PinInfo | None:
        """Release a pin (its prefix becomes evictable again); None if there is no such pin. Changes
        the cache."""
        pin = self._pins.pop(pin_id, None)
        if pin is None:
            return None
        assert self.tree is not None
        info = self._info(pin)
        self.tree.release_hold(pin.node)
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
        return PinInfo(pin.id, pin.namespace, pin.tokens, len(self._blocks_of([pin.node])), hits, hits * pin.tokens,
                       pin.created, pin.label)

    def _blocks_of(self, nodes: Iterable[RadixNode]) -> set[int]:
        blocks: set[int] = set()
        for node in nodes:
            n: RadixNode | None = node
            while n is not None and n.parent is not None:
                blocks.update(n.blocks)
                n = n.parent
        return blocks
