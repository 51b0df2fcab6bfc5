"""`radixserve bench agent`: runs the agent workload against radixserve servers it starts and builds the
results document (harness.run_scenario writes, prints and publishes it).

Order, and why: one server per (API, cache mode), so no run finds another's prefixes in the cache
(the three APIs render the same conversation to the same tokens, so a shared server would serve the
second API's turns from the first's); the cache-on and cache-off runs of an API follow each other, so
a drifting machine weighs on both alike. Each server gets one warm-up request of the API's turn-1
shape with a message no task sends (it compiles the forced-call grammar, which a client may compile
only one at a time, and caches the system prompt and tools, as a live agent server has them), then
the tasks run in a client process of their own (client.py). Last, on a fresh cache-on server, the
scheduler phase: `loops` short agent loops at once, the APIs in turn, while a step observer and the
engine's own phase clock (engine/step_phases.py: `schedule` is Scheduler.schedule and the launch's
bookkeeping) record every step.

The servers run in this process (BackgroundServer: the engine's phase clock is read directly; the
HTTP server exposes step wall times but not the scheduler's share), their clients in another, so the
clients' stream parsing never takes the interpreter from the engine.

Invariants: the workload is planned once (the first server counts its prompts) and every run sends
exactly it; every figure is read from the servers' usage and the run's clocks; a run with an error
makes its headline figures NaN, so metrics.check_complete fails the run and the exit status says so.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

import radixserve_bench
from radixserve_bench import results as results_mod
from radixserve_bench.agents import SCENARIO
from radixserve_bench.agents.analysis import analyse_run, compare, evaluate_targets, headline, summarize_steps
from radixserve_bench.agents.client import APIS, LOOPS, PATHS, RESPONSES_MODES, ClientPlan, LoopTask
from radixserve_bench.agents.tools import TOOLS
from radixserve_bench.agents.workload import SYSTEM_PROMPT, TASKS, AgentParams, AgentTask, build_tasks, describe
from radixserve_bench.flags import BenchConfigError
from radixserve_bench.harness import model_facts

SYSTEM = "radixserve"
CACHE_MODES = ("on", "off")
WARMUP_USER = "Before the task: which tools do you have? Call one."
MAX_TOKENS = {"chat": "max_tokens", "responses": "max_output_tokens", "anthropic": "max_tokens"}


@dataclass
class AgentBenchOptions:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    seed: int = 0
    params: AgentParams = field(default_factory=AgentParams)
    apis: tuple[str, ...] = APIS
    caches: tuple[str, ...] = CACHE_MODES
    responses_mode: str = "chain"  # chain: previous_response_id; replay: the whole input every turn
    final_tool_choice: str = "auto"  # the final turn's tool_choice: auto or none
    concurrency: int | None = None  # loops in flight in the main runs (default: every task)
    loops: int = 64  # the scheduler phase's loops (0: no scheduler phase)
    loop_round_trips: int = 3
    loop_output_tokens: tuple[int, int] = (16, 48)
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    num_blocks: int | None = None  # default: what each phase needs (_main_blocks, _loop_blocks)
    max_model_len: int | None = None
    cpu_threads: int | None = None
    state_slots: int | None = None  # hybrid models: the engine's state slots (None: its default)
    state_checkpoints: str = "branches"  # hybrid models: the engine's checkpoint policy
    state_eviction: str = "lru"  # hybrid models: which checkpoint goes first
    eviction_lookahead: int = 64  # waiting requests whose cached prefixes evictions keep for last (0: LRU alone)
    sliding_window_kv: str = "auto"  # sliding-window layers: K/V as a state or in the pool (config.SLIDING_WINDOW_KV)
    window_blocks: int | None = None  # --sliding-window-kv window-blocks: the window pool (None: the engine's default)
    timeout_s: float = 14400.0  # per client run
    partial_path: str | None = None  # where the runs finished so far are written after each one

    def check(self) -> None:
        unknown = [a for a in self.apis if a not in APIS]
        if unknown or not self.apis:
            raise BenchConfigError(f"--apis takes a comma list of {', '.join(APIS)}, got {', '.join(self.apis) or 'none'}")
        if not self.caches or any(c not in CACHE_MODES for c in self.caches):
            raise BenchConfigError(f"--cache takes on, off or on,off, got {','.join(self.caches)}")
        if self.responses_mode not in RESPONSES_MODES:
            raise BenchConfigError(f"--responses-mode must be one of {', '.join(RESPONSES_MODES)}")
        if self.final_tool_choice not in ("auto", "none"):
            raise BenchConfigError("--final-tool-choice must be auto or none")
        if self.params.tools > len(TOOLS):
            raise BenchConfigError(f"--tools: the catalog has {len(TOOLS)} tools, asked for {self.params.tools}")
        if self.loops < 0 or self.loop_round_trips < 1:
            raise BenchConfigError("--loops must be >= 0 and --loop-round-trips >= 1")


@dataclass(frozen=True)
class Counter:
    """Prompt lengths as the server counts them (POST /v1/messages/count_tokens, the Messages API's
    request shape; the three APIs render a conversation through the same chat template)."""

    url: str
    model: str
    tools: list[dict[str, Any]]  # Anthropic's shape

    def count(self, messages: list[dict[str, Any]]) -> int:
        body = {"model": self.model, "system": SYSTEM_PROMPT, "messages": messages, "tools": self.tools}
        r = httpx.post(f"{self.url}/v1/messages/count_tokens", json=body, timeout=120)
        if r.status_code != 200:
            raise RuntimeError(f"count_tokens: HTTP {r.status_code}: {r.text[:300]}")
        return int(r.json()["input_tokens"])

    def first_prompt(self, user: str) -> int:
        return self.count([{"role": "user", "content": user}])

    def round_trip_framing(self, user: str, tool: str, encode: Callable[[str], list[int]]) -> int:
        """The tokens one (call, result) pair adds besides the call's arguments and the result's text."""
        pair = self.count([{"role": "user", "content": user},
                           {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_0", "name": tool,
                                                              "input": {}}]},
                           {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_0",
                                                         "content": "ok"}]}])
        return pair - self.first_prompt(user) - len(encode("ok"))


def _neutral_tools(n: int) -> list[dict[str, Any]]:
    return [{"name": t.name, "description": t.description, "parameters": t.parameters} for t in TOOLS[:n]]


@contextmanager
def serving(o: AgentBenchOptions, model_dir: str, cache: bool, num_blocks: int, clients: int) -> Iterator[Any]:
    """A radixserve server on 127.0.0.1 (a free port) in this process; stopped and released on exit."""
    from radixserve.config import EngineConfig
    from radixserve.engine.async_engine import AsyncEngine
    from radixserve.server import BackgroundServer, ServerConfig

    engine = EngineConfig(model=model_dir, device=o.device, dtype=o.dtype, block_size=o.block_size, seed=o.seed,
                          num_blocks=num_blocks, max_num_batched_tokens=o.max_num_batched_tokens,
                          max_num_seqs=max(o.max_num_seqs, clients), max_model_len=o.max_model_len,
                          enable_prefix_cache=cache, cpu_threads=o.cpu_threads, state_slots=o.state_slots,
                          state_checkpoints=o.state_checkpoints, state_eviction=o.state_eviction,
                          eviction_lookahead=o.eviction_lookahead,
                          sliding_window_kv=o.sliding_window_kv, window_blocks=o.window_blocks)
    # every loop of a run comes from one client address: let all of them generate at once
    config = ServerConfig(port=0, web_dir=None, shutdown_grace_s=0.2, max_generations_per_client=max(64, clients + 8))
    with BackgroundServer(lambda: AsyncEngine(engine), config) as srv:
        yield srv
    gc.collect()  # the pool goes before the next server allocates its own


def warm_up(url: str, plan: ClientPlan, api: str) -> None:
    """One non-streamed request of the API's turn-1 shape with a message no task sends."""
    body = LOOPS[api](plan, LoopTask("warmup", api, WARMUP_USER, [])).body(1, False)
    body["stream"] = False
    body.pop("stream_options", None)
    body[MAX_TOKENS[api]] = 2  # enough to compile the grammar and fill the cache with the prompt
    r = httpx.post(f"{url}{PATHS[api]}", json=body, timeout=1200)
    if r.status_code != 200:
        raise RuntimeError(f"warm-up on {api}: HTTP {r.status_code}: {r.text[:300]}")


def ttft_totals(url: str) -> tuple[float, float]:
    """The server's own time-to-first-token histogram (arrival to first generated token): (sum s, count)."""
    r = httpx.get(f"{url}/metrics", timeout=60)
    r.raise_for_status()
    totals = {}
    for line in r.text.splitlines():
        for part in ("sum", "count"):
            if line.startswith(f"radixserve_time_to_first_token_seconds_{part} "):
                totals[part] = float(line.split()[-1])
    return totals.get("sum", 0.0), totals.get("count", 0.0)


def cache_held(engine: Any) -> dict[str, Any]:
    """What the prefix cache holds once a run is over (every turn finished): its tokens, and the bytes
    holding them, the KV blocks only the tree keeps plus its checkpoints' state slots and its window
    blocks (with --sliding-window-kv window-blocks: nothing else runs, so every one in use is the tree's)."""
    stats, runner = engine.stats(), engine.engine.runner
    states = runner.state_layout()
    kv_bytes = stats.blocks_cached * runner.kv_layout().bytes_per_block
    state_bytes = stats.state_checkpoints * (states.bytes_per_slot if states is not None else 0)
    window_layout = runner.window_layout()
    window_bytes = ((stats.window_blocks_total - stats.window_blocks_free) * window_layout.bytes_per_block
                    if window_layout is not None else 0)
    held = kv_bytes + state_bytes + window_bytes
    windows = [a for a in runner.spec.attentions if a.window is not None]
    layout = (None if not windows else "window-blocks" if windows[0].window_group else
              "window" if windows[0].window_state else "all")
    return {"tree_tokens": stats.tree_tokens, "kv_bytes": kv_bytes, "state_bytes": state_bytes,
            "window_bytes": window_bytes, "window_blocks": stats.window_blocks_total,
            "state_slots": stats.state_slots_total,
            "checkpoints": stats.state_checkpoints, "tokens_per_gb": stats.tree_tokens / (held / 1e9) if held else 0.0,
            "sliding_window_kv": layout}


def run_client(plan: ClientPlan, timeout_s: float) -> dict[str, Any]:
    """The plan's loops in a client process (client.py); its records."""
    root = Path(radixserve_bench.__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)}
    with tempfile.TemporaryDirectory(prefix="radixserve-agents-") as tmp:
        plan_path, out_path = Path(tmp) / "plan.json", Path(tmp) / "records.json"
        plan_path.write_text(json.dumps(asdict(plan)))
        proc = subprocess.run([sys.executable, "-m", "radixserve_bench.agents.client", str(plan_path), str(out_path)],
                              env=env, capture_output=True, text=True, timeout=timeout_s + 120)
        if proc.returncode != 0:
            raise RuntimeError(f"the agent client exited with {proc.returncode}: {proc.stderr[-2000:]}")
        return dict(json.loads(out_path.read_text()))


def _main_blocks(context: int, block_size: int, concurrency: int) -> int:
    """The main runs' pool: every task in flight with a whole context of its own (with the cache on they
    share their first prompt, so each task's conversation also stays cached between its turns)."""
    return concurrency * -(-(context + 64) // block_size) + 64


def _loop_blocks(tasks: list[AgentTask], block_size: int) -> int:
    """The scheduler phase's pool (cache on): the common first prompt once, each loop's conversation
    beyond it, and a quarter more."""
    base = max(t.shape.base_tokens for t in tasks)
    own = sum(-(-(t.shape.max_prompt_tokens - t.shape.base_tokens + 64) // block_size) for t in tasks)
    return (-(-base // block_size) + own) * 5 // 4 + 64


class SchedulerCpu:
    """The engine thread's CPU time in the scheduler's per-step calls, `schedule`, `launched` and `commit`
    less the engine's stop test that commit calls per token (EOS, stop strings, detokenizing: the
    engine's work, which the scheduler micro-benchmark replaces by a no-op, micro.py), by wrapping those
    methods of the engine's Scheduler instance (instrumentation of this benchmark: the engine's code is
    unchanged). Thread CPU time leaves out the waits for the interpreter lock that the server's event
    loop causes."""

    CALLS = ("schedule", "launched", "commit")

    def __init__(self, scheduler: Any) -> None:
        self.spent = dict.fromkeys((*self.CALLS, "stop"), 0.0)
        for name in self.CALLS:
            setattr(scheduler, name, self._timed(name, getattr(scheduler, name)))

    def _timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any) -> Any:
            if name == "commit":  # commit(launch, commits, failed, stop): the stop test is charged apart
                args = (*args[:3], self._stop_test(args[3]))
            started, stop_before = time.thread_time(), self.spent["stop"]
            try:
                return fn(*args)
            finally:
                self.spent[name] += time.thread_time() - started - (self.spent["stop"] - stop_before)

        return timed

    def _stop_test(self, stop: Callable[..., Any]) -> Callable[..., Any]:
        def timed_stop(*args: Any) -> Any:
            started = time.thread_time()
            try:
                return stop(*args)
            finally:
                self.spent["stop"] += time.thread_time() - started

        return timed_stop

    def take(self) -> tuple[float, float, float, float]:
        """Seconds in schedule, launched, commit (less the stop test) and the stop test since the last take."""
        spent = tuple(self.spent[k] for k in (*self.CALLS, "stop"))
        self.spent = dict.fromkeys(self.spent, 0.0)
        return spent  # type: ignore[return-value]


class StepWatch:
    """A step observer (on the engine thread, after the step's commit) that, while `active`, keeps each
    step's running and scheduled sequences, tokens, the seconds it spent building grammar masks
    (ConstraintBook's running total) and the scheduler's CPU seconds per call (SchedulerCpu)."""

    def __init__(self, engine: Any) -> None:
        self.active = False
        self.engine = engine
        self.cpu = SchedulerCpu(engine.scheduler)
        # running, scheduled, prefill tokens, decode tokens, mask s, (schedule, launched, commit, stop test) CPU s
        self.steps: list[tuple[int, int, int, int, float, tuple[float, float, float, float]]] = []
        self._mask_s = engine.constraints.stats.mask_s

    def __call__(self, step: Any) -> None:
        mask_s, cpu = self.engine.constraints.stats.mask_s, self.cpu.take()
        if self.active:
            self.steps.append((step.num_running, step.num_seqs, step.prefill_tokens, step.decode_tokens,
                               mask_s - self._mask_s, cpu))
        self._mask_s = mask_s


def _phase_history(engine: Any) -> list[tuple[float, ...]]:
    """A copy of the engine's phase clock history (the engine thread may still be appending)."""
    for _ in range(100):
        try:
            return list(engine.phases.history)
        except RuntimeError:  # mutated while copied
            time.sleep(0.01)
    raise RuntimeError("could not copy the engine's step phases")


def _since(before: list[tuple[float, ...]], after: list[tuple[float, ...]]) -> tuple[list[tuple[float, ...]], bool]:
    """The entries `after` holds beyond `before` (the history is a bounded deque); True if complete."""
    if not before:
        return after, len(after) < 4096
    last = before[-1]
    for i in range(len(after) - 1, -1, -1):
        if after[i] is last:
            return after[i + 1:], True
    return after, False  # the phase ran more steps than the history keeps: its last ones


def scheduler_phase(o: AgentBenchOptions, model_dir: str, tools: list[dict[str, Any]], model: str,
                    make_tasks: Callable[[AgentParams, int], list[AgentTask]]) -> dict[str, Any]:
    p = o.params
    lo, hi = o.loop_output_tokens
    params = dataclasses.replace(p, tasks=o.loops, round_trips=(o.loop_round_trips, o.loop_round_trips),
                                 output_tokens=(lo, hi), min_output_tokens=None)
    tasks = make_tasks(params, o.seed + 1)
    blocks = o.num_blocks or _loop_blocks(tasks, o.block_size)
    loops = [LoopTask(t.task_id, APIS[k % len(APIS)], t.user, list(t.outputs)) for k, t in enumerate(tasks)]
    plan = ClientPlan("", model, SYSTEM_PROMPT, tools, loops, call_max_tokens=p.call_max_tokens,
                      answer_max_tokens=p.answer_max_tokens, responses_mode=o.responses_mode,
                      final_tool_choice=o.final_tool_choice, concurrency=len(loops), timeout_s=o.timeout_s)
    with serving(o, model_dir, True, blocks, len(loops)) as srv:
        plan.url = srv.url
        for api in APIS:
            warm_up(srv.url, plan, api)
        engine = srv.engine.engine
        watch = StepWatch(engine)
        srv.engine.add_step_observer(watch)
        before = _phase_history(engine)
        watch.active = True
        started = time.monotonic()
        run = run_client(plan, o.timeout_s)
        watch.active = False
        duration = time.monotonic() - started
        after = _phase_history(engine)
    entries, complete = _since(before, after)
    summary = summarize_steps(entries, watch.steps, o.loops)
    errors = [r for r in run["records"] if r["error"]]
    return {"loops": o.loops, "round_trips": o.loop_round_trips, "output_tokens": [lo, hi], "num_blocks": blocks,
            "requests": len(run["records"]), "errors": [f"{r['task_id']} turn {r['turn']}: {r['error']}" for r in errors],
            "duration_s": duration, "history_complete": complete, **summary}


@dataclass
class Planner:
    """What the first server counted, and the tasks built from it for any parameters and seed."""

    context: int  # the server's max_model_len
    overhead: int  # per round trip besides the output: the call's max_tokens and the result's framing
    firsts: dict[str, int]  # turn 1's prompt tokens for each task message
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]

    @classmethod
    def count(cls, url: str, model: str, tools: list[dict[str, Any]], p: AgentParams, tokenizer: Any,
              context: int) -> Planner:
        def encode(text: str) -> list[int]:
            return list(tokenizer.encode(text, add_special_tokens=False))

        def decode(ids: list[int]) -> str:
            return str(tokenizer.decode(ids))

        counter = Counter(url, model, [{"name": t["name"], "description": t["description"],
                                        "input_schema": t["parameters"]} for t in tools])
        framing = counter.round_trip_framing("What is the task?", tools[0]["name"], encode)
        return cls(context, framing + p.call_max_tokens, {u: counter.first_prompt(u) for u in TASKS}, encode, decode)

    def tasks(self, p: AgentParams, seed: int) -> list[AgentTask]:
        return build_tasks(p, seed, self.encode, self.decode, self.firsts.__getitem__, self.overhead, self.context)


def run_agents(o: AgentBenchOptions, argv: list[str] | None = None) -> dict[str, Any]:
    o.check()
    model_dir, name, spec, tokenizer = model_facts(o.model)
    if tokenizer is None:
        raise BenchConfigError("radixserve bench agent needs a model with a tokenizer and a chat template")
    p = o.params
    tools = _neutral_tools(p.tools)
    started = time.monotonic()
    concurrency = o.concurrency or p.tasks
    blocks = o.num_blocks or _main_blocks(o.max_model_len or spec.max_position_embeddings, o.block_size, concurrency)
    planner: Planner | None = None
    tasks: list[AgentTask] = []
    model = ""

    def one_run(api: str, cache: str, mode: str) -> dict[str, Any]:
        nonlocal planner, tasks, model
        with serving(o, model_dir, cache == "on", blocks, concurrency) as srv:
            model = str(httpx.get(f"{srv.url}/v1/models", timeout=60).json()["data"][0]["id"])
            if planner is None:  # the first server plans the workload; every run sends exactly it
                planner = Planner.count(srv.url, model, tools, p, tokenizer, int(srv.engine.max_model_len))
                tasks = planner.tasks(p, o.seed)
            plan = ClientPlan(srv.url, model, SYSTEM_PROMPT, tools,
                              [LoopTask(t.task_id, api, t.user, list(t.outputs)) for t in tasks],
                              call_max_tokens=p.call_max_tokens, answer_max_tokens=p.answer_max_tokens,
                              responses_mode=mode, final_tool_choice=o.final_tool_choice,
                              concurrency=concurrency, timeout_s=o.timeout_s)
            warm_up(srv.url, plan, api)
            before = ttft_totals(srv.url)
            run = run_client(plan, o.timeout_s)
            after = ttft_totals(srv.url)
            run["server_ttft"] = [after[0] - before[0], after[1] - before[1]]
            run["cache_held"] = cache_held(srv.engine)
            return run

    runs: dict[str, dict[str, Any]] = {}
    for api, cache in [(api, cache) for api in o.apis for cache in o.caches]:
        mode = o.responses_mode if api == "responses" else ""
        run = one_run(api, cache, mode)
        analysed = analyse_run(run, blocks, api, cache)
        if api == "responses" and mode == "chain" and analysed["errors"]:
            # the chain failed: the whole input every turn instead, and the chain's errors kept beside it
            mode = "replay"
            chain_errors = analysed["errors"]
            analysed = analyse_run(one_run(api, cache, mode), blocks, api, cache)
            analysed["chain_errors"] = chain_errors
        analysed["responses_mode"] = mode or None
        runs.setdefault(api, {})[cache] = analysed
        if o.partial_path:  # a long run that is stopped still leaves every finished run behind
            Path(o.partial_path).parent.mkdir(parents=True, exist_ok=True)
            Path(o.partial_path).write_text(json.dumps({"workload": describe(tasks), "runs": runs}, indent=1) + "\n")
        print(f"radixserve bench agent: {api}, cache {cache}: {analysed['requests']} turns in "
              f"{analysed['duration_s']:.0f} s", file=sys.stderr)
    assert planner is not None
    scheduler = scheduler_phase(o, model_dir, tools, model, planner.tasks) if o.loops else None
    results: dict[str, Any] = {
        "scenario": SCENARIO, "workloads": [SCENARIO], "planned_systems": {SCENARIO: [SYSTEM]},
        "workload": {"tasks": describe(tasks), "context": planner.context, "overhead_tokens": planner.overhead,
                     "tools": [t["name"] for t in tools], "system_prompt": SYSTEM_PROMPT,
                     "responses_mode": o.responses_mode, "final_tool_choice": o.final_tool_choice,
                     "concurrency": concurrency},
        "runs": runs, "comparison": compare(runs), "scheduler": scheduler,
        "total_seconds": time.monotonic() - started}
    results["results"] = {SCENARIO: {SYSTEM: headline(results)}}
    results_mod.add_environment(results, o, (model_dir, name), spec, argv)
    results["targets"] = evaluate_targets(results)
    return results
