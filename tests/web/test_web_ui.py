"""End-to-end tests of the web UI (web/) in headless Chromium against a real `radixserve serve`.

One server (embedded model, started with --api-key so every request exercises the key path) and one
browser serve the whole module; each test opens its own browser context (fixtures: web_testkit.py).
Chromium is Debian's /usr/bin/chromium driven by the playwright package — never `playwright install`. Generations use
temperature 0 and a handful of tokens (the model runs on CPU); only the stop test asks for more.
Screenshots of the chat and the dashboard are written to artifacts/.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import pytest
from cluster_stats_sample import TWO_REPLICAS, prompt_row
from playwright.sync_api import Browser, Locator, Page, ViewportSize, WebSocketRoute, expect

pytest.register_assert_rewrite("web_testkit")
from web_testkit import API_KEY, ARTIFACTS, Server, Ui, chip_value, make_ui  # noqa: E402

pytest_plugins = ["web_testkit"]

pytestmark = pytest.mark.slow

# Records the text of the streaming reply at every DOM change, to prove it arrives in pieces.
WATCH_STREAM = """() => {
  window.__partials = [];
  new MutationObserver(() => {
    const m = document.querySelector('.msg-assistant[aria-busy="true"] .msg-body');
    if (m && !m.querySelector('.msg-pending') && m.textContent.trim()) window.__partials.push(m.textContent.length);
  }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
}"""


def test_chat_streams_second_turn_hits_cache(ui: Ui) -> None:
    page = ui.page
    ui.open()
    page.locator("#system-prompt").fill("You are a helpful assistant. Answer briefly.")
    box = page.locator("#composer-input")
    box.fill("Name a fruit.")
    box.press("Shift+Enter")  # a newline, not a send
    box.type("One word.")
    assert box.input_value() == "Name a fruit.\nOne word."
    expect(page.locator(".msg")).to_have_count(0)
    box.press("Enter")
    expect(page.locator(".msg-user .msg-body")).to_have_text("Name a fruit.\nOne word.")
    expect(page.locator("#stop-btn")).to_be_visible()
    ui.wait_replies(1)
    first = page.locator(".msg-assistant").first
    assert first.locator(".msg-body").inner_text().strip()
    assert chip_value(first.locator(".meta-prompt")) > 0
    for chip in (".meta-cached", ".meta-ttft", ".meta-tps"):
        expect(first.locator(chip)).to_be_visible()

    ui.send("And a vegetable?")
    ui.wait_replies(2)
    second = page.locator(".msg-assistant").nth(1)
    cached = chip_value(second.locator(".meta-cached"))
    prompt = chip_value(second.locator(".meta-prompt"))
    assert 0 < cached < prompt, "the second turn should reuse the first turn's cached prefix"
    expect(second.locator(".meta-cached .chip-value")).to_contain_text("%")
    expect(page.locator("#send-btn")).to_be_visible()
    expect(page.locator(".session-item.active .session-title")).to_have_text("Name a fruit.\nOne word.")
    page.screenshot(path=str(ARTIFACTS / "chat.png"))
    sid = page.locator(".session-item.active").get_attribute("data-session-id")
    assert ui.server.rest("GET", f"/v1/sessions/{sid}")["system_prompt"] == "You are a helpful assistant. Answer briefly."

    # A saved chat's system prompt is fixed; editing it offers a new chat that starts from the edit.
    apply = page.locator("#apply-system")
    expect(apply).to_be_hidden()
    page.locator("#system-prompt").fill("You are a pirate.")
    apply.click()
    expect(page.locator(".msg")).to_have_count(0)
    expect(page.locator(".session-item.active.draft")).to_be_visible()
    expect(page.locator("#system-prompt")).to_have_value("You are a pirate.")


def test_stop_generation(browser: Browser, server: Server) -> None:
    with make_ui(browser, server, sampling={"temperature": 0, "top_p": 1, "max_tokens": 400}) as ui:
        ui.open()
        # Stopped once with the Stop button, once with Escape in the message box.
        for n, stop in enumerate([lambda: ui.page.locator("#stop-btn").click(),
                                  lambda: ui.page.locator("#composer-input").press("Escape")]):
            ui.page.evaluate(WATCH_STREAM)
            ui.send("Write a very long story about a dragon who learns to cook. Use many paragraphs.")
            reply = ui.page.locator(".msg-assistant").nth(n)
            expect(reply.locator(".msg-body")).not_to_have_text("Waiting for the server…", timeout=60_000)
            expect(reply.locator(".msg-body")).not_to_have_text("Thinking…", timeout=60_000)
            # the reply shows in pieces as it streams (a long one: a short reply's tokens can reach the page in
            # one network read, and render once)
            ui.page.wait_for_function("new Set(window.__partials).size >= 2", timeout=60_000)
            stop()
            expect(reply.locator(".chip-finish")).to_have_attribute("data-value", "abort", timeout=20_000)
            completion = chip_value(reply.locator(".meta-completion"))
            assert 0 < completion < 400
            expect(ui.page.locator("#send-btn")).to_be_visible()


def test_fork_and_delete(ui: Ui) -> None:
    parent = ui.server.chat_turn("You are a terse assistant.", "Name a color.")
    page = ui.page
    ui.open()
    page.locator(f'.session-item[data-session-id="{parent}"] .session-open').click()
    expect(page.locator(".msg")).to_have_count(2)
    page.locator(".msg-assistant .act-fork").click()
    ui.toast("Forked at message 2")
    active = page.locator(".session-item.active")
    expect(active).not_to_have_attribute("data-session-id", parent)
    child = active.get_attribute("data-session-id")
    assert child and len(ui.server.rest("GET", f"/v1/sessions/{child}")["messages"]) == 2
    ui.send("Another one?")
    ui.wait_replies(2)
    reply = page.locator(".msg-assistant").nth(1)
    assert chip_value(reply.locator(".meta-cached")) > 0, "a fork shares the parent's prefix"
    assert len(ui.server.rest("GET", f"/v1/sessions/{parent}")["messages"]) == 2, "the parent is unchanged"

    page.locator(".msg-user .act-edit").first.click()  # fork before the first message, text to edit
    expect(page.locator("#composer-input")).to_have_value("Name a color.")
    expect(page.locator(".msg")).to_have_count(0)
    edit_fork = page.locator(".session-item.active").get_attribute("data-session-id")
    delete = page.locator(".session-item.active .session-delete")
    delete.click()
    expect(delete).to_have_text("Delete?")
    delete.click()
    ui.toast("Chat deleted.")
    ids = {s["id"] for s in ui.server.rest("GET", "/v1/sessions")["sessions"]}
    assert edit_fork not in ids and parent in ids and child in ids


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
                   "required": ["city"], "additionalProperties": False}}}


def test_tool_call_is_shown_and_answered(ui: Ui) -> None:
    """A reply's tool call shows its name and pretty arguments; typing a result answers it (a tool
    message, pretty-printed) and the next reply streams; a JSON reply is shown pretty in a code block."""
    server = ui.server
    sid = server.rest("POST", "/v1/sessions", {"system_prompt": "You can call tools.", "tools": [WEATHER_TOOL]})["id"]
    first = server.rest("POST", f"/v1/sessions/{sid}/messages", {
        "content": "Weather in Paris?", "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False, "sampling": {"temperature": 0, "max_tokens": 60}})
    call = first["message"]["tool_calls"][0]
    page = ui.page
    ui.open()
    page.locator(f'.session-item[data-session-id="{sid}"] .session-open').click()
    card = page.locator(".tool-call")
    expect(card).to_have_count(1)
    expect(card.locator(".tool-call-name")).to_have_text("get_weather")
    expect(card.locator(".code-lang")).to_have_text("json")
    pretty = json.dumps(json.loads(call["function"]["arguments"]), indent=2)
    assert card.locator("pre code").text_content() == pretty
    expect(page.locator("#tools")).to_have_js_property("readOnly", True)  # a chat's tools are fixed
    card.locator(".tool-result-input").fill('{"temp_c": 21, "sky": "clear"}')
    page.locator(".act-tool-result").click()
    expect(page.locator(".msg-tool")).to_have_count(1)
    assert page.locator(".msg-tool pre code").text_content() == json.dumps({"temp_c": 21, "sky": "clear"}, indent=2)
    ui.wait_replies(2)
    expect(page.locator(".tool-call .tool-call-state")).to_have_text("answered")
    page.screenshot(path=str(ARTIFACTS / "web_ui_tool_call.png"))
    messages = server.rest("GET", f"/v1/sessions/{sid}")["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert messages[2]["tool_call_id"] == call["id"]

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    other = server.rest("POST", "/v1/sessions", {})["id"]
    server.rest("POST", f"/v1/sessions/{other}/messages", {
        "content": "Is the sky blue? Answer in JSON.", "sampling": {"temperature": 0, "max_tokens": 30},
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}})
    ui.open()
    page.locator(f'.session-item[data-session-id="{other}"] .session-open').click()
    # the switch has rendered only once this chat's own question is on the page (not the last chat's)
    expect(page.locator(".msg-user .msg-body")).to_have_text("Is the sky blue? Answer in JSON.")
    expect(page.locator(".tool-call")).to_have_count(0)
    reply = page.locator(".msg-assistant .msg-body").first
    expect(reply.locator(".code-lang")).to_have_text("json")
    shown = json.loads(reply.locator("pre code").text_content() or "")
    assert set(shown) == {"ok"} and "\n" in (reply.locator("pre code").text_content() or "")


def test_chats_belong_to_the_browser_that_made_them(browser: Browser, server: Server) -> None:
    """The page makes its own owner secret, keeps it in localStorage across a reload, and sees only
    its own chats; another browser (another secret) sees none of them."""
    server.chat_turn("You belong to someone else.", "Private question.")  # another client's chat: never listed here
    with make_ui(browser, server, owner=None) as ui:
        page = ui.page
        ui.open()
        ui.send("Name a planet.")
        ui.wait_replies(1)
        mine = page.locator(".session-item.active").get_attribute("data-session-id")
        secret = page.evaluate("localStorage.getItem('radixserve.owner')")
        assert mine and re.fullmatch(r"[A-Za-z0-9_-]{43}", secret or ""), secret
        assert [s["id"] for s in server.rest("GET", "/v1/sessions", owner=secret)["sessions"]] == [mine]
        assert mine not in {s["id"] for s in server.rest("GET", "/v1/sessions")["sessions"]}
        page.reload()
        expect(page.locator("#conn")).to_have_attribute("data-state", "open", timeout=20_000)
        expect(page.locator(".session-item.active")).to_have_attribute("data-session-id", mine)
        expect(page.locator(".msg-assistant")).to_have_count(1)
        assert page.evaluate("localStorage.getItem('radixserve.owner')") == secret
        expect(page.locator(".session-item:not(.draft)")).to_have_count(1)  # the list is loaded: not theirs
    with make_ui(browser, server, owner=None) as other:
        other.open()
        listed = other.page.evaluate("async () => (await import('/js/api.js')).api.listSessions()")
        assert listed == []  # the page's own client, with its own secret
        expect(other.page.locator(".session-item:not(.draft)")).to_have_count(0)


# Pixels of a chart's canvas in the colour of any of its series (its legend swatches).
COUNT_SERIES_PIXELS = """sel => {
  const fig = document.querySelector(sel);
  const colors = [...fig.querySelectorAll('.legend-item i')]
    .map(i => getComputedStyle(i).backgroundColor.match(/\\d+/g).map(Number));
  const c = fig.querySelector('canvas');
  const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
  let n = 0;
  for (let i = 0; i < d.length; i += 4) {
    if (d[i + 3] > 200 && colors.some(([r, g, b]) =>
        Math.abs(d[i] - r) < 24 && Math.abs(d[i + 1] - g) < 24 && Math.abs(d[i + 2] - b) < 24)) n++;
  }
  return n;
}"""


def histogram_quantile(metrics: str, name: str, q: float) -> float:
    """histogram_quantile over a histogram's buckets, written independently of the UI's JavaScript."""
    bucket = re.compile(rf'^{name}_bucket\{{le="([^"]+)"\}} (\S+)$', re.MULTILINE)
    buckets = sorted((float(m.group(1)), float(m.group(2))) for m in bucket.finditer(metrics))
    rank, prev_le, prev_count = q * buckets[-1][1], 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            return prev_le if le == float("inf") else prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    raise AssertionError(f"no {name} observations")


def shown_seconds(value: float) -> str:
    # as web/js/ui.js fmtMs: Math.round rounds halves up, where Python's round() rounds them to even
    ms = value * 1000
    return f"{ms / 1000:.2f} s" if ms >= 1000 else f"{math.floor(ms + 0.5)} ms"


def metric_value(metrics: str, sample: str) -> float:
    m = re.search(rf"^{sample} (\S+)$", metrics, re.MULTILINE)
    assert m is not None, f"{sample} missing from /metrics"
    return float(m.group(1))


def test_dashboard_charts_have_data(ui: Ui) -> None:
    ui.server.chat_turn("You are a dashboard test assistant.", "Say hi.")
    page = ui.page
    ui.open("#dashboard")
    for chart in ("#chart-hit-rate", "#chart-blocks", "#chart-requests", "#chart-throughput"):
        page.wait_for_function("sel => Number(document.querySelector(sel).dataset.points) >= 4", arg=chart)
        assert page.evaluate(COUNT_SERIES_PIXELS, chart) > 50, f"{chart} drew no line for its data"
    stats = ui.server.rest("GET", "/v1/cache/stats")
    hit = page.locator(".stat-card", has_text="Hit rate").locator(".stat-value")
    expect(hit).to_have_text(f"{stats['hit_rate'] * 100:.1f}%")
    total = page.locator(".stat-card", has_text="KV blocks used").locator(".stat-value")
    expect(total).to_contain_text(f"/ {stats['blocks']['total']:,}")
    expect(page.locator("#sp-table tbody tr", has_text="You are a dashboard test assistant.")).to_have_count(1)
    metrics = ui.server.rest_text("/metrics")
    p50 = histogram_quantile(metrics, "radixserve_time_to_first_token_seconds", 0.5)
    expect(page.locator(".stat-card", has_text="TTFT median").locator(".stat-value")).to_have_text(shown_seconds(p50))
    # the engine's per-step observations (a step observer feeds these histograms)
    step = page.locator(".stat-card", has_text="Engine step")
    expect(step.locator(".stat-value")).to_have_text(
        shown_seconds(histogram_quantile(metrics, "radixserve_step_seconds", 0.5)))
    per_step = metric_value(metrics, "radixserve_step_tokens_sum") / metric_value(metrics, "radixserve_step_tokens_count")
    expect(step.locator(".stat-sub")).to_contain_text(f"{round(per_step):,} tokens/step")
    expect(page.locator("#chart-hit-rate canvas")).to_have_attribute("aria-label", re.compile(r"overall \d+%"))
    expect(page.locator(".metrics-details summary")).to_contain_text("families from /metrics")
    page.set_viewport_size(ViewportSize(width=1280, height=1180))
    page.screenshot(path=str(ARTIFACTS / "dashboard.png"))


# A host tier as /v1/cache/stats reports it (docs/protocol.md), every figure distinct.
HOST_ON = {"enabled": True, "blocks": {"total": 1000, "free": 250, "used": 750}, "nodes": 12, "tokens": 3456,
           "hit_tokens": 900, "write_back": {"blocks": 800, "bytes": 3 * 2**20, "seconds": 0.25},
           "load_back": {"blocks": 400, "bytes": 3 * 2**19, "seconds": 0.5}, "dropped_blocks": 17}


def test_dashboard_host_tier_panel(ui: Ui) -> None:
    """Off on this server (no --host-cache-mb): the panel says so. With a host tier (the server's own
    reply, its `host` object replaced) it shows the pool as a bar and the traffic; a reply without
    `host` (an older server) hides it."""
    page = ui.page
    ui.open("#dashboard")
    panel = page.locator("#host-panel")
    expect(panel).to_be_visible()
    assert ui.server.rest("GET", "/v1/cache/stats")["host"]["enabled"] is False
    expect(panel).to_have_attribute("data-enabled", "false")
    expect(page.locator("#host-state")).to_have_text("off")
    expect(panel.locator(".host-off")).to_contain_text("--host-cache-mb")
    expect(panel.locator(".host-bar")).to_have_count(0)

    reply: dict[str, Any] = {"host": HOST_ON, "swaps": {"out": 7, "in": 5}, "cached_tokens": 1200}

    def patched(route: Any) -> None:
        body = json.loads(route.fetch().text())
        body.update(reply)
        if reply.get("host") is None:
            del body["host"]
        route.fulfill(json=body)

    page.route("**/v1/cache/stats", patched)
    expect(panel).to_have_attribute("data-enabled", "true")  # the next poll
    expect(page.locator("#host-state")).to_have_text("on")
    bar = panel.locator(".host-bar")
    expect(bar).to_have_attribute("aria-valuenow", "750")
    expect(bar).to_have_attribute("aria-valuemax", "1000")
    assert bar.locator(".bar-fill").evaluate("e => e.style.width") == "75%"
    expect(panel.locator(".host-blocks-used")).to_have_text("750 / 1,000 blocks used")
    expect(panel.locator(".host-blocks-free")).to_have_text("250 free")

    def card(key: str) -> Locator:
        return panel.locator(f'.stat-card[data-key="{key}"]')

    expect(card("hit_tokens").locator(".stat-value")).to_have_text("900")
    expect(card("hit_tokens").locator(".stat-sub")).to_contain_text("75.0% of cached tokens")
    expect(card("held").locator(".stat-value")).to_have_text("3,456 tokens")
    expect(card("held").locator(".stat-sub")).to_have_text("12 radix-tree nodes")
    expect(card("write_back").locator(".stat-value")).to_have_text("3.00 MiB")
    expect(card("write_back").locator(".stat-sub")).to_have_text("800 blocks · 250 ms · 12.0 MiB/s")
    expect(card("load_back").locator(".stat-value")).to_have_text("1.50 MiB")
    expect(card("load_back").locator(".stat-sub")).to_have_text("400 blocks · 500 ms · 3.00 MiB/s")
    expect(card("swaps").locator(".stat-value")).to_have_text("7 out · 5 in")
    expect(card("swaps").locator(".stat-sub")).to_contain_text("preemptions")
    expect(card("dropped").locator(".stat-value")).to_have_text("17 blocks")
    panel.scroll_into_view_if_needed()
    page.screenshot(path=str(ARTIFACTS / "dashboard_host_tier.png"), full_page=True)
    page.set_viewport_size(ViewportSize(width=390, height=800))
    assert page.evaluate("document.querySelector('#view-dashboard').scrollWidth <= window.innerWidth"), \
        "the host panel overflows a phone-width screen"

    reply["host"] = None
    expect(panel).to_be_hidden()


def serve_cluster_stats(page: Page, cluster: dict[str, Any]) -> None:
    """Answer GET /v1/cache/stats with the server's real (single-process) reply plus `cluster`."""
    def patched(route: Any) -> None:
        body = json.loads(route.fetch().text())
        assert "replicas" not in body and "routing" not in body, "the test server is single-process"
        body.update(cluster)
        route.fulfill(json=body)

    page.route("**/v1/cache/stats", patched)


def test_dashboard_replicas_panel_single_process(ui: Ui) -> None:
    """The test server is one process: its stats have no `replicas`, and the panel says so."""
    page = ui.page
    ui.open("#dashboard")
    panel = page.locator("#replicas-panel")
    expect(panel).to_be_visible()
    stats = ui.server.rest("GET", "/v1/cache/stats")
    assert "replicas" not in stats and "routing" not in stats
    expect(panel).to_have_attribute("data-mode", "single")
    expect(page.locator("#replicas-state")).to_have_text("single process")
    expect(panel.locator(".replicas-single")).to_contain_text("Single process: one engine serves every request.")
    expect(panel.locator(".replicas-single code")).to_have_text("--replicas N")
    expect(panel.locator(".replica-card")).to_have_count(0)
    expect(panel.locator(".routing-line")).to_have_count(0)


def test_dashboard_replicas_panel_shows_each_replica(ui: Ui) -> None:
    """With the ingress's `replicas` and `routing` in the stats (the server's own reply, extended):
    a card per replica with its figures, and the router's decisions; back to single process after."""
    page = ui.page
    serve_cluster_stats(page, TWO_REPLICAS)
    ui.open("#dashboard")
    panel = page.locator("#replicas-panel")
    expect(panel).to_have_attribute("data-mode", "replicas")
    expect(page.locator("#replicas-state")).to_have_text("2 replicas")
    expect(panel.locator(".replicas-single")).to_have_count(0)
    expect(panel.locator(".routing-name")).to_have_text("cache-aware")
    decisions = panel.locator(".routing-decision")
    expect(decisions).to_have_count(len(TWO_REPLICAS["routing"]["decisions"]))
    for reason, count in TWO_REPLICAS["routing"]["decisions"].items():
        decision = panel.locator(f'.routing-decision[data-reason="{reason}"]')
        expect(decision.locator(".routing-reason")).to_have_text(reason)
        expect(decision.locator(".routing-count")).to_have_text(str(count))
    # the merged figures above the panel still come from the server's own reply
    hit = page.locator("#stat-cards .stat-card", has_text="Hit rate").locator(".stat-value")
    expect(hit).to_have_text(re.compile(r"^\d+\.\d%$"))

    cards = panel.locator(".replica-card")
    expect(cards).to_have_count(2)
    a, b = cards.nth(0), cards.nth(1)
    expect(a).to_have_attribute("data-replica", "px365mzo")
    expect(b).to_have_attribute("data-replica", "q8k2ztw1")
    expect(a.locator(".replica-id")).to_have_text("px365mzo")
    expect(b.locator(".replica-id")).to_have_text("q8k2ztw1")
    expect(a.locator(".replica-hit-value")).to_have_text("71.0%")
    expect(b.locator(".replica-hit-value")).to_have_text("12.5%")
    expect(a.locator(".replica-tokens")).to_have_text("393 of 552 prompt tokens cached · 4 requests")
    expect(b.locator(".replica-tokens")).to_have_text("200 of 1,600 prompt tokens cached · 9 requests")
    expect(a.locator(".replica-blocks-label")).to_have_text("0 used · 12 cached · 52 free of 64 blocks")
    expect(b.locator(".replica-blocks-label")).to_have_text("32 used · 16 cached · 16 free of 64 blocks")
    expect(b.locator(".replica-bar")).to_have_attribute("aria-label", "KV blocks: 32 used · 16 cached · 16 free of 64 blocks")
    widths = [[seg.evaluate("e => e.style.width") for seg in (card.locator(".replica-seg-used"), card.locator(".replica-seg-cached"))]
              for card in (a, b)]
    assert widths == [["0%", "18.75%"], ["50%", "25%"]]

    def fact(card: Locator, key: str) -> Locator:
        return card.locator(f'.replica-fact[data-key="{key}"] .replica-fact-value')

    expect(fact(a, "load")).to_have_text("0 / 0")
    expect(fact(b, "load")).to_have_text("2 / 3")
    expect(fact(a, "routed")).to_have_text("4 / 0")
    expect(fact(b, "routed")).to_have_text("11 / 5")
    expect(fact(a, "router_view")).to_have_text("4 prefixes · 159 tokens")
    expect(fact(b, "router_view")).to_have_text("7 prefixes · 2,048 tokens · 1 resync")

    # top system prompts per replica, most requests first, two at most
    expect(a.locator(".replica-prompt")).to_have_count(1)
    expect(a.locator(".replica-prompt-preview")).to_have_text("You are a helpful assistant.")
    expect(a.locator(".replica-prompt-rate")).to_have_text("75%")
    expect(a.locator(".replica-prompt-hits")).to_have_text("3 / 4 hit")
    expect(b.locator(".replica-prompt-preview")).to_have_text(["You are a pirate.", "You are a poet."])
    expect(b.locator(".replica-prompt-rate")).to_have_text(["80%", "50%"])
    expect(b.locator(".replica-prompt-hits")).to_have_text(["5 / 6 hit", "1 / 2 hit"])

    panel.scroll_into_view_if_needed()
    page.screenshot(path=str(ARTIFACTS / "dashboard_replicas.png"), full_page=True)
    page.set_viewport_size(ViewportSize(width=390, height=800))
    assert page.evaluate("document.querySelector('#view-dashboard').scrollWidth <= window.innerWidth"), \
        "the replicas panel overflows a phone-width screen"

    page.unroute("**/v1/cache/stats")
    expect(panel).to_have_attribute("data-mode", "single")  # the next poll: a single-process reply
    expect(page.locator("#replicas-state")).to_have_text("single process")
    expect(panel.locator(".replica-card")).to_have_count(0)


def test_dashboard_replicas_panel_shows_user_text_as_text(ui: Ui) -> None:
    """System prompt previews are user text (and a replica id or router name is not trusted either):
    markup in them is shown as text, never parsed."""
    page = ui.page
    evil = '<img src=x onerror="window.__pwned=1">'
    cluster = json.loads(json.dumps(TWO_REPLICAS))
    cluster["replicas"][0]["replica"] = "<b>r0</b>"
    cluster["replicas"][0]["system_prompts"] = [prompt_row("e1", f"Hi {evil} there", 3, 2, 2 / 3)]
    cluster["routing"]["router"] = "<i>cache-aware</i>"
    serve_cluster_stats(page, cluster)
    ui.open("#dashboard")
    panel = page.locator("#replicas-panel")
    card = panel.locator(".replica-card").first
    preview = card.locator(".replica-prompt-preview")
    expect(preview).to_have_text(f"Hi {evil} there")
    expect(preview).to_have_attribute("title", f"Hi {evil} there")
    expect(card.locator(".replica-prompt-rate")).to_have_text("67%")
    expect(card.locator(".replica-id")).to_have_text("<b>r0</b>")
    expect(panel.locator(".routing-name")).to_have_text("<i>cache-aware</i>")
    assert panel.locator("img, b, i").count() == 0
    page.wait_for_timeout(300)  # an injected image would have failed to load and run its handler by now
    assert page.evaluate("window.__pwned") is None


def test_reply_loaded_from_the_host_tier_shows_a_chip(ui: Ui) -> None:
    """A turn whose usage says some cached tokens came from the host tier shows them (frames from the
    server with host_cached_tokens set, as a server with a host tier sends them)."""
    def from_host(ws: WebSocketRoute) -> None:
        server = ws.connect_to_server()

        def forward(message: str | bytes) -> None:
            frame = json.loads(message)
            if frame.get("type") == "start":
                frame["host_cached_tokens"] = frame["cached_tokens"] = frame["prompt_tokens"] - 1
            if frame.get("type") == "done":
                u = frame["usage"]
                u["host_cached_tokens"] = u["cached_tokens"] = u["prompt_tokens"] - 1
            ws.send(json.dumps(frame))

        server.on_message(forward)

    ui.page.route_web_socket("**/v1/chat/ws*", from_host)
    ui.open()
    ui.send("Say hi.")
    ui.wait_replies(1)
    reply = ui.page.locator(".msg-assistant").last
    chip = reply.locator(".meta-host")
    expect(chip).to_be_visible()
    assert chip_value(chip) == chip_value(reply.locator(".meta-prompt")) - 1 > 0
    expect(chip.locator(".chip-value")).to_have_text(f"{chip_value(chip):,} tok")


def test_reply_without_host_hits_has_no_host_chip(ui: Ui) -> None:
    ui.open()
    ui.send("Name a color.")
    ui.wait_replies(1)
    expect(ui.page.locator(".msg-assistant .meta-cached")).to_have_count(1)
    expect(ui.page.locator(".msg-assistant .meta-host")).to_have_count(0)


def test_malformed_replies_and_server_errors_are_shown(ui: Ui) -> None:
    page = ui.page
    page.route("**/v1/cache/stats", lambda route: route.fulfill(status=200, body="<html>not json</html>"))

    def inject_bad_frame(ws: WebSocketRoute) -> None:
        ws.connect_to_server()
        ws.send("{this is not json")

    page.route_web_socket("**/v1/chat/ws*", inject_bad_frame)
    ui.open("#dashboard")
    expect(page.locator("#dash-status")).to_contain_text("malformed reply (not JSON)")
    ui.toast("Dashboard: GET /v1/cache/stats: the server sent a malformed reply")
    ui.toast("malformed frame (not JSON)")

    page.unroute("**/v1/cache/stats")
    page.route("**/metrics", lambda route: route.fulfill(status=200, body="radixserve_ok 1\nthis line is { bad\n"))
    expect(page.locator("#dash-status")).to_contain_text("/metrics line 2")

    page.locator("#tab-chat").click()
    ui.send("hello " * 10_000)  # longer than the model's context: the server refuses the turn
    expect(page.locator(".msg-assistant .msg-error")).to_contain_text("context_too_long", timeout=30_000)
    expect(page.locator(".msg-user")).to_have_count(1)  # the refused message stays visible
    expect(page.locator("#send-btn")).to_be_visible()

    gone = ui.server.rest("POST", "/v1/sessions", {})["id"]
    page.evaluate("id => localStorage.setItem('radixserve.currentSession', id)", gone)
    page.reload()
    expect(page.locator(".session-item.active")).to_have_attribute("data-session-id", gone)
    ui.server.rest("DELETE", f"/v1/sessions/{gone}")
    ui.send("Are you there?")
    expect(page.locator(".msg-assistant .msg-error")).to_contain_text("unknown_session")
    expect(page.locator(f'.session-item[data-session-id="{gone}"]')).to_have_count(0)


def test_reconnects_after_drop(ui: Ui) -> None:
    connections: list[WebSocketRoute] = []

    def track(ws: WebSocketRoute) -> None:
        ws.connect_to_server()
        connections.append(ws)

    ui.page.route_web_socket("**/v1/chat/ws*", track)
    ui.open()
    connections[0].close(code=1011, reason="test drop")
    conn = ui.page.locator("#conn")
    expect(conn).to_have_attribute("data-state", "reconnecting")
    expect(ui.page.locator("#conn-text")).to_contain_text(re.compile("Disconnected|Reconnecting"))
    expect(conn).to_have_attribute("data-state", "open", timeout=15_000)
    assert len(connections) == 2
    ui.send("Hi after reconnect")
    ui.wait_replies(1)


def test_api_key_prompt(browser: Browser, server: Server) -> None:
    with make_ui(browser, server, key=False) as ui:
        page = ui.page
        page.goto(server.base + "/")
        dialog = page.locator("#auth-dialog")
        expect(dialog).to_be_visible()
        page.locator("#auth-key").fill("wrong-key")
        page.locator("#auth-key").press("Enter")
        expect(dialog).to_be_visible()
        expect(page.locator("#auth-reason")).to_contain_text("rejected")
        page.locator("#auth-key").fill(API_KEY)
        page.locator("#auth-key").press("Enter")
        expect(dialog).to_be_hidden()
        expect(page.locator("#conn")).to_have_attribute("data-state", "open", timeout=20_000)
        expect(page.locator(".session-item").first).to_be_visible()


def test_phone_width_and_keyboard(browser: Browser, server: Server) -> None:
    with make_ui(browser, server, viewport=ViewportSize(width=390, height=800)) as ui:
        page = ui.page
        ui.open()
        sidebar = page.locator("#sidebar")
        expect(sidebar).not_to_be_in_viewport()
        page.locator("#menu-btn").click()
        expect(sidebar).to_be_in_viewport()
        expect(page.locator("#menu-btn")).to_have_attribute("aria-expanded", "true")
        page.keyboard.press("Escape")
        expect(sidebar).not_to_be_in_viewport()
        page.locator("#tab-chat").focus()
        page.keyboard.press("ArrowRight")
        expect(page.locator("#tab-dashboard")).to_be_focused()
        expect(page.locator("#view-dashboard")).to_be_visible()
        box = page.evaluate("document.querySelector('#view-dashboard').scrollWidth <= window.innerWidth")
        assert box, "the dashboard overflows a phone-width screen"


def test_markdown_is_safe_and_prometheus_parses(ui: Ui) -> None:
    ui.page.goto(ui.server.base + "/")
    out = ui.page.evaluate("""async () => {
      const md = await import('/js/markdown.js');
      const prom = await import('/js/prometheus.js');
      const host = document.createElement('div');
      host.append(md.renderMarkdown('Hi <img src=x onerror="window.__pwned=1"> **b** `c<d>`\\n\\n```py\\nx = "<b>"\\n```'));
      const fams = prom.parsePrometheus('# TYPE req counter\\nreq_total{code="a\\\\"b",x="1"} 3\\nreq_created 5\\ng 2.5e1\\n');
      const hist = prom.parsePrometheus('# TYPE t histogram\\nt_bucket{le="0.1"} 2\\nt_bucket{le="0.5"} 6\\nt_bucket{le="+Inf"} 8\\nt_count 8\\n');
      const quantiles = [0.25, 0.5, 0.95].map(q => prom.histogramQuantile(hist, 't', q));
      let err = '';
      try { prom.parsePrometheus('ok 1\\nbad{ 2\\n'); } catch (e) { err = e.message; }
      return {imgs: host.querySelectorAll('img').length, text: host.textContent,
              code: host.querySelector('pre code').textContent, lang: host.querySelector('.code-lang').textContent,
              strong: host.querySelector('strong').textContent, pwned: window.__pwned === 1,
              req: fams.get('req').samples.map(s => [s.name, s.labels.code, s.value]), g: prom.sampleSum(fams, 'g'),
              err, quantiles};
    }""")
    assert out["imgs"] == 0 and not out["pwned"] and '<img src=x onerror="window.__pwned=1">' in out["text"]
    assert out["code"] == 'x = "<b>"' and out["lang"] == "py" and out["strong"] == "b"
    assert out["req"] == [["req_total", 'a"b', 3], ["req_created", None, 5]]
    assert out["g"] == 25 and "line 2" in out["err"]
    assert out["quantiles"] == pytest.approx([0.1, 0.3, 0.5])
