"""`radixserve bench agent`: the flags of the agent workload and its entry point.

    radixserve bench agent --publish docs/bench/agents   # 4 tasks x 10-30 round trips on 3 APIs, cache on and off,
                                                         # then 64 loops at once for the scheduler's step
    radixserve bench agent --smoke --model DIR           # 2 tasks x 3 round trips, tiny outputs: checks the harness

Importing this module is cheap (argparse only): the parser is built for every `radixserve` run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from radixserve.config import SLIDING_WINDOW_KV, STATE_CHECKPOINT_POLICIES, STATE_EVICTIONS, EngineConfig
from radixserve_bench.flags import add_model_arguments, add_output_arguments, names

APIS = ("chat", "responses", "anthropic")  # client.APIS, without importing httpx here


def span(text: str) -> tuple[int, int]:
    """`LO-HI` or `N` (both ends N) as a pair of integers."""
    lo, _, hi = text.partition("-")
    try:
        return int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LO-HI, got {text!r}") from None


def add_agent_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--apis", type=names, default=APIS, help=f"comma list of {', '.join(APIS)} (default all)")
    g.add_argument("--cache", type=names, default=("on", "off"), help="on, off or on,off (default both)")
    g.add_argument("--tasks", type=int, default=4, help="tasks, all in flight at once (default %(default)s)")
    g.add_argument("--round-trips", type=span, default=(10, 30), metavar="LO-HI",
                   help="tool round trips per task, drawn (default 10-30; fewer where the context is too short)")
    g.add_argument("--output-tokens", type=span, default=(200, 2000), metavar="LO-HI",
                   help="tokens per tool output, drawn log-uniformly, then fitted into the context (default 200-2000)")
    g.add_argument("--min-output-tokens", type=int, default=None,
                   help="fitting cuts round trips before an output gets shorter (default: the --output-tokens low end)")
    g.add_argument("--tools", type=int, default=20, help="tool schemas in the system prompt (default %(default)s)")
    g.add_argument("--call-max-tokens", type=int, default=96, help="max_tokens of a forced call (default %(default)s)")
    g.add_argument("--answer-max-tokens", type=int, default=16, help="max_tokens of the final answer (default %(default)s)")
    g.add_argument("--responses-mode", choices=("chain", "replay"), default="chain",
                   help="Responses history: previous_response_id chains or the whole input every turn (default chain)")
    g.add_argument("--final-tool-choice", choices=("auto", "none"), default="auto",
                   help="the final turn's tool_choice (default auto; none renders no tools on this server)")
    g.add_argument("--loops", type=int, default=64,
                   help="agent loops in flight in the scheduler phase; 0 skips it (default %(default)s)")
    g.add_argument("--loop-round-trips", type=int, default=3, help="round trips per loop there (default %(default)s)")
    g.add_argument("--loop-output-tokens", type=span, default=(16, 48), metavar="LO-HI",
                   help="tool output tokens there (default 16-48)")
    g.add_argument("--smoke", action="store_true",
                   help="2 tasks x 3 round trips of 16-48 tokens, 3 tools, calls of at most 40 tokens, 4 loops: "
                        "checks the harness in seconds")
    g.add_argument("--seed", type=int, default=0, help="workload seed (default %(default)s)")
    g.add_argument("--timeout", type=float, default=14400.0, help="seconds allowed per client run (default %(default)s)")
    add_output_arguments(g, "bench-results/agents")
    e = p.add_argument_group("engine (every server)")
    add_model_arguments(e)
    e.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step (default %(default)s)")
    e.add_argument("--max-num-seqs", type=int, default=256, help="running sequences at most (default %(default)s)")
    e.add_argument("--num-blocks", type=int, default=None, help="pool size in blocks (default: what the workload needs)")
    e.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    e.add_argument("--cpu-threads", type=int, default=None, help="CPU: torch threads of the engine (default: the engine's)")
    e.add_argument("--state-slots", type=int, default=None,
                   help="hybrid models: recurrent-state slots (default: the engine's)")
    e.add_argument("--state-checkpoints", choices=STATE_CHECKPOINT_POLICIES, default="branches",
                   help="hybrid models: the checkpoint policy (default %(default)s; the baselines: request-ends, "
                        "every-block)")
    e.add_argument("--state-eviction", choices=STATE_EVICTIONS, default="lru",
                   help="hybrid models: which checkpoint goes first (default %(default)s)")
    e.add_argument("--eviction-lookahead", type=int, default=EngineConfig.eviction_lookahead,
                   help="waiting requests whose cached prefixes evictions keep for last; 0: least recently used "
                        "alone (default %(default)s)")
    e.add_argument("--sliding-window-kv", choices=SLIDING_WINDOW_KV, default="auto",
                   help="sliding-window layers: their window's K/V as a state, or every token's in the pool, "
                        "or in window blocks that attention reads in place (default %(default)s)")
    e.add_argument("--window-blocks", type=int, default=None,
                   help="--sliding-window-kv window-blocks: the window pool's blocks (default: the engine's)")


def run_agent_command(args: argparse.Namespace) -> int:
    from radixserve_bench.agents.chart import write_charts
    from radixserve_bench.agents.report import render
    from radixserve_bench.agents.runner import AgentBenchOptions, run_agents
    from radixserve_bench.agents.workload import AgentParams
    from radixserve_bench.flags import BenchConfigError
    from radixserve_bench.harness import Scenario, run_scenario

    def run(a: argparse.Namespace, argv: list[str] | None) -> dict:
        smoke = a.smoke
        out_lo = (16, 48) if smoke else a.output_tokens
        try:
            params = AgentParams(tasks=2 if smoke else a.tasks, round_trips=(3, 3) if smoke else a.round_trips,
                                 output_tokens=out_lo, tools=3 if smoke else a.tools,
                                 call_max_tokens=min(a.call_max_tokens, 40) if smoke else a.call_max_tokens,
                                 answer_max_tokens=a.answer_max_tokens,
                                 min_output_tokens=a.min_output_tokens)
        except ValueError as e:
            raise BenchConfigError(str(e)) from None
        options = AgentBenchOptions(
            model=a.model, device=a.device, dtype=a.dtype, block_size=a.block_size, seed=a.seed, params=params,
            apis=a.apis, caches=a.cache, responses_mode=a.responses_mode, final_tool_choice=a.final_tool_choice,
            loops=4 if smoke and a.loops == 64 else a.loops, loop_round_trips=a.loop_round_trips,
            loop_output_tokens=a.loop_output_tokens, max_num_batched_tokens=a.max_num_batched_tokens,
            max_num_seqs=a.max_num_seqs, num_blocks=a.num_blocks, max_model_len=a.max_model_len,
            cpu_threads=a.cpu_threads, state_slots=a.state_slots, state_checkpoints=a.state_checkpoints,
            state_eviction=a.state_eviction, eviction_lookahead=a.eviction_lookahead,
            sliding_window_kv=a.sliding_window_kv, window_blocks=a.window_blocks,
            timeout_s=a.timeout,
            partial_path=str(Path(a.out) / "partial.json"))
        return run_agents(options, argv)

    return run_scenario(Scenario("radixserve bench agent", run, render, write_charts,
                                 docs_anchor=""), args)
