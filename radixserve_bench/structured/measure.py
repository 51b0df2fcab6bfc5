"""The pieces the structured workload's runner drives: a batch of requests run to the end on one
engine (their whole replies and the steps each took), the verdict on a reply, and percentiles.

Invariants: a reply is judged from its own text only: "length" when max_tokens cut it (never valid
or invalid: a cut reply is not the constraint's fault), "error" when the engine ended it (a grammar
dead end, a failed forward), else "valid" or "invalid" by `json.loads` and `jsonschema`'s Draft
2020-12 validator with its format checker, so `format` keywords are checked too.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from radixserve.core import StepInfo
from radixserve.engine.engine import LLMEngine
from radixserve.sampling_params import SamplingParams
from radixserve_bench.metrics import percentile

VERDICTS = ("valid", "invalid", "length", "error")


@dataclass
class Job:
    key: str  # the caller's label (schema or tool name, mode, seed)
    prompt: list[int]
    params: SamplingParams


@dataclass
class Reply:
    key: str
    text: str = ""
    tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class Verdict:
    verdict: str  # one of VERDICTS
    why: str = ""  # for invalid and error: the first problem


def run_jobs(engine: LLMEngine, jobs: list[Job], on_done: Callable[[Reply], None] | None = None) -> list[Reply]:
    """Queue every job, step the engine until all are done; their whole replies, in job order."""
    ids = {engine.add_request(j.prompt, j.params): j.key for j in jobs}
    replies = {rid: Reply(key) for rid, key in ids.items()}
    while engine.has_unfinished():
        outputs = engine.step()
        for out in outputs:
            reply = replies.get(out.request_id)
            if reply is None:
                continue
            for c in out.outputs:
                reply.text += c.text
                reply.tokens += len(c.token_ids)
                reply.finish_reason = c.finish_reason or reply.finish_reason
            reply.error = out.error or reply.error
            if out.finished and on_done is not None:
                on_done(reply)
    if engine.leaked_blocks():
        raise RuntimeError(f"{engine.leaked_blocks()} KV blocks leaked by the structured workload")
    return [replies[rid] for rid in ids]


@dataclass
class StepLog:
    """Every StepInfo the engine reports while it is attached (`LLMEngine.add_step_observer`)."""

    steps: list[StepInfo] = field(default_factory=list)
    on: bool = False

    def __call__(self, info: StepInfo) -> None:
        if self.on:
            self.steps.append(info)

    def start(self) -> None:
        self.steps.clear()
        self.on = True

    def stop(self) -> list[StepInfo]:
        self.on = False
        return list(self.steps)


def judge(reply: Reply, validator: Any) -> Verdict:
    """The verdict on one constrained reply (see the module docstring)."""
    if reply.finish_reason == "length":
        return Verdict("length")
    if reply.finish_reason not in ("stop", None) or reply.error:
        return Verdict("error", reply.error or f"finish_reason {reply.finish_reason}")
    try:
        value = json.loads(reply.text)
    except ValueError as e:
        return Verdict("invalid", f"not JSON: {e}")
    error = next(iter(validator.iter_errors(value)), None)
    return Verdict("valid") if error is None else Verdict("invalid", f"{'/'.join(map(str, error.path))}: {error.message}")


def validator_for(schema: dict[str, Any]) -> Any:
    """A Draft 2020-12 validator that also checks `format` (jsonschema ignores it by default)."""
    from jsonschema import Draft202012Validator

    return Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)


def tally(verdicts: list[Verdict]) -> dict[str, Any]:
    """Counts per verdict and the valid shares: of all replies, and of those not cut by max_tokens."""
    counts = {v: sum(1 for x in verdicts if x.verdict == v) for v in VERDICTS}
    total, judged = len(verdicts), len(verdicts) - counts["length"]
    return {"replies": total, **counts, "valid_pct": 100.0 * counts["valid"] / total if total else float("nan"),
            "valid_pct_of_finished": 100.0 * counts["valid"] / judged if judged else float("nan")}


def spread_ms(seconds: list[float]) -> dict[str, float]:
    """p50 / p95 / max / mean in milliseconds."""
    ms = [1000 * s for s in seconds]
    return {"p50_ms": percentile(ms, 50), "p95_ms": percentile(ms, 95), "max_ms": max(ms), "mean_ms": sum(ms) / len(ms)}
