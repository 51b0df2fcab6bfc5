"""What the scale-out scenario will do: its options, its two workloads as chat conversations, the pool
each replica gets and the systems that run.

Workloads come from the bench's token-level generators (workloads.py) and are decoded to text, since
they travel as OpenAI chat messages: shared-prefix's group system prompt becomes the system message
and the question the user message; multi-turn's common + per-conversation prefix becomes the system
message and each turn's new tokens a user message, the system's own replies joining the history as
assistant messages. Requests go out in rounds (turn k of every conversation before any turn k + 1;
shared-prefix is single-turn, its groups already interleaved), `concurrency` at a time, so every
conversation stays live for the whole run and the pools must hold all of them at once.

Pool sizing, on the requests in send order, each prompt rendered with the model's chat template and
each reply a placeholder of `max_tokens` tokens: the working set is what one unbounded cache would
hold (belady.working_set_blocks); the reused set is the part of it that a later request hits (the
group system prompts; the conversations' histories), counted in whole blocks. P, the pool of one
replica of the two-replica systems, is `pool_fraction` (0.6) of the reused set: one pool of P cannot
hold every group / conversation, two of them (or one of 2P) can, with room to spare for the requests
in flight. P is never less than the largest request needs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from radixserve.scaleout.routing import DEFAULT_MAX_LOAD_GAP
from radixserve_bench.belady import TraceRequest, block_chain, working_set_blocks
from radixserve_bench.plan import RunOptions
from radixserve_bench.scaleout import SYSTEMS, WORKLOADS
from radixserve_bench.textsource import TokenStream
from radixserve_bench.workloads import Load, MultiTurnParams, SharedPrefixParams, build_workload

Message = dict[str, str]
Render = Callable[[list[Message]], list[int]]  # chat messages -> prompt token ids (the server's template)

DEFAULT_PARAMS: dict[str, SharedPrefixParams | MultiTurnParams] = {
    "shared-prefix": SharedPrefixParams(groups=16, prompts_per_group=8, system_len=256, question_len=16, output_len=8),
    "multi-turn": MultiTurnParams(conversations=8, turns=4, common_prefix_len=64, conversation_prefix_len=192,
                                  user_len=16, output_len=8),
}
SMOKE_PARAMS: dict[str, SharedPrefixParams | MultiTurnParams] = {
    "shared-prefix": SharedPrefixParams(groups=4, prompts_per_group=2, system_len=48, question_len=8, output_len=4),
    "multi-turn": MultiTurnParams(conversations=4, turns=2, common_prefix_len=16, conversation_prefix_len=48,
                                  user_len=8, output_len=4),
}
DESCRIPTIONS = {
    "cache-aware": "{n} replicas of {p} blocks, ClusterConfig(router='cache-aware')",
    "power-of-two": "{n} replicas of {p} blocks, ClusterConfig(router='power-of-two') (Ray Serve's default rule)",
    "one-replica": "1 replica of {total} blocks ({n} x {p}: the same memory in one pool)",
}


@dataclass
class ScaleOutOptions(RunOptions):
    KNOWN_WORKLOADS = WORKLOADS
    repeats: int = 1
    pool_fraction: float = 0.6  # P / the reused set
    timeout_s: float = 900.0
    workloads: tuple[str, ...] = WORKLOADS
    systems: tuple[str, ...] = SYSTEMS
    replicas: int = 2  # of the cache-aware and power-of-two systems; one-replica gets replicas x P blocks
    pool_blocks: int | None = None  # P; None: pool_fraction of the reused set
    concurrency: int = 4
    max_load_gap: int = DEFAULT_MAX_LOAD_GAP
    torch_threads: int | None = 1  # per replica
    cluster: bool = True  # False: the routing micro-benchmark only
    micro_replicas: tuple[int, ...] = (2, 8)
    micro_prefixes: int = 1000

    def scenario_problems(self) -> list[str]:
        problems = []
        if not self.workloads or set(self.workloads) - set(WORKLOADS):
            problems.append(f"workloads must be among {', '.join(WORKLOADS)}, got {', '.join(self.workloads)}")
        if not self.systems or set(self.systems) - set(SYSTEMS):
            problems.append(f"systems must be among {', '.join(SYSTEMS)}, got {', '.join(self.systems)}")
        if self.replicas < 2 or self.concurrency < 1 or self.max_load_gap < 0:
            problems.append("--replicas must be >= 2, --concurrency >= 1, --max-load-gap >= 0")
        if self.pool_blocks is not None and self.pool_blocks < 1:
            problems.append("--pool-blocks must be >= 1")
        if self.micro_prefixes < 1 or not self.micro_replicas or min(self.micro_replicas) < 1:
            problems.append("--routing-prefixes and every --routing-replicas must be >= 1")
        if not self.cluster and not self.micro:
            problems.append("--no-cluster and --no-micro together leave nothing to run")
        return problems


@dataclass(frozen=True)
class ChatSession:
    session_id: str
    group: int  # shared-prefix group or conversation index
    system: str
    users: tuple[str, ...]  # one user message per turn
    max_tokens: int

    def messages(self, turn: int, replies: Sequence[str]) -> list[Message]:
        """What an OpenAI client sends for `turn`: the whole history, its replies included."""
        out = [{"role": "system", "content": self.system}]
        for k in range(turn + 1):
            out.append({"role": "user", "content": self.users[k]})
            if k < turn:
                out.append({"role": "assistant", "content": replies[k]})
        return out


@dataclass(frozen=True)
class ChatWorkload:
    name: str
    sessions: tuple[ChatSession, ...]
    concurrency: int
    params: dict[str, float]

    @property
    def num_requests(self) -> int:
        return sum(len(s.users) for s in self.sessions)

    def order(self) -> list[tuple[ChatSession, int]]:
        """(session, turn) in send order: turn k of every session before any session's turn k + 1."""
        turns = max((len(s.users) for s in self.sessions), default=0)
        return [(s, k) for k in range(turns) for s in self.sessions if k < len(s.users)]

    def describe(self) -> str:
        shape = ", ".join(f"{k}={v}" for k, v in self.params.items())
        return f"{self.name} ({shape}; {self.num_requests} requests; {self.concurrency} in flight, in rounds)"


def workload_params(name: str, o: ScaleOutOptions) -> SharedPrefixParams | MultiTurnParams:
    params = o.workload_params(name, DEFAULT_PARAMS, SMOKE_PARAMS)
    assert isinstance(params, (SharedPrefixParams, MultiTurnParams))
    return params


def build_chat_workload(name: str, params: SharedPrefixParams | MultiTurnParams, encode: Callable[[str], list[int]],
                        decode: Callable[[list[int]], str], seed: int, concurrency: int) -> ChatWorkload:
    """The bench's token-level workload, decoded into chat messages (the module docstring says how)."""
    w = build_workload(name, params, Load("rounds", concurrency), encode, seed)
    if isinstance(params, SharedPrefixParams):
        split = params.system_len
    else:
        split = params.common_prefix_len + params.conversation_prefix_len
    sessions = []
    for s in w.sessions:
        first = list(s.turns[0].new_tokens)
        users = (decode(first[split:]), *(decode(list(t.new_tokens)) for t in s.turns[1:]))
        sessions.append(ChatSession(s.session_id, s.group, decode(first[:split]), users, s.turns[0].output_len))
    return ChatWorkload(name, tuple(sessions), concurrency, w.params)


@dataclass(frozen=True)
class Sizing:
    working_set_blocks: int
    reused_blocks: int  # of the working set, the blocks a later request's prompt hits
    max_request_blocks: int
    pool_blocks: int  # P: one replica of the multi-replica systems
    replicas: int

    @property
    def one_replica_blocks(self) -> int:
        return self.replicas * self.pool_blocks


def chat_trace(w: ChatWorkload, render: Render, encode: Callable[[str], list[int]],
               decode: Callable[[list[int]], str], seed: int = 0) -> list[TraceRequest]:
    """The requests in send order as the server will see them, replies replaced by placeholder text
    of `max_tokens` tokens (real text, so it renders like a reply)."""
    stream = TokenStream(encode, seed=seed + 7919)
    replies: dict[str, list[str]] = {s.session_id: [] for s in w.sessions}
    trace = []
    for s, k in w.order():
        prompt = render(s.messages(k, replies[s.session_id]))
        reply = decode(stream.take(s.max_tokens))
        replies[s.session_id].append(reply)
        trace.append(TraceRequest(len(prompt), tuple(prompt) + tuple(encode(reply))))
    return trace


def reused_blocks(trace: Sequence[TraceRequest], block_size: int) -> int:
    """Distinct whole blocks that some request's prompt finds in an unbounded cache of everything
    before it (the leading run of its prompt's blocks; its last prompt token is always computed)."""
    seen: set[int] = set()
    reused: set[int] = set()
    for req in trace:
        usable = req.prompt_len - 1
        for block in block_chain(req.sequence[:usable // block_size * block_size], block_size):
            if block not in seen:
                break
            reused.add(block)
        kept = req.sequence[:-1]  # the last token has no K/V
        seen.update(block_chain(kept[:len(kept) // block_size * block_size], block_size))
    return len(reused)


def size_pool(trace: Sequence[TraceRequest], block_size: int, replicas: int, pool_fraction: float,
              pool_blocks: int | None = None) -> Sizing:
    ws, reused = working_set_blocks(trace, block_size), reused_blocks(trace, block_size)
    per_request = max(-(-len(r.sequence) // block_size) for r in trace)
    pool = pool_blocks or max(math.ceil(pool_fraction * reused), per_request + 2)
    return Sizing(ws, reused, per_request, pool, replicas)


@dataclass(frozen=True)
class SystemSpec:
    name: str
    replicas: int
    router: str
    blocks_per_replica: int
    description: str


def system_specs(names: Sequence[str], sizing: Sizing) -> list[SystemSpec]:
    n, p = sizing.replicas, sizing.pool_blocks
    out = []
    for name in names:
        replicas, blocks = (1, sizing.one_replica_blocks) if name == "one-replica" else (n, p)
        router = "power-of-two" if name == "power-of-two" else "cache-aware"
        out.append(SystemSpec(name, replicas, router, blocks,
                              DESCRIPTIONS[name].format(n=n, p=p, total=sizing.one_replica_blocks)))
    return out

