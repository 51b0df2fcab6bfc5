"""instructor run unmodified against the server's chat completions: `instructor.from_openai(OpenAI(...),
mode=...)` in TOOLS mode (the answer as a forced function call) and JSON_SCHEMA mode (the answer as
`response_format` json_schema), `response_model=Report`, whole (`create_with_completion`) and streamed
(`create_partial`). instructor validates the reply and would re-ask on a bad one: with one attempt
allowed, the server's first reply must already be the valid answer. Over the tiny random chat model.
Through a transport that takes `tool_calls` out of the server's replies, TOOLS mode must fail.
"""

from __future__ import annotations

import json
from typing import Any

import httpx2
import pytest

from radixserve.server import BackgroundServer

instructor = pytest.importorskip("instructor")
openai = pytest.importorskip("openai")
from instructor.core.exceptions import InstructorRetryException  # noqa: E402

pytest.register_assert_rewrite("agent_kit")
from agent_kit import MAX_TOKENS, Report, TamperingTransport, drop_key, model_name, openai_base  # noqa: E402

pytest_plugins = ["agent_kit"]

ASK = [{"role": "user", "content": "Paris is sunny today. Report the weather."}]


def client(srv: BackgroundServer, mode: str, http_client: Any = None) -> Any:
    return instructor.from_openai(openai.OpenAI(base_url=openai_base(srv), api_key="x", max_retries=0, timeout=120,
                                                http_client=http_client), mode=instructor.Mode[mode])


def extract(srv: BackgroundServer, mode: str, http_client: Any = None) -> None:
    """The answer asked for whole and streamed, checked: what each test below runs, with the client's
    default HTTP client or through a TamperingTransport."""
    ins = client(srv, mode, http_client)
    report, completion = ins.chat.completions.create_with_completion(
        model=model_name(srv), response_model=Report, messages=ASK, max_tokens=MAX_TOKENS,
        temperature=0, max_retries=1)
    assert isinstance(report, Report)
    answer = report.model_dump()
    message = completion.choices[0].message
    if mode == "TOOLS":  # the answer came as the forced call of the model's own tool
        assert completion.choices[0].finish_reason in ("tool_calls", "stop")
        assert [c.function.name for c in message.tool_calls] == ["Report"]
        assert Report.model_validate_json(message.tool_calls[0].function.arguments).model_dump() == answer
    else:
        assert not message.tool_calls and Report.model_validate(json.loads(message.content)).model_dump() == answer
    partials = list(ins.chat.completions.create_partial(
        model=model_name(srv), response_model=Report, messages=ASK, max_tokens=MAX_TOKENS, temperature=0))
    assert len(partials) > 1  # streamed: the answer grew over several chunks
    assert Report.model_validate(partials[-1].model_dump()).model_dump() == answer  # greedy: the same answer streamed


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_response_model(agent_server: BackgroundServer, mode: str) -> None:
    extract(agent_server, mode)


@pytest.mark.parametrize("dropped", [False, True], ids=["intact", "dropped"])
def test_tools_mode_fails_when_server_drops_tool_calls(agent_server: BackgroundServer, dropped: bool) -> None:
    """TOOLS mode through a transport that takes `tool_calls` out of the server's replies fails (and
    through the same transport untouched succeeds): instructor finds no answer to validate."""
    transport = TamperingTransport(drop_key(None, "tool_calls") if dropped else None)
    with httpx2.Client(transport=transport, timeout=120) as http_client:
        if not dropped:
            extract(agent_server, "TOOLS", http_client)
            return
        with pytest.raises(InstructorRetryException):
            extract(agent_server, "TOOLS", http_client)
        assert transport.seen.edited >= 1
