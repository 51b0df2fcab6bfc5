"""Speculative decoding in the web UI (web/), in headless Chromium against a real `radixserve serve`
(fixtures: web_testkit.py): a reply's stats line marks how many of its tokens were accepted drafts
and from which sources (the `done` frame's usage.speculation), and the dashboard's speculation panel
shows tokens per step and the acceptance of each draft source (/v1/cache/stats `speculation`)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from playwright.sync_api import Locator, WebSocketRoute, expect

from radixserve.core import DRAFT_SOURCES

pytest.register_assert_rewrite("web_testkit")
from web_testkit import ARTIFACTS, Ui, chip_value  # noqa: E402

pytest_plugins = ["web_testkit"]
pytestmark = pytest.mark.slow

# what a `done` frame's usage.speculation says for an 80-token reply (docs/protocol.md), every figure distinct
DRAFTED = {"proposed": 45, "accepted": 32, "verify_steps": 9, "by_source": {
    "tree": {"proposed": 30, "accepted": 28}, "prediction": {"proposed": 0, "accepted": 0},
    "lookup": {"proposed": 15, "accepted": 4}}}


def rewrite_done(ui: Ui, usage: dict[str, Any]) -> None:
    """The server's WebSocket frames, the `done` frames' usage updated with `usage`."""
    def route(ws: WebSocketRoute) -> None:
        server = ws.connect_to_server()

        def forward(message: str | bytes) -> None:
            frame = json.loads(message)
            if frame.get("type") == "done":
                frame["usage"].update(usage)
            ws.send(json.dumps(frame))

        server.on_message(forward)

    ui.page.route_web_socket("**/v1/chat/ws*", route)


def test_reply_marks_its_accepted_drafts(ui: Ui) -> None:
    rewrite_done(ui, {"completion_tokens": 80, "speculation": DRAFTED})
    ui.open()
    ui.send("Say hi.")
    ui.wait_replies(1)
    chip = ui.page.locator(".msg-assistant").last.locator(".meta-drafted")
    expect(chip.locator(".chip-value")).to_have_text("32 of 80 tok (tree, lookup)")  # most accepted first
    assert chip_value(chip) == 32 and chip.get_attribute("data-sources") == "tree,lookup"
    expect(chip).to_have_class(re.compile(r"\bchip-hit\b"))
    title = chip.get_attribute("title") or ""
    assert "tree: 28 of 30" in title and "lookup: 4 of 15" in title and "prediction: 0 of 0" in title


def test_reply_whose_drafts_were_all_rejected_says_so(ui: Ui) -> None:
    none_kept = {**DRAFTED, "accepted": 0, "by_source": {s: {"proposed": 5, "accepted": 0} for s in DRAFT_SOURCES}}
    rewrite_done(ui, {"completion_tokens": 12, "speculation": none_kept})
    ui.open()
    ui.send("Name a color.")
    ui.wait_replies(1)
    chip = ui.page.locator(".msg-assistant").last.locator(".meta-drafted")
    expect(chip.locator(".chip-value")).to_have_text("0 of 12 tok")
    expect(chip).not_to_have_class(re.compile(r"\bchip-hit\b"))


def test_reply_without_drafts_has_no_mark(ui: Ui) -> None:
    zero = {"proposed": 0, "accepted": 0, "verify_steps": 0,
            "by_source": {s: {"proposed": 0, "accepted": 0} for s in DRAFT_SOURCES}}
    rewrite_done(ui, {"speculation": zero})
    ui.open()
    ui.send("Name a shape.")
    ui.wait_replies(1)
    reply = ui.page.locator(".msg-assistant").last
    expect(reply.locator(".meta-completion")).to_be_visible()
    expect(reply.locator(".meta-drafted")).to_have_count(0)


def test_a_real_reply_shows_what_the_server_counted(ui: Ui) -> None:
    """A reply the radix tree could draft (the same greedy turn was answered before, over REST): the
    chip shows exactly the accepted drafts the server's session keeps for it, also after a reload."""
    system, question = "You are a speculation test assistant.", "Count from one to five."
    ui.server.chat_turn(system, question)
    page = ui.page
    ui.open()
    page.locator("#system-prompt").fill(system)
    ui.send(question)
    ui.wait_replies(1)
    sid = page.locator(".session-item.active").get_attribute("data-session-id")
    usage = ui.server.rest("GET", f"/v1/sessions/{sid}")["messages"][-1]["usage"]
    spec = usage["speculation"]
    assert list(spec["by_source"]) == list(DRAFT_SOURCES)
    assert spec["proposed"] > 0, f"the tree had this reply's tokens, yet nothing was drafted: {usage}"
    reply = page.locator(".msg-assistant").last
    chip = reply.locator(".meta-drafted")
    assert chip_value(chip) == spec["accepted"]
    expect(chip.locator(".chip-value")).to_contain_text(f"{spec['accepted']} of {usage['completion_tokens']} tok")
    page.screenshot(path=str(ARTIFACTS / "chat_speculation.png"))
    page.reload()
    expect(page.locator(".msg-assistant").last.locator(".meta-drafted")).to_have_attribute(
        "data-value", str(spec["accepted"]))


SPEC_STATS = {"proposed": 110, "accepted": 75, "acceptance": 75 / 110, "verify_draws": 40, "committed_draws": 100,
              "tokens_per_step": 1.8, "by_source": {
                  "tree": {"proposed": 60, "accepted": 30, "acceptance": 0.5},
                  "prediction": {"proposed": 50, "accepted": 45, "acceptance": 0.9},
                  "lookup": {"proposed": 0, "accepted": 0, "acceptance": 0.0}}}


def test_dashboard_speculation_panel(ui: Ui) -> None:
    page = ui.page
    ui.server.chat_turn("You are a dashboard speculation assistant.", "Say hi.")
    ui.open("#dashboard")
    panel = page.locator("#spec-panel")
    expect(panel).to_be_visible()
    real = ui.server.rest("GET", "/v1/cache/stats")["speculation"]
    assert list(real["by_source"]) == list(DRAFT_SOURCES) and real["committed_draws"] > 0

    def card(key: str) -> Locator:
        return panel.locator(f'.stat-card[data-key="{key}"]')

    for source in DRAFT_SOURCES:
        expect(card(f"source_{source}")).to_be_visible()
    expect(card("tokens_per_step").locator(".stat-value")).to_have_text(re.compile(r"^\d+\.\d\d$"))

    reply: dict[str, Any] = {"speculation": SPEC_STATS}

    def patched(route: Any) -> None:
        body = json.loads(route.fetch().text())
        if reply["speculation"] is None:
            del body["speculation"]
        else:
            body["speculation"] = reply["speculation"]
        route.fulfill(json=body)

    page.route("**/v1/cache/stats", patched)
    expect(page.locator("#spec-state")).to_have_text("68% of drafts accepted")  # the next poll
    # constant counters: no 10 s figure once the window holds only these replies (up to 10 s), so the
    # card shows the figure since start
    expect(card("tokens_per_step").locator(".stat-value")).to_have_text("1.80", timeout=30_000)
    expect(card("tokens_per_step").locator(".stat-sub")).to_have_text("per sequence · since start")
    expect(card("verify_draws").locator(".stat-value")).to_have_text("40")
    expect(card("verify_draws").locator(".stat-sub")).to_have_text("40.0% of 100 sequence-steps verified drafts")
    expect(card("source_tree").locator(".stat-value")).to_have_text("50.0%")
    expect(card("source_tree").locator(".stat-sub")).to_have_text("30 of 60 drafted tokens accepted")
    expect(card("source_prediction").locator(".stat-value")).to_have_text("90.0%")
    expect(card("source_lookup").locator(".stat-value")).to_have_text("—")
    expect(card("source_lookup").locator(".stat-sub")).to_have_text("0 of 0 drafted tokens accepted")
    page.wait_for_function("() => Number(document.querySelector('#chart-tokens-per-step').dataset.points) >= 2")
    expect(page.locator("#chart-tokens-per-step canvas")).to_have_attribute("aria-label", re.compile(r"since start 1\.80"))
    panel.scroll_into_view_if_needed()
    page.screenshot(path=str(ARTIFACTS / "dashboard_speculation.png"), full_page=True)

    # counters moving: the card shows the last 10 s (here 60 tokens over 20 draws: 3.00 a step)
    moving = json.loads(json.dumps(SPEC_STATS))

    def advancing(route: Any) -> None:
        body = json.loads(route.fetch().text())
        moving["committed_draws"] += 20
        body["generation_tokens"] = 1000 + 3 * moving["committed_draws"]
        body["speculation"] = moving
        route.fulfill(json=body)

    page.unroute("**/v1/cache/stats")
    page.route("**/v1/cache/stats", advancing)
    # (once the window holds only these replies: up to 10 s)
    expect(card("tokens_per_step").locator(".stat-value")).to_have_text("3.00", timeout=30_000)
    expect(card("tokens_per_step").locator(".stat-sub")).to_have_text("per sequence · last 10 s · 1.80 since start")

    page.unroute("**/v1/cache/stats")
    reply["speculation"] = None
    page.route("**/v1/cache/stats", patched)
    expect(panel).to_be_hidden()  # an older server's reply
