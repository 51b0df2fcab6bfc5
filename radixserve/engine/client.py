"""What the server needs from an engine: the contract `AsyncEngine` (one engine in this process) and
`scaleout.ClusterEngine` (replicas behind Ray Serve) both meet, so the HTTP/WebSocket app is the same.

Contract: `generate` streams one request's incremental outputs, the last with finished=True, and a
caller that stops iterating aborts the request; `stats` answers at once from the last published
snapshot (never waits for a step: /metrics and /v1/cache/stats call it on the event loop; treat the
result as read-only); `health` answers without taking any engine lock; `abort` is safe to call for
an unknown id.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Protocol

from radixserve.core import Placement, RequestOutput
from radixserve.engine.observers import StepObserver
from radixserve.engine.stats import EngineStats
from radixserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from radixserve.engine.beam_search import BeamSearchOutput, BeamSearchParams


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

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                 priority: int = 0, cancelled: Callable[[], bool] | None = None,
                 placement: Placement | None = None) -> AsyncIterator[RequestOutput]: ...

    async def beam_search(self, prompt: list[int], params: BeamSearchParams, priority: int = 0,
                          placement: Placement | None = None) -> BeamSearchOutput: ...

    def abort(self, request_id: str) -> None: ...

    def add_step_observer(self, observer: StepObserver, pool: bool = False) -> None: ...

    def health(self, stall_s: float) -> str | None: ...

    def stats(self) -> EngineStats: ...
