"""The systems `radixserve bench` can compare, by name, and how each is built for one workload.

Every system runs the same model directory with the same dtype and device. Pool sizes are given in
blocks of `block_size` tokens and are the same for every system with a pool, except the bounded-pool
variants, which get a fraction of the workload's working set on purpose (the FP8 one as many blocks
as the same bytes hold); the one with the host tier also gets a host pool (`host_cache_mb`) that
holds the whole working set, as does `radixserve-host` beside the ample pool. Every radixserve system
speculates as `SystemSettings` says (the engine's default unless the bench's flags change it) except
`radixserve-nospec`, the same engine with speculation off, so one run gives the on / off ratio;
`hf-prompt-lookup` is transformers' prompt lookup decoding at batch 1, the peer of that comparison.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from radixserve.config import EngineConfig
from radixserve_bench.systems.base import System

SYSTEM_DESCRIPTIONS = {
    "radixserve": "radixserve, prefix cache on, ample pool",
    "radixserve-nocache": "radixserve, prefix cache off (EngineConfig(enable_prefix_cache=False))",
    "radixserve-pool25": "radixserve, prefix cache on, pool = a fraction (default 25%) of the working set",
    "radixserve-pool25-host": "radixserve-pool25 plus the host-memory tier (EngineConfig(host_cache_mb=...)), "
                              "sized for the whole working set",
    "radixserve-pool25-fp8": "radixserve-pool25's memory with an FP8 KV cache (EngineConfig(kv_cache_dtype='fp8')): "
                             "as many blocks as the same bytes hold (not run by default)",
    "radixserve-host": "radixserve plus a host-memory tier as large as its pool: what the tier costs when "
                       "everything fits (not run by default)",
    "radixserve-triton": "radixserve, prefix cache on, Triton attention backend (CUDA only)",
    "radixserve-nospec": "radixserve, prefix cache on, speculative decoding off (EngineConfig(num_speculative_tokens=0))",
    "hf-generate": "transformers generate, static left-padded batches",
    "hf-generate-batch": "transformers generate_batch (continuous batching, block sharing on)",
    "hf-prompt-lookup": "transformers generate(prompt_lookup_num_tokens=k), greedy, batch 1",
}
REFERENCE = "radixserve"
BOUNDED = "radixserve-pool25"  # the bounded pool (a fraction of the working set), host tier off
BOUNDED_HOST = "radixserve-pool25-host"  # the same pool with the host tier on
BOUNDED_FP8 = "radixserve-pool25-fp8"  # the bounded pool's bytes as an FP8 cache (ask for it by name)
AMPLE_HOST = "radixserve-host"  # the ample pool with a host tier of the same size (ask for it by name)
NOSPEC = "radixserve-nospec"  # speculation off: the reference of the on / off ratio
PROMPT_LOOKUP = "hf-prompt-lookup"  # transformers' prompt lookup decoding, the speculation peer
PEERS = ("radixserve-nocache", "hf-generate", "hf-generate-batch")
GREEDY_ONLY = ("hf-generate", "hf-generate-batch", PROMPT_LOOKUP)  # the transformers peers


def default_systems(cuda: bool) -> tuple[str, ...]:
    base = ("radixserve", "radixserve-nocache", "hf-generate", "hf-generate-batch", "radixserve-pool25",
            "radixserve-pool25-host", NOSPEC, PROMPT_LOOKUP)
    return base + (("radixserve-triton",) if cuda else ())


@dataclass(frozen=True)
class SystemSettings:
    model_dir: str
    device: str
    dtype: str
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    seed: int
    num_speculative_tokens: int | None = None  # None: the engine's default (every radixserve system but nospec)
    speculative_max_batch: int | None = None  # None: the engine's default
    speculative_max_rows: int | None = None  # None: the engine's default
    prompt_lookup_tokens: int = 10  # hf-prompt-lookup's prompt_lookup_num_tokens


def build_system(name: str, s: SystemSettings, num_blocks: int, static_batch_size: int,
                 host_cache_mb: float = 0.0) -> System:
    """A fresh system object (HF peers share their loaded weights across runs, see hf_common).
    `host_cache_mb` is radixserve's host tier (0: off)."""
    if name.startswith("radixserve"):
        from radixserve_bench.systems.radix import RadixServeSystem

        config = EngineConfig(
            model=s.model_dir, block_size=s.block_size, num_blocks=num_blocks,
            max_num_batched_tokens=s.max_num_batched_tokens, max_num_seqs=s.max_num_seqs,
            enable_prefix_cache=name != "radixserve-nocache",
            attention_backend="triton" if name == "radixserve-triton" else "auto",
            kv_cache_dtype="fp8" if name == BOUNDED_FP8 else "auto",
            dtype=s.dtype, device=s.device, seed=s.seed, host_cache_mb=host_cache_mb,
            speculative_max_batch=s.speculative_max_batch, speculative_max_rows=s.speculative_max_rows,
        )
        draft_tokens = 0 if name == NOSPEC else s.num_speculative_tokens
        if draft_tokens is not None:  # else the engine's default
            config = dataclasses.replace(config, num_speculative_tokens=draft_tokens)
        return RadixServeSystem(name, SYSTEM_DESCRIPTIONS[name], config)
    if name == "hf-generate":
        from radixserve_bench.systems.hf_generate import HFStaticBatchSystem

        return HFStaticBatchSystem(name, s.model_dir, s.device, s.dtype, max_batch_size=static_batch_size)
    if name == PROMPT_LOOKUP:
        from radixserve_bench.systems.hf_generate import HFStaticBatchSystem

        return HFStaticBatchSystem(name, s.model_dir, s.device, s.dtype, max_batch_size=1,
                                   prompt_lookup_tokens=s.prompt_lookup_tokens)
    if name == "hf-generate-batch":
        from radixserve_bench.systems.hf_cb import HFContinuousBatchSystem

        return HFContinuousBatchSystem(name, s.model_dir, s.device, s.dtype, block_size=s.block_size,
                                       num_blocks=num_blocks, max_batch_tokens=s.max_num_batched_tokens,
                                       max_requests_per_batch=s.max_num_seqs)
    raise ValueError(f"unknown system {name!r}; choose from {', '.join(SYSTEM_DESCRIPTIONS)}")
