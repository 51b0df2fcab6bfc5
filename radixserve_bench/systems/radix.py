"""radixserve itself as a benchmarked system: the AsyncEngine with the prefix cache on or off (and
any other EngineConfig, e.g. a small pool or the Triton backend). Outputs are streamed, so every
token is stamped when it reaches the client.

Pool samples are exact and per step: a step observer (`AsyncEngine.add_step_observer`) receives, on
the engine thread, the pool at each step's peak (blocks allocated, nothing yet released): the blocks
live sequences hold and those held by the cache alone. Sampling from another thread would have to
take the step lock (delaying steps) and could miss short peaks.

Speculative decoding (`EngineConfig.num_speculative_tokens`, 0 for `radixserve-nospec`): each request's
`usage.speculation` (draft tokens proposed and accepted by source) comes back with its completion, and
`engine_counters` adds the engine's speculation counters (generated tokens, committed draws: tokens
per step; proposed / accepted by source) counted over the measured run only: from `start_sampling`
(after the warm-up) to the end.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from radixserve.config import EngineConfig
from radixserve.core import DRAFT_SOURCES, StepInfo
from radixserve.sampling_params import SamplingParams
from radixserve_bench.systems.base import GREEDY, Completion, PoolSample, Sampling, System, SystemInfo

HOST_COUNTERS = ("host_blocks_total", "host_cached_tokens", "written_back_blocks", "write_back_s", "loaded_blocks",
                 "load_s", "host_dropped_blocks", "swaps_out", "swaps_in")

if TYPE_CHECKING:
    from radixserve.engine.async_engine import AsyncEngine


class RadixServeSystem(System):
    has_block_pool = True

    def __init__(self, name: str, description: str, config: EngineConfig) -> None:
        self.name = name
        self.description = description
        self.config = config
        self.engine: AsyncEngine | None = None  # created in start(): loading the model blocks for seconds
        self._num_blocks: int | None = None
        self._samples: list[PoolSample] = []
        self._recording = False
        self._spec_base: dict[str, float] = {}

    async def start(self) -> None:
        from radixserve.engine.async_engine import AsyncEngine

        engine = await asyncio.to_thread(lambda: AsyncEngine(self.config))
        self.engine = engine
        self._num_blocks = engine.stats().blocks_total
        engine.add_step_observer(self._on_step, pool=True)
        await engine.start()

    def _on_step(self, step: StepInfo) -> None:
        if self._recording:
            assert step.blocks_used is not None and step.blocks_cached is not None  # asked for with pool=True
            self._samples.append(PoolSample(step.started, step.blocks_used, step.blocks_cached, step.blocks_total))

    def start_sampling(self) -> None:
        self._samples = []
        self._recording = True
        self._spec_base = self._spec_totals()

    def stop_sampling(self) -> list[PoolSample]:
        self._recording = False
        return list(self._samples)

    async def generate(self, prompt: list[int], output_len: int, request_id: str,
                       sampling: Sampling = GREEDY) -> Completion:
        assert self.engine is not None, "start() first"
        params = SamplingParams(max_tokens=output_len, temperature=sampling.temperature, seed=sampling.seed,
                                ignore_eos=True,
                                prediction=list(sampling.prediction) if sampling.prediction is not None else None)
        tokens: list[int] = []
        times: list[float] = []
        last = None
        async for out in self.engine.generate(list(prompt), params, request_id=request_id):
            now = time.monotonic()
            new = out.outputs[0].token_ids
            tokens += new
            times += [now] * len(new)
            last = out
        if last is None or not last.finished:
            raise RuntimeError(f"{self.name}: request {request_id} ended without a final output")
        spec = last.usage.speculation
        drafts = {k: list(v) for k, v in spec.by_source.items()} if spec is not None else None
        return Completion(tokens, times, last.usage.cached_tokens, last.timing.first_scheduled,
                          last.usage.host_cached_tokens, drafts=drafts)

    def _spec_totals(self) -> dict[str, float]:
        """The engine's cumulative speculation counters, flat (see spec_counters)."""
        if self.engine is None:
            return {}
        s = self.engine.stats()
        out: dict[str, float] = {"generation_tokens": s.generation_tokens, "committed_draws": s.committed_draws,
                                 "spec_verify_draws": s.spec_verify_draws}
        for source in DRAFT_SOURCES:
            out[f"spec_proposed_{source}"] = s.spec_proposed.get(source, 0)
            out[f"spec_accepted_{source}"] = s.spec_accepted.get(source, 0)
        return out

    def spec_counters(self) -> dict[str, float]:
        """Speculation counters of the measured run (since start_sampling): generation_tokens,
        committed_draws (their ratio is tokens per sequence per step), spec_verify_draws, and
        spec_proposed_<source> / spec_accepted_<source> for every draft source."""
        now = self._spec_totals()
        return {k: v - self._spec_base.get(k, 0.0) for k, v in now.items()}

    def engine_counters(self) -> dict[str, float]:
        """Cumulative engine counters (evictions, preemptions, host-tier traffic, ...) for the JSON report."""
        if self.engine is None:
            return {}
        s = self.engine.stats()
        counters: dict[str, float] = {"evictions": s.evictions, "evicted_blocks": s.evicted_blocks, "preemptions": s.preemptions,
                                      "computed_tokens": s.computed_tokens,
                                      "leaked_blocks": self.engine.leaked_blocks()}
        if self.config.host_cache_mb > 0:
            counters |= {name: getattr(s, name) for name in HOST_COUNTERS}
        return counters | self.spec_counters()

    async def stop(self) -> None:
        if self.engine is not None:
            await self.engine.shutdown()
            self.engine = None

    def info(self) -> SystemInfo:
        c = self.config
        return SystemInfo(self.name, self.description, block_size=c.block_size, num_blocks=self._num_blocks,
                          settings={"enable_prefix_cache": c.enable_prefix_cache, "host_cache_mb": c.host_cache_mb,
                                    "attention_backend": c.attention_backend,
                                    "max_num_batched_tokens": c.max_num_batched_tokens, "max_num_seqs": c.max_num_seqs,
                                    "policy": c.policy, "device": c.device, "dtype": c.dtype,
                                    "num_speculative_tokens": c.num_speculative_tokens,
                                    "speculative_max_batch": c.speculative_max_batch,
                                    "speculative_max_rows": c.speculative_max_rows})
