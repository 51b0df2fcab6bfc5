"""The three workloads of `radixserve bench peers`, as chat conversations every server receives alike.

They come from the bench's token-level generators (workloads.py) turned into chat messages by
scale-out's `build_chat_workload` (a group's system prompt or a conversation's prefixes become the
system message, each turn's new tokens a user message, the server's own replies join the history):

- decode: batch-1 decode, one client, a short prompt and a long forced reply (256 tokens);
- shared-prompt: one ~1k-token system prompt shared by every request, each with its own question,
  `concurrency` (8) in flight: what a prefix cache saves under load;
- multi-turn: conversations x turns, `concurrency` (4) clients; each turn re-sends the history.

Invariants: one seed gives every server the same messages; a later turn's history holds the reply the
server under test gave (so replies that differ make the histories differ from there on).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from radixserve_bench.flags import BenchConfigError
from radixserve_bench.peers import WORKLOADS
from radixserve_bench.peers.servers import check_systems
from radixserve_bench.plan import RunOptions
from radixserve_bench.scaleout.plan import ChatWorkload, build_chat_workload
from radixserve_bench.workloads import MultiTurnParams, SharedPrefixParams

Params = SharedPrefixParams | MultiTurnParams

DEFAULT_PARAMS: dict[str, Params] = {
    "decode": SharedPrefixParams(groups=1, prompts_per_group=2, system_len=32, question_len=32, output_len=256),
    "shared-prompt": SharedPrefixParams(groups=1, prompts_per_group=32, system_len=1024, question_len=32,
                                        output_len=32),
    "multi-turn": MultiTurnParams(conversations=8, turns=6, common_prefix_len=64, conversation_prefix_len=128,
                                  user_len=32, output_len=32),
}
SMOKE_PARAMS: dict[str, Params] = {
    "decode": SharedPrefixParams(groups=1, prompts_per_group=1, system_len=8, question_len=8, output_len=16),
    "shared-prompt": SharedPrefixParams(groups=1, prompts_per_group=4, system_len=64, question_len=8, output_len=4),
    "multi-turn": MultiTurnParams(conversations=2, turns=2, common_prefix_len=16, conversation_prefix_len=16,
                                  user_len=8, output_len=4),
}
CONCURRENCY = {"decode": 1, "shared-prompt": 8, "multi-turn": 4}
SMOKE_CONCURRENCY = {"decode": 1, "shared-prompt": 2, "multi-turn": 2}


@dataclass
class PeersOptions(RunOptions):
    KNOWN_WORKLOADS = WORKLOADS
    repeats: int = 1
    timeout_s: float = 1800.0
    workloads: tuple[str, ...] = WORKLOADS
    systems: tuple[str, ...] = ()  # () : every system (those absent are skipped)
    gguf: str | None = None  # llama-server's model (default: the shipped GGUF when --model is not given)
    peers_dir: str | None = None  # default: the repository's .peers/
    threads: int = 2
    startup_timeout_s: float = 900.0
    extra_args: dict[str, tuple[str, ...]] = field(default_factory=dict)  # system -> words appended to its argv
    logs_dir: str | None = None  # where each server's output is kept (default: a temporary folder)

    def scenario_problems(self) -> list[str]:
        problems = check_systems(self.systems) if self.systems else []
        if not self.workloads or set(self.workloads) - set(WORKLOADS):
            problems.append(f"--workload takes a comma list of {', '.join(WORKLOADS)}, got {', '.join(self.workloads)}")
        if self.threads < 1 or self.startup_timeout_s <= 0:
            problems.append("--threads must be >= 1 and --startup-timeout > 0")
        return problems

    def params_of(self, name: str) -> Params:
        params = self.workload_params(name, DEFAULT_PARAMS, SMOKE_PARAMS)
        assert isinstance(params, (SharedPrefixParams, MultiTurnParams))
        return params

    def concurrency_of(self, name: str) -> int:
        return (SMOKE_CONCURRENCY if self.smoke else CONCURRENCY)[name]


def build_peer_workloads(o: PeersOptions, encode: Callable[[str], list[int]],
                         decode: Callable[[list[int]], str]) -> list[ChatWorkload]:
    """The chosen workloads, in WORKLOADS order, each with its own stream of text (seed + its index)
    so no workload's prompt opens with another's."""
    out = []
    for i, name in enumerate(WORKLOADS):
        if name not in o.workloads:
            continue
        params = o.params_of(name)
        if isinstance(params, SharedPrefixParams) and params.groups != 1:
            raise BenchConfigError(f"{name}: one shared system prompt is the workload; groups must be 1")
        out.append(build_chat_workload(name, params, encode, decode, o.seed + 1009 * i, o.concurrency_of(name)))
    return out
