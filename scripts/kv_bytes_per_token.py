"""What a cached token and a state slot of a model directory cost, as radixserve lays them out with window
states (`--sliding-window-kv window`): the paged pool's bytes per token, a state slot's bytes, and the K/V a
token would take in every attention layer, and in the layers that project their own (docs/bench/hybrid.md).

    python scripts/kv_bytes_per_token.py /tmp/rs-gemma4-cpu
"""

from __future__ import annotations

import sys

import torch

from radixserve.model.kv_cache import KVLayout
from radixserve.model.spec import load_spec
from radixserve.model.state_cache import StateLayout


def main(path: str, block_size: int = 16, dtype: torch.dtype = torch.float32) -> None:
    spec = load_spec(path).with_window_states()
    element = torch.empty((), dtype=dtype).element_size()
    pool = KVLayout(len(spec.paged_attentions), *spec.paged_kv_shape, block_size, dtype)
    print(f"{spec.architecture}: {spec.num_layers} layers, {len(spec.paged_attentions)} paged, "
          f"{len(spec.recurrents)} keeping states")
    print(f"paged pool: {pool.bytes_per_token:,} bytes per token")
    if spec.is_hybrid:
        print(f"a state slot: {StateLayout(tuple(spec.recurrents), dtype).bytes_per_slot:,} bytes")
    every = sum(2 * spec.kv_size_of(a) * element for a in spec.attentions)
    own = sum(2 * spec.kv_size_of(a) * element for a in spec.attentions if a.kv_source is None)
    print(f"K/V of a token in every attention layer: {every:,} bytes; in the layers projecting their own: {own:,}")


if __name__ == "__main__":
    main(sys.argv[1])
