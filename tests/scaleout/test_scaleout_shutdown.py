"""`radixserve serve --replicas 2` stopped by SIGTERM (what a service manager or `docker stop` sends)
behaves as Ctrl-C does: the in-flight generation is drained (its client gets a proper end, not a cut
connection), the command exits 0, and every process of the Ray cluster it started is gone.

One foreground server, as an operator runs it: a subprocess over a tiny random-weight model. Whatever
happens, the test kills what is left of it, so a failure leaves no Ray process on the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

pytest.importorskip("ray.serve")

pytest_plugins = ["server_testkit"]
from server_testkit import pump_lines, wait_for_serving_url, write_tiny_chat_model  # noqa: E402

GONE_WITHIN_S = 30.0  # every Ray process, once the command has exited


def _descendants(root: psutil.Process, seen: dict[int, psutil.Process]) -> None:
    """Record every process under `root` (Ray's agents are re-parented once the raylet exits, so they
    are recorded while the cluster is up)."""
    try:
        for p in root.children(recursive=True):
            seen.setdefault(p.pid, p)
    except psutil.NoSuchProcess:
        pass


def _stream(url: str, started: threading.Event, events: list[dict[str, Any] | str]) -> None:
    """One long streamed completion; `started` is set at its first token."""
    body = {"model": "tiny", "max_tokens": 3000, "stream": True, "temperature": 1.0,
            "messages": [{"role": "user", "content": "Tell me a very long story."}]}
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120.0) as r:
            if r.status_code != 200:
                events.append(f"status {r.status_code}: {r.read().decode()}")
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
                started.set()
    except httpx.HTTPError as e:
        events.append(f"error: {type(e).__name__}: {e}")
    finally:
        started.set()


def test_sigterm_drains_exits_0_and_leaves_no_ray_process(tmp_path: Path) -> None:
    from radixserve.model.embedded import embedded_model_dir

    model = write_tiny_chat_model(tmp_path / "tiny", embedded_model_dir(), 4096)
    cmd = [sys.executable, "-m", "radixserve", "serve", "--replicas", "2", "--replica-torch-threads", "1",
           "--model", str(model), "--num-blocks", "256", "--port", "0", "--no-web", "--shutdown-grace", "1",
           "--served-model-name", "tiny"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    me, seen = psutil.Process(proc.pid), dict[int, psutil.Process]()
    out: queue.Queue[str] = queue.Queue()
    log: list[str] = []
    threading.Thread(target=pump_lines, args=(proc, out), daemon=True).start()
    try:
        url = wait_for_serving_url(proc, out, log)
        _descendants(me, seen)
        assert seen, "serve started no Ray process"
        started, events = threading.Event(), list[dict[str, Any] | str]()
        client = threading.Thread(target=_stream, args=(url, started, events), daemon=True)
        client.start()
        assert started.wait(120), "the streamed completion never started"
        _descendants(me, seen)  # the workers Ray started for the replicas
        assert events and isinstance(events[0], dict), events
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(120)
        client.join(60)
        while not out.empty():
            log.append(out.get())
        assert rc == 0, f"serve exited with {rc} on SIGTERM:\n{''.join(log)}"
        assert "radixserve: stopping the replicas" in "".join(log)
        # drained: the stream ended as with one process (the grace ran out: "abort"), not a cut connection
        assert events[-1] == "[DONE]", events[-3:]
        finishes = [c["choices"][0].get("finish_reason") for c in events if isinstance(c, dict) and c["choices"]]
        assert finishes[-1] in ("abort", "length"), events[-3:]
        _, alive = psutil.wait_procs(list(seen.values()), timeout=GONE_WITHIN_S)
        assert not alive, f"still running {GONE_WITHIN_S:.0f} s after serve exited: " \
                          f"{[(p.pid, _name(p)) for p in alive]}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        _, alive = psutil.wait_procs(list(seen.values()), timeout=1)
        for p in alive:  # a failed run leaves nothing behind on the machine
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()


def _name(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())[:80]
    except psutil.Error:
        return "?"
