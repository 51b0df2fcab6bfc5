"""A request is tokenized once and checked once on its way into the engine (issue 25, item 5): the
server tokenizes the chat prompt (off the event loop when large), the engine's intake checks the
ids, and nothing after that tokenizes or checks it again, neither the async engine nor the engine
thread. A refusal of that one check is the API's error before any response starts."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

import radixserve.engine.engine as engine_module
import radixserve.engine.intake as intake_module
from radixserve.chat.template import ChatFormatter

pytest.register_assert_rewrite("server_testkit")
from server_testkit import engine_idle, rest_client, wait_until  # noqa: E402

pytest_plugins = ["server_testkit"]
pytestmark = pytest.mark.slow

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime number."}]


@pytest.fixture()
def calls(chat_server, monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:  # noqa: ANN001
    """How often a prompt is tokenized (by the server's chat formatter, or the engine's intake turning
    a prompt into ids) and checked, on any thread, wherever the engine module still binds its own."""
    counts: Counter[str] = Counter()

    def counting(owner: Any, name: str, key: str) -> None:
        original: Callable[..., Any] = getattr(owner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            counts[key] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)

    for module in (intake_module, engine_module):
        for name in ("tokenize", "validate"):
            if hasattr(module, name):
                counting(module, name, name)
    for name in ("prompt_tokens", "append_user"):  # the server's tokenizing of a chat prompt
        counting(ChatFormatter, name, "chat_prompt")
    wait_until(lambda: engine_idle(chat_server), what="the engine idle")
    yield counts


def _chat(srv: Any, stream: bool, **extra: Any) -> httpx.Response:
    body = {"model": srv.state.model_name, "messages": MESSAGES, "max_tokens": 3, "temperature": 0,
            "stream": stream, **extra}
    return httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_chat_completion_is_tokenized_and_checked_once(chat_server, calls, stream: bool) -> None:  # noqa: ANN001
    r = _chat(chat_server, stream)
    assert r.status_code == 200, r.text
    wait_until(lambda: engine_idle(chat_server), what="the engine idle")
    assert calls == {"chat_prompt": 1, "tokenize": 1, "validate": 1}


def test_a_session_turn_is_tokenized_and_checked_once(chat_server, calls) -> None:  # noqa: ANN001
    http = rest_client(chat_server)
    sid = http.post("/v1/sessions", json={"system_prompt": "Be brief."}).json()["id"]
    calls.clear()  # creating the session tokenized its system prompt: not a request
    r = http.post(f"/v1/sessions/{sid}/messages", json={"content": "Name a prime number.",
                                                       "sampling": {"max_tokens": 3, "temperature": 0}})
    assert r.status_code == 200, r.text
    wait_until(lambda: engine_idle(chat_server), what="the engine idle")
    assert calls == {"chat_prompt": 1, "tokenize": 1, "validate": 1}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_refusal_of_the_one_check_is_an_api_error_before_any_stream(chat_server, calls, stream: bool) -> None:  # noqa: ANN001
    before = chat_server.engine.stats().prompt_tokens
    limit = chat_server.engine.max_model_len
    r = _chat(chat_server, stream, messages=[{"role": "user", "content": "word " * (limit + 10)}], max_tokens=None)
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json"), r.text
    error = r.json()["error"]
    assert error["code"] == "context_too_long" and str(limit) in error["message"]
    assert calls == {"chat_prompt": 1, "tokenize": 1, "validate": 1}
    assert chat_server.engine.stats().prompt_tokens == before  # nothing reached the engine thread
