"""The chat server: Starlette app (HTTP + WebSocket) over the AsyncEngine, run on uvicorn.

Entry points: `build_app(engine_factory, ServerConfig)` -> Starlette app; `BackgroundServer` runs it in
a thread (tests, benchmarks); `radixserve serve` (radixserve.server.cli) runs it in the foreground.
The names are resolved on first use, so importing `radixserve.server.cli` or `.config` (to build the
command line) does not import Starlette, uvicorn or websockets.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixserve.server.app import build_app
    from radixserve.server.config import ServerConfig
    from radixserve.server.runner import BackgroundServer

_EXPORTS = {"build_app": "radixserve.server.app", "ServerConfig": "radixserve.server.config",
            "BackgroundServer": "radixserve.server.runner"}
__all__ = ["BackgroundServer", "ServerConfig", "build_app"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
