"""Per-request sampling parameters and their validation.

A request is rejected up front (ValueError with a clear message) rather than failing mid-batch.
Every accepted value is one the sampler handles for any logits: a temperature below
`MIN_TEMPERATURE` is greedy (dividing logits by a subnormal float overflows them to inf and the
probabilities to NaN), a repetition_penalty below `MIN_REPETITION_PENALTY` is refused for the
same reason (logits are divided by it; 1e-300 is 0 in float32), the other floats are bounded so
float32 holds them (a top_p or min_p that underflows to 0 only keeps the most likely token or
filters nothing), and any integer seed is taken modulo 2**64, the generator's range, so
`seed + sample index` never overflows. A seeded sample's random numbers are a function of
(seed + sample index, position) alone (see engine/sampler.py), so its tokens do not depend on what
else is in the batch; an unseeded sample takes its key from the engine's generator.
The token rules (stop_token_ids, ignore_eos, min_tokens, bad_words, allowed_token_ids) are checked
for shape here; whether their ids are inside the vocabulary is the engine's intake to say. What each
API calls these fields and the ranges the APIs accept are radixserve/sampling_fields.py's table.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from radixserve.structured import StructuredOutput

MIN_TEMPERATURE = 1e-5  # below this a temperature means greedy (as vLLM does)
SEED_MODULUS = 2**64  # sample keys are 64-bit
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI's top_logprobs allows
PENALTY_RANGE = (-2.0, 2.0)  # presence_penalty and frequency_penalty, as OpenAI allows
# repetition_penalty in [MIN, MAX]: 1 is off. The sampler divides logits by it in float32, where a
# tiny positive value is 0 or subnormal (1e-300 -> 0: logits / 0 -> inf, NaN probabilities), so the
# floor keeps the quotient of any logit finite: 1/MIN scales a logit by at most 100
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 2.0
LOGIT_BIAS_RANGE = (-100.0, 100.0)
MAX_LOGIT_BIAS_ENTRIES = 300  # as OpenAI allows
MAX_PREDICTION_LENGTH = 1 << 20  # a prediction's characters (or token ids)
MAX_CACHE_NAMESPACE_LENGTH = 1024  # characters of a cache namespace (a tenant plus a cache_salt)
MAX_STOP_STRINGS, MAX_STOP_CHARS = 8, 256  # stop strings a request may give, characters in each
MAX_BAD_WORDS, MAX_BAD_WORD_CHARS = 128, 256  # bad_words a request may give, characters in each
MAX_TOKEN_ID = 2**31 - 1  # no vocabulary is larger; ids past the model's own are the engine's to refuse


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
    stop_token_ids: list[int] = field(default_factory=list)  # generation ends on any of them (once min_tokens are out)
    ignore_eos: bool = False  # the model's EOS tokens do not end generation (stop_token_ids still do)
    # vLLM's: neither EOS nor stop_token_ids may end the reply before this many tokens (max_tokens still does)
    min_tokens: int = 0
    # vLLM's: each word's token sequences (as tokenized with and without a leading space) are never generated
    bad_words: list[str] = field(default_factory=list)
    # vLLM's: only these token ids may be sampled (None: any); ids past the vocabulary are the engine's to refuse
    allowed_token_ids: list[int] | None = None
    # None: no logprobs; k >= 0: each generated token's logprob plus the k most likely alternatives,
    # from the model's distribution before temperature and filtering (vLLM's default "raw" mode)
    logprobs: int | None = None
    # False: special tokens appear in the text (a tool-call marker such as Mistral's [TOOL_CALLS] is one);
    # end-of-sequence tokens never do
    skip_special_tokens: bool = True
    # the generated text must match this (a JSON schema, regex, choice or grammar: structured.py)
    structured: StructuredOutput | None = None
    # OpenAI's penalties, over the generated tokens: logit -= presence x [count > 0] + frequency x count
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM/transformers': a token seen in the prompt or the output has its logit divided by it when
    # positive, multiplied when negative; 1 is off
    repetition_penalty: float = 1.0
    # token id -> bias added to its logit before sampling (-100 bans it, +100 all but forces it)
    logit_bias: dict[int, float] = field(default_factory=dict)
    # None: none; k >= 0: the logprob of every prompt token after the first (the first has none)
    # with the k most likely alternatives at its position (RequestOutput.prompt_logprobs)
    prompt_logprobs: int | None = None
    # OpenAI's Predicted Outputs: text (or token ids) the output is expected to repeat, a source of
    # speculative drafts; it never changes what is generated, only how fast
    prediction: str | list[int] | None = None
    # the part of the radix cache this request reads and writes ("" the shared one): a request only
    # hits prefixes cached under the same namespace. The server sets it from the caller's tenant and
    # the request's `cache_salt` (server/tenants.py); the engine treats it as an opaque key
    cache_namespace: str = ""
    # the widest `logprobs` accepted; beam search's internal steps ask wider (engine/beam_search.py)
    logprobs_limit: ClassVar[int] = MAX_LOGPROBS

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def has_penalties(self) -> bool:
        """Does any penalty or bias change this request's logits?"""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

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
        self._validate_token_rules(is_int)
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError("skip_special_tokens must be a boolean")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError("structured must be a StructuredOutput")
        if self.prompt_logprobs is not None and (not is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= self.logprobs_limit):
            raise ValueError(f"prompt_logprobs must be an integer in [0, {self.logprobs_limit}] or None, "
                             f"got {self.prompt_logprobs!r}")
        self._validate_penalties(is_int)
        prediction = self.prediction
        if prediction is not None and not isinstance(prediction, str) and not (
                isinstance(prediction, list) and all(is_int(t) and t >= 0 for t in prediction)):
            raise ValueError("prediction must be a string or a list of token ids")
        if prediction is not None and len(prediction) > MAX_PREDICTION_LENGTH:
            raise ValueError(f"prediction is at most {MAX_PREDICTION_LENGTH} characters or tokens, got {len(prediction)}")

        if not isinstance(self.cache_namespace, str) or len(self.cache_namespace) > MAX_CACHE_NAMESPACE_LENGTH:
            raise ValueError(f"cache_namespace must be a string of at most {MAX_CACHE_NAMESPACE_LENGTH} characters")

    def _validate_token_rules(self, is_int: Callable[[object], bool]) -> None:
        """stop_token_ids, ignore_eos, min_tokens, bad_words, allowed_token_ids."""
        def token_ids(x: object) -> bool:
            return isinstance(x, list) and all(is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in x)

        if not token_ids(self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of token ids (integers in [0, {MAX_TOKEN_ID}])")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens = {self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        if not isinstance(self.bad_words, list) or len(self.bad_words) > MAX_BAD_WORDS or not all(
                isinstance(w, str) and 0 < len(w) <= MAX_BAD_WORD_CHARS for w in self.bad_words):
            raise ValueError(f"bad_words must be a list of at most {MAX_BAD_WORDS} non-empty strings of at most "
                             f"{MAX_BAD_WORD_CHARS} characters")
        allowed = self.allowed_token_ids
        if allowed is not None and (not token_ids(allowed) or not allowed):
            raise ValueError(f"allowed_token_ids must be None or a non-empty list of token ids (integers in "
                             f"[0, {MAX_TOKEN_ID}])")

    def _validate_penalties(self, is_int: Callable[[object], bool]) -> None:
        def is_number(x: object) -> bool:
            return (is_int(x) or isinstance(x, float)) and math.isfinite(x)  # type: ignore[arg-type]

        low, high = PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_number(value) or not low <= value <= high:
                raise ValueError(f"{name} must be in [{low}, {high}], got {value!r}")
        if not is_number(self.repetition_penalty) \
                or not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}], "
                             f"got {self.repetition_penalty!r}")
        if not isinstance(self.logit_bias, dict):
            raise ValueError("logit_bias must be a dict of token id -> bias")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(self.logit_bias)}")
        low, high = LOGIT_BIAS_RANGE
        for token, bias in self.logit_bias.items():
            if not is_int(token) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
            if not is_number(bias) or not low <= bias <= high:
                raise ValueError(f"logit_bias values must be in [{low}, {high}], got {bias!r} for token {token}")
