"""The `radixserve` command as a user runs it: chat (two turns, the second hits the cache) and
generate, as subprocesses on the embedded model."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

CMD = [sys.executable, "-m", "radixserve.cli"]


def run(args: list[str], stdin: str = "") -> str:
    proc = subprocess.run(CMD + args, input=stdin, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_chat_reports_cache_hits_per_turn() -> None:
    out = run(["chat", "--max-tokens", "6"], stdin="Name a fruit.\nAnd another?\n")
    figures = re.findall(r"\[cached (\d+)/(\d+) prompt tokens", out)
    assert len(figures) == 2, out
    (c1, p1), (c2, p2) = [(int(c), int(p)) for c, p in figures]
    assert c1 == 0 and c2 >= p1  # turn 2 reuses all of turn 1's prompt (and most of its reply)
    assert "TTFT" in out and "tok/s" in out


def test_generate_and_help() -> None:
    out = run(["generate", "--chat", "--max-tokens", "4", "Say hi."])
    assert "### Say hi." in out and "[cached 0/" in out
    help_text = run(["serve", "--help"])
    for flag in ("--block-size", "--kv-cache-memory-mb", "--max-num-batched-tokens", "--policy",
                 "--attention-backend", "--port", "--host-cache-mb", "--preemption-mode"):
        assert flag in help_text


def test_bad_model_path_is_a_clear_error() -> None:
    proc = subprocess.run(CMD + ["generate", "--model", "/nonexistent/model", "hi"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0
    assert "does not exist" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("flags, message", [
    (["--host-cache-mb", "-1"], "must be >= 0"),
    (["--host-cache-mb", "1e12"], "more host memory than this machine can pin"),
    (["--preemption-mode", "swap"], "needs the host tier"),
    (["--eviction-lookahead", "-1"], "eviction_lookahead (--eviction-lookahead) must be >= 0"),
])
def test_bad_cache_settings_are_clear_errors_at_start(flags: list[str], message: str) -> None:
    proc = subprocess.run(CMD + ["generate", *flags, "hi"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert message in proc.stderr and "Traceback" not in proc.stderr


# Runs `radixserve` with the server's libraries made unimportable: a subcommand that needs none of
# them must still work (a GPU box with only the engine's dependencies can run them).
WITHOUT_SERVER_LIBS = """
import importlib.abc, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("starlette", "uvicorn", "websockets"):
            raise ImportError(f"this subcommand imported {name}")
sys.meta_path.insert(0, Refuse())
from radixserve.cli import main
sys.exit(main(sys.argv[1:]))
"""


def run_without_server_libs(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", WITHOUT_SERVER_LIBS, *args], capture_output=True, text=True,
                          timeout=300)


def test_subcommands_import_only_what_they_use() -> None:
    for args in (["generate", "--max-tokens", "2", "Hi"], ["bench", "micro", "--smoke"]):
        proc = run_without_server_libs(args)
        assert proc.returncode == 0, (args, proc.stderr[-2000:])
    kernels = run_without_server_libs(["bench", "kernels"])  # no CUDA here: it must say so, not crash on imports
    assert "imported" not in kernels.stderr and "CUDA" in kernels.stdout + kernels.stderr, kernels.stderr[-2000:]
    refused = run_without_server_libs(["serve", "--port", "0"])  # the control: serve does need them
    assert refused.returncode != 0 and "this subcommand imported" in refused.stderr
