"""The KV cache's bookkeeping: the block pool (free list, refcounts, copy-on-write) and the radix tree
over token IDs that maps cached prefixes to blocks. No tensors live here (the model layer owns them),
and only the scheduler changes this state."""

from radixserve.cache.block_pool import BlockPool
from radixserve.cache.radix_tree import Match, RadixNode, RadixTree

__all__ = ["BlockPool", "Match", "RadixNode", "RadixTree"]
