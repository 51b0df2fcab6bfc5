"""The chat server: Starlette app (HTTP + WebSocket) over the AsyncEngine, run on uvicorn.

Entry points: `build_app(engine_factory, ServerConfig)` -> Starlette app; `BackgroundServer` runs it in
a thread (tests, benchmarks); `radixserve serve` (radixserve.server.cli) runs it in the foreground.
"""

from radixserve.server.app import build_app
from radixserve.server.config import ServerConfig
from radixserve.server.runner import BackgroundServer

__all__ = ["BackgroundServer", "ServerConfig", "build_app"]
