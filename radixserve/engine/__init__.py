"""The engines: the synchronous step loop (`LLMEngine`), its asyncio front (`AsyncEngine`), the offline
`LLM` API, and what they own besides the scheduler: sampling, detokenization, stats."""

from radixserve.engine.async_engine import AsyncEngine
from radixserve.engine.engine import LLMEngine
from radixserve.engine.llm import LLM

__all__ = ["LLM", "AsyncEngine", "LLMEngine"]
