"""The web UI tests' shared pieces (a pytest plugin: test modules list it in `pytest_plugins`).

`server` is a real `radixserve serve` subprocess over the embedded model, started with --api-key so
every request exercises the key path; module-scoped, so each test module that uses it has its own,
stopped at the module's end. `browser` is Debian's /usr/bin/chromium driven by the playwright
package — never `playwright install`. `ui` is a fresh browser context and page per test (`make_ui` for
other settings), failing the test on any uncaught error in the page. Screenshots go to artifacts/.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, Locator, Page, ViewportSize, expect, sync_playwright

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]
API_KEY = "web-ui-test-key"
# The session owner secret of the tests' browsers (preset in localStorage) and of Server.rest, so the
# UI lists the sessions a test makes over REST.
UI_OWNER = "web-ui-test-owner-secret"
STARTUP_TIMEOUT_S = 240.0
SMALL = {"temperature": 0, "top_p": 1, "max_tokens": 12}


@dataclass
class Server:
    base: str
    proc: subprocess.Popen[bytes]

    def rest(self, method: str, path: str, body: Any = None, owner: str = UI_OWNER) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method, headers={
            "Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json", "X-Session-Owner": owner})
        with urllib.request.urlopen(req, timeout=120) as r:
            raw = r.read()
        return json.loads(raw) if raw else None

    def rest_text(self, path: str) -> str:
        req = urllib.request.Request(self.base + path, headers={"Authorization": f"Bearer {API_KEY}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.read().decode()

    def chat_turn(self, system_prompt: str, content: str) -> str:
        """A session with one finished turn, made over REST; returns its id."""
        sid = self.rest("POST", "/v1/sessions", {"system_prompt": system_prompt})["id"]
        self.rest("POST", f"/v1/sessions/{sid}/messages", {"content": content, "sampling": SMALL})
        return sid


def chip_value(chip: Locator) -> int:
    """The number a cache-figure chip carries in data-value."""
    raw = chip.get_attribute("data-value")
    assert raw is not None, "chip without data-value"
    return int(raw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(proc: subprocess.Popen[bytes], base: str, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with serving() as srv:
        yield srv


@contextmanager
def serving(*extra_args: str) -> Iterator[Server]:
    """`radixserve serve` with --api-key and `extra_args`, stopped on exit (what `server` runs)."""
    ARTIFACTS.mkdir(exist_ok=True)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = ARTIFACTS / "web_ui_server.log"
    cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--api-key", API_KEY, *extra_args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
        try:
            wait_healthy(proc, base, log_path)
            yield Server(base, proc)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium (`make test` does this)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@dataclass
class Ui:
    page: Page
    server: Server
    errors: list[str] = field(default_factory=list)

    def open(self, fragment: str = "") -> None:
        self.page.goto(self.server.base + "/" + fragment)
        expect(self.page.locator("#conn")).to_have_attribute("data-state", "open", timeout=20_000)

    def send(self, text: str) -> None:
        box = self.page.locator("#composer-input")
        box.fill(text)
        box.press("Enter")

    def wait_replies(self, n: int, timeout_ms: float = 60_000) -> None:
        self.page.wait_for_function(
            "n => [...document.querySelectorAll('.msg-assistant')].filter(m => m.querySelector('.meta-tps')).length >= n",
            arg=n, timeout=timeout_ms)

    def toast(self, text: str) -> None:
        expect(self.page.locator(".toast", has_text=text).first).to_be_visible(timeout=15_000)


@contextmanager
def make_ui(browser: Browser, server: Server, *, key: bool = True, sampling: dict[str, Any] | None = None,
            viewport: ViewportSize | None = None, owner: str | None = UI_OWNER) -> Iterator[Ui]:
    """A fresh browser context and page; fails the test on any uncaught error in the page. `owner`
    presets the owner secret in localStorage (None: the page makes its own)."""
    ctx = browser.new_context(viewport=viewport or ViewportSize(width=1280, height=800))
    init = {"radixserve.sampling": json.dumps(sampling or SMALL)}
    if owner is not None:
        init["radixserve.owner"] = owner
    script = "".join(f"localStorage.setItem({json.dumps(k)}, {json.dumps(v)});" for k, v in init.items())
    if key:
        script += f"sessionStorage.setItem('radixserve.apiKey', {json.dumps(API_KEY)});"
    ctx.add_init_script(script)
    page = ctx.new_page()
    page.set_default_timeout(30_000)
    ui = Ui(page, server)
    page.on("pageerror", lambda e: ui.errors.append(str(e)))
    try:
        yield ui
        assert ui.errors == [], f"uncaught errors in the page: {ui.errors}"
    finally:
        ctx.close()


@pytest.fixture
def ui(browser: Browser, server: Server) -> Iterator[Ui]:
    with make_ui(browser, server) as page_ui:
        yield page_ui
