"""The compile workers: a pool of processes (engine/grammar/worker_process.py) where every constraint
is first converted, compiled and first-masked, so that a grammar that would crash, stall or exhaust
the server does that to a worker instead.

Owns: the worker processes (started when first needed, at most `GrammarLimits.workers` alive), the
idle list, and the boot message each new worker is sent (the tokenizer's JSON, its vocabulary size
and EOS ids, the limits).

Invariants:
- a compile holds one worker for at most `compile_timeout_s`; a worker that runs past it is killed
  (SIGKILL: the work stops, never blocks the next compile) and a worker that dies (a native stack
  overflow, its memory cap) is dropped; either way its request gets CompileRefused in our words, and
  the next compile that finds no idle worker starts a fresh one;
- a compile waits at most `compile_timeout_s` for a worker, then gets CompileBusy (the server's
  per-client compile slots, server/pipeline/compile_slots.py, keep one client from holding every worker);
- `close` kills every worker; a worker also exits by itself when the engine's end of its pipe closes.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from radixserve.engine.grammar.limits import GrammarLimits
from radixserve.engine.grammar.worker_process import HEADER, write_message
from radixserve.structured import JSON_OPTIONS

WORKER_SCRIPT = Path(__file__).with_name("worker_process.py")
BOOT_TIMEOUT_S = 60.0  # python, llguidance and the tokenizer (~1 s on an idle machine)


class CompileRefused(Exception):
    """The worker refused the constraint, or the constraint killed or outlasted its worker; the
    message is in our words and names no library internals."""


class CompileBusy(Exception):
    """No worker came free within the compile timeout."""


class WorkerLost(Exception):
    """The worker died or was killed mid-request; the text says which."""


class CompileWorker:
    """One worker process and its pipes; used by one thread at a time (the pool's)."""

    def __init__(self, boot: dict[str, Any]) -> None:
        self.process = subprocess.Popen([sys.executable, "-I", str(WORKER_SCRIPT)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE)
        self._buffer = b""
        try:
            answer = self.request(boot, BOOT_TIMEOUT_S)
        except WorkerLost:
            raise RuntimeError("a grammar compile worker failed to start; see the server log") from None
        if not answer.get("ready"):
            self.kill()
            raise RuntimeError(f"a grammar compile worker failed to start: {answer}")

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def request(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """The worker's answer to `message`; WorkerLost (the worker then dead) if it dies or does not
        answer within `timeout_s`."""
        assert self.process.stdin is not None
        try:
            write_message(self.process.stdin, message)  # type: ignore[arg-type]
        except (BrokenPipeError, OSError):
            self.kill()
            raise WorkerLost("crashed") from None
        try:
            return self._read(time.monotonic() + timeout_s)
        except WorkerLost:
            self.kill()
            raise

    def _read(self, deadline: float) -> dict[str, Any]:
        """One message from the worker; WorkerLost("crashed") at the end of its output, ("timeout") past
        `deadline`."""
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        while True:
            if len(self._buffer) >= HEADER.size:
                (size,) = HEADER.unpack(self._buffer[:HEADER.size])
                if len(self._buffer) >= HEADER.size + size:
                    body = self._buffer[HEADER.size:HEADER.size + size]
                    self._buffer = self._buffer[HEADER.size + size:]
                    return dict(json.loads(body))
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise WorkerLost("timeout")
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise WorkerLost("crashed")
            self._buffer += chunk

    def kill(self) -> None:
        if self.alive:
            self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()


class CompilePool:
    def __init__(self, boot: dict[str, Any], limits: GrammarLimits) -> None:
        self.boot = {**boot, "memory_mb": limits.worker_memory_mb, "stack_mb": limits.stack_mb,
                     "parser": limits.parser(), "json_options": JSON_OPTIONS}
        self.limits = limits
        self.workers_started = 0
        self.workers_lost = 0  # killed past the timeout, or dead of their grammar
        self._idle: list[CompileWorker] = []
        self._alive = 0
        self._closed = False
        self._cond = threading.Condition()

    def run(self, kind: str, value: Any) -> dict[str, Any]:
        """A worker's answer for one constraint source: {"grammar", "compile_s"} or {"refused"}.
        CompileRefused when the constraint killed or outlasted its worker; CompileBusy when no worker
        came free in time."""
        worker = self._acquire()
        try:
            return worker.request({"kind": kind, "value": value}, self.limits.compile_timeout_s)
        except WorkerLost as e:
            with self._cond:
                self.workers_lost += 1
            if str(e) == "timeout":
                raise CompileRefused(f"did not compile within {self.limits.compile_timeout_s:g} s") from None
            raise CompileRefused("is too large or too deeply chained to compile within the engine's limits "
                                 f"({self.limits.stack_mb} MB of stack, {self.limits.worker_memory_mb} MB "
                                 "of memory)") from None
        finally:
            self._release(worker)

    def _acquire(self) -> CompileWorker:
        deadline = time.monotonic() + self.limits.compile_timeout_s
        with self._cond:
            while not self._idle and self._alive >= self.limits.workers:
                left = deadline - time.monotonic()
                if self._closed or left <= 0:
                    raise CompileBusy()
                self._cond.wait(left)
            if self._closed:
                raise CompileBusy()
            if self._idle:
                return self._idle.pop()
            self._alive += 1
            self.workers_started += 1
        try:
            return CompileWorker(self.boot)
        except BaseException:
            with self._cond:
                self._alive -= 1
                self._cond.notify()
            raise

    def _release(self, worker: CompileWorker) -> None:
        with self._cond:
            if worker.alive and not self._closed:
                self._idle.append(worker)
            else:
                self._alive -= 1
                worker.kill()
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._alive -= len(idle)
            self._cond.notify_all()
        for worker in idle:
            worker.kill()
