"""Peer: transformers `generate` in static, left-padded batches, served the way a static batcher would.

Requests queue up; whenever the model is idle, up to `max_batch_size` queued requests with the same
output length (FIFO) form one padded batch, and nobody joins until the whole batch is done. A short
gather window lets requests submitted together share a batch. Every request generates exactly its
output length (min_new_tokens = max_new_tokens, greedy). A streamer stamps each decode step, so
TTFT and inter-token latency are real, not end-of-batch. No KV is reused across requests.

`hf-prompt-lookup` is the same server at batch 1 with `generate(..., prompt_lookup_num_tokens=k)`:
transformers' prompt lookup decoding (assisted generation that drafts the continuation of the last
n-gram's earlier occurrence in the prompt and output; greedy, batch size 1 only). A step may then
commit several tokens: the streamer stamps each of them with that step's time and counts the steps,
so tokens per step comes back with every completion. Its length is forced by generating with an EOS
id no token has (as radixserve's ignore_eos; see `_lookup_config`) instead of min_new_tokens. Only greedy
requests are served; a request's `prediction` is not a transformers feature and is ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from radixserve_bench.systems.base import GREEDY, Completion, Sampling, System, SystemInfo
from radixserve_bench.systems.hf_common import eos_ids, shared_hf_model


@dataclass
class _Pending:
    prompt: list[int]
    output_len: int
    future: asyncio.Future = field(repr=False)


class _StepClock:
    """A transformers streamer that only records when each generation step's tokens exist: one put
    per step, of one token per row ([batch]) or, in assisted decoding (batch 1), of every token the
    step committed ([1, n])."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.steps = 0
        self._saw_prompt = False

    def put(self, value: Any) -> None:
        if not self._saw_prompt:  # generate() first hands the streamer the prompt itself
            self._saw_prompt = True
            return
        now = time.monotonic()
        self.steps += 1
        self.times += [now] * (int(value.shape[-1]) if value.dim() == 2 else 1)

    def end(self) -> None:
        pass


class HFStaticBatchSystem(System):
    def __init__(self, name: str, model_dir: str, device: str, dtype: str, max_batch_size: int,
                 gather_s: float = 0.01, prompt_lookup_tokens: int | None = None) -> None:
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        if prompt_lookup_tokens is not None and (prompt_lookup_tokens < 1 or max_batch_size != 1):
            raise ValueError("prompt lookup needs prompt_lookup_tokens >= 1 and batch size 1")
        self.prompt_lookup_tokens = prompt_lookup_tokens
        self.name = name
        self.model_dir, self.device, self.dtype = model_dir, device, dtype
        self.max_batch_size = max_batch_size
        self.gather_s = gather_s
        self.model: Any = None
        self._queue: list[_Pending] = []
        self._wake: asyncio.Event | None = None
        self._server: asyncio.Task | None = None
        self.batch_sizes: list[int] = []

    async def start(self) -> None:
        self.model = await asyncio.to_thread(shared_hf_model, self.model_dir, self.device, self.dtype, self.name)
        eos = eos_ids(self.model)
        self._pad = eos[0] if eos else 0
        self._wake = asyncio.Event()
        self._server = asyncio.create_task(self._serve(), name=f"{self.name}-batcher")

    async def generate(self, prompt: list[int], output_len: int, request_id: str,
                       sampling: Sampling = GREEDY) -> Completion:
        assert self._wake is not None, "start() first"
        if not sampling.greedy:
            raise RuntimeError(f"{self.name} serves greedy requests only ({request_id} asks temperature "
                               f"{sampling.temperature})")
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._queue.append(_Pending(list(prompt), output_len, future))
        self._wake.set()
        return await future

    async def _serve(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                await asyncio.sleep(self.gather_s)  # requests sent together join one batch
                batch = self._take_batch()
                self.batch_sizes.append(len(batch))
                try:
                    results = await asyncio.to_thread(self._run_batch, [p.prompt for p in batch], batch[0].output_len)
                except Exception as exc:  # noqa: BLE001 - fail this batch's callers, keep serving the rest
                    for p in batch:
                        if not p.future.done():
                            p.future.set_exception(exc)
                    continue
                for p, completion in zip(batch, results):
                    if not p.future.done():
                        p.future.set_result(completion)

    def _take_batch(self) -> list[_Pending]:
        want = self._queue[0].output_len
        batch = [p for p in self._queue if p.output_len == want][: self.max_batch_size]
        taken = set(map(id, batch))
        self._queue = [p for p in self._queue if id(p) not in taken]
        return batch

    @torch.inference_mode()
    def _run_batch(self, prompts: list[list[int]], output_len: int) -> list[Completion]:
        width = max(len(p) for p in prompts)
        device = self.model.device
        ids = torch.full((len(prompts), width), self._pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every row's last prompt token is aligned
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        clock = _StepClock()
        if self.prompt_lookup_tokens is None:
            settings: dict[str, Any] = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                                            pad_token_id=self._pad)
        else:
            settings = {"generation_config": self._lookup_config(output_len)}
        out = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), streamer=clock, **settings)
        new = out[:, width:].tolist()
        if len(clock.times) != output_len or any(len(row) != output_len for row in new):
            raise RuntimeError(f"{self.name}: generate returned {len(clock.times)} tokens, wanted {output_len}")
        return [Completion(row, list(clock.times), cached_tokens=0, steps=clock.steps) for row in new]

    def _lookup_config(self, output_len: int) -> Any:
        """Prompt lookup, greedy, exactly `output_len` tokens: with no EOS that can occur (as radixserve's
        ignore_eos; generate fills an unset EOS from the model's config, so it is the id one past the
        vocabulary) rather than min_new_tokens, whose logits processor transformers' prompt lookup runs
        over the whole vocabulary for every candidate token of every match it tries (a cost of forcing
        the length, not of prompt lookup: it made the peer several times slower)."""
        config = copy.deepcopy(self.model.generation_config)
        config.update(eos_token_id=self.model.config.get_text_config().vocab_size, max_new_tokens=output_len,
                      do_sample=False, pad_token_id=self._pad, prompt_lookup_num_tokens=self.prompt_lookup_tokens)
        return config

    async def stop(self) -> None:
        if self._server is not None:
            self._server.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._server
            self._server = None
        for p in self._queue:
            if not p.future.done():
                p.future.set_exception(RuntimeError(f"{self.name} stopped"))
        self._queue = []

    def info(self) -> SystemInfo:
        what = "transformers generate, static left-padded batches (no KV reuse)" if self.prompt_lookup_tokens is None \
            else f"transformers generate(prompt_lookup_num_tokens={self.prompt_lookup_tokens}), batch 1"
        return SystemInfo(self.name, what,
                          settings={"max_batch_size": self.max_batch_size, "attn_implementation": "sdpa",
                                    "prompt_lookup_num_tokens": self.prompt_lookup_tokens,
                                    "batch_sizes": list(self.batch_sizes)})
