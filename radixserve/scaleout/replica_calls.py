"""Calls the ingress makes on one named engine replica, or on each of them: pins and the tree view,
which concern every replica's own cache rather than one request's.

A call's first argument is a `Target` (calls.py), which the router (router.py) chooses the replica
it names for. Ray may still hand that replica to another request waiting to be routed (it serves its
waiting requests first come, first served, whatever they were chosen for) and this call to another
replica, which answers NotHere: the call is then made again, up to MISROUTED_TRIES times while the
target is up. The calls of one `on_each` are made one after another, so they do not take each
other's replicas. The replicas are the ones the router knows now (RoutingTable.replicas); a replica
that is gone by the time the call is routed or run (or Ray fails the call) is left out of the
answers, as if it had not been asked: its cache is gone with it.
"""

from __future__ import annotations

from typing import Any

from ray.exceptions import RayError
from ray.serve.handle import DeploymentHandle

from radixserve.scaleout.calls import NotHere, Target
from radixserve.scaleout.routing import RoutingTable


class Gone:
    """The answer of a replica that is gone (a sentinel: an answer itself may be None)."""


GONE = Gone()
MISROUTED_TRIES = 8


class ReplicaCalls:
    def __init__(self, handle: DeploymentHandle, table: RoutingTable) -> None:
        self.handle, self.table = handle, table

    def replicas(self) -> list[str]:
        with self.table.lock:
            return self.table.replicas

    async def on(self, replica: str, method: str, *args: Any) -> Any:
        """`method`'s answer on `replica`, or GONE."""
        for _ in range(MISROUTED_TRIES):
            try:
                out = await getattr(self.handle, method).remote(Target(replica), *args)
            except RayError:
                return GONE
            if not isinstance(out, NotHere):
                return out
            if replica not in self.replicas():
                return GONE
        return GONE

    async def on_each(self, method: str, *args: Any) -> dict[str, Any]:
        """`method`'s answer on each replica up, by replica name (those gone left out)."""
        outs = {name: await self.on(name, method, *args) for name in self.replicas()}
        return {name: out for name, out in outs.items() if out is not GONE}
