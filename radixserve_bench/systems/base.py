"""The seam between the benchmark driver and a serving system.

A system takes token-id prompts one request at a time (many may be in flight), generates exactly
`output_len` tokens (greedily unless the request's `Sampling` says otherwise; a `prediction` is a
hint a system may use to go faster, never a change to the output), and reports when each output
token was produced. Times are
`time.monotonic()` seconds, the clock the engine's own Timing uses, so client-side and engine-side
stamps compare directly. Systems with a block pool also report pool samples (blocks held by live
requests and by the cache alone) for the memory figures and charts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Sampling:
    """How one request samples: greedy (temperature 0) or seeded sampling, and an optional
    prediction (token ids the output is expected to repeat: OpenAI's Predicted Outputs)."""

    temperature: float = 0.0
    seed: int | None = None
    prediction: tuple[int, ...] | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = Sampling()


@dataclass
class Completion:
    output_tokens: list[int]
    token_times: list[float]  # when each output token reached the client (monotonic seconds)
    cached_tokens: int  # prompt tokens the system served from a cache instead of computing them
    scheduled_time: float | None = None  # when the system began computing the request, if it says
    host_cached_tokens: int = 0  # the part of cached_tokens loaded back from a host-memory tier
    steps: int | None = None  # decode steps (forward passes) that produced the output, where the system says
    # speculative decoding: source -> [draft tokens proposed, accepted] (radixserve's usage.speculation)
    drafts: dict[str, list[int]] | None = None


@dataclass(frozen=True)
class PoolSample:
    t: float
    blocks_used: int  # held by live requests
    blocks_cached: int  # held only by the cache (evictable)
    blocks_total: int


@dataclass
class SystemInfo:
    name: str
    description: str
    block_size: int | None = None  # tokens per KV block, for systems with a block pool
    num_blocks: int | None = None
    settings: dict[str, object] = field(default_factory=dict)


class System(ABC):
    """One serving system under test. `start` before the first request, `stop` after the last."""

    name: str
    has_block_pool: bool = False

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def generate(self, prompt: list[int], output_len: int, request_id: str,
                       sampling: Sampling = GREEDY) -> Completion: ...

    @abstractmethod
    async def stop(self) -> None: ...

    @abstractmethod
    def info(self) -> SystemInfo: ...

    # -- pool samples, recorded between start_sampling() and stop_sampling() around a measured run --
    def start_sampling(self) -> None:  # noqa: B027 - a no-op for systems without a block pool
        pass

    def stop_sampling(self) -> list[PoolSample]:
        return []
