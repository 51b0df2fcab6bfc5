"""The synchronous engine: requests in, one scheduled step at a time, incremental outputs out.

Owns the request table, the model runner, the sampler, the outputs (`outputs.OutputTracker`) and the
token accounting behind the cache metrics; the scheduler owns the cache state (blocks, tree,
queues) and every change to it. A step is: schedule, launch (forward and sampling, queued on the
device without waiting; the sampled ids become `PENDING_TOKEN`s), then one `_resolve` that waits for
a launched step's ids, fills them in, finishes what stopped and builds the outputs.

Overlap (`EngineConfig.overlap`; by default on CUDA, off on CPU where the forward runs on the host
anyway and overlap would only delay each output by a step): `step()` launches step N and then
resolves step N-1, so the host schedules, prepares and post-processes while the device computes. A
decoding sequence's next input is its pending token, which the runner reads from the previous step's
sampled ids on the device, so no host round trip sits between two steps. What a resolution decides
(a stop, an error) takes effect one step late: the step launched meanwhile computed one token too
many for that sequence, which is dropped, and its blocks are released when it finishes (later device
work is queued behind that step, so a released block is never written twice at once). Length limits
are known at launch, so such a sequence is not scheduled again. Without overlap, each step resolves
before the next is scheduled. Either way the scheduler's invariants hold at every step boundary.

A request whose own forward, logits or decoding fails ends alone with finish_reason "error"; the
rest of the batch goes on. Step observers see a `StepInfo` after every step;
RADIXSERVE_CHECK_INTEGRITY=1 runs the scheduler's integrity check after every step.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.cache.block_pool import BlockPool
from radixserve.cache.radix_tree import RadixTree
from radixserve.config import DEFAULT_CPU_KV_MB, EngineConfig
from radixserve.core import (
    PENDING_TOKEN,
    Batch,
    Request,
    RequestOutput,
    Sequence,
    SequenceStatus,
)
from radixserve.engine.host_tier import CostFeed, host_tier_blocks
from radixserve.engine.intake import tokenize, validate, validate_priority
from radixserve.engine.observers import StepObserver, StepObservers
from radixserve.engine.outputs import OutputTracker
from radixserve.engine.sampler import Draw, Sampler, SampleResult
from radixserve.engine.stats import EngineStats
from radixserve.engine.step_clock import StepClock, StepSpan
from radixserve.errors import RequestError
from radixserve.model.embedded import resolve_model
from radixserve.model.loader import load_tokenizer
from radixserve.model.runner import ModelRunner, PendingInputs
from radixserve.sampling_params import SamplingParams
from radixserve.scheduler import Scheduler

log = logging.getLogger(__name__)
# What a failed request's caller is told: our words, never a library's exception text (that is logged).
FORWARD_FAILED = "the model failed on this request; see the server log"
INVALID_LOGITS = "the model produced non-finite logits for this request"
POSTPROCESS_FAILED = "decoding this request's output failed; see the server log"


@dataclass
class InFlight:
    """A launched step whose sampled ids have not been resolved on the host yet."""

    owners: list[Sequence]  # the sequence each draw belongs to
    sampled: SampleResult | None
    failed: dict[Request, str]
    positions: list[int]  # where each draw's pending token sits in its sequence's token_ids
    span: StepSpan
    prefill_tokens: int = 0  # tokens of the step beyond one per sampled row: what preemption costs weigh

    @property
    def rows(self) -> dict[int, int]:
        """seq_id -> its draw's index in `sampled.token_ids`."""
        return {s.seq_id: i for i, s in enumerate(self.owners)}


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_dir, self.model_name = resolve_model(config.model)
        self.runner = ModelRunner(self.model_dir, config.dtype, config.device, config.attention_backend,
                                  config.block_size, config.load_format, config.enforce_eager)
        self.spec = self.runner.spec
        self.tokenizer: Any = load_tokenizer(self.model_dir)
        num_blocks = config.num_blocks or self._pool_blocks()
        host_blocks = host_tier_blocks(config.host_cache_mb, self.runner.kv_layout().bytes_per_block)
        self.runner.allocate_kv_cache(num_blocks, host_blocks)
        self.pool = BlockPool(num_blocks, config.block_size)
        self.host_pool = BlockPool(host_blocks, config.block_size) if host_blocks else None
        self.tree = RadixTree(self.pool, self.host_pool) if config.enable_prefix_cache else None
        self.scheduler = Scheduler(config, self.pool, self.tree)
        self.sampler = Sampler(self.runner.device)
        self.overlap = config.overlap if config.overlap is not None else self.runner.device.type == "cuda"
        self.clock = StepClock(self.runner.device)
        self.cost_feed = CostFeed(self.scheduler.costs, self.clock, self.runner.host_cache)
        self._keys = random.Random(config.seed)  # the engine's generator: noise keys of unseeded samples
        limit = self.spec.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's {limit} positions")
        self.max_model_len = config.max_model_len or limit
        # one sequence must fit the pool on its own, or it could never run
        self.max_seq_len = min(self.max_model_len, num_blocks * config.block_size)
        self.runner.prepare_decode(config.max_num_seqs, self.max_seq_len)
        self.eos_token_ids = set(self.spec.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.outputs = OutputTracker(self.tokenizer)
        self._in_flight: InFlight | None = None
        self._order = itertools.count()
        self.stats_totals = EngineStats()
        self.observers = StepObservers()
        self._steps = 0
        self._check_integrity = os.environ.get("RADIXSERVE_CHECK_INTEGRITY", "") not in ("", "0")

    def _pool_blocks(self) -> int:
        config = self.config
        if config.kv_cache_memory_mb is None and self.runner.device.type == "cuda":
            return self.runner.kv_blocks_for_device(config.gpu_memory_utilization, config.max_num_batched_tokens,
                                                    config.max_num_seqs)
        return self.runner.kv_layout().blocks_for_budget(config.kv_cache_memory_mb or DEFAULT_CPU_KV_MB)

    # -- requests ------------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return tokenize(self.tokenizer, prompt)

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        validate(token_ids, params, self.spec.vocab_size, self.max_seq_len)

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    priority: int = 0) -> str:
        token_ids = self.tokenize(prompt)
        self.validate(token_ids, params)
        validate_priority(priority)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        req = Request(request_id, token_ids, params, priority=priority, order=next(self._order))
        req.timing.arrival = time.monotonic()
        seq = Sequence(req, 0, list(token_ids), len(token_ids), noise_key=self._noise_key(params, 0),
                       pending_forks=params.n - 1)
        req.sequences.append(seq)
        self.requests[request_id] = req
        self.outputs.track(seq)
        self.scheduler.add(seq)
        self.stats_totals.prompt_tokens += len(token_ids)
        return request_id

    def _noise_key(self, params: SamplingParams, index: int) -> int:
        """A seeded sample's key follows from its seed; an unseeded one's from the engine's generator."""
        seed = params.sample_seed(index)
        return self._keys.getrandbits(64) if seed is None else seed

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        for seq in req.sequences:
            if seq.status is not SequenceStatus.FINISHED:
                self._finish(seq, "abort")
        return self._output(req, req.sequences)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    # -- the step ------------------------------------------------------------------------------
    def add_step_observer(self, observer: StepObserver, pool: bool = False) -> None:
        """Call `observer` with a StepInfo after every step that ran (on the stepping thread). With
        `pool`, the StepInfo also counts the blocks live sequences hold, a pass over every block table
        that each step then pays for, so only observers that need it ask."""
        self.observers.add(observer, pool)

    def step(self) -> list[RequestOutput]:
        """Schedule and launch one step; return the outputs of the step that just resolved: this
        one without overlap, the previous one with it (the last call with nothing left to schedule
        resolves the step still in flight)."""
        started = time.monotonic()
        batch = self.scheduler.schedule()
        if batch.copies:
            self.runner.apply_copies(batch.copies)
        if not batch.items:
            flight, self._in_flight = self._in_flight, None
            return self._resolve(flight) if flight is not None else self._unschedulable()
        peak = self.observers.pool_counts(self.pool, self.scheduler) if self.observers else None
        launched = self._launch(batch)
        if self.overlap:
            flight, self._in_flight = self._in_flight, launched
        else:
            flight = launched
        outputs = self._resolve(flight) if flight is not None else []
        self._steps += 1
        if self._check_integrity:
            self.check_integrity()
        if peak is not None:
            self.observers.notify(self._steps, batch, started, peak, self.pool, self.scheduler)
        return outputs

    def _launch(self, batch: Batch) -> InFlight:
        """Run the forward and sampling of `batch` without waiting for the device; the sampled ids
        become pending tokens that `_resolve` fills in."""
        now = time.monotonic()
        for item in batch.items:
            req = item.seq.request
            if req.timing.first_scheduled is None:
                req.timing.first_scheduled = now
            self.stats_totals.computed_tokens += max(0, min(item.start + item.num_tokens, item.seq.num_prompt_tokens)
                                                     - item.start)
        prev = self._in_flight
        inputs = PendingInputs(prev.sampled.token_ids, prev.rows) if prev is not None and prev.sampled else None
        failed: dict[Request, str] = {}
        logits: torch.Tensor | None
        start = self.clock.mark()
        try:
            logits = self.runner.run(batch, inputs)
        except Exception:
            # One request's input can break a batched forward; rerun the items one at a time so only
            # the requests whose own forward fails are lost.
            log.exception("a forward pass of %d sequences failed; retrying them one by one", len(batch.items))
            per_item = self.runner.run_each(batch, inputs)
            failed = {it.seq.request: FORWARD_FAILED for it, rows in zip(batch.items, per_item) if rows is None}
            kept = [(it, rows) for it, rows in zip(batch.items, per_item)
                    if rows is not None and it.seq.request not in failed]
            batch = Batch([it for it, _ in kept], [])
            logits = torch.cat([rows for _, rows in kept]) if kept else None
            for req in failed:  # known now: end them before the next step is scheduled
                for seq in req.sequences:
                    if seq.status is not SequenceStatus.FINISHED:
                        self._finish(seq, "error")
        self.scheduler.complete(batch, failed)
        owners, draws = self._draws(batch)
        sampled = self.sampler.sample(logits, draws) if draws and logits is not None else None
        span = self.clock.span(start)
        if sampled is not None:
            sampled.start_copy()
        for seq in owners:
            seq.token_ids.append(PENDING_TOKEN)
            params = seq.request.params
            seq.final_token_pending = seq.num_generated + 1 >= params.max_tokens \
                or len(seq.token_ids) >= self.max_seq_len
        prefill = batch.num_tokens - sum(it.samples for it in batch.items)
        return InFlight(owners, sampled, failed, [d.position for d in draws], span, prefill)

    def _draws(self, batch: Batch) -> tuple[list[Sequence], list[Draw]]:
        """Who samples this step, and from which logits row; n > 1 forks the other samples off the
        finished prompt here, each drawing its first token from the prompt's row."""
        owners, draws = [], []
        rows = [it.seq for it in batch.items if it.samples]
        for row, seq in enumerate(rows):
            forks = self.scheduler.fork(seq) if seq.pending_forks else []
            for s in (seq, *forks):
                if s is not seq:
                    s.noise_key = self._noise_key(s.request.params, s.index)
                    self.outputs.track(s)
                owners.append(s)
                draws.append(Draw(row, s.request.params, s.noise_key, len(s.token_ids)))
        return owners, draws

    def _resolve(self, flight: InFlight) -> list[RequestOutput]:
        """Fill in a launched step's sampled tokens, finish what stopped, and build the outputs."""
        failed = flight.failed
        ids, usable, logprobs = flight.sampled.host() if flight.sampled is not None else ([], [], {})
        self.clock.resolved(flight.span)
        self.cost_feed.observe(flight.prefill_tokens)
        failed.update((s.request, INVALID_LOGITS) for s, ok in zip(flight.owners, usable) if not ok)
        now = time.monotonic()
        touched: dict[str, list[Sequence]] = {}
        for i, (seq, token) in enumerate(zip(flight.owners, ids)):
            req = seq.request
            if req in failed or seq.status is SequenceStatus.FINISHED:
                continue  # aborted or finished while in flight: its pending token was dropped
            seq.token_ids[flight.positions[i]] = token
            if req.timing.first_token is None:
                req.timing.first_token = now
            if req.params.logprobs is not None:
                seq.logprobs.append(logprobs[i])
            try:
                self._append(seq, token)
            except Exception:  # e.g. a tokenizer that cannot decode this id
                log.exception("finishing a token of request %s failed", req.request_id)
                failed[req] = POSTPROCESS_FAILED
                continue
            touched.setdefault(req.request_id, []).append(seq)
        self.scheduler.resolved([s for s in flight.owners if s.status is SequenceStatus.RUNNING])
        outputs = [self._output(self.requests[rid], seqs) for rid, seqs in touched.items()
                   if rid in self.requests and self.requests[rid] not in failed]
        return outputs + [self._fail(req, why) for req, why in failed.items() if req.request_id in self.requests]

    def _finish(self, seq: Sequence, reason: str) -> None:
        # tokens still on the device for it will not be used (a failed request's may sit before the
        # one in flight): drop them first, so what the scheduler caches is only tokens known here
        if PENDING_TOKEN in seq.token_ids:
            del seq.token_ids[seq.token_ids.index(PENDING_TOKEN):]
        self.scheduler.finish(seq, reason)

    def _fail(self, req: Request, why: str) -> RequestOutput:
        """End one request with finish_reason "error"; the rest of the batch is untouched."""
        for seq in req.sequences:
            if seq.status is not SequenceStatus.FINISHED:
                self._finish(seq, "error")
        out = self._output(req, req.sequences)
        out.error = why
        return out

    def _unschedulable(self) -> list[RequestOutput]:
        """Nothing could be scheduled. With work waiting and nothing running, the head of the queue can
        never fit (the scheduler's liveness rules make this unreachable; counted and logged if not):
        failing it keeps the engine from spinning on empty steps."""
        if not self.scheduler.has_work():
            return []
        self.stats_totals.stalled_steps += 1
        if self.scheduler.running:
            log.error("a step scheduled none of %d running sequences", len(self.scheduler.running))
            return []
        head = self.scheduler.waiting_in_order()[0].request
        log.error("request %s cannot be scheduled in a pool of %d blocks; failing it", head.request_id,
                  self.pool.num_blocks)
        return [self._fail(head, "the request does not fit in the KV cache")]

    def _append(self, seq: Sequence, token: int) -> None:
        params = seq.request.params
        self.stats_totals.generation_tokens += 1
        stopped = self.outputs.add_token(seq, token)
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids or stopped:
            self._finish(seq, "stop")
        elif seq.num_generated >= params.max_tokens or seq.num_resolved >= self.max_seq_len:
            self._finish(seq, "length")

    def _output(self, req: Request, seqs: list[Sequence]) -> RequestOutput:
        out = self.outputs.output(req, seqs)
        if out.finished:
            self._retire(req)
        return out

    def _retire(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)
        self.stats_totals.count_finished(req)

    # -- introspection -------------------------------------------------------------------------
    def live_sequences(self) -> list[Sequence]:
        return self.scheduler.live_sequences()

    def stats(self) -> EngineStats:
        return EngineStats.collect(self)

    def leaked_blocks(self) -> int:
        return self.scheduler.leaked_blocks()

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
