"""A thinking model's reasoning in the web UI (web/js/thinking_view.js), in headless Chromium.

The server runs in this process over the tiny checkpoint with a Qwen3-like template
(tiny_models.tiny_reasoning_model_dir), with the web UI and --api-key, so the model's reply can be
forced (reasoning_kit.Replies: the real engine under a grammar that admits exactly the given text):
its `<think>` part reaches the page as `delta` frames carrying `reasoning`, its answer as plain
`delta`s. The server's frames pass through a gate in the page's WebSocket route that can hold them
back, so a test sees the page mid-reply, at a point it chose, without racing the stream.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from playwright.sync_api import Browser, Locator, Page, WebSocketRoute, expect

from radixserve import AsyncEngine, EngineConfig
from radixserve.server import BackgroundServer, ServerConfig

pytest.register_assert_rewrite("web_testkit", "reasoning_kit")
# the reasoning test kit lives beside the server tests (pytest puts that folder on the path only for them)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from reasoning_kit import Replies  # noqa: E402
from tiny_models import tiny_reasoning_model_dir  # noqa: E402
from web_testkit import API_KEY, ARTIFACTS, Server, Ui, make_ui  # noqa: E402

pytest_plugins = ["web_testkit"]
pytestmark = pytest.mark.slow

REASONING = "The user greets me, so I should greet them back."
ANSWER = "Hello there!"
SAMPLING = {"temperature": 0, "top_p": 1, "max_tokens": 120}  # room for the forced replies
Frame = dict[str, Any]


def reasoning_piece(frame: Frame) -> bool:
    return frame.get("type") == "delta" and bool(frame.get("reasoning"))


def answer_piece(frame: Frame) -> bool:
    return frame.get("type") == "delta" and bool(frame.get("text"))


def after(n: int, kind: Callable[[Frame], bool]) -> Callable[[Frame], bool]:
    """Matches the frames of `kind` after the first `n` of them (each frame is asked once)."""
    seen = [0]

    def match(frame: Frame) -> bool:
        if not kind(frame):
            return False
        seen[0] += 1
        return seen[0] > n

    return match


class FrameGate:
    """The server's WebSocket frames to the page, held back from the first one `stop` matches until released."""

    def __init__(self, page: Page, stop: Callable[[Frame], bool] | None) -> None:
        self.stop = stop
        self.held: list[str | bytes] = []
        self.ws: WebSocketRoute | None = None
        page.route_web_socket("**/v1/chat/ws*", self._route)

    def _route(self, ws: WebSocketRoute) -> None:
        self.ws = ws
        server = ws.connect_to_server()

        def forward(message: str | bytes) -> None:
            if self.held or (self.stop is not None and self.stop(json.loads(message))):
                self.held.append(message)  # behind the frames already held: the order stays the server's
            else:
                ws.send(message)

        server.on_message(forward)

    def release(self, stop: Callable[[Frame], bool] | None = None) -> None:
        """Send the held frames to the page, holding again from the first that `stop` matches (None: none)."""
        assert self.ws is not None
        self.stop = stop
        while self.held:  # a frame may arrive while one is sent: it joins the list, and goes out in turn
            if stop is not None and stop(json.loads(self.held[0])):
                return
            self.ws.send(self.held.pop(0))


@pytest.fixture(scope="module")
def thinking_server() -> Iterator[BackgroundServer]:
    model = str(tiny_reasoning_model_dir("qwen3"))
    # forced_tokens off: a forced reply is generated a step a token, so it streams as a free one would
    srv = BackgroundServer(lambda: AsyncEngine(EngineConfig(model=model, num_blocks=512, forced_tokens=False)),
                           ServerConfig(port=0, api_key=API_KEY, shutdown_grace_s=0.5))  # the default web dir
    with srv:
        yield srv


@pytest.fixture
def server(thinking_server: BackgroundServer) -> Server:
    # web_testkit's Server is a `radixserve serve` subprocess; the UI helpers only use its address
    return Server(thinking_server.url, proc=cast("subprocess.Popen[bytes]", None))


@pytest.fixture
def forced(thinking_server: BackgroundServer, monkeypatch: pytest.MonkeyPatch) -> Replies:
    return Replies(thinking_server, monkeypatch)


@pytest.fixture
def ui(browser: Browser, server: Server) -> Iterator[Ui]:
    with make_ui(browser, server, sampling=SAMPLING) as page_ui:
        yield page_ui


def is_open(block: Locator) -> bool:
    return bool(block.evaluate("d => d.open"))


def test_reasoning_streams_open_then_collapses_above_the_answer(ui: Ui, forced: Replies) -> None:
    page = ui.page
    gate = FrameGate(page, stop=answer_piece)  # the page gets every reasoning piece, then waits
    ui.open()
    forced.force(f"<think>\n{REASONING}\n</think>\n\n{ANSWER}")
    ui.send("Hi!")
    reply = page.locator(".msg-assistant").last
    block = reply.locator("details.thinking")
    # all the reasoning is in, no answer yet: the block is open and says it is thinking
    expect(block.locator(".thinking-body")).to_have_text(REASONING)
    expect(block.locator(".thinking-body")).to_be_visible()
    expect(block.locator(".thinking-summary")).to_have_text("Thinking…")
    assert is_open(block)
    assert reply.get_attribute("aria-busy") == "true"
    expect(reply.locator(".msg-body > p")).to_have_count(0)  # the answer's paragraphs: none yet
    expect(reply.locator(".msg-pending")).to_have_count(0)

    gate.release()
    ui.wait_replies(1)
    # the answer started: the block collapsed, above the answer, which is outside it
    expect(reply.locator(".msg-body > p")).to_have_text(ANSWER)
    expect(block.locator(".thinking-body")).to_be_hidden()
    assert not is_open(block)
    assert reply.locator(".msg-body").evaluate("b => b.firstElementChild.matches('details.thinking')")
    assert ANSWER not in (block.text_content() or "") and REASONING not in reply.locator(".msg-body > p").inner_text()
    # the reasoning token count is the reply's usage.reasoning_tokens, as the server keeps it
    sid = page.evaluate("localStorage.getItem('radixserve.currentSession')")
    kept = ui.server.rest("GET", f"/v1/sessions/{sid}")["messages"][-1]
    assert kept["reasoning_content"] == REASONING and kept["content"] == ANSWER
    tokens = kept["usage"]["reasoning_tokens"]
    assert 0 < tokens < kept["usage"]["completion_tokens"]
    tokens_node = block.locator(".thinking-tokens")
    expect(tokens_node).to_have_text(f"{tokens} tokens")
    assert tokens_node.get_attribute("data-value") == str(tokens)
    expect(block.locator(".thinking-label")).to_have_text("Thinking")

    # a click opens it; Enter on the focused summary closes it again
    block.locator(".thinking-summary").click()
    expect(block.locator(".thinking-body")).to_be_visible()
    expect(block.locator(".thinking-body")).to_have_text(REASONING)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "web_reasoning.png"))
    block.locator(".thinking-summary").press("Enter")
    expect(block.locator(".thinking-body")).to_be_hidden()

    # reloaded, the session's history (GET /v1/sessions/{id}) shows the same block, collapsed
    page.reload()
    expect(page.locator("#conn")).to_have_attribute("data-state", "open", timeout=20_000)
    reply = page.locator(".msg-assistant").last
    block = reply.locator("details.thinking")
    expect(reply.locator(".msg-body > p")).to_have_text(ANSWER)
    expect(block.locator(".thinking-tokens")).to_have_text(f"{tokens} tokens")
    expect(block.locator(".thinking-body")).to_be_hidden()
    block.locator(".thinking-summary").click()
    expect(block.locator(".thinking-body")).to_have_text(REASONING)


def test_reader_who_closes_the_block_keeps_it_closed_while_it_streams(ui: Ui, forced: Replies) -> None:
    page = ui.page
    gate = FrameGate(page, stop=after(1, reasoning_piece))  # the first reasoning piece only
    ui.open()
    forced.force(f"<think>\n{REASONING}\n</think>\n\n{ANSWER}")
    ui.send("Hi!")
    block = page.locator(".msg-assistant").last.locator("details.thinking")
    expect(block.locator(".thinking-body")).to_be_visible()
    first = block.locator(".thinking-body").inner_text()
    assert first and REASONING.startswith(first) and first != REASONING
    block.locator(".thinking-summary").click()
    expect(block.locator(".thinking-body")).to_be_hidden()
    # the rest of the reasoning re-renders the reply, piece by piece; the block stays as the reader left it
    gate.release(stop=answer_piece)
    expect(block.locator(".thinking-body")).to_have_text(REASONING)
    expect(block.locator(".thinking-summary")).to_have_text("Thinking…")
    assert not is_open(block)
    # and the reader's opening it again, while it still thinks, holds too once the answer comes
    block.locator(".thinking-summary").click()
    expect(block.locator(".thinking-body")).to_be_visible()
    gate.release()
    ui.wait_replies(1)
    expect(page.locator(".msg-assistant .msg-body > p")).to_have_text(ANSWER)
    assert is_open(block)
