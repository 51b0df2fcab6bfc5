"""The engine's side of the host tier: sizing it from `--host-cache-mb`, with a clear error when
the host cannot hold it (pinned memory the host cannot back would fail at allocation, or later under
memory pressure, far from the flag that asked for it), and feeding measured rates to the
scheduler's swap-or-recompute estimate (`scheduler/preemption.py`)."""

from __future__ import annotations

from radixserve.core import CopyKind
from radixserve.engine.step_clock import StepClock
from radixserve.model.host_kv import HostKVCache, available_host_bytes
from radixserve.scheduler.preemption import PreemptionCosts

TIER_MOVES = (CopyKind.TO_HOST, CopyKind.TO_DEVICE)

MIB = 2**20


def host_tier_blocks(host_cache_mb: float, bytes_per_block: int) -> int:
    """Blocks of the host tier; 0 when it is off."""
    if host_cache_mb <= 0:
        return 0
    wanted = int(host_cache_mb * MIB)
    available = available_host_bytes()
    if wanted > available:
        raise ValueError(f"--host-cache-mb {host_cache_mb:g} asks for more host memory than this machine can pin: "
                         f"{available / MIB:.0f} MiB is available; lower it (or 0 to turn the host tier off)")
    blocks = wanted // bytes_per_block
    if blocks < 1:
        raise ValueError(f"--host-cache-mb {host_cache_mb:g} holds no KV block of {bytes_per_block / MIB:.2f} MiB; "
                         "raise it (or 0 to turn the host tier off)")
    return blocks


class CostFeed:
    """After each resolved step: its prefill rate, and the bandwidth of tier copies completed since."""

    def __init__(self, costs: PreemptionCosts, clock: StepClock, host: HostKVCache | None) -> None:
        self.costs, self.clock, self.host = costs, clock, host
        if host is not None:
            costs.bytes_per_block = host.bytes_per_block
        self._seen_blocks, self._seen_seconds = 0, 0.0

    def observe(self, prefill_tokens: int) -> None:
        if prefill_tokens and self.clock.history:
            self.costs.observe_prefill(prefill_tokens, self.clock.history[-1].device_s)
        if self.host is None or self.host.num_blocks == 0:
            return
        done = self.host.completed()
        blocks = sum(done.blocks.get(k, 0) for k in TIER_MOVES)
        seconds = sum(done.seconds.get(k, 0.0) for k in TIER_MOVES)
        if blocks > self._seen_blocks:
            self.costs.observe_copy((blocks - self._seen_blocks) * self.host.bytes_per_block, seconds - self._seen_seconds)
            self._seen_blocks, self._seen_seconds = blocks, seconds
