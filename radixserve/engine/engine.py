"""The synchronous engine: requests in, one scheduled step at a time, incremental outputs out.

Owns the request table, the model runner, the sampler, the outputs (`outputs.OutputTracker`) and the
token accounting behind the cache metrics. It writes no sequence: the scheduler owns sequences and
cache state and takes each step's results back (`Scheduler.launched`, `Scheduler.commit`). A step
reads top to bottom in `step`: schedule → block copies → run → grammar masks → sample → scheduler
commit → outputs. Structured output (each constrained sequence's matcher, its masks and the tokens
a grammar forces) is `engine/grammar/`'s `ConstraintBook`. Prompt logprobs (the rows of a prompt's positions the forward
reduces to logprobs, collected per request) are `engine/prompt_logprobs.py`'s `PromptLogprobBook`.
Penalties and logit_bias (each penalised sequence's token counts, kept on the device, and the
corrections a commit brings: forced tokens, void draws) are `engine/penalties.py`'s `PenaltyBook`.

Overlap (`EngineConfig.overlap`; by default on CUDA, off on CPU where it would only delay each
output by a step): `step()` launches step N, then commits step N-1, so the host works while the
device computes (the pending-token rules: `scheduler/pending.py`). A request whose own forward,
logits or decoding fails ends alone with finish_reason "error". Step observers see a `StepInfo`
after every step; RADIXSERVE_CHECK_INTEGRITY=1 checks the scheduler's integrity after every step.
Where each step's time goes: device vs unhidden host time is `step_clock.StepClock`'s; the host
wall clock per phase (schedule, batch building, forward + sampling, wait, post-processing) is
`step_phases.StepPhases`', lapped at the phase boundaries in `step`, `_launch` and `_resolve`.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from radixserve.cache.block_pool import BlockPool
from radixserve.cache.radix_tree import RadixTree
from radixserve.config import EngineConfig
from radixserve.core import Batch, Request, RequestOutput, Sequence
from radixserve.engine.forward import FORWARD_FAILED, run_isolating_failures
from radixserve.engine.grammar import ConstraintBook, GrammarCompiler
from radixserve.engine.grammar.limits import GrammarLimits
from radixserve.engine.host_tier import CostFeed
from radixserve.engine.intake import Intake, ValidatedRequest
from radixserve.engine.observers import StepObserver, StepObservers, decode_tokens
from radixserve.engine.outputs import OutputTracker
from radixserve.engine.penalties import PenaltyBook
from radixserve.engine.pins import PinRegistry, pin_budget_blocks
from radixserve.engine.prompt_logprobs import PromptAsk, PromptLogprobBook
from radixserve.engine.sampler import Sampler, SampleResult
from radixserve.engine.sizing import engine_sizes
from radixserve.engine.speculation import (
    VerifyPlan,
    default_max_batch,
    default_max_rows,
    sampler_draws,
    unusable_verifications,
    verify,
)
from radixserve.engine.stats import EngineStats
from radixserve.engine.step_clock import StepClock, StepSpan
from radixserve.engine.step_phases import FORWARD, SCHEDULE, WAIT, StepPhases
from radixserve.errors import RequestError
from radixserve.model.embedded import resolve_model
from radixserve.model.loader import load_tokenizer
from radixserve.model.runner import ModelRunner, PendingInputs
from radixserve.sampling_params import SamplingParams
from radixserve.scheduler import Scheduler
from radixserve.scheduler.step_results import Launch

# What a failed request's caller is told: our words, never a library's exception text (that is logged).
INVALID_LOGITS = "the model produced non-finite logits for this request"
POSTPROCESS_FAILED = "decoding this request's output failed; see the server log"
__all__ = ["FORWARD_FAILED", "INVALID_LOGITS", "POSTPROCESS_FAILED", "LLMEngine"]


log = logging.getLogger(__name__)


@dataclass
class InFlight:
    """A launched step whose sampled ids have not been committed yet."""

    launch: Launch
    sampled: SampleResult | None
    failed: dict[Request, str]
    span: StepSpan
    prefill_tokens: int = 0  # tokens of the step beyond one per sampled row: what preemption costs weigh
    prompt_ask: PromptAsk | None = None  # prompt logprobs the step's forward computes
    verify_plan: VerifyPlan | None = None  # where verifying draws' extra rows are among the sampled ids
    decodes: tuple[int, int] = (0, 0)  # the step's decode and draft tokens (observers.decode_tokens)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        started = time.perf_counter()
        self.config = config
        self.model_dir, self.model_name = resolve_model(config.model)
        self.runner = ModelRunner(self.model_dir, config.dtype, config.device, config.attention_backend,
                                  config.block_size, config.load_format, config.enforce_eager, config.cpu_threads,
                                  config.kv_cache_dtype)
        self.spec = self.runner.spec
        self.tokenizer: Any = load_tokenizer(self.model_dir)
        if config.speculative_max_batch is None:
            config = self.config = replace(config, speculative_max_batch=default_max_batch(self.runner.device))
        if config.speculative_max_rows is None:  # stays None where the device has no knee
            config = self.config = replace(config, speculative_max_rows=default_max_rows(self.runner.device))
        sizes = engine_sizes(config, self.runner)
        self.max_model_len, self.max_seq_len = sizes.max_model_len, sizes.max_seq_len
        self.runner.allocate_kv_cache(sizes.num_blocks, sizes.host_blocks)
        self.pool = BlockPool(sizes.num_blocks, config.block_size)
        self.host_pool = BlockPool(sizes.host_blocks, config.block_size) if sizes.host_blocks else None
        self.tree = RadixTree(self.pool, self.host_pool) if config.enable_prefix_cache else None
        self.scheduler = Scheduler(config, self.pool, self.tree, max_seq_len=self.max_seq_len)
        self.pins = PinRegistry(self.tree, pin_budget_blocks(config.pin_budget, sizes.num_blocks, self.max_seq_len,
                                                             config.block_size))
        self.eos_token_ids = set(self.spec.eos_token_ids)
        self.grammars = GrammarCompiler(self.tokenizer, self.spec.vocab_size, sorted(self.eos_token_ids),
                                        config.grammar_cache_size, grammar_limits(config), config.open_json_objects)
        self.constraints = ConstraintBook(self.grammars, self.spec.vocab_size, self.runner.device, config.forced_tokens)
        self.penalties = PenaltyBook(self.spec.vocab_size, self.runner.device)  # token counts on the device
        self.intake = Intake.of(self)  # the one check of a request (engine/intake.py)
        self.prompt_logprobs = PromptLogprobBook()
        self.sampler = Sampler(self.runner.device)
        self.overlap = config.overlap if config.overlap is not None else self.runner.device.type == "cuda"
        self.clock = StepClock(self.runner.device)
        self.cost_feed = CostFeed(self.scheduler.costs, self.clock, self.runner.host_cache)
        self._keys = random.Random(config.seed)  # the engine's generator: noise keys of unseeded samples
        self.runner.prepare_decode(config.max_num_seqs, self.max_seq_len)
        self.phases = StepPhases(self.runner.build_time)
        self.requests: dict[str, Request] = {}
        self.outputs = OutputTracker(self.tokenizer, frozenset(self.eos_token_ids))
        self._in_flight: InFlight | None = None
        self._order = itertools.count()
        self.stats_totals = EngineStats()
        self.observers = StepObservers()
        self._steps = 0
        self._check_integrity = os.environ.get("RADIXSERVE_CHECK_INTEGRITY", "") not in ("", "0")
        self.startup_s = time.perf_counter() - started
        log.info("engine ready in %.1f s: %s on %s (%s, %d threads), %d KV blocks%s", self.startup_s, self.model_name,
                 self.runner.device, str(self.runner.dtype).removeprefix("torch."), torch.get_num_threads(),
                 sizes.num_blocks, " (FP8)" if config.kv_cache_dtype == "fp8" else "")

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    priority: int = 0) -> str:
        """Check a request (RequestError when refused: engine/intake.py), then queue it; returns its id."""
        return self.add_validated(self.intake.check(prompt, params, priority), request_id)

    def add_validated(self, request: ValidatedRequest, request_id: str | None = None) -> str:
        """Queue a request `self.intake` checked, without checking it again; returns its id."""
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        token_ids, params = request.token_ids, request.params
        req = Request(request_id, token_ids, params, priority=request.priority, order=next(self._order),
                      prediction_ids=request.prediction_ids)
        req.drafts.prediction_tokens = len(request.prediction_ids)
        req.timing.arrival = time.monotonic()
        seq = Sequence(req, 0, list(token_ids), len(token_ids), noise_key=self._noise_key(req, 0),
                       pending_forks=params.n - 1)  # created here; from now on only the scheduler writes it
        req.sequences.append(seq)
        if params.structured is not None:
            self.constraints.begin(req, request.grammar)
        if params.has_penalties:
            self.penalties.begin(req)
        if params.prompt_logprobs is not None:
            self.prompt_logprobs.begin(req)
        self.requests[request_id] = req
        self.outputs.track(seq)
        self.scheduler.add(seq)
        self.stats_totals.prompt_tokens += len(token_ids)
        return request_id

    def _noise_key(self, req: Request, index: int) -> int:
        """A seeded sample's key follows from its seed; an unseeded one's from the engine's generator."""
        seed = req.params.sample_seed(index)
        return self._keys.getrandbits(64) if seed is None else seed

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        self.scheduler.end(req, "abort")
        return self._output(req, req.sequences)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    # -- the step ------------------------------------------------------------------------------
    def add_step_observer(self, observer: StepObserver, pool: bool = False) -> None:
        """`observer(StepInfo)` after every step, on the stepping thread; with `pool`, the StepInfo also
        counts the blocks live sequences hold (a pass over every block table: only when asked)."""
        self.observers.add(observer, pool)

    def step(self) -> list[RequestOutput]:
        """Schedule and launch one step; return the outputs of the step that just resolved: this
        one without overlap, the previous one with it (the last call with nothing left to schedule
        resolves the step still in flight)."""
        self.phases.begin()
        started = time.monotonic()
        batch = self.scheduler.schedule()
        if batch.copies:
            self.runner.apply_copies(batch.copies)
        if not batch.items:
            flight, self._in_flight = self._in_flight, None
            outputs = self._resolve(flight) if flight is not None else self._unschedulable()
            self.phases.end()
            return outputs
        peak = self.observers.pool_counts(self.pool, self.scheduler) if self.observers else None
        launched = self._launch(batch)
        flight, self._in_flight = (self._in_flight, launched) if self.overlap else (launched, None)
        forced, totals = self.constraints.stats.forced_tokens, self.stats_totals
        tokens, draws = totals.generation_tokens, totals.committed_draws
        outputs = self._resolve(flight) if flight is not None else []
        self._steps += 1
        if self._check_integrity:
            self.check_integrity()
        if peak is not None:
            self.observers.notify(self._steps, batch, launched.decodes, started, peak, self.pool, self.scheduler,
                                  self.constraints.stats.forced_tokens - forced,
                                  (totals.generation_tokens - tokens, totals.committed_draws - draws))
        self.phases.end()
        return outputs

    def _launch(self, batch: Batch) -> InFlight:
        """Run the forward and sampling of `batch` without waiting for the device; the scheduler
        gives each draw a pending slot that `_resolve` has filled."""
        now = time.monotonic()
        for item in batch.items:
            req = item.seq.request
            if req.timing.first_scheduled is None:
                req.timing.first_scheduled = now
            self.stats_totals.computed_tokens += max(0, min(item.start + item.num_tokens, item.seq.num_prompt_tokens)
                                                     - item.start)
        prev = self._in_flight
        inputs = PendingInputs(prev.sampled.token_ids, prev.launch.draw_of()) if prev is not None and prev.sampled else None
        start = self.clock.mark()
        prompt_ask = self.prompt_logprobs.ask(batch) if self.prompt_logprobs else None
        decode = decode_tokens(batch)
        self.phases.lap(SCHEDULE)
        batch, logits, failed = run_isolating_failures(self.runner, batch, inputs,
                                                       prompt_ask.rows if prompt_ask is not None else None)
        self.phases.lap(FORWARD)  # batch building inside it is lapped apart (step_phases.py)
        # before `launched`, whose pending slots make no chunk reach its sequence's last token
        prefill = batch.num_tokens - sum(it.logit_rows for it in batch.items if it.samples)
        launch = self.scheduler.launched(batch, failed, self._noise_key)
        for fork in launch.forks:
            self.outputs.track(fork)
        draws, plan = sampler_draws(launch)  # the launch's draws, then verifying draws' extra rows
        masks = self.constraints.masks(launch.owners, launch.positions, _pending_ids(prev)) \
            if self.constraints and draws else None
        if masks is not None:
            failed = {**failed, **masks.dead}
        penalties = self.penalties.step(launch.owners, launch.positions) if self.penalties and draws else None
        self.phases.lap(SCHEDULE)  # the launch's bookkeeping: pending slots, grammar masks, penalty rows
        sampled = self.sampler.sample(logits, draws, masks, penalties) if draws and logits is not None else None
        if sampled is not None and penalties is not None:  # on the device, before the next step samples
            self.penalties.count_sampled(penalties, sampled.token_ids)
        span = self.clock.span(start)
        if sampled is not None:
            sampled.start_copy()
        self.phases.lap(FORWARD)
        return InFlight(launch, sampled, dict(failed), span, prefill, prompt_ask, plan, decode)

    def _resolve(self, flight: InFlight) -> list[RequestOutput]:
        """Hand a launched step's sampled tokens to the scheduler and build the outputs."""
        failed = flight.failed
        ids, usable, logprobs = flight.sampled.host() if flight.sampled is not None else ([], [], {})
        self.phases.lap(WAIT)  # the rest of the step is post-processing
        self.clock.resolved(flight.span)
        self.cost_feed.observe(flight.prefill_tokens)
        owners = flight.launch.owners
        failed.update((s.request, INVALID_LOGITS) for s, ok in zip(owners, usable) if not ok)
        if flight.prompt_ask is not None:
            self.prompt_logprobs.collect(flight.prompt_ask)
        commits = self.constraints.commits(flight.launch, ids, logprobs, failed)  # forced tokens included
        if flight.verify_plan is not None and flight.verify_plan.extra_at:
            failed.update((req, INVALID_LOGITS) for req in unusable_verifications(flight.launch, flight.verify_plan, usable))
            self.stats_totals.count_verified(verify(flight.launch, flight.verify_plan, ids, logprobs, commits))
        voids = set(self.scheduler.void_draws) if self.penalties else None
        done = self.scheduler.commit(flight.launch, commits, list(failed), self._stopped)
        if voids is not None:  # forced tokens counted, the draws they made void uncounted
            self.penalties.committed(flight.launch, commits, self.scheduler.void_draws - voids, _sampled(self._in_flight))
        failed.update((req, self.constraints.violation(req) or POSTPROCESS_FAILED) for req in done.errors)
        self.stats_totals.generation_tokens += done.tokens
        self.stats_totals.committed_draws += len(done.touched)
        now = time.monotonic()
        touched: dict[str, list[Sequence]] = {}
        for seq in done.touched:
            if seq.request not in failed:
                seq.request.timing.first_token = seq.request.timing.first_token or now
                touched.setdefault(seq.request.request_id, []).append(seq)
        outputs = [self._output(self.requests[rid], seqs) for rid, seqs in touched.items() if rid in self.requests]
        return outputs + [self._fail(req, why) for req, why in failed.items() if req.request_id in self.requests]

    def _stopped(self, seq: Sequence, token: int) -> bool:
        """The stop test the scheduler is handed: a stop string (the detokenizer sees every committed
        token, in order), EOS unless ignored, or a stop id."""
        params = seq.request.params
        stopped = self.outputs.add_token(seq, token) or (token in self.eos_token_ids and not params.ignore_eos) \
            or token in params.stop_token_ids
        # the grammar's end; a reply that stops before it raises GrammarViolation (finish_reason "error")
        completed = self.constraints.on_commit(seq, stopped) if params.structured is not None else False
        return stopped or completed

    def _fail(self, req: Request, why: str) -> RequestOutput:
        """End one request with finish_reason "error"; the rest of the batch is untouched. A request its
        constraint ended is a reply that ends in error (`error_ends_reply`), not a failure."""
        ends_reply = req.params.structured is not None and self.constraints.violation(req) is not None
        self.scheduler.end(req, "error")
        out = self._output(req, req.sequences)
        out.error, out.error_ends_reply = why, ends_reply
        return out

    def _unschedulable(self) -> list[RequestOutput]:
        """Nothing could be scheduled though work remains (a liveness bug: counted, and the head of the
        queue failed if it can never fit, so the engine does not spin on empty steps)."""
        if not self.scheduler.has_work():
            return []
        self.stats_totals.stalled_steps += 1
        head = self.scheduler.unschedulable_head()
        return [self._fail(head, "the request does not fit in the KV cache")] if head is not None else []

    def _output(self, req: Request, seqs: list[Sequence]) -> RequestOutput:
        out = self.outputs.output(req, seqs)
        if req.params.prompt_logprobs is not None:
            out.prompt_logprobs = self.prompt_logprobs.take(req)
        if out.finished:  # the request retires
            self.requests.pop(req.request_id, None)
            if req.params.structured is not None:
                self.constraints.release(req)
            if req.params.has_penalties:
                self.penalties.release(req)
            self.prompt_logprobs.release(req)
            self.stats_totals.count_finished(req)
        return out

    # -- introspection -------------------------------------------------------------------------
    def live_sequences(self) -> list[Sequence]:
        return self.scheduler.live_sequences()

    def stats(self) -> EngineStats:
        return EngineStats.collect(self)

    def leaked_blocks(self) -> int:
        return self.scheduler.leaked_blocks()

    def check_integrity(self) -> None:
        self.scheduler.check_integrity(self.pins.held_nodes())


def grammar_limits(config: EngineConfig) -> GrammarLimits:
    return GrammarLimits(workers=config.grammar_compile_workers, cache_mb=config.grammar_cache_mb,
                         compile_timeout_s=config.grammar_compile_timeout_s,
                         worker_memory_mb=config.grammar_worker_memory_mb,
                         max_lexer_states=config.grammar_max_lexer_states)


def _sampled(flight: InFlight | None) -> tuple[Launch, torch.Tensor] | None:
    """The launch still in flight and its sampled ids on the device, if it sampled."""
    return None if flight is None or flight.sampled is None else (flight.launch, flight.sampled.token_ids)


def _pending_ids(flight: InFlight | None) -> Callable[[Sequence], int | None]:
    """The id a sequence's draw in the step still in flight sampled (waiting for it), if it drew there."""
    if flight is None or flight.sampled is None:
        return lambda seq: None
    sampled, draw_of = flight.sampled, flight.launch.draw_of()

    def pending(seq: Sequence) -> int | None:
        draw = draw_of.get(seq.seq_id)
        return None if draw is None else sampled.host()[0][draw]
    return pending
