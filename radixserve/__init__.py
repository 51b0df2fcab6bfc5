"""radixserve: a prefix-caching chat backend.

A radix tree over token IDs maps cached prefixes to refcounted, copy-on-write KV blocks; a
chunked-prefill continuous batcher runs a lean Llama-family model over them.
"""

from radixserve.async_engine import AsyncEngine
from radixserve.config import EngineConfig
from radixserve.engine import LLMEngine
from radixserve.llm import LLM
from radixserve.outputs import CompletionOutput, RequestOutput, Timing, Usage
from radixserve.sampling_params import SamplingParams

__all__ = [
    "AsyncEngine", "CompletionOutput", "EngineConfig", "LLM", "LLMEngine", "RequestOutput", "SamplingParams",
    "Timing", "Usage",
]
