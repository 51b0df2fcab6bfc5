"""Latency of GET /v1/cache/stats, /metrics and /health while the engine is under full prefill load.

Eight clients stream chat completions of ~2k-token prompts that are never cached (unique words), on
the embedded model with a 4,096-token step budget, so every step is a long prefill; a ninth polls the
three endpoints for DURATION_S and prints p50 / p99 / max of each. Issue 24's target: stats and
metrics p99 <= 50 ms. Run: .venv/bin/python scripts/stats_latency.py [seconds]
"""

from __future__ import annotations

import sys
import threading
import time
import uuid

import httpx

from radixserve import AsyncEngine, EngineConfig
from radixserve.server import BackgroundServer, ServerConfig

STREAMS = 8
PATHS = ("/v1/cache/stats", "/metrics", "/health")


def stream_forever(url: str, model: str, stop: threading.Event) -> None:
    with httpx.Client(base_url=url, timeout=600) as client:
        while not stop.is_set():
            words = " ".join(f"w{uuid.uuid4().hex[:6]}" for _ in range(700))
            body = {"model": model, "max_tokens": 16, "stream": True, "temperature": 0,
                    "messages": [{"role": "user", "content": f"Summarize: {words}"}]}
            with client.stream("POST", "/v1/chat/completions", json=body) as r:
                for _ in r.iter_lines():
                    pass


def main(duration_s: float) -> None:
    config = ServerConfig(port=0, web_dir=None, shutdown_grace_s=0.5)
    with BackgroundServer(lambda: AsyncEngine(EngineConfig(max_num_batched_tokens=4096)), config) as srv:
        stop = threading.Event()
        workers = [threading.Thread(target=stream_forever, args=(srv.url, srv.state.model_name, stop), daemon=True)
                   for _ in range(STREAMS)]
        for w in workers:
            w.start()
        time.sleep(3.0)  # the streams are prefilling
        latencies: dict[str, list[float]] = {p: [] for p in PATHS}
        deadline = time.monotonic() + duration_s
        with httpx.Client(base_url=srv.url, timeout=600) as client:
            while time.monotonic() < deadline:
                for path in PATHS:
                    started = time.monotonic()
                    assert client.get(path).status_code == 200, path
                    latencies[path].append((time.monotonic() - started) * 1e3)
                time.sleep(0.05)
        stop.set()
        for path, xs in latencies.items():
            xs.sort()
            print(f"{path:16s} n={len(xs):4d} p50={xs[len(xs) // 2]:7.1f} ms "
                  f"p99={xs[min(len(xs) - 1, int(0.99 * len(xs)))]:7.1f} ms max={xs[-1]:7.1f} ms")
        for w in workers:
            w.join(600)


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 40.0)
