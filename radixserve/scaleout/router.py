"""Ray Serve request routers for the engine deployment: cache-aware, and Ray's power-of-two for contrast.

Both run where the requests come from (the ingress replica's process, on Ray's router loop) and
share the process-wide `RoutingTable` of their deployment (`table_for`), which the ingress reads for
statistics: every replica's periodic report (`record_routing_stats`: engine statistics and the cache
events it dropped) lands there, and so do requests sent and completed. `CacheAwareRouter` decides
with the table's rule (routing.py); `PowerOfTwoRouter` keeps Ray's choice and only records.

The table is touched from Ray's router loop and from the ingress's event loop, so every use holds
its lock. Ray ships this module to the routing process by value (cloudpickle), so nothing shared may
live in it: the tables are in routing.py, which is imported there by name.
"""

from __future__ import annotations

from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from radixserve.cache.events import Dropped, EventBatch
from radixserve.engine.stats import EngineStats
from radixserve.scaleout.routing import (
    DEFAULT_MAX_LOAD_GAP,
    DEFAULT_MIN_PREFIX_FRACTION,
    Decision,
    RoutingTable,
    table_for,
)

MAX_UNSENT_DECISIONS = 10_000


def _call_of(pending: PendingRequest | None) -> Any:
    return pending.args[0] if pending is not None and pending.args else None


class _Recording(RequestRouter):
    """Keeps the deployment's RoutingTable current; subclasses choose."""

    table: RoutingTable

    def initialize_state(self, **kwargs: Any) -> None:
        self._decisions: dict[int, Decision] = {}  # the rule's last choice per pending request not yet sent
        self.table = table_for(f"{self._deployment_id.app_name}/{self._deployment_id.name}")
        with self.table.lock:
            self.table.max_load_gap = int(kwargs.get("max_load_gap", DEFAULT_MAX_LOAD_GAP))
            self.table.min_prefix_fraction = float(kwargs.get("min_prefix_fraction", DEFAULT_MIN_PREFIX_FRACTION))

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        with self.table.lock:
            self.table.set_replicas(r.replica_id.unique_id for r in replicas)
            for r in replicas:
                report = r.routing_stats or {}
                if isinstance(report.get("stats"), dict):
                    events = report.get("events")
                    batch = None if events is None else EventBatch(
                        tuple(Dropped(seq, tuple(path)) for seq, path in events["dropped"]), events["last_seq"])
                    self.table.report(r.replica_id.unique_id, EngineStats.from_dict(report["stats"]), batch)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        call = _call_of(pending_request)
        prompt = getattr(call, "prompt", None)
        if prompt is None:  # not a generation (a facts call)
            return
        decision = self._decisions.pop(id(pending_request), None)
        with self.table.lock:  # a generation's id: the ingress reports its end (beam searches have none)
            self.table.sent(pending_request.metadata.internal_request_id, replica_id.unique_id, prompt, decision,
                            getattr(call, "request_id", None))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        with self.table.lock:
            self.table.completed(internal_request_id, replica_id.unique_id)


class CacheAwareRouter(_Recording):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        call = _call_of(pending_request)
        prompt = getattr(call, "prompt", None)
        if prompt is None:  # not a generation: any replica will do
            return [candidate_replicas]
        with self.table.lock:
            decision = self.table.choose(prompt, list(by_name), getattr(call, "prefer", None))
            rest = sorted((n for n in by_name if n != decision.replica), key=lambda n: self.table.loads[n])
        if pending_request is not None:
            self._decisions[id(pending_request)] = decision
            while len(self._decisions) > MAX_UNSENT_DECISIONS:  # requests cancelled while being routed
                del self._decisions[next(iter(self._decisions))]
        # the rest are Ray's fallbacks should the chosen replica refuse (its queue full)
        return [[by_name[decision.replica]], [by_name[n] for n in rest]]


class PowerOfTwoRouter(_Recording, PowerOfTwoChoicesRequestRouter):
    """Ray Serve's default choice (two random replicas, the shorter queue), with our statistics."""
