"""The synchronous engine: requests in, one scheduled step at a time, incremental outputs out.

Owns the request table, the model runner, the sampler, the outputs (`outputs.OutputTracker`), the
per-request logits features and the step recorder. It writes no sequence: the scheduler owns
sequences and cache state and takes each step's results back (`Scheduler.launched`,
`Scheduler.commit`). A step reads top to bottom in `step`, `_launch` and `_resolve`: schedule → block
copies → forward → the features' draws and logits edits → sample → the features' commits → scheduler
commit → outputs.

Every per-request logits feature (structured output's `ConstraintBook`, `PenaltyBook`,
`PromptLogprobBook`, the `DraftVerifier`, and the token rules min_tokens, bad_words and
allowed_token_ids) goes through one seam, `engine/features.py`: the step loops over
`LogitsFeatures`, never naming one, and which requests may draft is derived from them. Timing and
counters (device vs host time, phases, observers, the cumulative counters, the integrity check) are
the `StepRecorder`'s (engine/step_recorder.py).

Overlap (`EngineConfig.overlap`; by default on CUDA, off on CPU where it would only delay each
output by a step): `step()` launches step N, then commits step N-1, so the host works while the
device computes (the pending-token rules: `scheduler/pending.py`). A request whose own forward,
logits or decoding fails ends alone with finish_reason "error". Step observers see a `StepInfo`
after every step; RADIXSERVE_CHECK_INTEGRITY=1 checks the scheduler's integrity after every step.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from radixserve.cache.block_pool import BlockPool
from radixserve.cache.radix_tree import RadixTree
from radixserve.cache.window_blocks import WindowBlocks
from radixserve.config import EngineConfig
from radixserve.core import Batch, Request, RequestOutput, Sequence
from radixserve.engine.features import INVALID_LOGITS, LogitsFeatures, SamplingStep
from radixserve.engine.forward import FORWARD_FAILED, run_isolating_failures
from radixserve.engine.grammar import ConstraintBook, GrammarCompiler
from radixserve.engine.grammar.limits import GrammarLimits
from radixserve.engine.intake import Intake, ValidatedRequest
from radixserve.engine.observers import StepObserver
from radixserve.engine.outputs import OutputTracker
from radixserve.engine.penalties import PenaltyBook
from radixserve.engine.pins import PinRegistry, pin_budget_blocks
from radixserve.engine.prompt_logprobs import PromptLogprobBook
from radixserve.engine.sampler import Sampler
from radixserve.engine.sizing import Sizes, engine_sizes
from radixserve.engine.speculation import DraftVerifier, default_max_batch, default_max_rows
from radixserve.engine.stats import EngineStats
from radixserve.engine.step_clock import StepClock
from radixserve.engine.step_phases import SCHEDULE, StepPhases
from radixserve.engine.step_recorder import LaunchRecord, StepRecorder
from radixserve.engine.token_rules import AllowedTokenIds, BadWords, MinTokens
from radixserve.errors import RequestError
from radixserve.model.embedded import resolve_model
from radixserve.model.loader import load_tokenizer
from radixserve.model.runner import ModelRunner, PendingInputs
from radixserve.model.spec import ModelSpec
from radixserve.sampling_params import SamplingParams
from radixserve.scheduler import Scheduler

# What a failed request's caller is told: our words, never a library's exception text (that is logged).
POSTPROCESS_FAILED = "decoding this request's output failed; see the server log"
__all__ = ["FORWARD_FAILED", "INVALID_LOGITS", "POSTPROCESS_FAILED", "LLMEngine"]


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelFacts:
    """What the engine knows of its model once loaded and sized."""

    model_dir: str
    model_name: str
    spec: ModelSpec
    eos_token_ids: frozenset[int]
    max_model_len: int  # the context length the engine advertises
    max_seq_len: int  # the longest sequence (prompt + generated) it runs


@dataclass(frozen=True)
class CachePools:
    """The KV block pools (device, and the host tier's), a hybrid model's state slots, and the radix
    tree over them."""

    pool: BlockPool
    host_pool: BlockPool | None
    tree: RadixTree | None
    states: BlockPool | None = None  # recurrent-state slots, one-slot "blocks" (None: attention layers only)
    windows: WindowBlocks | None = None  # --sliding-window-kv window-blocks: the sliding layers' K/V of cached blocks

    @classmethod
    def of(cls, config: EngineConfig, sizes: Sizes, window: int = 0) -> CachePools:
        """`window`: the longest sliding window, which window blocks need."""
        pool = BlockPool(sizes.num_blocks, config.block_size)
        host_pool = BlockPool(sizes.host_blocks, config.block_size) if sizes.host_blocks else None
        states = BlockPool(sizes.state_slots, 1) if sizes.state_slots else None
        tree = RadixTree(pool, host_pool, states) if config.enable_prefix_cache else None
        windows = WindowBlocks(sizes.window_blocks, window, pool) if sizes.window_blocks else None
        return cls(pool, host_pool, tree, states, windows)


@dataclass
class RequestKeys:
    """Each request's admission order, and each sample's noise key: a seeded sample's follows from its
    seed, an unseeded one's from the engine's generator."""

    generator: random.Random
    order: itertools.count[int] = field(default_factory=itertools.count)

    def noise_key(self, req: Request, index: int) -> int:
        seed = req.params.sample_seed(index)
        return self.generator.getrandbits(64) if seed is None else seed


@dataclass
class InFlight:
    """A launched step whose sampled ids have not been committed yet."""

    step: SamplingStep
    record: LaunchRecord


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        started = time.perf_counter()
        model_dir, model_name = resolve_model(config.model, config.dtype, config.device, config.enforce_eager)
        self.runner = ModelRunner(model_dir, config.dtype, config.device, config.attention_backend,
                                  config.block_size, config.load_format, config.enforce_eager, config.cpu_threads,
                                  config.kv_cache_dtype, config.quantized_activations, config.sliding_window_kv)
        self.tokenizer: Any = load_tokenizer(model_dir)
        self.config = config = for_device(config, self.runner.device)
        sizes = engine_sizes(config, self.runner)
        spec = self.runner.spec
        self.model = ModelFacts(str(model_dir), model_name, spec, frozenset(spec.eos_token_ids), sizes.max_model_len,
                                sizes.max_seq_len)
        self.runner.allocate_kv_cache(sizes.num_blocks, sizes.host_blocks, sizes.state_slots, sizes.window_blocks)
        self.cache = CachePools.of(config, sizes, max((a.window or 0 for a in spec.attentions), default=0))
        self.scheduler = Scheduler(config, self.cache.pool, self.cache.tree, max_seq_len=sizes.max_seq_len,
                                   states=self.cache.states, windows=self.cache.windows)
        self.pins = PinRegistry(self.scheduler, pin_budget_blocks(config.pin_budget, sizes.num_blocks,
                                                                  sizes.max_seq_len, config.block_size))
        self.recorder = StepRecorder(self.runner, self.scheduler, self.cache.pool,
                                     lambda: self.constraints.stats.forced_tokens, self.check_integrity)
        self.features = logits_features(config, self.model, self.tokenizer, self.runner.device, self.recorder.totals)
        self.scheduler.drafts.forbid_drafts(self.features.draft_vetoes())
        self.intake = Intake.of(self)  # the one check of a request (engine/intake.py)
        self.sampler = Sampler(self.runner.device)
        self._keys = RequestKeys(random.Random(config.seed))  # the engine's generator: noise keys of unseeded samples
        self.runner.prepare_decode(config.max_num_seqs, sizes.max_seq_len)
        self.requests: dict[str, Request] = {}
        self.outputs = OutputTracker(self.tokenizer, self.model.eos_token_ids)
        self._in_flight: InFlight | None = None
        log.info("engine ready in %.1f s: %s on %s (%s, %d threads), %d KV blocks%s", time.perf_counter() - started,
                 model_name, self.runner.device, str(self.runner.dtype).removeprefix("torch."),
                 torch.get_num_threads(), sizes.num_blocks,
                 {"fp8": " (FP8)", "fp16": " (fp16 K/V)"}.get(self.runner.kv_cache_dtype, ""))

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
        req = Request(request_id, token_ids, params, priority=request.priority, order=next(self._keys.order),
                      prediction_ids=request.prediction_ids)
        req.drafts.prediction_tokens = len(request.prediction_ids)
        req.timing.arrival = time.monotonic()
        seq = Sequence(req, 0, list(token_ids), len(token_ids), noise_key=self._keys.noise_key(req, 0),
                       pending_forks=params.n - 1)  # created here; from now on only the scheduler writes it
        self.features.begin(req, request)
        self.requests[request_id] = req
        self.outputs.track(seq)
        self.scheduler.add(seq)
        self.recorder.totals.prompt_tokens += len(token_ids)
        return request_id

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
        self.recorder.observers.add(observer, pool)

    def step(self) -> list[RequestOutput]:
        """Schedule and launch one step; return the outputs of the step that just resolved: this
        one without overlap, the previous one with it (the last call with nothing left to schedule
        resolves the step still in flight)."""
        self.recorder.begin()
        batch = self.scheduler.schedule()
        if batch.copies:
            self.runner.apply_copies(batch.copies)
        if not batch.items:
            flight, self._in_flight = self._in_flight, None
            return self.recorder.end(self._resolve(flight) if flight is not None else self._unschedulable())
        self.recorder.scheduled()
        launched = self._launch(batch)
        flight, self._in_flight = (self._in_flight, launched) if self.config.overlap else (launched, None)
        outputs = self._resolve(flight) if flight is not None else []
        self.recorder.stepped(batch, launched.record)
        return self.recorder.end(outputs)

    def _launch(self, batch: Batch) -> InFlight:
        """Run the forward and sampling of `batch` without waiting for the device; the scheduler
        gives each draw a pending slot that `_resolve` has filled."""
        prev = self._in_flight.step if self._in_flight is not None else None
        step = SamplingStep(batch, _pending_ids(prev))
        self.features.ask_forward(step)  # extra outputs of the forward (prompt-logprob rows)
        record = self.recorder.launching(batch)
        inputs = PendingInputs(prev.sampled.token_ids, prev.launch.draw_of()) if prev and prev.sampled else None
        batch, logits, failed = run_isolating_failures(self.runner, batch, inputs, step.asked)
        self.recorder.forwarded(record, batch)
        step.launched(self.scheduler.launched(batch, failed, self._keys.noise_key), failed)
        for fork in step.launch.forks:
            self.outputs.track(fork)
        self.features.contribute(step)  # extra draws (verification), logits edits, failures
        self.recorder.lap(SCHEDULE)  # the launch's bookkeeping: pending slots, masks, penalty rows
        if step.draws and logits is not None:
            step.sampled = self.sampler.sample(logits, step.draws, step.edits)
            self.features.sampled(step)
        self.recorder.launched(record, step.sampled)
        return InFlight(step, record)

    def _resolve(self, flight: InFlight) -> list[RequestOutput]:
        """Hand a launched step's tokens, as the features commit them, to the scheduler; build the outputs."""
        step = flight.step
        step.to_host()
        self.recorder.resolved(flight.record)  # the rest of the step is post-processing
        self.features.resolve(step)  # prompt logprobs taken; forced tokens and verified drafts in the commits
        voided = set(self.scheduler.void_draws)
        done = self.scheduler.commit(step.launch, step.commits, list(step.failed), self._stopped)
        later = self._in_flight.step if self._in_flight is not None else None
        self.features.after_commit(step, self.scheduler.void_draws - voided, later)
        step.failed.update((req, self.features.violation(req) or POSTPROCESS_FAILED) for req in done.errors)
        self.recorder.committed(done)
        return self._outputs(done.touched, step.failed)

    def _outputs(self, touched: list[Sequence], failed: dict[Request, str]) -> list[RequestOutput]:
        """The outputs of a resolved step: the touched sequences' requests, then the failed ones."""
        now = time.monotonic()
        by_request: dict[str, list[Sequence]] = {}
        for seq in touched:
            if seq.request not in failed:
                seq.request.timing.first_token = seq.request.timing.first_token or now
                by_request.setdefault(seq.request.request_id, []).append(seq)
        outputs = [self._output(self.requests[rid], seqs) for rid, seqs in by_request.items() if rid in self.requests]
        return outputs + [self._fail(req, why) for req, why in failed.items() if req.request_id in self.requests]

    def _stopped(self, seq: Sequence, token: int) -> bool:
        """The stop test the scheduler is handed: a stop string (the detokenizer sees every committed
        token, in order), EOS unless ignored, or a stop id; then each feature's part (a grammar's end;
        a reply that stops before it raises GrammarViolation: finish_reason "error")."""
        params = seq.request.params
        stopped = self.outputs.add_token(seq, token) or (token in self.model.eos_token_ids and not params.ignore_eos) \
            or token in params.stop_token_ids
        return self.features.stops(seq, stopped) or stopped

    def _fail(self, req: Request, why: str) -> RequestOutput:
        """End one request with finish_reason "error"; the rest of the batch is untouched. A request a
        feature ended (its constraint) is a reply that ends in error (`error_ends_reply`), not a failure."""
        ends_reply = self.features.violation(req) is not None
        self.scheduler.end(req, "error")
        out = self._output(req, req.sequences)
        out.error, out.error_ends_reply = why, ends_reply
        return out

    def _unschedulable(self) -> list[RequestOutput]:
        """Nothing could be scheduled though work remains (a liveness bug: counted, and the head of the
        queue failed if it can never fit, so the engine does not spin on empty steps)."""
        if not self.scheduler.has_work():
            return []
        self.recorder.totals.stalled_steps += 1
        head = self.scheduler.unschedulable_head()
        return [self._fail(head, "the request does not fit in the KV cache")] if head is not None else []

    def _output(self, req: Request, seqs: list[Sequence]) -> RequestOutput:
        out = self.outputs.output(req, seqs)
        self.features.add_to_output(req, out)
        if out.finished:  # the request retires
            self.requests.pop(req.request_id, None)
            self.features.release(req)
            self.recorder.totals.count_finished(req)
        return out

    # -- the parts, by the names callers read ------------------------------------------------------
    @property
    def model_dir(self) -> str:
        return self.model.model_dir

    @property
    def model_name(self) -> str:
        return self.model.model_name

    @property
    def spec(self) -> ModelSpec:
        return self.model.spec

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.model.eos_token_ids

    @property
    def max_model_len(self) -> int:
        return self.model.max_model_len

    @property
    def max_seq_len(self) -> int:
        return self.model.max_seq_len

    @property
    def pool(self) -> BlockPool:
        return self.cache.pool

    @property
    def host_pool(self) -> BlockPool | None:
        return self.cache.host_pool

    @property
    def tree(self) -> RadixTree | None:
        return self.cache.tree

    @property
    def constraints(self) -> ConstraintBook:
        return self.features.of_type(ConstraintBook)

    @property
    def grammars(self) -> GrammarCompiler:
        return self.constraints.compiler

    @property
    def penalties(self) -> PenaltyBook:
        return self.features.of_type(PenaltyBook)

    @property
    def stats_totals(self) -> EngineStats:
        return self.recorder.totals

    @property
    def clock(self) -> StepClock:
        return self.recorder.clock

    @property
    def phases(self) -> StepPhases:
        return self.recorder.phases

    # -- introspection -------------------------------------------------------------------------
    def live_sequences(self) -> list[Sequence]:
        return self.scheduler.live_sequences()

    def stats(self) -> EngineStats:
        return EngineStats.collect(self)

    def leaked_blocks(self) -> int:
        return self.scheduler.leaked_blocks()

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()


def for_device(config: EngineConfig, device: torch.device) -> EngineConfig:
    """`config` with what it leaves to the device filled in: the speculation caps (max_rows stays None
    where the device has no knee) and overlap (on CUDA; on CPU it would only delay each output)."""
    if config.speculative_max_batch is None:
        config = replace(config, speculative_max_batch=default_max_batch(device))
    if config.speculative_max_rows is None:
        config = replace(config, speculative_max_rows=default_max_rows(device))
    if config.overlap is None:
        config = replace(config, overlap=device.type == "cuda")
    return config


def logits_features(config: EngineConfig, model: ModelFacts, tokenizer: Any, device: torch.device,
                    totals: EngineStats) -> LogitsFeatures:
    """The engine's per-request logits features, in stage order (engine/features.py)."""
    vocab, eos = model.spec.vocab_size, model.eos_token_ids
    grammars = GrammarCompiler(tokenizer, vocab, sorted(eos), config.grammar_cache_size, grammar_limits(config),
                               config.open_json_objects)
    return LogitsFeatures([
        DraftVerifier(totals),  # first: its extra draws exist before any mask is built over the draws
        ConstraintBook(grammars, vocab, device, config.forced_tokens),
        MinTokens(eos, device),
        BadWords(device),
        AllowedTokenIds(device),
        PenaltyBook(vocab, device),  # after the masks (sampler.py)
        PromptLogprobBook(),
    ])


def grammar_limits(config: EngineConfig) -> GrammarLimits:
    return GrammarLimits(workers=config.grammar_compile_workers, cache_mb=config.grammar_cache_mb,
                         compile_timeout_s=config.grammar_compile_timeout_s,
                         worker_memory_mb=config.grammar_worker_memory_mb,
                         max_lexer_states=config.grammar_max_lexer_states)


def _pending_ids(step: SamplingStep | None) -> Callable[[Sequence], int | None]:
    """The id a sequence's draw in the step still in flight sampled (waiting for it), if it drew there."""
    if step is None or step.sampled is None:
        return lambda seq: None
    sampled, draw_of = step.sampled, step.launch.draw_of()

    def pending(seq: Sequence) -> int | None:
        draw = draw_of.get(seq.seq_id)
        return None if draw is None else sampled.host()[0][draw]
    return pending
