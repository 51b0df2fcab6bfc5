"""Peer: transformers continuous batching, the engine behind `model.generate_batch`.

The ContinuousBatchingManager is configured explicitly (page_size, block sharing, num_blocks,
max_batch_tokens): left to its defaults it sizes its cache from host RAM. Requests submitted
together (within a short gather window) are added sorted the way `generate_batch` sorts them, so an
all-at-once closed loop is exactly a `generate_batch` call, while multi-turn and open-loop traffic
streams in as it would to a server. EOS is disabled per request so every request generates exactly
its output length. The prefix-cache hit of each request is read by wrapping the cache's prefix
search on this manager's cache instance (a measurement hook; it changes nothing).

transformers renamed the config's tokens-per-block field from `block_size` (<= 5.17) to `page_size`
(later; `block_size` stays as a deprecated alias): `cb_config_kwargs` names each setting the way the
installed version's ContinuousBatchingConfig does. The manager API used here is the same in both.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import time
from collections.abc import Collection
from typing import Any

from radixserve_bench.systems.base import GREEDY, Completion, Sampling, System, SystemInfo
from radixserve_bench.systems.hf_common import shared_hf_model

# our setting -> its field names across transformers versions, preferred first
CB_CONFIG_ALIASES: dict[str, tuple[str, ...]] = {"page_size": ("page_size", "block_size")}


def config_fields(cls: Any) -> set[str]:
    """The keyword arguments `cls` (a dataclass, or any class) accepts."""
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls) if f.init}
    return {name for name, p in inspect.signature(cls).parameters.items()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def cb_config_kwargs(settings: dict[str, Any], accepted: Collection[str]) -> dict[str, Any]:
    """`settings` renamed to the fields a ContinuousBatchingConfig accepting `accepted` has; a setting
    it has under no known name is an error (silently dropping it would change what is measured)."""
    out = {}
    for key, value in settings.items():
        names = CB_CONFIG_ALIASES.get(key, (key,))
        name = next((n for n in names if n in accepted), None)
        if name is None:
            raise RuntimeError(f"this transformers' ContinuousBatchingConfig takes none of {', '.join(names)}")
        out[name] = value
    return out


class HFContinuousBatchSystem(System):
    def __init__(self, name: str, model_dir: str, device: str, dtype: str, *, block_size: int, num_blocks: int,
                 max_batch_tokens: int, max_requests_per_batch: int, gather_s: float = 0.01) -> None:
        self.name = name
        self.model_dir, self.device, self.dtype = model_dir, device, dtype
        self.block_size, self.num_blocks = block_size, num_blocks
        self.max_batch_tokens, self.max_requests_per_batch = max_batch_tokens, max_requests_per_batch
        self.gather_s = gather_s
        self.model: Any = None
        self.manager: Any = None
        self._hits: dict[str, int] = {}
        self._pending: list[tuple[str, list[int], int, asyncio.Future]] = []
        self._flush: asyncio.TimerHandle | None = None
        self._clock_offset = 0.0

    def _configs(self) -> tuple[Any, Any]:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        generation = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=1)
        cb = ContinuousBatchingConfig(**cb_config_kwargs(self._settings(), config_fields(ContinuousBatchingConfig)))
        return generation, cb

    def _settings(self) -> dict[str, Any]:
        return {"page_size": self.block_size, "allow_block_sharing": True, "num_blocks": self.num_blocks,
                "max_batch_tokens": self.max_batch_tokens, "max_requests_per_batch": self.max_requests_per_batch}

    def _start_manager(self) -> Any:
        self.model = shared_hf_model(self.model_dir, self.device, self.dtype, self.name)
        generation, cb = self._configs()
        manager = self.model.init_continuous_batching(generation_config=generation, continuous_batching_config=cb)
        manager.warmup()  # builds the batch processor and its cache now, as generate_batch does
        cache = manager.batch_processor.cache
        search = cache.search_prefix_match
        hits = self._hits

        def counted_search(request_id: str, prompt_ids: list[int]) -> int:
            matched = search(request_id, prompt_ids)
            hits[request_id] = matched  # the last search before scheduling is the one that counts
            return matched

        cache.search_prefix_match = counted_search
        manager.start()
        return manager

    async def start(self) -> None:
        self._clock_offset = time.monotonic() - time.perf_counter()  # CB stamps tokens with perf_counter
        self.manager = await asyncio.to_thread(self._start_manager)

    async def generate(self, prompt: list[int], output_len: int, request_id: str,
                       sampling: Sampling = GREEDY) -> Completion:
        if not sampling.greedy:
            raise RuntimeError(f"{self.name} serves greedy requests only ({request_id} asks temperature "
                               f"{sampling.temperature})")
        assert self.manager is not None, "start() first"
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._pending.append((request_id, list(prompt), output_len, future))
        if self._flush is None:
            self._flush = loop.call_later(self.gather_s, self._submit_pending)
        output = await future
        if output.error is not None:
            raise RuntimeError(f"{self.name}: request {request_id} failed: {output.error}")
        times = [t + self._clock_offset for t in (output.timestamps or [])]
        tokens = list(output.generated_tokens)
        if len(tokens) != output_len or len(times) != output_len:
            raise RuntimeError(f"{self.name}: request {request_id} returned {len(tokens)} tokens, wanted {output_len}")
        return Completion(tokens, times, cached_tokens=self._hits.pop(request_id, 0))

    def _submit_pending(self) -> None:
        self._flush = None
        pending, self._pending = self._pending, []
        pending.sort(key=lambda p: p[1], reverse=True)  # generate_batch's order, for prefix sharing
        for request_id, prompt, output_len, future in pending:
            def deliver(output: Any, future: asyncio.Future = future) -> None:
                if output.is_finished() and not future.done():
                    future.set_result(output)

            self.manager.register_result_handler(request_id, deliver)
            added = self.manager.add_request(prompt, request_id=request_id, max_new_tokens=output_len,
                                             record_timestamps=True, eos_token_id=-1)
            if added is None and not future.done():
                future.set_exception(RuntimeError(f"{self.name}: the manager refused request {request_id}"))

    async def stop(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        for *_, future in self._pending:
            if not future.done():
                future.set_exception(RuntimeError(f"{self.name} stopped"))
        self._pending = []
        if self.manager is not None:
            manager, self.manager = self.manager, None
            await asyncio.to_thread(manager.stop, True, 60)
            await asyncio.to_thread(manager.destroy)

    def info(self) -> SystemInfo:
        return SystemInfo(self.name, "transformers continuous batching (generate_batch's manager), block sharing on",
                          block_size=self.block_size, num_blocks=self.num_blocks,
                          settings=self._settings())
