"""The synchronous engine: requests in, one scheduled step at a time, incremental outputs out.

Owns the request table, the block pool, the radix tree, the scheduler, the model runner and the
sampler, and the token accounting behind the cache metrics. It is single-threaded by design: the
async engine drives it from one background thread and hands it requests and aborts between steps.

Invariants (checked by `check_integrity`): every live sequence is in exactly one scheduler queue;
each block's refcount equals the sequence tables and tree nodes listing it; each tree node's lock
count equals the live sequences whose locked path passes through it.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from radixserve.block_pool import BlockPool
from radixserve.config import EngineConfig
from radixserve.detokenizer import IncrementalDetokenizer
from radixserve.errors import PromptTooLongError, RequestError
from radixserve.model.loader import load_tokenizer
from radixserve.model_runner import ModelRunner
from radixserve.outputs import CompletionOutput, RequestOutput, Usage
from radixserve.radix_tree import RadixTree
from radixserve.sampler import Sampler, generator_for
from radixserve.sampling_params import SamplingParams
from radixserve.scheduler import Batch, Scheduler
from radixserve.sequence import Request, Sequence, SequenceStatus
from radixserve.stats import EngineStats

log = logging.getLogger(__name__)
# What a failed request's caller is told: our words, never a library's exception text (that is logged).
FORWARD_FAILED = "the model failed on this request; see the server log"
INVALID_LOGITS = "the model produced non-finite logits for this request"
POSTPROCESS_FAILED = "decoding this request's output failed; see the server log"


def resolve_model(model: str | None) -> tuple[str, str]:
    """(directory, display name) of the model to serve; None means the embedded default."""
    if model is None:
        from radixserve.embedded import MODEL_NAME, embedded_model_dir

        return str(embedded_model_dir()), MODEL_NAME
    if not Path(model).is_dir():
        raise FileNotFoundError(f"model directory {model!r} does not exist (radixserve never downloads models)")
    return model, Path(model).resolve().name


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_dir, self.model_name = resolve_model(config.model)
        self.runner = ModelRunner(self.model_dir, config.dtype, config.device, config.attention_backend,
                                  config.block_size)
        self.spec = self.runner.spec
        self.tokenizer: Any = load_tokenizer(self.model_dir)
        layout = self.runner.kv_layout()
        num_blocks = config.num_blocks or layout.blocks_for_budget(config.kv_cache_memory_mb)
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
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch.items:
            return self._unschedulable()
        now = time.monotonic()
        for item in batch.items:
            req = item.seq.request
            if req.timing.first_scheduled is None:
                req.timing.first_scheduled = now
            self.stats_totals.computed_tokens += max(0, min(item.start + item.num_tokens, item.seq.num_prompt_tokens)
                                                     - item.start)
        failed: dict[Request, str] = {}
        try:
            logits = self.runner.run(batch)
        except Exception:
            # One request's input can break a batched forward; rerun the items one at a time so only
            # the requests whose own forward fails are lost.
            log.exception("a forward pass of %d sequences failed; retrying them one by one", len(batch.items))
            per_item = self.runner.run_each(batch)
            failed = {it.seq.request: FORWARD_FAILED for it, rows in zip(batch.items, per_item) if rows is None}
            kept = [(it, rows) for it, rows in zip(batch.items, per_item) if it.seq.request not in failed]
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
        sampling = [it for it in batch.items if it.samples]
        rows = [it.seq for it in sampling]
        tokens = self.sampler.sample(logits, [s.request.params for s in rows], [s.generator for s in rows]) \
            if rows else []
        failed.update((s.request, INVALID_LOGITS) for s, t in zip(rows, tokens) if t is None)
        now = time.monotonic()
        touched: dict[str, list[Sequence]] = {}
        for item in batch.items:
            seq = item.seq
            if seq.request in failed:
                continue
            before = seq.num_computed
            seq.num_computed = item.start + item.num_tokens
            self.scheduler.cache_computed(seq, before)
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
        """n > 1: the prompt is done; fork the other samples, sharing every block (COW), each with
        its own first token drawn from the same logits."""
        req = parent.request
        forks = []
        for i in range(1, parent.pending_forks + 1):
            child = Sequence(req, i, list(parent.token_ids), parent.num_prompt_tokens,
                             generator=generator_for(req.params, i), num_computed=parent.num_computed,
                             block_table=list(parent.block_table), locked_node=parent.locked_node,
                             admitted_once=True)
            for b in child.block_table:
                self.pool.incref(b)
            if child.locked_node is not None and self.tree is not None:
                self.tree.lock(child.locked_node)
            req.sequences.append(child)
            self._track(child)
            self.scheduler.add_running(child)
            token = self.sampler.sample(row[None], [req.params], [child.generator])[0]
            assert token is not None, "the parent's row was usable, so the same row is"
            forks.append((child, token))
        parent.pending_forks = 0
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
        return self.scheduler.running + self.scheduler.waiting

    def stats(self) -> EngineStats:
        return EngineStats.collect(self)

    def leaked_blocks(self) -> int:
        owners = Counter(b for s in self.live_sequences() for b in s.block_table)
        if self.tree is not None:
            owners.update(self.tree.block_refs())
        return sum(1 for b, rc in enumerate(self.pool.refcount) if rc > 0 and owners[b] == 0)

    def check_integrity(self) -> None:
        live = self.live_sequences()
        assert len({s.seq_id for s in live}) == len(live), "a sequence is queued twice"
        owners: Counter[int] = Counter()
        locks: Counter[int] = Counter()
        for s in live:
            owners.update(s.block_table)
            assert len(s.block_table) * self.pool.block_size >= s.num_computed, "table shorter than computed"
            node = s.locked_node
            while node is not None and self.tree is not None and node is not self.tree.root:
                locks[node.id] += 1
                node = node.parent
        if self.tree is not None:
            owners.update(self.tree.block_refs())
            self.tree.check_integrity()
            for n in self.tree.nodes():
                assert n.lock_count == locks[n.id], f"node {n.id}: lock count {n.lock_count} != {locks[n.id]}"
        self.pool.check_integrity(owners)
