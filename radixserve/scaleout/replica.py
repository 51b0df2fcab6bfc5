"""One engine replica of the Ray Serve application: an AsyncEngine with its own pool, radix tree and
(on GPU) its own device, which Ray gives it through the deployment's resource request.

It streams generations as calls.py describes, runs beam searches whole, and reports to the routers
through Ray Serve's `record_routing_stats` (polled by the controller every
`request_routing_stats_period_s` and handed to every router): its engine statistics and the cache
events its tree dropped (each with its namespace), and its pins with their hit counts and the pin
budget (ClusterEngine.pins reads them there). A report carries the events of the last `REPORT_WINDOW` reports, so a
router that misses a few reports (they are snapshots, the newest wins) still sees every event.
Ray Serve's health check calls `check_health`; an engine that died or stalls gets the replica
restarted.

Pins and the tree view are calls the ingress makes on every replica by name (replica_calls.py); a
call meant for another replica (gone when it was routed) is answered `NotHere` and does nothing.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from ray import serve

from radixserve.cache.tree_view import TreeView
from radixserve.config import EngineConfig
from radixserve.engine.async_engine import AsyncEngine
from radixserve.engine.beam_search import BeamSearchOutput
from radixserve.engine.pins import PinInfo
from radixserve.scaleout.calls import BeamCall, EngineCall, Failed, NotHere, ReplicaFacts, Served, Target

log = logging.getLogger("radixserve.scaleout")
REPORT_WINDOW = 4


class EngineReplica:
    def __init__(self, engine_config: EngineConfig, torch_threads: int | None = None,
                 health_stall_s: float = 120.0) -> None:
        if torch_threads is not None:  # the runner sizes torch's pool from the config (model/cpu_threads.py)
            engine_config = dataclasses.replace(engine_config, cpu_threads=torch_threads)
        self.name = serve.get_replica_context().replica_id.unique_id
        self.engine = AsyncEngine(engine_config)
        self.events = self.engine.follow_cache_events() if engine_config.enable_prefix_cache else None
        self.health_stall_s = health_stall_s
        self._reported: deque[int] = deque(maxlen=REPORT_WINDOW)  # last event seq of recent reports

    def facts(self) -> ReplicaFacts:
        e = self.engine
        grammars = e.intake.grammars
        return ReplicaFacts(self.name, e.model_name, e.max_model_len, e.intake.limits.vocab, e.eos_token_ids,
                            e.block_size, e.tokenizer, grammars is not None and grammars.open_objects)

    def _served(self) -> Served:
        return Served(self.name, self.events.last_seq if self.events is not None else 0)

    async def generate(self, call: EngineCall) -> AsyncIterator[Any]:
        yield self._served()
        try:
            async for out in self.engine.generate_validated(call.request, request_id=call.request_id):
                yield out
        except Exception as e:  # the caller gets radixserve's error, not a traceback
            yield self._failed(e, f"request {call.request_id}")

    async def beam_search(self, call: BeamCall) -> tuple[Served, BeamSearchOutput | Failed]:
        served = self._served()
        try:
            return served, await self.engine.beam_search(call.prompt, call.params, call.priority)
        except Exception as e:
            return served, self._failed(e, "a beam search")

    async def pin(self, target: Target, token_ids: list[int], namespace: str, label: str) -> PinInfo | Failed | NotHere:
        if target.replica != self.name:
            return NotHere(self.name)
        try:
            return await self.engine.pin(token_ids, namespace, label)
        except Exception as e:
            return self._failed(e, "a pin")

    async def unpin(self, target: Target, pin_id: str) -> PinInfo | None | NotHere:
        if target.replica != self.name:
            return NotHere(self.name)
        return await self.engine.unpin(pin_id)

    async def cache_tree(self, target: Target, limit: int,
                         include: Callable[[str], bool] | None) -> TreeView | NotHere:
        if target.replica != self.name:
            return NotHere(self.name)
        return await self.engine.cache_tree(limit, include)

    def _failed(self, e: Exception, what: str) -> Failed:
        """What the caller is told; a failure that is not the request's own fault is logged here,
        where its traceback is (the caller's message points to this log)."""
        if not isinstance(e, ValueError):
            log.exception("%s failed on replica %s", what, self.name)
        return Failed.of(e)

    def record_routing_stats(self) -> dict[str, Any]:
        """Plain types only: Ray's controller unpickles this, and radixserve need not be importable there."""
        report: dict[str, Any] = {"replica": self.name, "stats": self.engine.stats().to_dict(), "events": None}
        if self.events is not None:
            batch = self.events.since(self._reported[0] if self._reported else 0)
            self._reported.append(batch.last_seq)
            report["events"] = {"last_seq": batch.last_seq,
                                "dropped": [(e.seq, e.path, e.namespace) for e in batch.events]}
            report["pins"] = [dataclasses.asdict(p) for p in self.engine.pins()]
            report["pin_budget"] = dataclasses.astuple(self.engine.pin_budget())
        return report

    def check_health(self) -> None:
        problem = self.engine.health(self.health_stall_s)
        if problem is not None:
            raise RuntimeError(problem)
