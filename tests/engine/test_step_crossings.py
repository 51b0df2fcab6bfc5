"""How often one decode step crosses a package boundary, measured with `sys.setprofile`.

A crossing is a Python call from a function of one of the packages that hold components (engine,
scheduler, cache, model) into a function of another. Core's types (reading a `Sequence` property)
are shared vocabulary, not a component, and the model's calls into `kernels/` are the forward's own
inside: neither counts. Issue 25's target: one decode step (batch of one, steady state, with and
without overlap) crosses at most 8 times.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
from tiny_models import tiny_model_dir

from radixserve import SamplingParams
from radixserve.config import EngineConfig
from radixserve.engine.engine import LLMEngine

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "radixserve"
COMPONENTS = ("engine", "scheduler", "cache", "model")


def _package(frame: FrameType) -> str | None:
    """The radixserve package a frame's function is in ("core.py" for the top-level modules)."""
    try:
        return Path(frame.f_code.co_filename).relative_to(PACKAGE_ROOT).parts[0]
    except ValueError:
        return None


def _caller(frame: FrameType) -> FrameType | None:
    """The nearest radixserve frame below `frame`: a call made through a decorator or a library
    (torch.inference_mode, a context manager) is the radixserve function's that made it."""
    caller = frame.f_back
    while caller is not None and _package(caller) is None:
        caller = caller.f_back
    return caller


def crossings_of(run: Any) -> Counter[str]:
    """'caller -> callee function' for every cross-component call `run()` makes."""
    seen: Counter[str] = Counter()

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event != "call" or (callee := _package(frame)) not in COMPONENTS:
            return
        back = _caller(frame)
        caller = _package(back) if back is not None else None
        if caller in COMPONENTS and callee != caller:
            seen[f"{caller} -> {callee}.{frame.f_code.co_name}"] += 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return seen


@pytest.mark.parametrize("overlap", [False, True])
def test_one_decode_step_crosses_at_most_eight_times(overlap: bool) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir("llama")), overlap=overlap))
    engine.recorder.check_integrity = False  # the tests' RADIXSERVE_CHECK_INTEGRITY=1 is not part of a step
    engine.add_request(list(range(3, 40)), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    for _ in range(6):  # past the prompt and into steady decoding (no block completes on the measured step)
        engine.step()
    seq = engine.scheduler.running[0]
    while (seq.num_computed + 1) % engine.config.block_size == 0:
        engine.step()
    crossings = crossings_of(engine.step)
    assert sum(crossings.values()) <= 8, crossings
    assert "engine -> scheduler.commit" in crossings and "engine -> model.run" in crossings
