"""Latency of GET /v1/cache/stats, /metrics and /health while the engine is under full prefill load.

A real `radixserve serve` (the embedded model, a 4,096-token step budget) in its own process; eight
clients stream chat completions of ~2k-token prompts that are never cached (unique words), so every
step is a long prefill; a ninth polls the three endpoints for the given seconds and prints p50 / p99 /
max of each. Issue 24's target: stats and metrics p99 <= 50 ms.

    radixserve bench stats-latency [seconds] [--port N]
"""

from __future__ import annotations

import argparse
import threading
import time
import uuid
from pathlib import Path

import httpx

from radixserve_bench.checks.server_process import Server

STREAMS = 8
PATHS = ("/v1/cache/stats", "/metrics", "/health")
KEYS = "ops-key ops admin\n"  # one admin: it reads every endpoint
AUTH = {"Authorization": "Bearer ops-key"}


def stream_forever(url: str, model: str, stop: threading.Event) -> None:
    with httpx.Client(base_url=url, timeout=600, headers=AUTH) as client:
        while not stop.is_set():
            words = " ".join(f"w{uuid.uuid4().hex[:6]}" for _ in range(700))
            body = {"model": model, "max_tokens": 16, "stream": True, "temperature": 0,
                    "messages": [{"role": "user", "content": f"Summarize: {words}"}]}
            with client.stream("POST", "/v1/chat/completions", json=body) as r:
                for _ in r.iter_lines():
                    pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("duration_s", nargs="?", type=float, default=40.0, metavar="seconds",
                        help="how long the endpoints are polled under load (default %(default)s)")
    parser.add_argument("--port", type=int, default=8793, help="the server's port on 127.0.0.1 (default %(default)s)")


def run(args: argparse.Namespace) -> int:
    duration_s: float = args.duration_s
    keys = Path("/tmp/radixserve-stats-latency.keys")
    keys.write_text(KEYS)
    with Server(keys, args.port, ["--max-num-batched-tokens", "4096"]) as server:
        url, model = f"http://127.0.0.1:{args.port}", server.model("ops-key")
        stop = threading.Event()
        workers = [threading.Thread(target=stream_forever, args=(url, model, stop), daemon=True) for _ in range(STREAMS)]
        for w in workers:
            w.start()
        time.sleep(3.0)  # the streams are prefilling
        latencies: dict[str, list[float]] = {p: [] for p in PATHS}
        deadline = time.monotonic() + duration_s
        with httpx.Client(base_url=url, timeout=600, headers=AUTH) as client:
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
    return 0
