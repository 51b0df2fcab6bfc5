"""Per-request sampling parameters and their validation.

A request is rejected up front (ValueError with a clear message) rather than failing mid-batch.
Every accepted value is one the sampler handles for any logits: a temperature below
`MIN_TEMPERATURE` is greedy (dividing logits by a subnormal float overflows them to inf and the
probabilities to NaN), and any integer seed is taken modulo 2**64, the generator's range, so
`seed + sample index` never overflows. A seeded sample's random numbers are a function of
(seed + sample index, position) alone (see engine/sampler.py), so its tokens do not depend on what
else is in the batch; an unseeded sample takes its key from the engine's generator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from radixserve.structured import StructuredOutput

MIN_TEMPERATURE = 1e-5  # below this a temperature means greedy (as vLLM does)
SEED_MODULUS = 2**64  # sample keys are 64-bit
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI's top_logprobs allows


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # below MIN_TEMPERATURE -> greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 -> disabled
    min_p: float = 0.0  # drop tokens whose probability is below min_p x the most likely one's; 0 -> disabled
    n: int = 1  # parallel samples forked from one prompt (prompt computed once, blocks shared COW)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # None: no logprobs; k >= 0: each generated token's logprob plus the k most likely alternatives,
    # from the model's distribution before temperature and filtering (vLLM's default "raw" mode)
    logprobs: int | None = None
    # False: special tokens appear in the text (a tool-call marker such as Mistral's [TOOL_CALLS] is one);
    # end-of-sequence tokens never do
    skip_special_tokens: bool = True
    # the generated text must match this (a JSON schema, regex, choice or grammar: structured.py)
    structured: StructuredOutput | None = None
    # the widest `logprobs` accepted; beam search's internal steps ask wider (engine/beam_search.py)
    logprobs_limit: ClassVar[int] = MAX_LOGPROBS

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def sample_seed(self, index: int) -> int | None:
        """The noise key of sample `index`, reduced into 64 bits; None when unseeded."""
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
        if isinstance(self.min_p, bool) or not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= self.logprobs_limit):
            raise ValueError(f"logprobs must be an integer in [0, {self.logprobs_limit}] or None, got {self.logprobs!r}")
        if self.seed is not None and not is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError("skip_special_tokens must be a boolean")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError("structured must be a StructuredOutput")
