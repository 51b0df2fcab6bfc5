"""The agent workload: tasks of a coding / operations agent, each a loop of forced tool calls whose
results are long tool outputs, fitted into the model's context. Deterministic by seed.

A task has a user message (one of TASKS), a number of round trips drawn from `round_trips`, and one
tool output per round trip whose length in tokens is drawn log-uniformly from `output_tokens`; the
outputs are real English text (textsource.TokenStream over the model's tokenizer, so a length is a
length in the model's tokens), one stream for the whole workload, so no two outputs share text and
nothing but the system prompt and the tools is common to two tasks.

Fitting (`fit_task`): a task's last prompt holds the first prompt (system, tools, task: `base`
tokens, counted by the server), per round trip the call (at most `call_max_tokens`) and the tool
result's framing (`overhead`, counted by the server) plus the output, and the final answer. When the
drawn task exceeds the context (less SAFETY tokens), round trips are cut first, down to the low end of
`round_trips`, then below it only if even outputs of `min_output_tokens` (default: the low end of
`output_tokens`) would not fit; then, if the outputs still do not fit, each keeps that minimum and
the part of it above the minimum is scaled by one factor. Each task's shape records what was drawn
and what was kept, so the report states the scaling.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from radixserve_bench.textsource import TokenStream

SAFETY = 64  # tokens left free below the context: re-tokenized text may come out a few tokens longer

SYSTEM_PROMPT = ("You are an autonomous software engineering agent working in a company's monorepo and its "
                 "production environment. Work on the user's task step by step: call exactly one tool per turn, "
                 "read its result, and decide the next call. Prefer reading code, logs and metrics before changing "
                 "anything. When the task is done, answer with one short sentence.")

TASKS = (
    "The checkout service returns HTTP 500 for orders that use a coupon code. Find the cause and fix it.",
    "The nightly billing job has been running twice as long since last week. Find out why.",
    "Search latency p99 doubled after yesterday's deploy. Investigate and propose a rollback or a fix.",
    "Users report being logged out every few minutes. Find the session expiry bug in the auth service.",
    "The flaky test test_refund_partial fails one run in ten. Find the race and make it deterministic.",
    "Add rate limiting to the public search API and document the new limits.",
    "A customer's invoice total is off by one cent. Trace the rounding through the billing code.",
    "The worker queue is backing up; pods restart with OOMKilled. Find the memory leak.",
)


@dataclass(frozen=True)
class AgentParams:
    tasks: int = 4
    round_trips: tuple[int, int] = (10, 30)  # drawn per task, inclusive
    output_tokens: tuple[int, int] = (200, 2000)  # drawn per tool output (log-uniform), before fitting
    tools: int = 20  # the first N of tools.TOOLS
    call_max_tokens: int = 96  # max_tokens of a forced call
    answer_max_tokens: int = 16  # max_tokens of the final answer
    # fitting cuts round trips before an output would get shorter than this (None: output_tokens' low end)
    min_output_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("round_trips", "output_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be LO-HI with 1 <= LO <= HI, got {lo}-{hi}")
        for name in ("tasks", "tools", "call_max_tokens", "answer_max_tokens", "shortest_output"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def shortest_output(self) -> int:
        return self.output_tokens[0] if self.min_output_tokens is None else self.min_output_tokens


@dataclass(frozen=True)
class TaskShape:
    """What was drawn for a task and what fitting kept."""

    drawn_round_trips: int
    drawn_output_tokens: tuple[int, ...]
    round_trips: int
    output_tokens: tuple[int, ...]
    scale: float  # the factor on each kept output's part above the minimum (1.0: none)
    base_tokens: int  # turn 1's prompt, as the server counts it
    overhead_tokens: int  # per round trip besides the output: the call at most and the result's framing
    max_prompt_tokens: int  # the last turn's prompt at most


@dataclass(frozen=True)
class AgentTask:
    task_id: str
    user: str
    outputs: tuple[str, ...]
    shape: TaskShape


def draw(p: AgentParams, seed: int) -> list[tuple[str, int, list[int]]]:
    """Per task: (user message, round trips, output lengths), as drawn before fitting."""
    rng = random.Random(f"agents:{seed}")
    lo, hi = p.output_tokens
    out = []
    for k in range(p.tasks):
        rounds = rng.randint(*p.round_trips)
        lengths = [round(math.exp(rng.uniform(math.log(lo), math.log(hi)))) for _ in range(rounds)]
        out.append((TASKS[k % len(TASKS)], rounds, lengths))
    return out


def fit_task(drawn: list[int], base: int, overhead: int, context: int, p: AgentParams) -> TaskShape:
    """Round trips and output lengths so that the task's last prompt fits `context` (module docstring)."""
    room = context - SAFETY - base - p.answer_max_tokens
    rounds = len(drawn)
    while rounds > p.round_trips[0] and sum(drawn[:rounds]) + rounds * overhead > room:
        rounds -= 1
    while rounds > 1 and room - rounds * overhead < rounds * p.shortest_output:
        rounds -= 1
    space = room - rounds * overhead
    kept = drawn[:rounds]
    floors = [min(n, p.shortest_output) for n in kept]
    if space < sum(floors):
        raise ValueError(f"the context ({context} tokens) cannot hold one round trip after a first prompt of "
                         f"{base} tokens: use fewer tools or a longer context")
    above = sum(kept) - sum(floors)
    scale = 1.0 if sum(kept) <= space else (space - sum(floors)) / above
    lengths = tuple(f + math.floor((n - f) * scale) for n, f in zip(kept, floors))
    return TaskShape(len(drawn), tuple(drawn), rounds, lengths, scale, base, overhead,
                     base + rounds * overhead + sum(lengths))


def build_tasks(p: AgentParams, seed: int, encode: Callable[[str], list[int]], decode: Callable[[list[int]], str],
                count: Callable[[str], int], overhead: int, context: int) -> list[AgentTask]:
    """The workload's tasks. `count(user)` is the server's prompt length of turn 1 for that task;
    `overhead` the tokens a round trip adds besides its output (see fit_task)."""
    stream = TokenStream(encode, seed=seed)
    tasks = []
    for k, (user, _, lengths) in enumerate(draw(p, seed)):
        shape = fit_task(lengths, count(user), overhead, context, p)
        outputs = tuple(decode(stream.take(n)) for n in shape.output_tokens)
        tasks.append(AgentTask(f"task{k}", user, outputs, shape))
    return tasks


def describe(tasks: list[AgentTask]) -> list[dict[str, Any]]:
    """Each task's shape for the results document (the outputs' text is left out)."""
    return [{"task_id": t.task_id, "user": t.user, **asdict(t.shape)} for t in tasks]
