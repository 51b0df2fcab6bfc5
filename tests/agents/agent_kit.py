"""What the agent-framework tests share (a pytest plugin: test modules list it in `pytest_plugins`): the
`agent_server` fixture, the tools an agent gets (plain typed functions each framework wraps its own way,
recording every call that ran), the structured answer they ask for, and `TamperingTransport`, an httpx2
transport the official clients take through their `http_client`, which edits the server's replies on
their way to the client (a field or an event taken out) so a test can show that a framework loop fails
when the server drops what the client needs.

Invariants: every tool argument is an enum or a bounded integer and the answer model has only an enum
and a boolean, so the tiny random-weight model under the server's grammar always writes a complete,
valid call or answer well within the small `MAX_TOKENS`. `agent_server` is the tiny chat model of
`tiny_chat_server` with a longer context: an agent's request (its tools' and answer's schemas, then a
round trip) is about 1,000 tokens in the tiny 500-token vocabulary, past that server's 1,024. The
transport changes nothing but what its edit returns: with no edit it hands back the server's response
itself, so the same loop through it must succeed; a whole JSON body the edit would leave out is passed
unchanged (only SSE events can be dropped).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import httpx2
import pytest
from pydantic import BaseModel, Field

from radixserve import AsyncEngine, EngineConfig
from radixserve.server import BackgroundServer, ServerConfig

MAX_TOKENS = 64  # a call or the answer takes about 35 tiny-model tokens
AGENT_CONTEXT = 4096  # agent_server's context length: the longest loop here is under 2,000 tokens
MAX_TURNS = 4  # every loop here needs 2 model turns (a tool round trip, then the answer)
INSTRUCTIONS = "Answer with the tools."

City = Literal["Paris", "Rome", "Oslo"]
Digit = Annotated[int, Field(ge=0, le=9)]


class Report(BaseModel):
    """The weather the agent found."""

    city: City
    sunny: bool


@dataclass
class ToolRuns:
    """The agent's two tools as plain functions (each framework wraps them as its users do) and the calls
    that actually ran, in order."""

    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def functions(self) -> list[Callable[..., Any]]:
        def get_weather(city: City) -> str:
            """Current weather of a city."""
            self.calls.append(("get_weather", {"city": city}))
            return f"{city}: sunny, 21 C"

        def add(a: Digit, b: Digit) -> int:
            """Add two digits."""
            self.calls.append(("add", {"a": a, "b": b}))
            return a + b

        return [get_weather, add]

    def ran(self) -> set[str]:
        return {name for name, _ in self.calls}


@pytest.fixture(scope="session")
def agent_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    """A real server on 127.0.0.1 over the tiny random-weight chat model (tests/tiny_models.py) given an
    AGENT_CONTEXT-token context, shared by the agent tests and stopped at the end."""
    from tiny_models import tiny_chat_model_dir

    model = tmp_path_factory.mktemp("agent-model")
    shutil.copytree(tiny_chat_model_dir("llama"), model, dirs_exist_ok=True)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = AGENT_CONTEXT  # random weights: any length reads as well as another
    (model / "config.json").write_text(json.dumps(config))
    server = ServerConfig(port=0, web_dir=None, shutdown_grace_s=0.5)
    with BackgroundServer(lambda: AsyncEngine(EngineConfig(model=str(model), num_blocks=1024)), server) as srv:
        yield srv


def openai_base(srv: BackgroundServer) -> str:
    return srv.url + "/v1"


def model_name(srv: BackgroundServer) -> str:
    name = srv.state.model_name
    assert isinstance(name, str)
    return name


# --- taking a field or an event out of the server's replies -------------------------------------------

Edit = Callable[[dict[str, Any]], "dict[str, Any] | None"]  # a reply body or SSE event -> kept (edited) or None


def drop_events(*types: str) -> Edit:
    """Leave out every SSE event whose `type` is one of `types`."""
    return lambda payload: None if payload.get("type") in types else payload


def drop_key(owner_type: str | None, key: str) -> Edit:
    """Take `key` out of every object, at any depth, whose `type` is `owner_type` (a Responses
    `function_call` item's `call_id`, an Anthropic `tool_use` block's `id`, ...), or of every object
    when `owner_type` is None (a chat message's `tool_calls`)."""

    def strip(node: Any) -> Any:
        if isinstance(node, dict):
            owned = owner_type is None or node.get("type") == owner_type
            return {k: strip(v) for k, v in node.items() if not (k == key and owned)}
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node

    return strip


@dataclass
class Tampered:
    """What a TamperingTransport changed: how many payloads its edit altered or left out."""

    edited: int = 0
    dropped: int = 0


def _edit_json(edit: Edit, raw: bytes, seen: Tampered) -> bytes | None:
    try:
        payload = json.loads(raw)
    except ValueError:
        return raw  # not JSON (an SSE `[DONE]`): passed through
    if not isinstance(payload, dict):
        return raw
    out = edit(payload)
    if out is None:
        seen.dropped += 1
        return None
    if out != payload:
        seen.edited += 1
    return json.dumps(out).encode()


def _edit_sse_event(edit: Edit, event: bytes, seen: Tampered) -> bytes:
    """One SSE event (its lines, without the blank line ending it): the `data:` JSON edited, or b"" when
    the edit leaves the event out."""
    lines = event.split(b"\n")
    data = [i for i, line in enumerate(lines) if line.startswith(b"data:")]
    if len(data) != 1:
        return event + b"\n\n"
    edited = _edit_json(edit, lines[data[0]][5:].strip(), seen)
    if edited is None:
        return b""
    lines[data[0]] = b"data: " + edited
    return b"\n".join(lines) + b"\n\n"


class _EditedSSE(httpx2.AsyncByteStream, httpx2.SyncByteStream):
    """An SSE body re-cut at event boundaries, each event edited as it arrives (streaming stays streaming)."""

    def __init__(self, inner: Any, edit: Edit, seen: Tampered) -> None:
        self.inner, self.edit, self.seen = inner, edit, seen

    def _events(self, buffer: bytearray, chunk: bytes) -> Iterator[bytes]:
        buffer.extend(chunk.replace(b"\r\n", b"\n"))
        while (end := buffer.find(b"\n\n")) >= 0:
            event = bytes(buffer[:end])
            del buffer[:end + 2]
            if out := _edit_sse_event(self.edit, event, self.seen):
                yield out

    async def __aiter__(self) -> AsyncIterator[bytes]:
        buffer = bytearray()
        async for chunk in self.inner:
            for out in self._events(buffer, chunk):
                yield out
        if buffer:
            yield bytes(buffer)

    def __iter__(self) -> Iterator[bytes]:
        buffer = bytearray()
        for chunk in self.inner:
            yield from self._events(buffer, chunk)
        if buffer:
            yield bytes(buffer)

    async def aclose(self) -> None:
        await self.inner.aclose()

    def close(self) -> None:
        self.inner.close()


class TamperingTransport(httpx2.AsyncBaseTransport, httpx2.BaseTransport):
    """A real HTTP transport to the server whose replies pass through `edit` (None: untouched), JSON
    bodies whole and SSE streams event by event. Give it to a client as
    `httpx2.AsyncClient(transport=...)` / `httpx2.Client(transport=...)`."""

    def __init__(self, edit: Edit | None) -> None:
        self.edit = edit
        self.seen = Tampered()
        self._async = httpx2.AsyncHTTPTransport()
        self._sync = httpx2.HTTPTransport()

    def _headers(self, response: httpx2.Response) -> list[tuple[str, str]]:
        # the body's length changes with the edit
        return [(k, v) for k, v in response.headers.multi_items() if k.lower() != "content-length"]

    def _is_sse(self, response: httpx2.Response) -> bool:
        return response.headers.get("content-type", "").startswith("text/event-stream")

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self._async.handle_async_request(request)
        if self.edit is None:
            return response
        if self._is_sse(response):
            return httpx2.Response(response.status_code, headers=self._headers(response), request=request,
                                   stream=_EditedSSE(response.stream, self.edit, self.seen),
                                   extensions=response.extensions)
        body = await response.aread()
        await response.aclose()
        edited = _edit_json(self.edit, body, self.seen)
        return httpx2.Response(response.status_code, headers=self._headers(response), request=request,
                               content=body if edited is None else edited, extensions=response.extensions)

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        response = self._sync.handle_request(request)
        if self.edit is None:
            return response
        if self._is_sse(response):
            return httpx2.Response(response.status_code, headers=self._headers(response), request=request,
                                   stream=_EditedSSE(response.stream, self.edit, self.seen),
                                   extensions=response.extensions)
        body = response.read()
        response.close()
        edited = _edit_json(self.edit, body, self.seen)
        return httpx2.Response(response.status_code, headers=self._headers(response), request=request,
                               content=body if edited is None else edited, extensions=response.extensions)

    async def aclose(self) -> None:
        await self._async.aclose()

    def close(self) -> None:
        self._sync.close()
