"""A real `radixserve serve` in a child process for the checks that probe a server: started with an API-keys
file on 127.0.0.1, waited for until /health answers, stopped (and waited for) on exit."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import httpx

from radixserve.model.embedded import embedded_model_dir

START_TIMEOUT_S = 300.0


class Server:
    def __init__(self, keys: Path, port: int, extra: list[str] | None = None) -> None:
        self.keys, self.port, self.extra = keys, port, extra or []
        self.proc: subprocess.Popen[bytes] | None = None
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600)
        config = json.loads((embedded_model_dir() / "config.json").read_text())
        self.vocab: int = config["vocab_size"]  # token ids the probes may use

    def __enter__(self) -> Server:
        cmd = [sys.executable, "-m", "radixserve", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--api-keys", str(self.keys), *self.extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}: {' '.join(cmd)}")
            try:
                if self.client.get("/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__(None, None, None)
        raise RuntimeError("the server did not become healthy")

    def model(self, key: str) -> str:
        """The served model's name, as /v1/models tells a holder of `key`."""
        r = self.client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
        r.raise_for_status()
        return str(r.json()["data"][0]["id"])

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.client.close()
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
