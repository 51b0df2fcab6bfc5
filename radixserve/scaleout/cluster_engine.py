"""The ingress's engine: the EngineClient contract (engine/client.py) over the engine replicas of a
Ray Serve application, so the unchanged server app serves many replicas as it serves one engine.

Each generation is one streaming call through the deployment handle; the handle's router (router.py)
picks the replica. The ingress, not the replica, keeps what a conversation needs: the server's
sessions hold the token history, and this class holds which replica each session lives on
(`placement.affinity` -> replica, learnt from the replica's first frame). When that replica is gone
the router sends the next turn elsewhere ("failover") and the history is simply recomputed there.

A replica that dies mid-request fails that request with a clear RequestFailedError (the server's
500 `generation_failed`); nothing else is affected. When a request finishes, the tokens its replica
cached (prompt and reply) go into the router's picture of that replica; when it ends before its
first token (aborted, refused), the router forgets the prompt it entered there (routing.py).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any, cast

from ray.exceptions import RayError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from radixserve.core import CompletionOutput, Placement, RequestOutput, StepInfo, Timing, Usage
from radixserve.engine.beam_search import BeamSearchOutput, BeamSearchParams
from radixserve.engine.grammar import GrammarCompiler
from radixserve.engine.intake import Intake, Limits, ValidatedRequest
from radixserve.engine.stats import EngineStats
from radixserve.errors import EngineStoppedError, RequestFailedError
from radixserve.sampling_params import SamplingParams
from radixserve.scaleout.calls import BeamCall, EngineCall, Failed, ReplicaFacts, Served
from radixserve.scaleout.routing import RoutingTable, table_for

log = logging.getLogger("radixserve.scaleout")
MAX_AFFINITIES = 100_000  # sessions remembered (least recently used forgotten: they then fail over)


class ClusterEngine:
    def __init__(self, handle: DeploymentHandle, table_key: str) -> None:
        self.handle = handle
        self.table: RoutingTable = table_for(table_key)
        self._facts: ReplicaFacts | None = None
        self._intake: Intake | None = None
        self._affinity: OrderedDict[str, str] = OrderedDict()
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
            grammars = GrammarCompiler(facts.tokenizer, facts.vocab_size, list(facts.eos_token_ids))
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

    async def shutdown(self) -> None:
        self._stopping = True
        for rid in list(self._streams):
            self.abort(rid)

    # -- requests ------------------------------------------------------------------------------
    def _prefer(self, placement: Placement | None) -> str | None:
        if placement is None or placement.affinity is None:
            return None
        replica = self._affinity.get(placement.affinity)
        if replica is not None:
            self._affinity.move_to_end(placement.affinity)
        return replica

    def _placed(self, placement: Placement | None, replica: str) -> None:
        if placement is None:
            return
        placement.replica = replica
        if placement.affinity is not None:
            self._affinity[placement.affinity] = replica
            self._affinity.move_to_end(placement.affinity)
            while len(self._affinity) > MAX_AFFINITIES:
                self._affinity.popitem(last=False)

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
        call = EngineCall(request, rid, self._prefer(placement))
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
                    self._placed(placement, frame.replica)
                elif isinstance(frame, Failed):
                    raise frame.error()
                else:
                    last = frame
                    for o in frame.outputs:
                        replies.setdefault(o.index, []).extend(o.token_ids)
                    yield frame
                    if frame.finished:
                        self._cached(served, tokens, replies)
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

    def _cached(self, served: Served | None, prompt: list[int], replies: dict[int, list[int]]) -> None:
        if served is None:
            return
        with self.table.lock:
            for reply in replies.values() or [[]]:  # the last token was sampled, not computed
                self.table.cached(served.replica, prompt + reply[:-1], served.events_seq)

    async def beam_search(self, prompt: list[int], params: BeamSearchParams, priority: int = 0,
                          placement: Placement | None = None) -> BeamSearchOutput:
        """The whole search on one replica (its beams share the prompt's blocks there)."""
        try:
            replica, out = await self.handle.beam_search.remote(BeamCall(prompt, params, priority,
                                                                          self._prefer(placement)))
            assert isinstance(replica, Served)
        except RayError:
            raise RequestFailedError("the replica stopped while running this beam search; send it again") from None
        self._placed(placement, replica.replica)
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
