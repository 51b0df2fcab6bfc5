"""The single error path, without a model: an ApiError a route raises is answered by the app's one
exception handler (OpenAI-shaped JSON, counted once in api_errors), an unexpected exception by the
generic 500, and the stream error payloads come from the same mapping and count."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.testclient import TestClient

from radixserve.server import ServerConfig, build_app
from radixserve.server.api_errors import error_frame, openai_stream_error
from radixserve.server.metrics import ServerMetrics
from radixserve.server.validation import ApiError

LOCAL = "http://127.0.0.1"  # a Host the request guard answers
CONFLICT = ApiError("session_busy", "busy right now", 409, param="session_id")


def api_errors(metrics: ServerMetrics, code: str) -> float:
    return metrics.registry.get_sample_value("radixserve_api_errors_total", {"code": code}) or 0.0


@pytest.fixture()
def app() -> Iterator[Starlette]:
    """An app whose model never loads (no lifespan runs), plus two routes that fail on purpose."""
    never = threading.Event()
    app = build_app(lambda: never.wait() or None, ServerConfig(web_dir=None))  # type: ignore[arg-type,func-returns-value]

    async def refuses(request: Request) -> Response:
        raise CONFLICT

    async def breaks(request: Request) -> Response:
        raise RuntimeError("library internals")

    app.router.routes += [Route("/v1/test/refuses", refuses), Route("/v1/test/breaks", breaks)]
    yield app
    never.set()


def test_a_raised_api_error_is_one_json_error_counted_once(app: Starlette, caplog: pytest.LogCaptureFixture) -> None:
    metrics = app.state.server.metrics
    with caplog.at_level(logging.WARNING):
        r = TestClient(app, base_url=LOCAL).get("/v1/test/refuses")
    assert not caplog.records  # a refusal is not an internal error: nothing is logged
    assert r.status_code == 409
    assert r.json() == {"error": {"message": "busy right now", "type": "conflict_error", "param": "session_id",
                                  "code": "session_busy"}}
    assert api_errors(metrics, "session_busy") == 1


def test_endpoints_refuse_through_the_handler(app: Starlette) -> None:
    metrics, client = app.state.server.metrics, TestClient(app, base_url=LOCAL)
    for method, path in [("GET", "/v1/models"), ("GET", "/v1/cache/stats"), ("GET", "/v1/sessions"),
                         ("POST", "/v1/chat/completions")]:
        r = client.request(method, path, json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable", (path, r.text)
    assert api_errors(metrics, "unavailable") == 4
    r = client.get("/v1/models", headers={"Host": "evil.example"})  # refused by middleware, same body
    assert r.status_code == 421 and r.json()["error"]["code"] == "forbidden_host"
    assert api_errors(metrics, "forbidden_host") == 1


def test_an_unexpected_exception_is_a_generic_500_counted_once(app: Starlette,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    metrics = app.state.server.metrics
    with caplog.at_level(logging.ERROR, "radixserve.server"):
        r = TestClient(app, base_url=LOCAL, raise_server_exceptions=False).get("/v1/test/breaks")
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["code"] == "internal" and err["type"] == "server_error" and "library internals" not in r.text
    assert api_errors(metrics, "internal") == 1
    logged = [rec for rec in caplog.records if rec.exc_info is not None]
    assert len(logged) == 1 and logged[0].exc_info[1].args == ("library internals",)
    assert logged[0].getMessage().split("request id ")[1].rstrip(")") in err["message"]


def test_stream_error_payloads_share_the_mapping_and_count() -> None:
    metrics = ServerMetrics(ServerConfig().system_prompt_labels)
    assert error_frame(CONFLICT, metrics) == {"type": "error", "code": "session_busy", "message": "busy right now"}
    assert error_frame(CONFLICT, metrics, gen_id="g", req=None, has_req=True) == {
        "type": "error", "code": "session_busy", "message": "busy right now", "gen_id": "g", "req": None}
    assert openai_stream_error(CONFLICT, metrics)["error"]["type"] == "conflict_error"
    assert api_errors(metrics, "session_busy") == 3
    frame = error_frame(RuntimeError("secret"), metrics, gen_id="g")
    assert frame["code"] == "internal" and "secret" not in frame["message"]
    assert api_errors(metrics, "internal") == 1
