"""Benchmark workloads: token-level request traces, deterministic by seed, built from real text.

A workload is a list of sessions; a session is a list of turns. A turn's prompt is the session's
history (every earlier prompt and the system's actual reply) plus the turn's new tokens (or its new
tokens alone for a turn with `history=False`: a regenerated reply), and a turn is sent only after the
previous turn's reply arrived. Single-turn sessions make ordinary requests.
Every turn has a fixed output length, and every system is made to generate exactly that many tokens.

- shared-prefix: SGLang's generated-shared-prefix shape: groups x prompts per group, each prompt a
  group system prompt followed by its own question.
- multi-turn: vLLM's multi-turn shape: conversations x turns, all conversations opening with one
  common prefix, then a per-conversation prefix, then alternating user / assistant turns.
- random: nothing shared beyond chance; shows what the cache costs when it cannot help.
- bounded-pool: the shared-prefix shape with many groups and few clients, so that a pool of a
  quarter of the working set still fits every request: the scenario for comparing radixserve's
  eviction with the offline optimum.
- returning-chats: many conversations with long histories that take turns round-robin, so each goes
  idle while the others talk and comes back after its history has left a device pool of a quarter
  of the working set: the scenario for the host-memory tier (load back vs recompute).
- regenerate / regenerate-sampled: a chat request, then the same request again (the regenerate
  button: the second turn re-sends the first prompt alone), greedy or sampled with a new seed; the
  radix tree holds the first reply when the second is decoded (speculative decoding's tree drafts).
- edit / edit-prediction: "return this code / text with a small change" chat requests
  (edit_texts.py), whose replies repeat most of the prompt; edit-prediction also sends the text as
  the request's prediction (OpenAI's Predicted Outputs). Both have the same prompts for one seed.

Loads: closed loop (a fixed number of clients, each sending its session's next turn as soon as the
previous one finished), rounds (the same clients, but they take turns from every session in
round-robin order: turn 1 of each session, then turn 2 of each, ...) or open loop (sessions arrive
as a Poisson process at `rate` per second).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from radixserve_bench.systems.base import GREEDY, Sampling
from radixserve_bench.textsource import TokenStream

SPEC_WORKLOADS = ("regenerate", "regenerate-sampled", "edit", "edit-prediction")
WORKLOADS = ("shared-prefix", "multi-turn", "random", "bounded-pool", "returning-chats", *SPEC_WORKLOADS)
LOAD_MODES = ("closed", "rounds", "open")
Encode = Callable[[str], list[int]]


@dataclass(frozen=True)
class Turn:
    new_tokens: tuple[int, ...]  # appended to the history before this turn is sent
    output_len: int
    history: bool = True  # False: the prompt is new_tokens alone (a regenerated reply re-sends its prompt)
    sampling: Sampling = GREEDY


@dataclass(frozen=True)
class Session:
    session_id: str
    group: int  # shared-prefix group or conversation index (for charts and the static batcher)
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class Load:
    mode: str = "closed"  # closed | rounds | open
    concurrency: int = 1  # closed loop and rounds: clients; open loop: ignored
    rate: float = 0.0  # open loop: sessions per second

    def __post_init__(self) -> None:
        if self.mode not in LOAD_MODES:
            raise ValueError(f"load mode must be one of {', '.join(LOAD_MODES)}, got {self.mode!r}")
        if self.mode != "open" and self.concurrency < 1:
            raise ValueError(f"a {self.mode} load needs concurrency >= 1")
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
        if self.mode == "open":
            return f"open loop, {self.rate:g} req/s"
        clients = f"{self.concurrency} client{'s' if self.concurrency != 1 else ''}"
        return f"closed loop, {clients}" + (", sessions take turns round-robin" if self.mode == "rounds" else "")


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
class ReturningChatsParams:
    conversations: int = 8
    turns: int = 3  # the first, then turns - 1 returns after every other conversation has had its turn
    system_len: int = 128  # one system prompt shared by every conversation (stays hot on the device)
    history_len: int = 896  # each conversation's earlier exchanges, already in its first prompt
    user_len: int = 32
    output_len: int = 8


@dataclass(frozen=True)
class RandomParams:
    requests: int = 8
    prompt_len: int = 128  # mean; each prompt is drawn from [prompt_len/2, 3*prompt_len/2]
    output_len: int = 8


@dataclass(frozen=True)
class RegenerateParams:
    sessions: int = 4
    asks: int = 2  # the first request and asks - 1 regenerations of it
    prompt_len: int = 96  # tokens of conversation excerpt in the chat request, at least
    output_len: int = 96
    temperature: float = 0.0  # 0: greedy; else seeded sampling, a new seed for every ask


@dataclass(frozen=True)
class RegenerateSampledParams(RegenerateParams):
    temperature: float = 0.7


@dataclass(frozen=True)
class EditParams:
    requests: int = 6
    text_len: int = 96  # tokens of the text to rewrite, at least (the output repeats it)
    output_extra: int = 16  # output_len = the text's tokens + this (code fences, a line around it)


@dataclass(frozen=True)
class EditPredictionParams(EditParams):
    """The same prompts as EditParams for the same seed, each with the original text as its prediction."""


# Defaults are scaled so a full run (5 systems x 3 workloads x 3 repeats) takes minutes on 2 CPU
# cores, where a 1024-token prefill costs ~3.4 s: prefill dominates, as in the SGLang / vLLM shapes.
# returning-chats: 8 first prompts of ~1,056 tokens, 16 returning turns; with the host tier off each
# returning turn recomputes its ~1,100-token history, about a minute and a half per repeat.
DEFAULT_PARAMS: dict[str, object] = {
    "shared-prefix": SharedPrefixParams(),
    "multi-turn": MultiTurnParams(),
    "random": RandomParams(),
    "bounded-pool": BoundedPoolParams(),
    "returning-chats": ReturningChatsParams(),
    "regenerate": RegenerateParams(),
    "regenerate-sampled": RegenerateSampledParams(),
    "edit": EditParams(),
    "edit-prediction": EditPredictionParams(),
}
SMOKE_PARAMS: dict[str, object] = {
    "shared-prefix": SharedPrefixParams(groups=2, prompts_per_group=3, system_len=48, question_len=8, output_len=4),
    "multi-turn": MultiTurnParams(conversations=2, turns=3, common_prefix_len=32, conversation_prefix_len=8,
                                  user_len=6, output_len=4),
    "random": RandomParams(requests=4, prompt_len=24, output_len=4),
    "bounded-pool": BoundedPoolParams(groups=4, prompts_per_group=2, system_len=32, question_len=8, output_len=4),
    "returning-chats": ReturningChatsParams(conversations=4, turns=3, system_len=16, history_len=64, user_len=8,
                                            output_len=4),
    "regenerate": RegenerateParams(sessions=2, prompt_len=24, output_len=16),
    "regenerate-sampled": RegenerateSampledParams(sessions=2, prompt_len=24, output_len=16),
    "edit": EditParams(requests=3, text_len=24, output_extra=4),
    "edit-prediction": EditPredictionParams(requests=3, text_len=24, output_extra=4),
}


@dataclass(frozen=True)
class Workload:
    name: str
    sessions: tuple[Session, ...]
    load: Load
    params: dict[str, float] = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def describe(self) -> str:
        shape = ", ".join(f"{k}={v}" for k, v in self.params.items())
        return f"{self.name} ({shape}; {self.num_requests} requests; {self.load.describe()})"


def default_load(name: str, params: object) -> Load:
    """Shared-prefix: everything submitted at once; multi-turn: one client per conversation;
    random: 4 clients; bounded-pool: 2 clients (few requests pin blocks, as in the offline simulation);
    returning-chats: one client taking the conversations' turns round-robin (each returning turn's
    time to first token is then the cost of its history alone, loaded back or recomputed);
    regenerate and edit: one client (batch 1, speculation's best case; --concurrency for more)."""
    if isinstance(params, (RegenerateParams, EditParams)):
        return Load("closed", concurrency=1)
    if isinstance(params, ReturningChatsParams):
        return Load("rounds", concurrency=1)
    if isinstance(params, BoundedPoolParams):
        return Load("closed", concurrency=2)
    if isinstance(params, SharedPrefixParams):
        return Load("closed", concurrency=params.groups * params.prompts_per_group)
    if isinstance(params, MultiTurnParams):
        return Load("closed", concurrency=params.conversations)
    return Load("closed", concurrency=4)


def with_overrides(params: object, overrides: dict[str, str]) -> object:
    """Replace fields by name (from `--param workload.field=value`), with clear errors: integer
    fields take integers >= 1, float fields (a temperature) numbers >= 0."""
    names = {f.name for f in dataclasses.fields(params)}  # type: ignore[arg-type]
    values: dict[str, float] = {}
    for key, raw in overrides.items():
        if key not in names:
            raise ValueError(f"unknown parameter {key!r} for {type(params).__name__}; known: {', '.join(sorted(names))}")
        real = isinstance(getattr(params, key), float)
        try:
            values[key] = float(raw) if real else int(raw)
        except ValueError:
            raise ValueError(f"parameter {key} needs {'a number' if real else 'an integer'}, got {raw!r}") from None
        if values[key] < (0 if real else 1):
            raise ValueError(f"parameter {key} must be >= {0 if real else 1}, got {values[key]}")
    return dataclasses.replace(params, **values)  # type: ignore[type-var]


def build_workload(name: str, params: object, load: Load, encode: Encode, seed: int, chat: Encode | None = None) -> Workload:
    """`chat` renders one user message as the model's chat prompt (token ids ending in the assistant's
    generation prompt); regenerate and edit send chat requests, and fall back to `encode` without it."""
    stream = TokenStream(encode, seed=seed)
    rng = random.Random(f"{name}:{seed}")
    if isinstance(params, (RegenerateParams, EditParams)):
        from radixserve_bench.spec_workloads import edit_sessions, regenerate_sessions  # it imports this module

        sessions = regenerate_sessions(params, encode, chat or encode, seed) if isinstance(params, RegenerateParams) \
            else edit_sessions(params, encode, chat or encode, seed)
    elif isinstance(params, SharedPrefixParams):
        sessions = _shared_prefix(params, stream, rng)
    elif isinstance(params, MultiTurnParams):
        sessions = _multi_turn(params, stream)
    elif isinstance(params, RandomParams):
        sessions = _random(params, stream, rng)
    elif isinstance(params, ReturningChatsParams):
        sessions = _returning_chats(params, stream)
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


def _multi_turn(p: MultiTurnParams, stream: TokenStream, id_prefix: str = "mt") -> list[Session]:
    common = tuple(stream.take(p.common_prefix_len))
    sessions = []
    for c in range(p.conversations):
        first = common + tuple(stream.take(p.conversation_prefix_len)) + tuple(stream.take(p.user_len))
        turns = [Turn(first, p.output_len)]
        turns += [Turn(tuple(stream.take(p.user_len)), p.output_len) for _ in range(p.turns - 1)]
        sessions.append(Session(f"{id_prefix}-c{c}", c, tuple(turns)))
    return sessions


def _returning_chats(p: ReturningChatsParams, stream: TokenStream) -> list[Session]:
    """The multi-turn shape with a long per-conversation history; what differs is the load (rounds)."""
    shape = MultiTurnParams(conversations=p.conversations, turns=p.turns, common_prefix_len=p.system_len,
                            conversation_prefix_len=p.history_len, user_len=p.user_len, output_len=p.output_len)
    return _multi_turn(shape, stream, id_prefix="rc")


def send_order(w: Workload) -> list[tuple[Session, int]]:
    """(session, turn index) in the order one client sends them: session by session, or for a rounds
    load turn k of every session before any session's turn k + 1 (open loops: session by session)."""
    if w.load.mode != "rounds":
        return [(s, k) for s in w.sessions for k in range(len(s.turns))]
    rounds = max((len(s.turns) for s in w.sessions), default=0)
    return [(s, k) for k in range(rounds) for s in w.sessions if k < len(s.turns)]


def _random(p: RandomParams, stream: TokenStream, rng: random.Random) -> list[Session]:
    lo, hi = max(1, p.prompt_len // 2), max(1, p.prompt_len * 3 // 2)
    return [
        Session(f"rnd-{i}", i, (Turn(tuple(stream.take(rng.randint(lo, hi))), p.output_len),))
        for i in range(p.requests)
    ]

