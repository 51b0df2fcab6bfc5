"""What the server needs from an engine: the contract `AsyncEngine` (one engine in this process) and
`scaleout.ClusterEngine` (replicas behind Ray Serve) both meet, so the HTTP/WebSocket app is the same.

Contract: `intake.check` is the one check of a request (engine/intake.py), on the caller's thread:
RequestError, or a ValidatedRequest that `generate_validated` streams without checking it again
(`generate` is both in one call); the stream yields one request's incremental outputs, the last with
finished=True, and a caller that stops iterating aborts the request. `stats` answers at once from
the last published snapshot and `drain_steps` with the steps run since its last call (neither waits
for a step: /metrics and /v1/cache/stats call them on the event loop; treat the results as
read-only); `health` answers without taking any engine lock; `abort` is safe to call for an unknown id.
Pins (engine/pins.py) and the tree view (cache/tree_view.py): `pins` and `pin_budget` answer at once
(a cluster's from its replicas' last reports); `cache_tree`'s `include` must pickle (a scale-out
ingress runs it on the replicas: a function, or a closure over plain values).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Protocol

from radixserve.cache.tree_view import TreeNodeView, TreeView
from radixserve.core import Placement, RequestOutput, StepInfo
from radixserve.engine.intake import Intake, ValidatedRequest
from radixserve.engine.pins import PinBudget, PinError, PinInfo
from radixserve.engine.stats import EngineStats
from radixserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from radixserve.engine.beam_search import BeamSearchOutput, BeamSearchParams

# what the pin and tree calls return, for the layers above the engine (which may not import the cache)
__all__ = ["EngineClient", "PinBudget", "PinError", "PinInfo", "TreeNodeView", "TreeView"]


class EngineClient(Protocol):
    @property
    def tokenizer(self) -> Any: ...

    @property
    def model_name(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @property
    def block_size(self) -> int: ...

    @property
    def intake(self) -> Intake: ...

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                 priority: int = 0, cancelled: Callable[[], bool] | None = None,
                 placement: Placement | None = None) -> AsyncIterator[RequestOutput]: ...

    def generate_validated(self, request: ValidatedRequest, request_id: str | None = None,
                           cancelled: Callable[[], bool] | None = None,
                           placement: Placement | None = None) -> AsyncIterator[RequestOutput]: ...

    async def beam_search(self, prompt: list[int], params: BeamSearchParams, priority: int = 0,
                          placement: Placement | None = None) -> BeamSearchOutput: ...

    def abort(self, request_id: str) -> None: ...

    def drain_steps(self) -> list[StepInfo]: ...

    def health(self, stall_s: float) -> str | None: ...

    def stats(self) -> EngineStats: ...

    async def pin(self, token_ids: list[int], namespace: str = "", label: str = "") -> PinInfo: ...

    async def unpin(self, pin_id: str) -> PinInfo | None: ...

    def pins(self) -> list[PinInfo]: ...

    def pin_budget(self) -> PinBudget: ...

    async def cache_tree(self, limit: int, include: Callable[[str], bool] | None = None) -> TreeView: ...
