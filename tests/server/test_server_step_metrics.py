"""The server's step metrics are updated on its event loop, never by server code on the engine
thread (issue 25, item 6): the engine thread only records each step (engine/observers.py StepFeed),
and the server takes them in on the loop, periodically and whenever /metrics or /v1/cache/stats is
read, with every step counted once."""

from __future__ import annotations

import re
import threading
from typing import Any

import httpx
import pytest

pytest.register_assert_rewrite("server_testkit")
from server_testkit import engine_idle, on_server_loop, wait_until  # noqa: E402

pytest_plugins = ["server_testkit"]
pytestmark = pytest.mark.slow


async def _thread_id() -> int:
    return threading.get_ident()


def _step_count(srv: Any) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=30).text
    found = re.search(r"^radixserve_step_seconds_count (\S+)$", text, re.MULTILINE)
    assert found is not None, "the step histogram is missing"
    return float(found.group(1))


def test_step_metrics_are_updated_on_the_event_loop(chat_server, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    loop_thread = on_server_loop(chat_server, _thread_id())
    metrics, threads = chat_server.state.metrics, []
    for histogram in (metrics.step_time, metrics.step_tokens, metrics.step_slots, metrics.step_budget):
        original = histogram.observe

        def observe(value: float, *args: Any, _original: Any = original, **kwargs: Any) -> None:
            threads.append(threading.get_ident())
            _original(value, *args, **kwargs)

        monkeypatch.setattr(histogram, "observe", observe)
    wait_until(lambda: engine_idle(chat_server), what="the engine idle")
    before = _step_count(chat_server)
    threads.clear()
    body = {"model": chat_server.state.model_name, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Count to three."}]}
    r = httpx.post(chat_server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    wait_until(lambda: engine_idle(chat_server), what="the engine idle")
    steps = _step_count(chat_server) - before  # the scrape takes in every step run meanwhile
    assert steps >= r.json()["usage"]["completion_tokens"] >= 1
    assert len(threads) == 4 * steps  # each step observed once by each step histogram
    assert set(threads) == {loop_thread}, "step metrics were updated off the event loop"
