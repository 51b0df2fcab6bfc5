"""Pinned prefixes across the replicas (ClusterEngine.pin and friends): a pin is made on every
replica, so a pinned system prompt is a hit whichever replica a conversation lands on.

The ingress keeps the pins: each has its own id (`pin-N`, what the API shows) and, per replica, the
id of that replica's pin (engine/pins.py). `pin` is all or nothing: a replica that refuses (its pin
budget, no prefix cache) undoes the pin on the others and its PinError is the caller's. Replicas that
come up later (Ray Serve replaced one, or had not started it yet) get every pin by `reconcile`, which
the ingress runs periodically; one of them that refuses is logged and not asked again. A replica that
is gone takes its pins with it. `list` and `budget` answer at once from the replicas' last reports
(routing.py: ReplicaReport.pins, pin_budget), so hit counts trail by one report period.

A cluster pin's figures: `hits` and `hit_tokens` summed over the replicas (a request hits on one),
`blocks` the most any replica holds for it; the budget is the tightest replica's (the one with the
fewest blocks left), since a pin must fit on every replica.

Invariants: a pin's per-replica map names only replicas that hold it; an id unpinned while a
replica was being given it is unpinned there too once that call returns.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from radixserve.engine.pins import PinBudget, PinError, PinInfo
from radixserve.errors import EngineStoppedError
from radixserve.scaleout.calls import Failed
from radixserve.scaleout.routing import RoutingTable

log = logging.getLogger("radixserve.scaleout")
RECONCILE_PERIOD_S = 2.0


class ReplicaCaller(Protocol):
    """The replicas as pins need them (replica_calls.ReplicaCalls; a fake in tests, so this module
    needs no Ray): `on` answers what the replica's method returned, or anything else when it is gone."""

    def replicas(self) -> list[str]: ...

    async def on(self, replica: str, method: str, *args: Any) -> Any: ...


@dataclass(eq=False)
class _ClusterPin:
    id: str
    token_ids: list[int]
    namespace: str
    label: str
    created: float
    on: dict[str, PinInfo] = field(default_factory=dict)  # replica -> its pin there (last known figures)
    refused: set[str] = field(default_factory=set)  # replicas that refused it later: not asked again


def _error(failed: Failed) -> Exception:
    """A replica's refusal as the single engine's own error (PinError for a refused pin)."""
    return PinError(failed.message) if failed.kind == "request" else failed.error()


class ClusterPins:
    def __init__(self, calls: ReplicaCaller, table: RoutingTable) -> None:
        self.calls, self.table = calls, table
        self._pins: dict[str, _ClusterPin] = {}
        self._ids = itertools.count(1)

    async def pin(self, token_ids: list[int], namespace: str = "", label: str = "") -> PinInfo:
        # one replica after another (replica_calls.py): a refusal stops it before the rest prefill
        made: dict[str, PinInfo] = {}
        refused: list[Failed] = []
        for r in self.calls.replicas():
            out = await self.calls.on(r, "pin", token_ids, namespace, label)
            if isinstance(out, Failed):
                refused.append(out)
                break
            if isinstance(out, PinInfo):
                made[r] = out
        if refused or not made:
            for r, info in made.items():
                await self.calls.on(r, "unpin", info.id)
            if refused:
                raise _error(refused[0])
            raise EngineStoppedError("no engine replica is running: nothing to pin on")
        pin = _ClusterPin(f"pin-{next(self._ids)}", list(token_ids), namespace, label, time.time(), made)
        self._pins[pin.id] = pin
        return self._info(pin)

    async def unpin(self, pin_id: str) -> PinInfo | None:
        pin = self._pins.pop(pin_id, None)
        if pin is None:
            return None
        info = self._info(pin)
        for r, mine in list(pin.on.items()):
            await self.calls.on(r, "unpin", mine.id)
        return info

    def list(self) -> list[PinInfo]:
        return [self._info(p) for p in self._pins.values()]

    def budget(self) -> PinBudget:
        """The tightest replica's budget (PinBudget(0, 0) before any replica reported)."""
        with self.table.lock:
            budgets = [rep.pin_budget for rep in self.table.reports.values() if rep.pin_budget is not None]
        return min(budgets, key=lambda b: b.budget_blocks - b.used_blocks, default=PinBudget(0, 0))

    async def reconcile(self) -> None:
        """Give every pin to the replicas that came up without it; forget replicas that are gone."""
        names = set(self.calls.replicas())
        for pin in list(self._pins.values()):
            for gone in set(pin.on) - names:
                del pin.on[gone]
            for r in sorted(names - set(pin.on) - pin.refused):
                out = await self.calls.on(r, "pin", pin.token_ids, pin.namespace, pin.label)
                if isinstance(out, PinInfo):
                    if self._pins.get(pin.id) is pin:
                        pin.on[r] = out
                    else:  # unpinned meanwhile
                        await self.calls.on(r, "unpin", out.id)
                elif isinstance(out, Failed):
                    pin.refused.add(r)
                    log.warning("replica %s refused pin %s (%s): %s", r, pin.id, pin.label, out.message)

    async def keep(self, period_s: float = RECONCILE_PERIOD_S) -> None:
        """`reconcile` every `period_s` until cancelled."""
        while True:
            await asyncio.sleep(period_s)
            try:
                await self.reconcile()
            except Exception:  # noqa: BLE001 - the next period tries again; pins must not stop serving
                log.exception("keeping the pins on every replica failed")

    def _info(self, pin: _ClusterPin) -> PinInfo:
        self._refresh(pin)
        infos = list(pin.on.values())
        return PinInfo(pin.id, pin.namespace, len(pin.token_ids), max((i.blocks for i in infos), default=0),
                       sum(i.hits for i in infos), sum(i.hit_tokens for i in infos), pin.created, pin.label)

    def _refresh(self, pin: _ClusterPin) -> None:
        """Take each replica's figures for the pin from its last report."""
        with self.table.lock:
            reported = {r: {p.id: p for p in rep.pins} for r, rep in self.table.reports.items()}
        for r, mine in pin.on.items():
            latest = reported.get(r, {}).get(mine.id)
            if latest is not None:
                pin.on[r] = latest
