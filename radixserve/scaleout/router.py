"""Ray Serve request routers for the engine deployment: cache-aware, and Ray's power-of-two for contrast.

Both run where the requests come from (the ingress replica's process, on Ray's router loop) and
share the process-wide `RoutingTable` of their deployment (`table_for`), which the ingress reads for
statistics: every replica's periodic report (`record_routing_stats`: engine statistics and the cache
events it dropped) lands there, and so do requests sent and completed. `CacheAwareRouter` decides
with the table's rule (routing.py), matching prefixes in the request's cache namespace only;
`PowerOfTwoRouter` keeps Ray's choice and only records. Under both, a call whose first argument is a
`Target` (calls.py: pins, the tree view) goes to the replica it names and nowhere else.

The table is touched from Ray's router loop and from the ingress's event loop, so every use holds
its lock. Ray ships this module to the routing process by value (cloudpickle), so nothing shared may
live in it: the tables are in routing.py, which is imported there by name.
"""

from __future__ import annotations

from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from radixserve.cache.events import Dropped, EventBatch
from radixserve.engine.pins import PinBudget, PinInfo
from radixserve.engine.stats import EngineStats
from radixserve.scaleout.calls import Target
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


def _back_off(pending: PendingRequest | None) -> None:
    """Have Ray sleep between attempts when none of our choices could take the request (their queues
    full): Ray's own choosers say so, and without it Ray retries at once, spinning its routing loop."""
    if pending is not None:
        pending.routing_context.should_backoff = True


def _decode(report: dict[str, Any]) -> tuple[EventBatch | None, tuple[PinInfo, ...], PinBudget | None]:
    """A replica's `record_routing_stats` (plain types) as the table takes it."""
    events = report.get("events")
    batch = None if events is None else EventBatch(
        tuple(Dropped(seq, tuple(path), namespace) for seq, path, namespace in events["dropped"]),
        events["last_seq"])
    pins = tuple(PinInfo(**p) for p in report.get("pins") or ())
    budget = report.get("pin_budget")
    return batch, pins, None if budget is None else PinBudget(*budget)


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
                    batch, pins, budget = _decode(report)
                    self.table.report(r.replica_id.unique_id, EngineStats.from_dict(report["stats"]), batch, pins,
                                      budget)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        call = _call_of(pending_request)
        prompt = getattr(call, "prompt", None)
        key = pending_request.metadata.internal_request_id
        if prompt is None:  # not a generation (facts, pins, the tree view)
            with self.table.lock:
                self.table.sent_other(key, replica_id.unique_id)
            return
        decision = self._decisions.pop(id(pending_request), None)
        with self.table.lock:  # a generation's id: the ingress reports its end (beam searches have none)
            self.table.sent(key, replica_id.unique_id, prompt, decision, getattr(call, "request_id", None),
                            call.namespace)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        with self.table.lock:
            self.table.completed(internal_request_id, replica_id.unique_id)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        call = _call_of(pending_request)
        if isinstance(call, Target):
            _back_off(pending_request)
            # a target that is gone goes anywhere: the replica answers NotHere (waiting for it would hang)
            there = [r for r in candidate_replicas if r.replica_id.unique_id == call.replica]
            return [there or candidate_replicas]
        return await self._choose(candidate_replicas, pending_request)

    async def _choose(self, candidate_replicas: list[RunningReplica],
                      pending_request: PendingRequest | None) -> list[list[RunningReplica]]:
        raise NotImplementedError


class CacheAwareRouter(_Recording):
    async def _choose(self, candidate_replicas: list[RunningReplica],
                      pending_request: PendingRequest | None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        _back_off(pending_request)
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        call = _call_of(pending_request)
        prompt = getattr(call, "prompt", None)
        if prompt is None:  # not a generation: any replica will do
            return [candidate_replicas]
        with self.table.lock:
            decision = self.table.choose(prompt, list(by_name), getattr(call, "prefer", None), call.namespace)
            rest = sorted((n for n in by_name if n != decision.replica), key=lambda n: self.table.loads[n])
        if pending_request is not None:
            self._decisions[id(pending_request)] = decision
            while len(self._decisions) > MAX_UNSENT_DECISIONS:  # requests cancelled while being routed
                del self._decisions[next(iter(self._decisions))]
        # the rest are Ray's fallbacks should the chosen replica refuse (its queue full)
        return [[by_name[decision.replica]], [by_name[n] for n in rest]]


class PowerOfTwoRouter(_Recording, PowerOfTwoChoicesRequestRouter):
    """Ray Serve's default choice (two random replicas, the shorter queue), with our statistics."""

    async def _choose(self, candidate_replicas: list[RunningReplica],
                      pending_request: PendingRequest | None) -> list[list[RunningReplica]]:
        return await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidate_replicas, pending_request)
