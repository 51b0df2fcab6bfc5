"""A throwaway local cluster for `radixserve bench scale-out`: the scale-out application on 127.0.0.1
and a free port, its URL handed to the caller, everything (Serve, and Ray if this started it) shut
down on leaving. The bench layer may not import the server, so the ServerConfig is built here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from radixserve.config import EngineConfig
from radixserve.scaleout.config import ClusterConfig
from radixserve.scaleout.local import ServeCluster
from radixserve.server.config import ServerConfig

HOST = "127.0.0.1"


@contextmanager
def local_cluster(engine_config: EngineConfig, cluster: ClusterConfig, num_cpus: int | None = None,
                  port: int | None = None, startup_timeout_s: float = 600.0) -> Iterator[str]:
    """Start the application (no web UI) and yield its base URL once /health answers 200."""
    server = ServerConfig(host=HOST, port=port or 0, web_dir=None)  # 0: ServeCluster picks and retries
    with ServeCluster(engine_config, server, cluster, num_cpus=num_cpus, startup_timeout_s=startup_timeout_s) as c:
        yield c.url
