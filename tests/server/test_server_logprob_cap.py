"""The logprobs amplification bound on /v1/chat/completions (issue 24, item 5): `n: 16` with
`top_logprobs: 20` turned a 231-byte request into megabytes of JSON built on the event loop. A
request whose n × max_tokens × (top_logprobs + 1) exceeds --max-logprob-entries is a 400 naming
that product and the cap; an unset max_tokens is clamped to fit it; requests under it work,
streamed or not, and a large body is built off the event loop, so /health stays fast meanwhile.

One server over a tiny random-weight model with a small cap, so every case is cheap."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from radixserve import AsyncEngine, EngineConfig
from radixserve.server import BackgroundServer, ServerConfig

pytest.register_assert_rewrite("server_testkit")
from server_testkit import write_tiny_chat_model  # noqa: E402

pytestmark = pytest.mark.slow

CAP = 2000  # logprob entries per request on the test server
MESSAGES = [{"role": "user", "content": "Name three rivers."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    from radixserve.model.embedded import embedded_model_dir

    model = write_tiny_chat_model(tmp_path_factory.mktemp("tiny-logprobs"), embedded_model_dir())
    config = ServerConfig(port=0, web_dir=None, shutdown_grace_s=0.5, max_logprob_entries=CAP)
    with BackgroundServer(lambda: AsyncEngine(EngineConfig(model=str(model), num_blocks=512)), config) as srv:
        yield srv


def post(srv: BackgroundServer, **fields: Any) -> httpx.Response:
    body = {"model": srv.state.model_name, "messages": MESSAGES, "temperature": 0, **fields}
    return httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120)


def stream_entries(srv: BackgroundServer, **fields: Any) -> dict[int, list[dict[str, Any]]]:
    body = {"model": srv.state.model_name, "messages": MESSAGES, "temperature": 0, "stream": True, **fields}
    entries: dict[int, list[dict[str, Any]]] = {}
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                if c["logprobs"] is not None:
                    entries.setdefault(c["index"], []).extend(c["logprobs"]["content"])
    return entries


def test_over_the_cap_is_a_clear_400(server) -> None:  # noqa: ANN001
    fields = {"n": 16, "logprobs": True, "top_logprobs": 20, "max_tokens": 64}  # 16 * 64 * 21 = 21504
    request_bytes = len(json.dumps({"model": server.state.model_name, "messages": MESSAGES, **fields}))
    for stream in (False, True):
        r = post(server, stream=stream, **fields)
        assert r.status_code == 400, (f"{r.status_code}: {len(r.content)} bytes for a {request_bytes}-byte "
                                      f"request ({len(r.content) / request_bytes:.0f}x)")
        err = r.json()["error"]
        assert err["code"] == "too_many_logprobs" and err["param"] == "top_logprobs"
        assert "16 × 64 × (20 + 1) = 21504" in err["message"] and str(CAP) in err["message"]
    # an explicit max_tokens is checked as given, even when the context would clamp it anyway
    assert post(server, n=1, logprobs=True, top_logprobs=1, max_tokens=CAP // 2 + 1).status_code == 400


def test_under_the_cap_works_streamed_and_not(server) -> None:  # noqa: ANN001
    fields = {"n": 2, "logprobs": True, "top_logprobs": 5, "max_tokens": 16}
    r = post(server, **fields)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 2 and all(len(e["top_logprobs"]) == 5 for c in choices for e in c["logprobs"]["content"])
    streamed = stream_entries(server, **fields)
    assert {i: [e["token"] for e in es] for i, es in streamed.items()} == \
        {c["index"]: [e["token"] for e in c["logprobs"]["content"]] for c in choices}
    # exactly at the cap is allowed; n and max_tokens without logprobs are not counted at all
    assert post(server, n=1, logprobs=True, top_logprobs=1, max_tokens=CAP // 2).status_code == 200
    assert post(server, n=16, max_tokens=200).status_code == 200


def test_unset_max_tokens_is_clamped_to_the_cap(server) -> None:  # noqa: ANN001
    # n=1, logprobs, top_logprobs=5 and no max_tokens: the context left (about 2,000 tokens) would be
    # over the cap, so max_tokens defaults to what fits: CAP // 6
    r = post(server, logprobs=True, top_logprobs=5)
    assert r.status_code == 200, r.text
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    assert usage["completion_tokens"] == len(choice["logprobs"]["content"]) <= CAP // 6
    if choice["finish_reason"] == "length":
        assert usage["completion_tokens"] == CAP // 6
    entries = stream_entries(server, logprobs=True, top_logprobs=5)
    assert len(entries[0]) <= CAP // 6


def test_a_large_body_is_built_off_the_event_loop(server, monkeypatch) -> None:  # noqa: ANN001
    from radixserve.server.openai_chat import api as openai_api

    build = openai_api.logprobs_body

    def slow_build(*args: Any) -> Any:  # stands in for a body of megabytes: 16 x 50 ms
        time.sleep(0.05)
        return build(*args)

    monkeypatch.setattr(openai_api, "logprobs_body", slow_build)
    done = threading.Event()
    worst = 0.0

    def probe() -> None:
        nonlocal worst
        with httpx.Client(base_url=server.url, timeout=30) as client:
            while not done.is_set():
                t0 = time.monotonic()
                assert client.get("/health").status_code == 200
                worst = max(worst, time.monotonic() - t0)
                time.sleep(0.01)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        r = post(server, n=16, logprobs=True, top_logprobs=5, max_tokens=20)  # 1,920 entries
    finally:
        done.set()
        prober.join(30)
    assert r.status_code == 200 and len(r.json()["choices"]) == 16
    assert worst < 0.25, f"/health took {worst:.3f} s while the body was built"
