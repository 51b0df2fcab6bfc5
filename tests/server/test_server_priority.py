"""`priority` through every server API (OpenAI chat completions, streamed or not; REST session messages,
streamed or not; WebSocket chat frames) reaches the engine's Request, and bad values get a clear 400 /
`invalid_field` error naming `priority`; values beyond `--priority-range` need a `--priority-api-key`
on every API; a flood of the most urgent priority an ordinary caller may send cannot keep a
priority-0 request from its first token past the bound (issue 24, item 2); plus the metrics
(step utilization, cause counters) in /metrics and /v1/cache/stats."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixserve import AsyncEngine, EngineConfig
from radixserve.server import BackgroundServer, ServerConfig

pytest.register_assert_rewrite("server_testkit")
from server_testkit import OWNED, chat, connect, request, rest_client, write_tiny_chat_model  # noqa: E402

pytest_plugins = ["server_testkit"]
pytestmark = pytest.mark.slow

BAD = [True, False, 1.5, "3", [1], {"p": 1}, 2**31 + 1, -(2**31) - 1, 11, -11, -(2**31)]  # ordinary range: -10..10
PRIORITY_KEY = "priority-key-for-tests"
TINY = {"temperature": 0, "max_tokens": 2}


@pytest.fixture
def priorities(chat_server, monkeypatch: pytest.MonkeyPatch) -> list[int]:  # noqa: ANN001
    """The priority of every request the scheduler is given while the test runs, as it reads it."""
    scheduler = chat_server.engine.engine.scheduler
    seen: list[int] = []
    add = scheduler.add

    def spy(seq: Any) -> None:  # runs on the engine thread
        seen.append(seq.request.priority)
        add(seq)

    monkeypatch.setattr(scheduler, "add", spy)
    return seen


def openai_body(chat_server, **extra: Any) -> dict[str, Any]:  # noqa: ANN001
    return {"model": chat_server.state.model_name, "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2, "temperature": 0, **extra}


def test_openai_priority_reaches_the_scheduler(chat_server, priorities: list[int]) -> None:  # noqa: ANN001
    http = rest_client(chat_server)
    assert http.post("/v1/chat/completions", json=openai_body(chat_server, priority=-7)).status_code == 200
    r = http.post("/v1/chat/completions", json=openai_body(chat_server, priority=10, stream=True))
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    assert http.post("/v1/chat/completions", json=openai_body(chat_server)).status_code == 200
    assert priorities == [-7, 10, 0]


@pytest.mark.parametrize("bad", BAD)
def test_openai_bad_priority_is_a_400(chat_server, priorities: list[int], bad: Any) -> None:  # noqa: ANN001
    r = rest_client(chat_server).post("/v1/chat/completions", json=openai_body(chat_server, priority=bad))
    err = r.json()["error"]
    assert r.status_code == 400 and (err["code"], err["param"]) == ("invalid_field", "priority"), err
    assert "priority" in err["message"] and priorities == []


def test_rest_session_message_priority_reaches_the_scheduler(chat_server, priorities: list[int]) -> None:  # noqa: ANN001
    http = rest_client(chat_server)
    sid = http.post("/v1/sessions", json={"sampling": TINY}).json()["id"]
    assert http.post(f"/v1/sessions/{sid}/messages", json={"content": "Hi", "priority": 5}).status_code == 200
    r = http.post(f"/v1/sessions/{sid}/messages", json={"content": "Again", "priority": -1, "stream": True})
    events = [json.loads(line[len("data: "):]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1]["type"] == "done", events[-1]
    for bad in BAD:
        r = http.post(f"/v1/sessions/{sid}/messages", json={"content": "Hi", "priority": bad})
        err = r.json()["error"]
        assert r.status_code == 400 and (err["code"], err["param"]) == ("invalid_field", "priority"), (bad, err)
    assert priorities == [5, -1]
    assert len(http.get(f"/v1/sessions/{sid}").json()["messages"]) == 4  # refusals left the session unchanged


def test_websocket_chat_priority_reaches_the_scheduler(chat_server, priorities: list[int]) -> None:  # noqa: ANN001
    async def run() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        async with connect(chat_server) as ws:
            created = await request(ws, {"type": "session.create", "sampling": TINY, **OWNED})
            sid = created["session"]["id"]
            frames = await chat(ws, sid, "Hi", gen_id="p", priority=3)
            errors = []
            for i, bad in enumerate(BAD):
                await ws.send(json.dumps({"type": "chat", "session_id": sid, "content": "Hi", "gen_id": f"b{i}",
                                          "priority": bad, **OWNED}))
                errors.append(json.loads(await asyncio.wait_for(ws.recv(), 60)))
            return frames, errors

    frames, errors = asyncio.run(run())
    assert frames[-1]["type"] == "done", frames[-1]
    for i, e in enumerate(errors):
        assert (e["type"], e["code"], e["gen_id"]) == ("error", "invalid_field", f"b{i}"), e
        assert "priority" in e["message"]
    assert priorities == [3]


def test_a_priority_key_allows_any_priority_on_every_api(chat_server, priorities: list[int],  # noqa: ANN001
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chat_server.state.config, "priority_api_keys", [PRIORITY_KEY])
    keyed = {"Authorization": f"Bearer {PRIORITY_KEY}"}
    http = rest_client(chat_server)
    r = http.post("/v1/chat/completions", json=openai_body(chat_server, priority=-(2**31)))
    assert r.status_code == 400 and "[-10, 10]" in r.json()["error"]["message"] and "--priority-api-key" in r.text
    assert http.post("/v1/chat/completions", json=openai_body(chat_server, priority=-(2**31)), headers=keyed).status_code == 200
    wrong = {"Authorization": "Bearer not-the-key"}
    assert http.post("/v1/chat/completions", json=openai_body(chat_server, priority=-11), headers=wrong).status_code == 400
    sid = http.post("/v1/sessions", json={"sampling": TINY}).json()["id"]
    assert http.post(f"/v1/sessions/{sid}/messages", json={"content": "Hi", "priority": 2**31},
                     headers=keyed).status_code == 200

    async def run() -> tuple[dict[str, Any], list[dict[str, Any]]]:
        async with connect(chat_server) as ws:
            sid = (await request(ws, {"type": "session.create", "sampling": TINY, **OWNED}))["session"]["id"]
            await ws.send(json.dumps({"type": "chat", "session_id": sid, "content": "Hi", "gen_id": "refused",
                                      "priority": -50, **OWNED}))
            refused = json.loads(await asyncio.wait_for(ws.recv(), 60))
            assert (await request(ws, {"type": "auth", "api_key": PRIORITY_KEY}))["type"] == "auth.ok"
            return refused, await chat(ws, sid, "Hi", gen_id="keyed", priority=-50)

    refused, frames = asyncio.run(run())
    assert (refused["code"], refused["gen_id"]) == ("invalid_field", "refused") and frames[-1]["type"] == "done"
    assert priorities == [-(2**31), 2**31, -50]


def test_metrics_expose_step_utilization_and_causes(chat_server) -> None:  # noqa: ANN001
    http = rest_client(chat_server)
    assert http.post("/v1/chat/completions", json=openai_body(chat_server)).status_code == 200
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(http.get("/metrics").text) for s in fam.samples}
    for cause in ("blocks", "max_num_seqs", "urgent", "watermark"):
        assert ("radixserve_admission_blocked_total", (("cause", cause),)) in samples
        assert ("radixserve_preemptions_by_cause_total", (("cause", cause),)) in samples
    for name in ("radixserve_step_batch_slot_utilization", "radixserve_step_token_budget_utilization"):
        assert samples[(f"{name}_count", ())] >= 1
        assert 0 < samples[(f"{name}_sum", ())] <= samples[(f"{name}_count", ())]
    stats = http.get("/v1/cache/stats").json()
    assert set(stats["admission_blocked"]) >= {"blocks", "max_num_seqs", "urgent", "watermark"}
    assert set(stats["preemptions_by_cause"]) >= {"blocks", "max_num_seqs", "urgent", "watermark"}
    steps = stats["steps"]
    assert steps["count"] >= 1 and 0 < steps["mean_slot_utilization"] <= 1
    assert 0 < steps["mean_token_budget_utilization"] <= 1


FLOOD_CLIENTS = 6
VICTIM_FIRST_TOKEN_S = 30.0  # the target: at the default aging (10 s a level) and queue-wait bound (20 s)


def test_a_flood_at_the_most_urgent_ordinary_priority_cannot_starve_a_request(chat_server, tmp_path: Path) -> None:  # noqa: ANN001
    """The measured failure: a client flooding the most urgent priority kept a priority-0 request
    waiting past 150 s (aging closes one level per 10 s). Now the flood can only use -10 and a
    request queued 20 s ago goes ahead of every younger one; the victim's first token comes within 30 s."""
    model = write_tiny_chat_model(tmp_path / "tiny", Path(chat_server.engine.engine.model_dir))
    engine_config = EngineConfig(model=str(model), num_blocks=256, policy="priority", max_num_seqs=2)
    with BackgroundServer(lambda: AsyncEngine(engine_config), ServerConfig(port=0, web_dir=None)) as srv:
        low = srv.config.priority_range[0]
        body = {"model": srv.state.model_name, "temperature": 1.0, "max_tokens": 100, "seed": 1}

        async def run() -> tuple[float, int]:
            stop = asyncio.Event()
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as http:
                async def flood(i: int) -> int:
                    done = 0
                    while not stop.is_set():
                        r = await http.post("/v1/chat/completions", json={
                            **body, "priority": low, "messages": [{"role": "user", "content": f"flood {i} {done}"}]})
                        assert r.status_code == 200, r.text
                        done += 1
                    return done

                floods = [asyncio.create_task(flood(i)) for i in range(FLOOD_CLIENTS)]
                await asyncio.sleep(1.0)  # the queue is full of the flood's requests
                start = time.monotonic()

                async def victim() -> float:
                    async with http.stream("POST", "/v1/chat/completions", json={
                            **body, "stream": True, "messages": [{"role": "user", "content": "the victim"}]}) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: ") and '"content"' in line:
                                break
                    return time.monotonic() - start

                try:
                    first_token_s = await asyncio.wait_for(victim(), VICTIM_FIRST_TOKEN_S + 10)
                except asyncio.TimeoutError:
                    first_token_s = float("inf")
                stop.set()
                return first_token_s, sum(await asyncio.gather(*floods))

        first_token_s, flooded = asyncio.run(run())
        assert flooded > FLOOD_CLIENTS, "the flood did not keep the engine busy"
        assert first_token_s <= VICTIM_FIRST_TOKEN_S, first_token_s
        print(f"victim's first token after {first_token_s:.1f} s; {flooded} flood requests served")
