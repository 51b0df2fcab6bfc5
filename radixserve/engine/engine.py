"""The synchronous engine: requests in, one scheduled step at a time, incremental outputs out.

Owns the request table, the model runner, the sampler, detokenization and the token accounting
behind the cache metrics; the scheduler owns the cache state (blocks, tree, queues) and every change
to it. One step is: schedule, forward, sample, then one `_postprocess` that asks the scheduler to
complete the step (and to fork, and to finish what stopped) and builds the outputs. Single-threaded
by design: the async engine drives it from one background thread between its commands.

A request whose own forward, logits or decoding fails ends alone with finish_reason "error"; the
rest of the batch goes on. Step observers see a `StepInfo` after every step;
RADIXSERVE_CHECK_INTEGRITY=1 runs the scheduler's integrity check after every step.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch

from radixserve.cache.block_pool import BlockPool
from radixserve.cache.radix_tree import RadixTree
from radixserve.config import DEFAULT_CPU_KV_MB, EngineConfig
from radixserve.core import (
    Batch,
    CompletionOutput,
    Request,
    RequestOutput,
    Sequence,
    SequenceStatus,
    StepInfo,
    Usage,
)
from radixserve.engine.detokenizer import IncrementalDetokenizer
from radixserve.engine.sampler import Sampler, generator_for
from radixserve.engine.stats import EngineStats
from radixserve.errors import PromptTooLongError, RequestError
from radixserve.model.embedded import resolve_model
from radixserve.model.loader import load_tokenizer
from radixserve.model.runner import ModelRunner
from radixserve.sampling_params import SamplingParams
from radixserve.scheduler import Scheduler

log = logging.getLogger(__name__)
# What a failed request's caller is told: our words, never a library's exception text (that is logged).
FORWARD_FAILED = "the model failed on this request; see the server log"
INVALID_LOGITS = "the model produced non-finite logits for this request"
POSTPROCESS_FAILED = "decoding this request's output failed; see the server log"
StepObserver = Callable[[StepInfo], None]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_dir, self.model_name = resolve_model(config.model)
        self.runner = ModelRunner(self.model_dir, config.dtype, config.device, config.attention_backend,
                                  config.block_size, config.load_format)
        self.spec = self.runner.spec
        self.tokenizer: Any = load_tokenizer(self.model_dir)
        layout = self.runner.kv_layout()
        budget_mb = DEFAULT_CPU_KV_MB if config.kv_cache_memory_mb is None else config.kv_cache_memory_mb
        num_blocks = config.num_blocks or layout.blocks_for_budget(budget_mb)
        self.runner.allocate_kv_cache(num_blocks)
        self.pool = BlockPool(num_blocks, config.block_size)
        self.tree = RadixTree(self.pool) if config.enable_prefix_cache else None
        self.scheduler = Scheduler(config, self.pool, self.tree)
        self.sampler = Sampler(config.seed)
        limit = self.spec.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's {limit} positions")
        self.max_model_len = config.max_model_len or limit
        # one sequence must fit the pool on its own, or it could never run
        self.max_seq_len = min(self.max_model_len, num_blocks * config.block_size)
        self.eos_token_ids = set(self.spec.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._detok: dict[int, IncrementalDetokenizer] = {}
        self._sent: dict[int, int] = {}  # seq_id -> generated tokens already handed out
        self._order = itertools.count()
        self.stats_totals = EngineStats()
        self._observers: list[StepObserver] = []
        self._observers_want_pool = False
        self._steps = 0
        self._check_integrity = os.environ.get("RADIXSERVE_CHECK_INTEGRITY", "") not in ("", "0")

    # -- requests ------------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model directory has no tokenizer: send token ids")
            return list(self.tokenizer.encode(prompt))  # BOS where the model wants one, as vLLM does
        if not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise RequestError("a prompt is a string or a list of integer token ids")
        return list(prompt)

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise RequestError("the prompt is empty")
        vocab = self.spec.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        if len(token_ids) >= self.max_seq_len:
            raise PromptTooLongError(len(token_ids), params.max_tokens, self.max_seq_len)
        params.validate()

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    priority: int = 0) -> str:
        token_ids = self.tokenize(prompt)
        self.validate(token_ids, params)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        req = Request(request_id, token_ids, params, priority=priority, order=next(self._order))
        req.timing.arrival = time.monotonic()
        seq = Sequence(req, 0, list(token_ids), len(token_ids), generator=generator_for(params, 0),
                       pending_forks=params.n - 1)
        req.sequences.append(seq)
        self.requests[request_id] = req
        self._track(seq)
        self.scheduler.add(seq)
        self.stats_totals.prompt_tokens += len(token_ids)
        return request_id

    def _track(self, seq: Sequence) -> None:
        self._detok[seq.seq_id] = IncrementalDetokenizer(self.tokenizer, seq.request.params.stop)
        self._sent[seq.seq_id] = 0

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        for seq in req.sequences:
            if seq.status is not SequenceStatus.FINISHED:
                self.scheduler.finish(seq, "abort")
        return self._output(req, req.sequences)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # -- the step ------------------------------------------------------------------------------
    def add_step_observer(self, observer: StepObserver, pool: bool = False) -> None:
        """Call `observer` with a StepInfo after every step that ran (on the stepping thread). With
        `pool`, the StepInfo also counts the blocks live sequences hold, a pass over every block table
        that each step then pays for, so only observers that need it ask."""
        self._observers.append(observer)
        self._observers_want_pool |= pool

    def step(self) -> list[RequestOutput]:
        started = time.monotonic()
        batch = self.scheduler.schedule()
        if not batch.items:
            return self._unschedulable()
        peak = self._pool_counts() if self._observers else None
        outputs = self._run(batch)
        self._steps += 1
        if self._check_integrity:
            self.check_integrity()
        if peak is not None:
            self._notify(batch, started, *peak)
        return outputs

    def _run(self, batch: Batch) -> list[RequestOutput]:
        now = time.monotonic()
        for item in batch.items:
            req = item.seq.request
            if req.timing.first_scheduled is None:
                req.timing.first_scheduled = now
            self.stats_totals.computed_tokens += max(0, min(item.start + item.num_tokens, item.seq.num_prompt_tokens)
                                                     - item.start)
        failed: dict[Request, str] = {}
        logits: torch.Tensor | None
        try:
            logits = self.runner.run(batch)
        except Exception:
            # One request's input can break a batched forward; rerun the items one at a time so only
            # the requests whose own forward fails are lost.
            log.exception("a forward pass of %d sequences failed; retrying them one by one", len(batch.items))
            per_item = self.runner.run_each(batch)
            failed = {it.seq.request: FORWARD_FAILED for it, rows in zip(batch.items, per_item) if rows is None}
            kept = [(it, rows) for it, rows in zip(batch.items, per_item)
                    if rows is not None and it.seq.request not in failed]
            batch = Batch([it for it, _ in kept], [])
            logits = torch.cat([rows for _, rows in kept]) if kept else None
        return self._postprocess(batch, logits, failed)

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

    def _postprocess(self, batch: Batch, logits: Any, failed: dict[Request, str]) -> list[RequestOutput]:
        rows = [it.seq for it in batch.items if it.samples]
        tokens = self.sampler.sample(logits, [s.request.params for s in rows], [s.generator for s in rows]) \
            if rows else []
        failed.update((s.request, INVALID_LOGITS) for s, t in zip(rows, tokens) if t is None)
        self.scheduler.complete(batch, failed)
        now = time.monotonic()
        touched: dict[str, list[Sequence]] = {}
        for i, (seq, token) in enumerate(zip(rows, tokens)):
            req = seq.request
            if req in failed or token is None:
                continue
            if req.timing.first_token is None:
                req.timing.first_token = now
            pairs = [(seq, token)]
            if seq.pending_forks:
                pairs += self._fork(seq, logits[i])
            for s, t in pairs:
                s.token_ids.append(t)
                try:
                    self._append(s, t)
                except Exception:  # e.g. a tokenizer that cannot decode this id
                    log.exception("finishing a token of request %s failed", req.request_id)
                    failed[req] = POSTPROCESS_FAILED
                    break
                touched.setdefault(req.request_id, []).append(s)
        outputs = [self._output(self.requests[rid], seqs) for rid, seqs in touched.items()
                   if self.requests[rid] not in failed]
        return outputs + [self._fail(req, why) for req, why in failed.items()]

    def _fail(self, req: Request, why: str) -> RequestOutput:
        """End one request with finish_reason "error"; the rest of the batch is untouched."""
        for seq in req.sequences:
            if seq.status is not SequenceStatus.FINISHED:
                self.scheduler.finish(seq, "error")
        out = self._output(req, req.sequences)
        out.error = why
        return out

    def _fork(self, parent: Sequence, row: Any) -> list[tuple[Sequence, int]]:
        """n > 1: the scheduler forks the other samples off the finished prompt; each draws its own
        first token from the same logits row."""
        req, forks = parent.request, []
        for child in self.scheduler.fork(parent):
            child.generator = generator_for(req.params, child.index)
            self._track(child)
            token = self.sampler.sample(row[None], [req.params], [child.generator])[0]
            assert token is not None, "the parent's row was usable, so the same row is"
            forks.append((child, token))
        return forks

    def _append(self, seq: Sequence, token: int) -> None:
        params = seq.request.params
        self.stats_totals.generation_tokens += 1
        detok = self._detok[seq.seq_id]
        detok.add([token])
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids \
                or detok.stopped:
            self.scheduler.finish(seq, "stop")
        elif seq.num_generated >= params.max_tokens or len(seq.token_ids) >= self.max_seq_len:
            self.scheduler.finish(seq, "length")

    def _output(self, req: Request, seqs: list[Sequence]) -> RequestOutput:
        outs = []
        for seq in dict.fromkeys(seqs):
            sent = self._sent[seq.seq_id]
            final = seq.status is SequenceStatus.FINISHED
            outs.append(CompletionOutput(seq.index, seq.generated_ids[sent:], self._detok[seq.seq_id].delta(final),
                                         seq.finish_reason))
            self._sent[seq.seq_id] = seq.num_generated
        finished = req.finished
        if finished:
            req.timing.finished = time.monotonic()
            self._retire(req)
        usage = Usage(len(req.prompt_token_ids), req.cached_tokens, sum(s.num_generated for s in req.sequences))
        return RequestOutput(req.request_id, outs, usage, req.timing, finished, req.prompt_token_ids)

    def _retire(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)
        for seq in req.sequences:
            self._detok.pop(seq.seq_id, None)
            self._sent.pop(seq.seq_id, None)
        t = self.stats_totals
        t.requests_finished[req.sequences[0].finish_reason or "abort"] += 1
        t.cached_tokens += req.cached_tokens
        t.cache_hit_requests += int(req.cached_tokens > 0)

    # -- introspection -------------------------------------------------------------------------
    def live_sequences(self) -> list[Sequence]:
        return self.scheduler.live_sequences()

    def stats(self) -> EngineStats:
        return EngineStats.collect(self)

    def leaked_blocks(self) -> int:
        return self.scheduler.leaked_blocks()

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def _pool_counts(self) -> tuple[int, int | None, int | None]:
        """(free, held by live sequences, held only by the tree) blocks; the last two only when an
        observer asked for them."""
        free = self.pool.num_free
        if not self._observers_want_pool:
            return free, None, None
        used = len({b for s in self.scheduler.live_sequences() for b in s.block_table})
        return free, used, self.pool.num_blocks - free - used

    def _notify(self, batch: Batch, started: float, free: int, used: int | None, cached: int | None) -> None:
        decode = sum(1 for it in batch.items if it.num_tokens == 1 and it.samples)
        info = StepInfo(self._steps, started, time.monotonic() - started, len(batch.items),
                        batch.num_tokens - decode, decode, len(self.scheduler.running), len(self.scheduler.waiting),
                        self.pool.num_blocks, free, used, cached)
        for observer in self._observers:
            observer(info)
