"""Benchmark workloads: token-level request traces, deterministic by seed, built from real text.

A workload is a list of sessions; a session is a list of turns. A turn's prompt is the session's
history (every earlier prompt and the system's actual reply) plus the turn's new tokens, and a turn is
sent only after the previous turn's reply arrived. Single-turn sessions make ordinary requests.
Every turn has a fixed output length, and every system is made to generate exactly that many tokens.

- shared-prefix: SGLang's generated-shared-prefix shape: groups x prompts per group, each prompt a
  group system prompt followed by its own question.
- multi-turn: vLLM's multi-turn shape: conversations x turns, all conversations opening with one
  common prefix, then a per-conversation prefix, then alternating user / assistant turns.
- random: nothing shared beyond chance; shows what the cache costs when it cannot help.
- bounded-pool: the shared-prefix shape with many groups and few clients, so that a pool of a
  quarter of the working set still fits every request: the scenario for comparing radixserve's
  eviction with the offline optimum.

Loads: closed loop (a fixed number of clients, each sending its session's next turn as soon as the
previous one finished) or open loop (sessions arrive as a Poisson process at `rate` per second).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from radixserve.bench.textsource import TokenStream

WORKLOADS = ("shared-prefix", "multi-turn", "random", "bounded-pool")


@dataclass(frozen=True)
class Turn:
    new_tokens: tuple[int, ...]  # appended to the history before this turn is sent
    output_len: int


@dataclass(frozen=True)
class Session:
    session_id: str
    group: int  # shared-prefix group or conversation index (for charts and the static batcher)
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class Load:
    mode: str = "closed"  # closed | open
    concurrency: int = 1  # closed loop: clients; open loop: ignored
    rate: float = 0.0  # open loop: sessions per second

    def __post_init__(self) -> None:
        if self.mode not in ("closed", "open"):
            raise ValueError(f"load mode must be closed or open, got {self.mode!r}")
        if self.mode == "closed" and self.concurrency < 1:
            raise ValueError("a closed loop needs concurrency >= 1")
        if self.mode == "open" and not self.rate > 0:
            raise ValueError("an open loop needs a request rate > 0")

    def arrival_offsets(self, n: int, seed: int) -> list[float]:
        """Open loop: seconds after the start at which each of n sessions arrives (Poisson)."""
        rng = random.Random(f"arrivals:{seed}")
        t, out = 0.0, []
        for _ in range(n):
            out.append(t)
            t += rng.expovariate(self.rate)
        return out

    def describe(self) -> str:
        return f"closed loop, {self.concurrency} clients" if self.mode == "closed" else f"open loop, {self.rate:g} req/s"


@dataclass(frozen=True)
class SharedPrefixParams:
    groups: int = 2
    prompts_per_group: int = 8
    system_len: int = 512
    question_len: int = 16
    output_len: int = 8


@dataclass(frozen=True)
class BoundedPoolParams(SharedPrefixParams):
    groups: int = 8
    prompts_per_group: int = 2
    system_len: int = 256


@dataclass(frozen=True)
class MultiTurnParams:
    conversations: int = 2
    turns: int = 10
    common_prefix_len: int = 500
    conversation_prefix_len: int = 32
    user_len: int = 16
    output_len: int = 8  # the assistant turn: the system's own reply joins the history


@dataclass(frozen=True)
class RandomParams:
    requests: int = 8
    prompt_len: int = 128  # mean; each prompt is drawn from [prompt_len/2, 3*prompt_len/2]
    output_len: int = 8


# Defaults are scaled so a full run (5 systems x 3 workloads x 3 repeats) takes minutes on 2 CPU
# cores, where a 1024-token prefill costs ~3.4 s: prefill dominates, as in the SGLang / vLLM shapes.
DEFAULT_PARAMS: dict[str, object] = {
    "shared-prefix": SharedPrefixParams(),
    "multi-turn": MultiTurnParams(),
    "random": RandomParams(),
    "bounded-pool": BoundedPoolParams(),
}
SMOKE_PARAMS: dict[str, object] = {
    "shared-prefix": SharedPrefixParams(groups=2, prompts_per_group=3, system_len=48, question_len=8, output_len=4),
    "multi-turn": MultiTurnParams(conversations=2, turns=3, common_prefix_len=32, conversation_prefix_len=8,
                                  user_len=6, output_len=4),
    "random": RandomParams(requests=4, prompt_len=24, output_len=4),
    "bounded-pool": BoundedPoolParams(groups=4, prompts_per_group=2, system_len=32, question_len=8, output_len=4),
}


@dataclass(frozen=True)
class Workload:
    name: str
    sessions: tuple[Session, ...]
    load: Load
    params: dict[str, int] = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def describe(self) -> str:
        shape = ", ".join(f"{k}={v}" for k, v in self.params.items())
        return f"{self.name} ({shape}; {self.num_requests} requests; {self.load.describe()})"


def default_load(name: str, params: object) -> Load:
    """Shared-prefix: everything submitted at once; multi-turn: one client per conversation;
    random: 4 clients; bounded-pool: 2 clients (few requests pin blocks, as in the offline simulation)."""
    if isinstance(params, BoundedPoolParams):
        return Load("closed", concurrency=2)
    if isinstance(params, SharedPrefixParams):
        return Load("closed", concurrency=params.groups * params.prompts_per_group)
    if isinstance(params, MultiTurnParams):
        return Load("closed", concurrency=params.conversations)
    return Load("closed", concurrency=4)


def with_overrides(params: object, overrides: dict[str, str]) -> object:
    """Replace integer fields by name (from `--param workload.field=value`), with clear errors."""
    names = {f.name for f in dataclasses.fields(params)}  # type: ignore[arg-type]
    values: dict[str, int] = {}
    for key, raw in overrides.items():
        if key not in names:
            raise ValueError(f"unknown parameter {key!r} for {type(params).__name__}; known: {', '.join(sorted(names))}")
        try:
            values[key] = int(raw)
        except ValueError:
            raise ValueError(f"parameter {key} needs an integer, got {raw!r}") from None
        if values[key] < 1:
            raise ValueError(f"parameter {key} must be >= 1, got {values[key]}")
    return dataclasses.replace(params, **values)  # type: ignore[type-var]


def build_workload(name: str, params: object, load: Load, encode: Callable[[str], list[int]], seed: int) -> Workload:
    stream = TokenStream(encode, seed=seed)
    rng = random.Random(f"{name}:{seed}")
    if isinstance(params, SharedPrefixParams):
        sessions = _shared_prefix(params, stream, rng)
    elif isinstance(params, MultiTurnParams):
        sessions = _multi_turn(params, stream)
    elif isinstance(params, RandomParams):
        sessions = _random(params, stream, rng)
    else:
        raise TypeError(f"no workload builder for {type(params).__name__}")
    return Workload(name, tuple(sessions), load, dataclasses.asdict(params))


def _shared_prefix(p: SharedPrefixParams, stream: TokenStream, rng: random.Random) -> list[Session]:
    sessions = []
    for g in range(p.groups):
        system = tuple(stream.take(p.system_len))
        for i in range(p.prompts_per_group):
            prompt = system + tuple(stream.take(p.question_len))
            sessions.append(Session(f"sp-g{g}-p{i}", g, (Turn(prompt, p.output_len),)))
    rng.shuffle(sessions)  # groups interleave in arrival order, as independent users' requests would
    return sessions


def _multi_turn(p: MultiTurnParams, stream: TokenStream) -> list[Session]:
    common = tuple(stream.take(p.common_prefix_len))
    sessions = []
    for c in range(p.conversations):
        first = common + tuple(stream.take(p.conversation_prefix_len)) + tuple(stream.take(p.user_len))
        turns = [Turn(first, p.output_len)]
        turns += [Turn(tuple(stream.take(p.user_len)), p.output_len) for _ in range(p.turns - 1)]
        sessions.append(Session(f"mt-c{c}", c, tuple(turns)))
    return sessions


def _random(p: RandomParams, stream: TokenStream, rng: random.Random) -> list[Session]:
    lo, hi = max(1, p.prompt_len // 2), max(1, p.prompt_len * 3 // 2)
    return [
        Session(f"rnd-{i}", i, (Turn(tuple(stream.take(rng.randint(lo, hi))), p.output_len),))
        for i in range(p.requests)
    ]
