"""Per-request sampling parameters and their validation.

A request is rejected up front (ValueError with a clear message) rather than failing mid-batch.
Every accepted value is one the sampler handles for any logits: a temperature below
`MIN_TEMPERATURE` is greedy (dividing logits by a subnormal float overflows them to inf and the
probabilities to NaN), and any integer seed is taken modulo 2**64, the generator's range, so
`seed + sample index` never overflows. Seeded requests draw from their own torch.Generator, so their
samples do not depend on what else is in the batch; unseeded requests share the engine's generator.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIN_TEMPERATURE = 1e-5  # below this a temperature means greedy (as vLLM does)
SEED_MODULUS = 2**64  # torch generators take seeds in [0, 2**64)


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # below MIN_TEMPERATURE -> greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 -> disabled
    n: int = 1  # parallel samples forked from one prompt (prompt computed once, blocks shared COW)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def sample_seed(self, index: int) -> int | None:
        """The generator seed of sample `index`, reduced into the generator's range."""
        return None if self.seed is None else (self.seed + index) % SEED_MODULUS

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    def validate(self) -> None:
        def is_int(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        if not is_int(self.max_tokens) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not is_int(self.n) or self.n <= 0:
            raise ValueError(f"n must be a positive integer, got {self.n!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and not is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
