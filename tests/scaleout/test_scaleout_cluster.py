"""Scale-out end to end: a local Ray cluster (started and stopped here) running 2 engine replicas of a
tiny random-weight model (the embedded tokenizer) behind Ray Serve's proxy on 127.0.0.1, driven by
real HTTP, SSE, `openai` SDK and WebSocket clients; and a single-process server over the same model
as the oracle for greedy outputs.

Covers: a shared system prompt lands on one replica, session turns stay on theirs, outputs equal
the single-process server's, per-replica and total figures in /v1/cache/stats and /metrics, and a
replica killed mid-conversation (the in-flight turn gets a clear error, the session continues on the
other replica, Ray Serve starts a replacement). The cluster fixture checks on teardown that no
process it started is left.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

pytest.importorskip("ray.serve")

import ray  # noqa: E402
import websockets  # noqa: E402

from radixserve import AsyncEngine, EngineConfig  # noqa: E402
from radixserve.scaleout.config import ClusterConfig  # noqa: E402
from radixserve.scaleout.local import ServeCluster  # noqa: E402
from radixserve.server import BackgroundServer, ServerConfig  # noqa: E402
from radixserve.server.owners import OWNER_HEADER  # noqa: E402
from radixserve.server.replica_header import HEADER  # noqa: E402

pytest_plugins = ["server_testkit"]
from cluster_stats_sample import TWO_REPLICAS, shape  # noqa: E402
from server_testkit import OWNED, TEST_OWNER, leaves_no_process, recv_frame, wait_until, write_tiny_chat_model  # noqa: E402

SYSTEM = "You are a terse assistant for a shipping company. Answer in one short sentence. " * 4
CONTEXT = 4096  # long enough that the turn killed mid-way is still generating when the kill lands


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from radixserve.model.embedded import embedded_model_dir

    return str(write_tiny_chat_model(tmp_path_factory.mktemp("tiny-scaleout"), embedded_model_dir(), CONTEXT))


def engine_config(model: str) -> EngineConfig:
    return EngineConfig(model=model, num_blocks=256)


@pytest.fixture(scope="module")
def cluster(model_dir: str) -> Iterator[ServeCluster]:
    server = ServerConfig(port=0, web_dir=None, shutdown_grace_s=1.0, served_model_name="tiny")
    spec = ClusterConfig(replicas=2, torch_threads=1, stats_period_s=0.25, health_check_period_s=1.0)
    with leaves_no_process() as started, ServeCluster(engine_config(model_dir), server, spec, num_cpus=2,
                                                      startup_timeout_s=300) as c:
        assert started(), "the cluster started no process of its own"
        yield c
        started()  # and the replacements Ray Serve started since


@pytest.fixture(scope="module")
def single(model_dir: str) -> Iterator[BackgroundServer]:
    config = ServerConfig(port=0, web_dir=None, served_model_name="tiny")
    with BackgroundServer(lambda: AsyncEngine(engine_config(model_dir)), config) as srv:
        yield srv


def client(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=120.0, headers={OWNER_HEADER: TEST_OWNER})


def stats(c: ServeCluster, settle_s: float = 1.0) -> dict[str, Any]:
    time.sleep(settle_s)  # replicas report every stats_period_s
    with client(c.url) as h:
        r = h.get("/v1/cache/stats")
    assert r.status_code == 200, r.text
    return dict(r.json())


def completion(h: httpx.Client, user: str, system: str = SYSTEM, max_tokens: int = 8) -> httpx.Response:
    body = {"model": "tiny", "temperature": 0, "max_tokens": max_tokens,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
    r = h.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r


def test_a_shared_system_prompt_lands_on_one_replica(cluster: ServeCluster) -> None:
    with client(cluster.url) as h:
        replies = [completion(h, f"Where is parcel {i}?") for i in range(6)]
    replicas = {r.headers[HEADER] for r in replies}
    assert len(replicas) == 1, replicas
    system_tokens = replies[0].json()["usage"]["prompt_tokens"] - 20  # the user turn is under 20 tokens
    for r in replies[1:]:
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= system_tokens
    body = stats(cluster)
    (served,) = [row for row in body["replicas"] if row["replica"] in replicas]
    assert served["requests"] >= 6 and served["hit_rate"] > 0.5
    assert body["routing"]["router"] == "cache-aware" and body["routing"]["decisions"]["prefix"] >= 5
    assert served["system_prompts"] and served["system_prompts"][0]["hit_requests"] >= 5


def test_greedy_outputs_equal_the_single_process_servers(cluster: ServeCluster, single: BackgroundServer) -> None:
    questions = ["Name a colour.", "Count to three.", "What is a parcel?"]
    outs = {}
    for name, url in (("cluster", cluster.url), ("single", single.url)):
        sdk = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        texts = []
        for q in questions:
            msgs: Any = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
            raw = sdk.chat.completions.with_raw_response.create(model="tiny", messages=msgs, temperature=0,
                                                                max_tokens=12)
            assert (raw.headers.get(HEADER) is not None) == (name == "cluster")
            texts.append(raw.parse().choices[0].message.content)
            stream = sdk.chat.completions.create(model="tiny", messages=msgs, temperature=0, max_tokens=12,
                                                 stream=True)
            texts.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
        outs[name] = texts
    assert outs["cluster"] == outs["single"]
    assert all(outs["cluster"]), outs


def test_a_streamed_response_names_its_replica(cluster: ServeCluster) -> None:
    body = {"model": "tiny", "temperature": 0, "max_tokens": 6, "stream": True,
            "messages": [{"role": "user", "content": "Stream something."}]}
    with client(cluster.url) as h, h.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert r.headers[HEADER] in {row["replica"] for row in stats(cluster, 0.0)["replicas"]}
    assert events[-1] == "data: [DONE]"


def new_session(h: httpx.Client, system: str) -> str:
    r = h.post("/v1/sessions", json={"system_prompt": system, "sampling": {"temperature": 0, "max_tokens": 6}})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def turn(h: httpx.Client, sid: str, content: str) -> httpx.Response:
    r = h.post(f"/v1/sessions/{sid}/messages", json={"content": content})
    assert r.status_code == 200, r.text
    return r


def test_session_turns_stay_on_their_replica(cluster: ServeCluster) -> None:
    with client(cluster.url) as h:
        sessions = [new_session(h, f"Session {k} speaks only about topic number {k}. " * 3) for k in range(4)]
        homes: dict[str, set[str]] = {sid: set() for sid in sessions}
        prompt_before = dict.fromkeys(sessions, 0)
        for round_ in range(3):
            for sid in sessions:
                r = turn(h, sid, f"Tell me more, round {round_}.")
                homes[sid].add(r.headers[HEADER])
                usage = r.json()["usage"]
                assert usage["cached_tokens"] >= prompt_before[sid] - 1  # the whole previous turn was cached
                prompt_before[sid] = usage["prompt_tokens"]
    assert all(len(h) == 1 for h in homes.values()), homes
    assert len(set().union(*homes.values())) == 2, "four sessions from a cold start should use both replicas"
    assert stats(cluster, 0.0)["routing"]["decisions"]["session"] >= 8


def test_websocket_turns_stay_on_their_replica(cluster: ServeCluster) -> None:
    async def run() -> list[dict[str, Any]]:
        async with websockets.connect(cluster.ws_url, open_timeout=30) as ws:
            await ws.send(json.dumps({"type": "session.create", "system_prompt": "Be brief. " * 10, **OWNED}))
            created = await recv_frame(ws)
            sid = created["session"]["id"]
            dones = []
            for i in range(3):
                await ws.send(json.dumps({"type": "chat", "session_id": sid, "content": f"Turn {i}", "gen_id": f"g{i}",
                                          "sampling": {"temperature": 0, "max_tokens": 5}, **OWNED}))
                while (f := await recv_frame(ws))["type"] not in ("done", "error"):
                    pass
                dones.append(f)
            return dones

    before = stats(cluster)["replicas"]
    dones = asyncio.run(run())
    assert all(d["type"] == "done" for d in dones), dones
    assert dones[2]["usage"]["cached_tokens"] > dones[1]["usage"]["cached_tokens"] > 0
    after = stats(cluster)["replicas"]
    grew = {a["replica"]: a["routed"] - b["routed"] for a, b in zip(after, before)}
    assert sorted(grew.values()) == [0, 3], grew


def test_metrics_and_stats_show_each_replica_and_the_total(cluster: ServeCluster) -> None:
    with client(cluster.url) as h:
        completion(h, "Is the depot open today?")  # at least one system prompt row, whatever ran before
    body = stats(cluster)
    rows = body["replicas"]
    assert len(rows) == 2 and all(row["blocks"]["total"] == 256 for row in rows)
    assert body["blocks"]["total"] == 512  # the totals are the sum over replicas
    assert body["prompt_tokens"] == sum(row["prompt_tokens"] for row in rows) > 0
    assert body["cached_tokens"] == sum(row["cached_tokens"] for row in rows)
    with client(cluster.url) as h:
        text = h.get("/metrics").text
    for row in rows:
        assert f'radixserve_replica_hit_rate{{replica="{row["replica"]}"}}' in text
        assert f'radixserve_replica_requests_running{{replica="{row["replica"]}"}}' in text
    assert 'radixserve_routing_decisions_total{reason="prefix"}' in text
    assert "radixserve_replica_system_prompt_requests_total{" in text
    total = next(line for line in text.splitlines() if line.startswith("radixserve_prompt_tokens_total "))
    assert float(total.split()[1]) >= body["prompt_tokens"]
    # the dashboard is tested against sample data of this shape (tests/cluster_stats_sample.py)
    assert shape(body["routing"]) == shape(TWO_REPLICAS["routing"])
    sample_row = shape(TWO_REPLICAS["replicas"][0])
    for row in map(shape, rows):
        assert row["system_prompts"] in ([], sample_row["system_prompts"])
        assert {**row, "system_prompts": None} == {**sample_row, "system_prompts": None}
    assert any(row["system_prompts"] for row in rows)


def replica_names(c: ServeCluster) -> set[str]:
    return {row["replica"] for row in stats(c, 0.2)["replicas"]}


def test_a_replica_killed_mid_conversation(cluster: ServeCluster) -> None:
    with client(cluster.url) as h:
        sid = new_session(h, "You answer questions about the weather. " * 3)
        first = turn(h, sid, "Is it raining?")
        home = first.headers[HEADER]
        assert len(replica_names(cluster) - {home}) == 1  # one other replica, for the bystander below

        bystander = new_session(h, "You answer questions about trains. " * 3)  # no turn yet: no replica

        async def until_end(ws: Any) -> tuple[dict[str, Any], float]:
            while (f := await recv_frame(ws))["type"] not in ("done", "error"):
                pass
            return f, time.monotonic()

        async def started(ws: Any, sid: str, content: str, max_tokens: int) -> None:
            await ws.send(json.dumps({"type": "chat", "session_id": sid, "content": content, "gen_id": sid,
                                      "sampling": {"max_tokens": max_tokens}, **OWNED}))
            while (f := await recv_frame(ws))["type"] != "delta":
                assert f["type"] == "start", f

        async def killed_turn() -> tuple[tuple[dict[str, Any], float], tuple[dict[str, Any], float]]:
            async with websockets.connect(cluster.ws_url, open_timeout=30) as killed, \
                       websockets.connect(cluster.ws_url, open_timeout=30) as other_ws:
                await started(killed, sid, "Tell me a very long story.", 3000)
                # a miss goes to the least-loaded replica: the other one, busy with nothing
                await started(other_ws, bystander, "Tell me about a long train journey.", 1500)
                ray.kill(ray.get_actor(f"SERVE_REPLICA::{cluster.cluster.app_name}#engine#{home}", namespace="serve"))
                return await asyncio.gather(until_end(killed), until_end(other_ws))

        (end, failed_at), (ok, finished_at) = asyncio.run(killed_turn())
        assert end["type"] == "error" and end["code"] == "generation_failed", end
        assert f"replica {home} stopped while serving this request" in end["message"]
        assert "Traceback" not in end["message"]
        # the request running on the other replica went on through the failure and ended normally
        assert ok["type"] == "done" and ok["finish_reason"] == "length", ok
        assert ok["usage"]["completion_tokens"] == 1500 and finished_at > failed_at
        wait_until(lambda: home not in replica_names(cluster), 60, "the router to drop the killed replica")
        after = turn(h, sid, "Is it still raining?")
        moved = after.headers[HEADER]  # the other replica, or Ray's replacement if it is up already
        assert moved != home
        session = h.get(f"/v1/sessions/{sid}").json()
        assert [m["role"] for m in session["messages"]][-4:] == ["user", "assistant", "user", "assistant"]
        assert after.json()["usage"]["prompt_tokens"] > first.json()["usage"]["prompt_tokens"]
        assert completion(h, "Unrelated question.", system="Another system prompt.").status_code == 200
        assert h.get("/health").status_code == 200
        wait_until(lambda: len(replica_names(cluster)) == 2, 180, "Ray Serve to replace the killed replica")
        assert turn(h, sid, "And tomorrow?").headers[HEADER] == moved  # the session stays where it moved
    decisions = stats(cluster, 0.0)["routing"]["decisions"]
    assert decisions["failover"] >= 1, decisions


@pytest.mark.parametrize("body", [
    {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6},
    {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "priority": "high"},
    {"model": "other", "messages": [{"role": "user", "content": "hi"}]},
    {"model": "tiny", "messages": []},
])
def test_bad_requests_get_the_single_process_servers_errors(cluster: ServeCluster, single: BackgroundServer,
                                                            body: dict[str, Any]) -> None:
    replies = [httpx.post(url + "/v1/chat/completions", json=body, timeout=60) for url in (cluster.url, single.url)]
    assert replies[0].status_code == replies[1].status_code >= 400
    assert replies[0].json() == replies[1].json()


def test_a_cancelled_turn_ends_with_abort_as_on_one_process(cluster: ServeCluster) -> None:
    """The web UI's Stop: the replica aborts the request and the turn ends with `done`, not an error."""
    with client(cluster.url) as h:
        sid = new_session(h, "You write long stories. " * 3)

        async def cancelled_turn() -> list[dict[str, Any]]:
            async with websockets.connect(cluster.ws_url, open_timeout=30) as ws:
                await ws.send(json.dumps({"type": "chat", "session_id": sid, "content": "A long story, please.",
                                          "gen_id": "g", "sampling": {"max_tokens": 3000}, **OWNED}))
                frames = [await recv_frame(ws)]
                while frames[-1]["type"] != "delta":
                    frames.append(await recv_frame(ws))
                await ws.send(json.dumps({"type": "cancel", "gen_id": "g"}))
                while frames[-1]["type"] not in ("done", "error"):
                    frames.append(await recv_frame(ws))
                return frames

        frames = asyncio.run(cancelled_turn())
        assert frames[-1]["type"] == "done" and frames[-1]["finish_reason"] == "abort", frames[-1]
        assert frames[-1]["usage"]["completion_tokens"] < 3000
        session = h.get(f"/v1/sessions/{sid}").json()
        assert session["messages"][-1]["role"] == "assistant" and session["busy"] is False
        assert turn(h, sid, "Shorter, then.").status_code == 200
    wait_until(lambda: all(row["in_flight"] == 0 for row in stats(cluster, 0.2)["replicas"]), 30,
             "the router's in-flight counts to return to 0")


def test_beam_search_runs_on_one_replica_and_equals_the_single_process_servers(
        cluster: ServeCluster, single: BackgroundServer) -> None:
    body = {"model": "tiny", "use_beam_search": True, "n": 2, "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Two ideas?"}]}
    replies = [httpx.post(url + "/v1/chat/completions", json=body, timeout=120) for url in (cluster.url, single.url)]
    assert [r.status_code for r in replies] == [200, 200], replies[0].text
    beams = [[c["message"]["content"] for c in r.json()["choices"]] for r in replies]
    assert beams[0] == beams[1] and len(beams[0]) == 2
    assert replies[0].headers[HEADER] in {row["replica"] for row in stats(cluster, 0.0)["replicas"]}
