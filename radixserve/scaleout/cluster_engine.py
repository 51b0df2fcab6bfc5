"""The ingress's engine: the EngineClient contract (engine/client.py) over the engine replicas of a
Ray Serve application, so the unchanged server app serves many replicas as it serves one engine.

Each generation is one streaming call through the deployment handle; the handle's router (router.py)
picks the replica. The ingress, not the replica, keeps what a conversation needs: the server's
sessions hold the token history, and this class holds which replica each session lives on
(`placement.affinity` in the request's cache namespace -> replica, learnt from the replica's first
frame: affinity.py). When that replica is gone the router sends the next turn elsewhere ("failover")
and the history is simply recomputed there.

A replica that dies mid-request fails that request with a clear RequestFailedError (the server's
500 `generation_failed`); nothing else is affected. When a request finishes, the tokens its replica
cached (prompt and reply) go into the router's picture of that replica; when it ends before its
first token (aborted, refused), the router forgets the prompt it entered there (routing.py).

Pins are made on every replica and kept there as replicas come and go (cluster_pins.py); the tree
view merges every replica's (tree_merge.py), its namespaces unchanged, so the server filters and
labels it as it does one engine's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any, cast

from ray.exceptions import RayError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from radixserve.cache.tree_view import TreeView
from radixserve.core import CompletionOutput, Placement, RequestOutput, StepInfo, Timing, Usage
from radixserve.engine.beam_search import BeamSearchOutput, BeamSearchParams
from radixserve.engine.grammar import GrammarCompiler
from radixserve.engine.intake import Intake, Limits, ValidatedRequest
from radixserve.engine.pins import PinBudget, PinInfo
from radixserve.engine.stats import EngineStats
from radixserve.errors import EngineStoppedError, RequestFailedError
from radixserve.sampling_params import SamplingParams
from radixserve.scaleout.affinity import SessionAffinity
from radixserve.scaleout.calls import BeamCall, EngineCall, Failed, ReplicaFacts, Served
from radixserve.scaleout.cluster_pins import ClusterPins
from radixserve.scaleout.replica_calls import ReplicaCalls
from radixserve.scaleout.routing import RoutingTable, table_for
from radixserve.scaleout.tree_merge import merge_views

log = logging.getLogger("radixserve.scaleout")


class ClusterEngine:
    def __init__(self, handle: DeploymentHandle, table_key: str) -> None:
        self.handle = handle
        self.table: RoutingTable = table_for(table_key)
        self._facts: ReplicaFacts | None = None
        self._intake: Intake | None = None
        self.affinity = SessionAffinity()
        self.calls = ReplicaCalls(handle, self.table)
        self.pinned = ClusterPins(self.calls, self.table)
        self._keeping_pins: asyncio.Task[None] | None = None
        self._streams: dict[str, DeploymentResponseGenerator] = {}
        self._aborted: set[str] = set()  # ids this side cancelled (their RequestCancelledError is expected)
        self._stopping = False

    # -- facts (from any replica: they run the same model) ---------------------------------------
    @property
    def facts(self) -> ReplicaFacts:
        if self._facts is None:
            raise RuntimeError("ClusterEngine.start() has not run")
        return self._facts

    @property
    def tokenizer(self) -> Any:
        return self.facts.tokenizer

    @property
    def model_name(self) -> str:
        return self.facts.model_name

    @property
    def max_model_len(self) -> int:
        return self.facts.max_model_len

    @property
    def intake(self) -> Intake:
        """The replicas' checks (they run the same model and configuration), run at the ingress."""
        if self._intake is None:
            facts = self.facts
            grammars = GrammarCompiler(facts.tokenizer, facts.vocab_size, list(facts.eos_token_ids),
                                       open_objects=facts.open_json_objects)
            self._intake = Intake(facts.tokenizer, Limits(facts.vocab_size, facts.max_model_len), grammars)
        return self._intake

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.facts.eos_token_ids

    @property
    def block_size(self) -> int:
        return self.facts.block_size

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        if self._facts is None:
            self._facts = await self.handle.facts.remote()
            with self.table.lock:  # the router's views are bounded in tokens of the replicas' pools
                self.table.block_size = self._facts.block_size
        if self._keeping_pins is None:
            self._keeping_pins = asyncio.get_running_loop().create_task(self.pinned.keep())

    async def shutdown(self) -> None:
        self._stopping = True
        for rid in list(self._streams):
            self.abort(rid)
        if self._keeping_pins is not None:
            self._keeping_pins.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeping_pins
        if self._intake is not None and self._intake.grammars is not None:
            self._intake.grammars.close()  # its compile worker processes

    # -- requests ------------------------------------------------------------------------------
    def _prefer(self, placement: Placement | None, namespace: str) -> str | None:
        return None if placement is None else self.affinity.get(namespace, placement.affinity)

    def _placed(self, placement: Placement | None, replica: str, namespace: str) -> None:
        if placement is not None:
            placement.replica = replica
            self.affinity.set(namespace, placement.affinity, replica)

    def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                 priority: int = 0, cancelled: Callable[[], bool] | None = None,
                 placement: Placement | None = None) -> AsyncIterator[RequestOutput]:
        return self.generate_validated(self.intake.check(prompt, params, priority), request_id, cancelled,
                                       placement)

    async def generate_validated(self, request: ValidatedRequest, request_id: str | None = None,
                                 cancelled: Callable[[], bool] | None = None,
                                 placement: Placement | None = None) -> AsyncIterator[RequestOutput]:
        """Checked here against the replicas' limits; the replica takes it as checked (or checks it
        again where its own pool is smaller: Intake.admit)."""
        if self._stopping:
            raise EngineStoppedError("the server is shutting down")
        tokens, params = request.token_ids, request.params
        rid = request_id or uuid.uuid4().hex
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in use")
        call = EngineCall(request, rid, self._prefer(placement, params.cache_namespace))
        stream = cast(DeploymentResponseGenerator, self.handle.options(stream=True).generate.remote(call))
        self._streams[rid] = stream
        if cancelled is not None and cancelled():
            self.abort(rid)
        served: Served | None = None
        last: RequestOutput | None = None
        replies: dict[int, list[int]] = {}
        try:
            async for frame in stream:
                if isinstance(frame, Served):
                    served = frame
                    self._placed(placement, frame.replica, params.cache_namespace)
                elif isinstance(frame, Failed):
                    raise frame.error()
                else:
                    last = frame
                    for o in frame.outputs:
                        replies.setdefault(o.index, []).extend(o.token_ids)
                    yield frame
                    if frame.finished:
                        self._cached(served, params.cache_namespace, tokens, replies)
                        return
        except RayError as e:
            if rid in self._aborted or self._stopping:  # our own cancel: end as a single engine does
                yield _aborted(rid, params.n, len(tokens), last)
                return
            replica = served.replica if served is not None else None
            log.warning("replica %s failed during request %s: %s", replica, rid, type(e).__name__)
            where = f"replica {replica}" if replica is not None else "the engine replica"
            raise RequestFailedError(f"{where} stopped while serving this request; send it again "
                                     "(a conversation continues on another replica)") from None
        finally:
            stream.cancel()  # a no-op once finished; otherwise it aborts the request on the replica
            self._streams.pop(rid, None)
            self._aborted.discard(rid)
            with self.table.lock:  # a token came back only once the replica had computed the prompt
                self.table.finished(rid, prefilled=any(replies.values()))

    def _cached(self, served: Served | None, namespace: str, prompt: list[int], replies: dict[int, list[int]]) -> None:
        if served is None:
            return
        with self.table.lock:
            for reply in replies.values() or [[]]:  # the last token was sampled, not computed
                self.table.cached(served.replica, prompt + reply[:-1], served.events_seq, namespace)

    async def beam_search(self, prompt: list[int], params: BeamSearchParams, priority: int = 0,
                          placement: Placement | None = None) -> BeamSearchOutput:
        """The whole search on one replica (its beams share the prompt's blocks there)."""
        try:
            replica, out = await self.handle.beam_search.remote(
                BeamCall(prompt, params, priority, self._prefer(placement, params.cache_namespace)))
            assert isinstance(replica, Served)
        except RayError:
            raise RequestFailedError("the replica stopped while running this beam search; send it again") from None
        self._placed(placement, replica.replica, params.cache_namespace)
        if isinstance(out, Failed):
            raise out.error()
        assert isinstance(out, BeamSearchOutput)
        return out

    def abort(self, request_id: str) -> None:
        """Cancel the call; the replica's engine aborts the request and the caller gets a final
        output with finish_reason "abort", as from one engine."""
        stream = self._streams.get(request_id)
        if stream is not None:
            self._aborted.add(request_id)
            stream.cancel()

    # -- pins and the tree view (cluster_pins.py, tree_merge.py) ---------------------------------
    async def pin(self, token_ids: list[int], namespace: str = "", label: str = "") -> PinInfo:
        """Pin on every replica (all or nothing): one id for the cluster."""
        return await self.pinned.pin(token_ids, namespace, label)

    async def unpin(self, pin_id: str) -> PinInfo | None:
        return await self.pinned.unpin(pin_id)

    def pins(self) -> list[PinInfo]:
        return self.pinned.list()

    def pin_budget(self) -> PinBudget:
        return self.pinned.budget()

    async def cache_tree(self, limit: int, include: Callable[[str], bool] | None = None) -> TreeView:
        """Every replica's tree as one view (tree_merge.py); `include` runs on the replicas, so it
        must pickle (a function or a closure over plain values)."""
        return merge_views(await self.calls.on_each("cache_tree", limit, include), limit)

    def drain_steps(self) -> list[StepInfo]:
        """Steps run on the replicas; their step histograms are in each replica's own process."""
        return []

    def health(self, stall_s: float) -> str | None:
        """Ray Serve restarts a replica whose engine is unhealthy; the endpoint is down only when no
        replica is up."""
        with self.table.lock:
            return None if self.table.indexes else "no engine replica is running"

    # -- statistics ----------------------------------------------------------------------------
    def replica_stats(self) -> dict[str, EngineStats]:
        """Each replica's statistics from its last report (a replica that has not reported yet: empty)."""
        with self.table.lock:
            return {name: rep.stats or EngineStats() for name, rep in sorted(self.table.reports.items())}

    def stats(self) -> EngineStats:
        """The replicas' figures summed; counters include replicas that are gone, so they never go back."""
        total = EngineStats.merged(list(self.replica_stats().values()))
        with self.table.lock:
            total.add_counters(self.table.retired)
        return total


def _aborted(rid: str, n: int, prompt_tokens: int, last: RequestOutput | None) -> RequestOutput:
    """The final output of a request this side aborted: every sample ends with "abort", no new tokens."""
    outputs = [CompletionOutput(index=i, finish_reason="abort") for i in range(n)]
    if last is None:
        return RequestOutput(rid, outputs, Usage(prompt_tokens=prompt_tokens), Timing(arrival=time.monotonic()),
                             finished=True)
    return replace(last, outputs=outputs, finished=True)
