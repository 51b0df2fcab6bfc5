"""What a benchmark run will do: the options, the workloads built from them, which systems run on
which workload, and how big every pool is.

Pool sizing per workload, in blocks: the working set is what an unbounded cache would hold for the
trace (replies counted as unshareable placeholders of their fixed length); "ample" is that plus what
the clients in flight could hold without any sharing, so no system is memory-bound and the cache
never evicts; the bounded pool is `pool_fraction` of the working set, but never less than one
request's blocks (a request that cannot fit could never run). The host tier of the bounded pool with
it (`radixserve-pool25-host`) gets the ample number of blocks: the whole working set fits there.

Systems per workload: each scenario's own (bounded-pool, returning-chats); the transformers peers
only where every request is greedy; and by default, the speculation workloads run radixserve with
speculation on and off and transformers' prompt lookup (not on edit-prediction: it has the prompts of
edit, and a prediction is no transformers feature), random adds speculation off to the usual systems.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from radixserve_bench.belady import TraceRequest, working_set_blocks
from radixserve_bench.flags import BenchConfigError
from radixserve_bench.systems import (
    BOUNDED,
    BOUNDED_FP8,
    BOUNDED_HOST,
    GREEDY_ONLY,
    NOSPEC,
    PROMPT_LOOKUP,
    SYSTEM_DESCRIPTIONS,
    default_systems,
)
from radixserve_bench.workloads import (
    DEFAULT_PARAMS,
    SMOKE_PARAMS,
    SPEC_WORKLOADS,
    WORKLOADS,
    Encode,
    Load,
    Workload,
    build_workload,
    default_load,
    send_order,
    with_overrides,
)


@dataclass
class RunOptions:
    """What every scenario that runs workloads on systems takes (the main run here, scale-out's
    ScaleOutOptions). A scenario redeclares a field to change its default, names its workloads in
    KNOWN_WORKLOADS and checks its own fields in `scenario_problems`; bad options raise one
    BenchConfigError that lists them all."""

    KNOWN_WORKLOADS: ClassVar[tuple[str, ...]] = WORKLOADS
    repeats: int = 3
    smoke: bool = False
    seed: int = 0
    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    pool_fraction: float = 0.25
    params: dict[str, dict[str, str]] = field(default_factory=dict)  # workload -> field -> value
    timeout_s: float = 1800.0
    micro: bool = True
    progress: bool = True

    def __post_init__(self) -> None:
        problems = self._shared_problems() + self.scenario_problems()
        if problems:
            raise BenchConfigError("; ".join(problems))

    def scenario_problems(self) -> list[str]:
        return []

    def _shared_problems(self) -> list[str]:
        problems = []
        if self.repeats < 1:
            problems.append("--repeats must be >= 1")
        if not 0 < self.pool_fraction <= 1:
            problems.append("--pool-fraction must be in (0, 1]")
        if self.timeout_s <= 0:
            problems.append("--timeout must be > 0")
        unknown = set(self.params) - set(self.KNOWN_WORKLOADS)
        if unknown:
            problems.append(f"--param names unknown workload(s): {sorted(unknown)}")
        return problems

    def workload_params(self, name: str, defaults: Mapping[str, Any], smoke: Mapping[str, Any]) -> Any:
        """Workload `name`'s parameters: its defaults (smoke-sized with --smoke) with its --param applied."""
        try:
            return with_overrides((smoke if self.smoke else defaults)[name], self.params.get(name, {}))
        except ValueError as e:
            raise BenchConfigError(f"{name}: {e}") from None


@dataclass
class BenchOptions(RunOptions):
    workloads: tuple[str, ...] = WORKLOADS
    systems: tuple[str, ...] | None = None  # None: the defaults for this machine
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 256
    num_blocks: int | None = None  # None: ample for each workload
    load: str | None = None  # closed | open; None: each workload's default
    concurrency: int | None = None
    request_rate: float | None = None
    num_speculative_tokens: int | None = None  # None: the engine's default (radixserve-nospec: always 0)
    speculative_max_batch: int | None = None
    speculative_max_rows: int | None = None
    prompt_lookup_tokens: int = 10  # hf-prompt-lookup's prompt_lookup_num_tokens

    def scenario_problems(self) -> list[str]:
        problems = []
        unknown = [w for w in self.workloads if w not in WORKLOADS]
        if unknown or not self.workloads:
            problems.append(f"unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)} or all")
        if self.systems is not None:
            bad = [s for s in self.systems if s not in SYSTEM_DESCRIPTIONS]
            if bad or not self.systems:
                problems.append(f"unknown system(s) {bad}; choose from {', '.join(SYSTEM_DESCRIPTIONS)}")
        if self.num_blocks is not None and self.num_blocks < 1:
            problems.append("--num-blocks must be >= 1")
        if self.prompt_lookup_tokens < 1:
            problems.append("--prompt-lookup-tokens must be >= 1")
        return problems


@dataclass(frozen=True)
class Sizing:
    working_set_blocks: int
    max_request_blocks: int
    ample_blocks: int
    bounded_blocks: int
    static_batch_size: int
    host_blocks: int = 0  # the host tier of radixserve-pool25-host, in blocks of the device pool's size
    bounded_fp8_blocks: int = 0  # radixserve-pool25-fp8's pool: the bounded pool's bytes in FP8 blocks


def make_load(name: str, params: object, o: BenchOptions) -> Load:
    base = default_load(name, params)
    mode = o.load or ("open" if o.request_rate is not None else base.mode)
    if mode == "open":
        if o.request_rate is None:
            raise BenchConfigError("--load open needs --request-rate")
        return Load("open", concurrency=base.concurrency, rate=o.request_rate)
    return Load(mode, concurrency=o.concurrency or base.concurrency)


def build_workloads(o: BenchOptions, encode: Encode, vocab_size: int, max_len: int,
                    chat: Encode | None = None) -> list[Workload]:
    out = []
    for name in o.workloads:
        params = o.workload_params(name, DEFAULT_PARAMS, SMOKE_PARAMS)
        try:
            load = make_load(name, params, o)
        except ValueError as e:
            raise BenchConfigError(f"{name}: {e}") from None
        w = build_workload(name, params, load, encode, o.seed, chat)
        tokens = [t for s in w.sessions for turn in s.turns for t in turn.new_tokens]
        if tokens and max(tokens) >= vocab_size:
            raise BenchConfigError(f"{name}: token id {max(tokens)} outside the model's vocabulary of {vocab_size}")
        longest = max(len(r.sequence) for r in placeholder_trace(w))
        if longest > max_len:
            raise BenchConfigError(f"{name}: a session reaches {longest} tokens, over the model's context of {max_len}")
        out.append(w)
    return out


def placeholder_trace(w: Workload) -> list[TraceRequest]:
    """The workload's requests in the order one client sends them, with replies replaced by unique
    placeholders of the same length."""
    fresh = itertools.count(-1, -1)
    trace = []
    histories: dict[str, tuple[int, ...]] = {}
    for s, k in send_order(w):
        turn = s.turns[k]
        prompt = (histories.get(s.session_id, ()) if turn.history else ()) + turn.new_tokens
        histories[s.session_id] = prompt + tuple(next(fresh) for _ in range(turn.output_len))
        trace.append(TraceRequest(len(prompt), histories[s.session_id]))
    return trace


def size_pools(w: Workload, o: BenchOptions) -> Sizing:
    bs = o.block_size
    trace = placeholder_trace(w)
    ws = working_set_blocks(trace, bs)
    per_request = max(-(-len(r.sequence) // bs) for r in trace)
    in_flight = len(w.sessions) if w.load.mode == "open" else min(w.load.concurrency, len(w.sessions))
    ample = o.num_blocks or ws + in_flight * (per_request + 1) + 16
    bounded = max(math.ceil(o.pool_fraction * ws), per_request + 2)
    batch = min(in_flight, 64) if w.load.mode != "open" else 16
    return Sizing(ws, per_request, ample, bounded, batch, host_blocks=ample)


def default_on(name: str, workload: str) -> bool:
    """Whether a default system runs on `workload` unless the systems are named (see the docstring)."""
    if workload in SPEC_WORKLOADS:
        return name in ("radixserve", "radixserve-triton", NOSPEC) or (name == PROMPT_LOOKUP and workload != "edit-prediction")
    return name not in (NOSPEC, PROMPT_LOOKUP) or (name == NOSPEC and workload == "random")


def plan_systems(w: Workload, o: BenchOptions, cuda: bool, device: str) -> tuple[list[str], list[str]]:
    """The systems to run on `w`, and why any system named on the command line is skipped there
    (defaults that do not apply to a workload are left out silently)."""
    wanted = list(o.systems or [s for s in default_systems(cuda) if default_on(s, w.name)])
    sampled = any(not t.sampling.greedy for s in w.sessions for t in s.turns)
    run, skipped = [], []
    for name in wanted:
        if name in GREEDY_ONLY and sampled:
            skipped.append(f"{w.name}/{name}: transformers peers serve greedy requests only")
        elif w.name == "bounded-pool" and name not in ("radixserve", BOUNDED, BOUNDED_FP8):
            skipped.append(f"{w.name}/{name}: this scenario compares radixserve's bounded pool with the offline "
                           "optimum only")
        elif w.name == "returning-chats" and name not in ("radixserve", BOUNDED, BOUNDED_HOST):
            skipped.append(f"{w.name}/{name}: this scenario compares radixserve's bounded pool with and without "
                           "the host tier against an ample pool only")
        elif name == BOUNDED and w.name not in ("bounded-pool", "returning-chats"):
            skipped.append(f"{w.name}/{name}: the bounded pool runs on the bounded-pool and returning-chats workloads")
        elif name == BOUNDED_FP8 and w.name != "bounded-pool":
            skipped.append(f"{w.name}/{name}: the FP8 bounded pool runs on the bounded-pool workload")
        elif name == BOUNDED_HOST and w.name != "returning-chats":
            skipped.append(f"{w.name}/{name}: the host tier runs on the returning-chats workload")
        elif name == "radixserve-triton" and not (device == "cuda" or (device == "auto" and cuda)):
            skipped.append(f"{w.name}/{name}: the Triton backend needs a CUDA device")
        else:
            run.append(name)
    return run, skipped if o.systems else []
