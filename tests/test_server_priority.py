"""`priority` through every server API (OpenAI chat completions, streamed or not; REST session messages,
streamed or not; WebSocket chat frames) reaches the engine's Request, and bad values get a clear 400 /
`invalid_field` error naming `priority`; plus the metrics this branch adds (step utilization, cause
counters) in /metrics and /v1/cache/stats."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

pytest.register_assert_rewrite("server_testkit")
from server_testkit import OWNED, chat, connect, request, rest_client  # noqa: E402

pytest_plugins = ["server_testkit"]
pytestmark = pytest.mark.slow

BAD = [True, False, 1.5, "3", [1], {"p": 1}, 2**31 + 1, -(2**31) - 1]
TINY = {"temperature": 0, "max_tokens": 2}


@pytest.fixture
def priorities(chat_server, monkeypatch: pytest.MonkeyPatch) -> list[int]:  # noqa: ANN001
    """The priority of every Request the engine builds while the test runs (the field the scheduler reads)."""
    engine = chat_server.engine.engine
    seen: list[int] = []
    add = engine.add_request

    def spy(*args: Any, **kw: Any) -> str:  # runs on the engine thread
        rid = add(*args, **kw)
        seen.append(engine.requests[rid].priority)
        return rid

    monkeypatch.setattr(engine, "add_request", spy)
    return seen


def openai_body(chat_server, **extra: Any) -> dict[str, Any]:  # noqa: ANN001
    return {"model": chat_server.state.model_name, "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2, "temperature": 0, **extra}


def test_openai_priority_reaches_the_scheduler(chat_server, priorities: list[int]) -> None:  # noqa: ANN001
    http = rest_client(chat_server)
    assert http.post("/v1/chat/completions", json=openai_body(chat_server, priority=-7)).status_code == 200
    r = http.post("/v1/chat/completions", json=openai_body(chat_server, priority=2**31, stream=True))
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    assert http.post("/v1/chat/completions", json=openai_body(chat_server)).status_code == 200
    assert priorities == [-7, 2**31, 0]


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
