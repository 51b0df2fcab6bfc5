"""The dashboard's live picture of the radix tree (web/js/tree_view.js), in headless Chromium against a
real `radixserve serve` (fixtures: web_testkit.py): it draws the nodes GET /v1/cache/tree sends,
under their namespace, labelled with their first words; it follows new traffic; a prefix pinned
through the API is drawn as pinned. Also the icicle's layout on a made-up tree, and a failed fetch
shown in the panel without stopping the rest of the dashboard."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from playwright.sync_api import Page, expect

pytest.register_assert_rewrite("web_testkit")
from web_testkit import ARTIFACTS, Server, Ui, serving  # noqa: E402

pytest_plugins = ["web_testkit"]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    """The UI tests' server with a context short enough that the CPU pool leaves a pin budget (pins
    never take the room the longest sequence needs: engine/pins.py)."""
    with serving("--max-model-len", "2048") as srv:
        yield srv


def drawn_ids(page: Page) -> set[int]:
    ids = page.eval_on_selector_all("#tree-panel .tree-node", "gs => gs.map(g => Number(g.dataset.nodeId))")
    return set(ids)


def tree(ui: Ui) -> dict[str, Any]:
    body = ui.server.rest("GET", "/v1/cache/tree?limit=200")
    assert isinstance(body, dict)
    return body


def test_the_tree_draws_the_servers_nodes_and_follows_new_traffic(ui: Ui) -> None:
    ui.server.chat_turn("You are a tree view test assistant.", "Say hi.")
    ui.server.chat_turn("You are a tree view test assistant.", "Name a fruit.")
    page = ui.page
    ui.open("#dashboard")
    panel = page.locator("#tree-panel")
    expect(panel.locator(".tree-node").first).to_be_visible(timeout=20_000)
    sent = {n["id"] for n in tree(ui)["nodes"]}  # no traffic now: the tree stays as it is
    assert len(sent) >= 3  # the shared system prompt, and a branch for each chat
    page.wait_for_function("n => document.querySelectorAll('#tree-panel .tree-node').length === n", arg=len(sent))
    assert drawn_ids(page) == sent
    expect(panel.locator(".tree-ns", has=page.locator("text", has_text="default"))).to_have_count(1)
    # the two chats share their system prompt: one node holds it, labelled with its first words, hit
    shared = panel.locator(".tree-node", has=page.locator("title", has_text="You are a tree view"))
    expect(shared.first).to_be_attached()
    assert int(shared.first.get_attribute("data-hits") or 0) >= 1
    expect(panel.locator("#tree-state")).to_have_text(re.compile(r"^\d+ of \d+ nodes · [\d,]+ tokens"))
    page.screenshot(path=str(ARTIFACTS / "dashboard_tree.png"), full_page=True)

    before = drawn_ids(page)
    ui.server.chat_turn("A different prompt grows a new branch of the tree.", "Say bye.")
    page.wait_for_function("ids => [...document.querySelectorAll('#tree-panel .tree-node')]"
                           ".some(g => !ids.includes(Number(g.dataset.nodeId)))", arg=sorted(before), timeout=20_000)
    expect(panel.locator(".tree-node", has=page.locator("title", has_text="A different prompt")).first).to_be_attached()


def test_a_pinned_prefix_is_drawn_as_pinned(ui: Ui) -> None:
    system = "You are the pinned assistant of the tree view test."
    page = ui.page
    ui.open("#dashboard")
    panel = page.locator("#tree-panel")
    made = ui.server.rest("POST", "/v1/cache/pins", {"system": system})
    try:
        pinned = panel.locator(".tree-node.pinned")
        expect(pinned.first).to_be_visible(timeout=20_000)
        assert all(g.get_attribute("data-pinned") == "true" for g in pinned.all())
        expect(pinned.filter(has=page.locator("title", has_text="pinned assistant of the tree")).first).to_be_attached()
        expect(panel.locator("#tree-state")).to_contain_text("pinned")
        # drawn differently: the pinned outline is the --ok colour, an unpinned node has none
        ui.server.chat_turn("You are an unpinned neighbour.", "Say hi.")
        plain = panel.locator(".tree-node:not(.pinned)")
        expect(plain.first).to_be_attached(timeout=20_000)
        stroke = "g => getComputedStyle(g.querySelector('rect')).stroke"
        assert pinned.first.evaluate(stroke) != plain.first.evaluate(stroke)
        assert pinned.first.evaluate("g => getComputedStyle(g.querySelector('rect')).strokeWidth") == "3px"
        panel.scroll_into_view_if_needed()
        page.screenshot(path=str(ARTIFACTS / "dashboard_tree_pinned.png"), full_page=True)
        panel.screenshot(path=str(ARTIFACTS / "dashboard_tree_panel.png"))
    finally:
        ui.server.rest("DELETE", f"/v1/cache/pins/{made['id']}")
    expect(panel.locator(".tree-node.pinned")).to_have_count(0, timeout=20_000)


def test_the_icicle_sizes_nodes_by_their_tokens(ui: Ui) -> None:
    view = {"labels": True, "total_nodes": 4, "total_tokens": 400, "namespaces": [
        {"id": "a", "tenant": "a", "salted": False, "tokens": 300}, {"id": "b/salted-1", "tenant": "b", "salted": True,
                                                                    "tokens": 100}],
        "nodes": [
            {"id": 1, "parent": None, "namespace": "a", "tokens": 100, "subtree_tokens": 300, "hidden_tokens": 0},
            {"id": 2, "parent": 1, "namespace": "a", "tokens": 150, "subtree_tokens": 150, "hidden_tokens": 0},
            {"id": 3, "parent": 1, "namespace": "a", "tokens": 50, "subtree_tokens": 50, "hidden_tokens": 0},
            {"id": 4, "parent": None, "namespace": "b/salted-1", "tokens": 100, "subtree_tokens": 100, "hidden_tokens": 0},
        ]}
    ui.open("#dashboard")
    boxes = ui.page.evaluate("""async view => {
        const { layout } = await import('/js/tree_view.js');
        return layout(view).map(b => [b.kind, b.item.id, b.depth, Math.round(b.x * 1000), Math.round(b.w * 1000)]);
    }""", view)
    assert boxes == [["ns", "a", 0, 0, 750], ["node", 1, 1, 0, 750], ["node", 2, 2, 0, 375], ["node", 3, 2, 375, 125],
                     ["ns", "b/salted-1", 0, 750, 250], ["node", 4, 1, 750, 250]]


def test_a_failed_tree_fetch_is_shown_in_the_panel(ui: Ui) -> None:
    page = ui.page
    page.route("**/v1/cache/tree*", lambda route: route.fulfill(status=500, json={"error": {
        "message": "tree exploded", "type": "server_error", "code": "internal"}}))
    ui.open("#dashboard")
    expect(page.locator("#tree-state")).to_contain_text("tree exploded", timeout=20_000)
    expect(page.locator("#tree-panel")).to_have_attribute("data-error", "true")
    expect(page.locator("#dash-status")).to_contain_text("Live")  # the rest of the dashboard goes on
