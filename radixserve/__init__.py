"""radixserve: a prefix-caching chat backend.

A radix tree over token IDs maps cached prefixes to refcounted, copy-on-write KV blocks; a
chunked-prefill continuous batcher runs a lean Llama-family model over them.
"""

from radixserve.chat.session import ChatSession
from radixserve.config import EngineConfig
from radixserve.core import CompletionOutput, RequestOutput, Timing, Usage
from radixserve.engine import LLM, AsyncEngine, LLMEngine
from radixserve.engine.beam_search import BeamSearchOutput, BeamSearchParams
from radixserve.sampling_params import SamplingParams

__all__ = [
    "AsyncEngine", "BeamSearchOutput", "BeamSearchParams", "ChatSession", "CompletionOutput", "EngineConfig", "LLM",
    "LLMEngine", "RequestOutput", "SamplingParams", "Timing", "Usage",
]
