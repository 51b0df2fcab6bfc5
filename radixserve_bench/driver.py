"""Runs one workload against one system and records what every request saw.

Closed loop: `concurrency` clients each take the next session from a shared queue and send its turns
one after another. Rounds: the same clients take the next turn from a queue holding every session's
turn 1, then every session's turn 2, ... (a turn still waits for its session's previous reply), so a
session is idle while the others take their turns. Open loop: each session starts at its Poisson
arrival time, however many are in flight. A turn's prompt is the session's history (earlier prompts plus the system's own replies)
plus the turn's new tokens (the new tokens alone for a turn without history: a regenerated reply), sent
with the turn's sampling. All times are time.monotonic() seconds.

Invariants: a run either returns a record for every request of the workload or raises; a run is
bounded by `timeout_s`; the system's pool sampler is stopped whatever happens.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from radixserve_bench.systems.base import PoolSample, System
from radixserve_bench.workloads import Session, Workload, send_order


@dataclass
class RequestRecord:
    request_id: str
    session_id: str
    group: int
    turn: int
    prompt_len: int
    output_len: int
    send_time: float
    finish_time: float
    token_times: list[float]
    cached_tokens: int
    scheduled_time: float | None
    sequence: list[int] = field(repr=False, default_factory=list)  # prompt + output, for cache simulations
    host_cached_tokens: int = 0  # the part of cached_tokens loaded back from a host-memory tier
    steps: int | None = None  # decode steps the system says produced the output (None: it does not say)
    drafts: dict[str, list[int]] | None = None  # speculation: source -> [proposed, accepted], where reported

    @property
    def ttft_s(self) -> float:
        return self.token_times[0] - self.send_time

    @property
    def itl_s(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]

    @property
    def e2e_s(self) -> float:
        return self.finish_time - self.send_time

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Decode speed: the tokens that arrived after the first token's arrival, over the time from it to
        the last token (a step may hand out several tokens at once); None when all came at once."""
        t = self.token_times
        later = sum(1 for x in t if x > t[0])
        return later / (t[-1] - t[0]) if later else None


@dataclass
class RunTrace:
    system: str
    workload: str
    repeat: int
    start: float
    end: float
    records: list[RequestRecord]
    pool_samples: list[PoolSample]

    @property
    def duration_s(self) -> float:
        return self.end - self.start


class RunTimeout(RuntimeError):
    pass


async def warm_up(system: System, prompt: list[int]) -> None:
    """One short request before measuring: first-call costs (allocator, kernels) are not the workload's."""
    await system.generate(prompt, 2, request_id="bench-warmup")


async def drive(system: System, workload: Workload, repeat: int, seed: int, timeout_s: float,
                on_record: Callable[[RequestRecord], None] | None = None) -> RunTrace:
    records: list[RequestRecord] = []

    async def run_turn(session: Session, k: int, history: list[int]) -> list[int]:
        """Send turn k after `history` (the session's sequence so far); returns the new sequence."""
        turn = session.turns[k]
        prompt = (history if turn.history else []) + list(turn.new_tokens)
        rid = f"{session.session_id}-t{k}-r{repeat}"
        sent = time.monotonic()
        done = await system.generate(prompt, turn.output_len, rid, turn.sampling)
        finished = time.monotonic()
        if len(done.output_tokens) != turn.output_len or len(done.token_times) != turn.output_len:
            raise RuntimeError(f"{system.name}: {rid} produced {len(done.output_tokens)} tokens, "
                               f"wanted exactly {turn.output_len}")
        record = RequestRecord(rid, session.session_id, session.group, k, len(prompt), turn.output_len, sent,
                               finished, list(done.token_times), done.cached_tokens, done.scheduled_time,
                               prompt + list(done.output_tokens), done.host_cached_tokens, done.steps, done.drafts)
        records.append(record)
        if on_record is not None:
            on_record(record)
        return record.sequence

    async def run_session(session: Session) -> None:
        history: list[int] = []
        for k in range(len(session.turns)):
            history = await run_turn(session, k, history)

    async def closed_loop() -> None:
        queue = deque(workload.sessions)

        async def client() -> None:
            while queue:
                await run_session(queue.popleft())

        await asyncio.gather(*(client() for _ in range(min(workload.load.concurrency, len(queue)))))

    async def rounds() -> None:
        queue = deque(send_order(workload))
        histories: dict[str, list[int]] = {s.session_id: [] for s in workload.sessions}
        # done[(session, k)] is set once turn k's reply is in: turn k + 1 may be taken by another client
        # while turn k is still running, and then waits for it
        done = {(s.session_id, k): asyncio.Event() for s, k in queue}

        async def client() -> None:
            while queue:
                session, k = queue.popleft()
                if k:
                    await done[(session.session_id, k - 1)].wait()
                histories[session.session_id] = await run_turn(session, k, histories[session.session_id])
                done[(session.session_id, k)].set()

        await asyncio.gather(*(client() for _ in range(min(workload.load.concurrency, len(queue)))))

    async def open_loop(start: float) -> None:
        offsets = workload.load.arrival_offsets(len(workload.sessions), seed)

        async def arrive(session: Session, offset: float) -> None:
            await asyncio.sleep(max(0.0, start + offset - time.monotonic()))
            await run_session(session)

        await asyncio.gather(*(arrive(s, o) for s, o in zip(workload.sessions, offsets)))

    system.start_sampling()
    start = time.monotonic()
    try:
        loops = {"closed": closed_loop, "rounds": rounds}
        body = loops[workload.load.mode]() if workload.load.mode in loops else open_loop(start)
        try:
            await asyncio.wait_for(body, timeout_s)
        except asyncio.TimeoutError:
            raise RunTimeout(f"{system.name} on {workload.name}: run exceeded {timeout_s:.0f} s") from None
        end = time.monotonic()
    finally:
        samples = system.stop_sampling()
    if len(records) != workload.num_requests:
        raise RuntimeError(f"{system.name}: {len(records)} of {workload.num_requests} requests recorded")
    records.sort(key=lambda r: r.send_time)
    return RunTrace(system.name, workload.name, repeat, start, end, records, samples)
