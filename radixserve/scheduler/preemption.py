"""Swap or recompute: the estimated cost of each way to preempt a running sequence.

Swapping copies the sequence's computed K/V to the host tier and, when it resumes, back (twice its
bytes over the copy bandwidth); recomputing runs its computed tokens through the model again (its
tokens over the prefill rate). Under `preemption_mode="auto"` the scheduler swaps when that is the
cheaper estimate (and the host tier can hold the sequence; if it cannot, it recomputes). Both rates
start from priors and follow what the engine measures (exponentially weighted), so the choice
adapts to the model and the machine: on any current hardware copying K/V is far cheaper than
recomputing it except for very short sequences on a fast accelerator.
"""

from __future__ import annotations

from dataclasses import dataclass

PRIOR_COPY_BYTES_PER_S = 5e9  # host memory copies on a CPU, or a pageable-memory PCIe transfer
PRIOR_PREFILL_TOKENS_PER_S = 2e3  # a small model on a few CPU cores: low, so swap is not chosen blindly


@dataclass
class PreemptionCosts:
    bytes_per_block: int = 0  # the engine sets it from the KV layout
    copy_bytes_per_s: float = PRIOR_COPY_BYTES_PER_S
    prefill_tokens_per_s: float = PRIOR_PREFILL_TOKENS_PER_S
    weight: float = 0.2  # of each new observation in the running estimate

    def observe_copy(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.copy_bytes_per_s += self.weight * (nbytes / seconds - self.copy_bytes_per_s)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.prefill_tokens_per_s += self.weight * (tokens / seconds - self.prefill_tokens_per_s)

    def swap_seconds(self, blocks: int) -> float:
        return 2 * blocks * self.bytes_per_block / self.copy_bytes_per_s

    def recompute_seconds(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s

    def swap_is_cheaper(self, tokens: int, blocks: int) -> bool:
        return tokens > 0 and self.swap_seconds(blocks) < self.recompute_seconds(tokens)
