"""radixserve itself as a benchmarked system: the AsyncEngine with the prefix cache on or off (and
any other EngineConfig, e.g. a small pool or the Triton backend). Outputs are streamed, so every
token is stamped when it reaches the client.

Pool samples are exact and per step: this engine's scheduler's `schedule` is wrapped (a measurement
hook on this object only) to count, once a step's blocks are allocated and before anything is
released, on the engine thread, the blocks live sequences hold; blocks neither free nor held by a
sequence are held by the cache alone. Sampling from another
thread would have to take the step lock (delaying steps) and could miss short peaks.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from radixserve.bench.systems.base import Completion, PoolSample, System, SystemInfo
from radixserve.config import EngineConfig
from radixserve.sampling_params import SamplingParams

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

    async def start(self) -> None:
        from radixserve.engine.async_engine import AsyncEngine

        engine = await asyncio.to_thread(lambda: AsyncEngine(self.config))
        self.engine = engine
        self._num_blocks = engine.stats().blocks_total
        self._hook_steps(engine.engine)
        await engine.start()

    def _hook_steps(self, inner) -> None:  # inner: the synchronous LLMEngine
        schedule = inner.scheduler.schedule
        total = self._num_blocks or 0

        def sampled_schedule():  # -> the scheduler's Batch
            batch = schedule()
            if self._recording:
                used = len({b for s in inner.live_sequences() for b in s.block_table})
                self._samples.append(PoolSample(time.monotonic(), used, total - used - inner.pool.num_free, total))
            return batch

        inner.scheduler.schedule = sampled_schedule

    def start_sampling(self) -> None:
        self._samples = []
        self._recording = True

    def stop_sampling(self) -> list[PoolSample]:
        self._recording = False
        return list(self._samples)

    async def generate(self, prompt: list[int], output_len: int, request_id: str) -> Completion:
        assert self.engine is not None, "start() first"
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
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
        return Completion(tokens, times, last.usage.cached_tokens, last.timing.first_scheduled)

    def engine_counters(self) -> dict[str, int]:
        """Cumulative engine counters (evictions, preemptions, ...) for the JSON report."""
        if self.engine is None:
            return {}
        s = self.engine.stats()
        return {"evictions": s.evictions, "evicted_blocks": s.evicted_blocks, "preemptions": s.preemptions,
                "computed_tokens": s.computed_tokens, "leaked_blocks": self.engine.leaked_blocks()}

    async def stop(self) -> None:
        if self.engine is not None:
            await self.engine.shutdown()
            self.engine = None

    def info(self) -> SystemInfo:
        c = self.config
        return SystemInfo(self.name, self.description, block_size=c.block_size, num_blocks=self._num_blocks,
                          settings={"enable_prefix_cache": c.enable_prefix_cache, "attention_backend": c.attention_backend,
                                    "max_num_batched_tokens": c.max_num_batched_tokens, "max_num_seqs": c.max_num_seqs,
                                    "policy": c.policy, "device": c.device, "dtype": c.dtype})
