"""The server builds its engine in a thread of its own that exits once the engine is built
(`app.in_passing_thread`): OpenMP keeps a team of threads for every thread that ran a parallel loop
for as long as that thread lives, and a team left behind by an executor thread makes libgomp stop
spinning at the step's barriers (docs/quantized.md). These tests hold the helper to that: the build
runs outside the caller's thread, the thread is gone afterwards, the result or error comes back."""

from __future__ import annotations

import threading

import pytest
import torch

from radixserve.server.app import in_passing_thread


def test_the_build_runs_in_a_thread_that_is_gone_afterwards() -> None:
    seen: list[threading.Thread] = []

    def build() -> int:
        seen.append(threading.current_thread())
        torch.ones(1 << 16).sum()  # a parallel loop: this thread's OpenMP team, released when it exits
        return 42

    assert in_passing_thread(build) == 42
    assert seen and seen[0] is not threading.current_thread()
    assert seen[0].name == "radixserve-load" and not seen[0].is_alive()


def test_a_failed_build_raises_in_the_caller() -> None:
    def build() -> int:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        in_passing_thread(build)
    assert not any(t.name == "radixserve-load" for t in threading.enumerate())
