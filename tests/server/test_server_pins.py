"""Pinned prefixes through the server (server/pins_api.py, cache_control.py, tree_api.py) against a
real server on 127.0.0.1 over the tiny random-weight chat model, with keys of two tenants: an admin
of A, a user of A, a user of B. Chats go through the official `openai` and `anthropic` clients.

The pool is 128 blocks of 16 tokens, so the pin budget (a quarter) is 32 blocks, a tenant's
cache_control quota 8, and a "storm" of six long prompts (about 160 blocks) evicts everything that is
not pinned. The server's PinBook runs on a clock the tests move, so a cache_control pin's time to
live passes at once. Every test leaves no pin behind.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from radixserve import AsyncEngine, EngineConfig
from radixserve.server import BackgroundServer, ServerConfig
from radixserve.server.pin_book import PinBook
from radixserve.server.pin_target import load_pin_file, parse_target
from radixserve.server.tenants import Caller, Role, TenantKey

pytest.register_assert_rewrite("server_testkit")
from server_testkit import engine_idle, wait_until  # noqa: E402

pytest_plugins = ["server_testkit"]

ADMIN, USER_A, USER_B = "pins-admin-a", "pins-user-a", "pins-user-b"
KEYS = [TenantKey(ADMIN, Caller("A", Role.ADMIN)), TenantKey(USER_A, Caller("A", Role.USER)),
        TenantKey(USER_B, Caller("B", Role.USER))]
NUM_BLOCKS, BLOCK = 128, 16
BUDGET_BLOCKS = NUM_BLOCKS // 4


class Clock:
    """time.monotonic(), moved forward at will."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


@pytest.fixture(scope="module")
def clock() -> Clock:
    return Clock()


@pytest.fixture(scope="module")
def srv(clock: Clock) -> Iterator[BackgroundServer]:
    from tiny_models import tiny_chat_model_dir

    model = str(tiny_chat_model_dir("llama"))
    config = ServerConfig(port=0, web_dir=None, api_keys=KEYS, shutdown_grace_s=0.5)
    with BackgroundServer(lambda: AsyncEngine(EngineConfig(model=model, num_blocks=NUM_BLOCKS)), config) as s:
        s.state.pins = PinBook(clock)
        yield s


@pytest.fixture
def http(srv: BackgroundServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, timeout=120) as client:
        yield client
    for pin in client_pins(srv, ADMIN):  # every test starts with no pin
        httpx.delete(f"{srv.url}/v1/cache/pins/{pin['id']}", headers=auth(ADMIN), timeout=60)
    assert client_pins(srv, ADMIN) == []
    wait_until(lambda: engine_idle(srv), what="the engine idle with no blocks held")


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def client_pins(srv: BackgroundServer, key: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{srv.url}/v1/cache/pins", headers=auth(key), timeout=60)
    assert r.status_code == 200, r.text
    return list(r.json()["data"])


def pin(http: httpx.Client, body: dict[str, Any], key: str = ADMIN) -> httpx.Response:
    return http.post("/v1/cache/pins", json=body, headers=auth(key))


def chat_cached(srv: BackgroundServer, key: str, messages: list[dict[str, str]]) -> int:
    """The cached_tokens of one greedy one-token chat as `key`."""
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=120)
    out = client.chat.completions.create(model=srv.state.model_name, messages=messages, max_tokens=1, temperature=0)
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    return int(out.usage.prompt_tokens_details.cached_tokens or 0)


def storm(srv: BackgroundServer) -> None:
    """Six distinct long prompts: more blocks than the pool holds, so all that is not pinned goes."""
    for k in range(6):
        text = " ".join(f"storm {k} line {i}." for i in range(30))
        chat_cached(srv, USER_A, [{"role": "user", "content": text}])


def ask(system: str, question: str = "Say hi.") -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


# -- the pins API ------------------------------------------------------------------------------

def test_a_pin_is_hit_by_its_own_tenant_only(srv: BackgroundServer, http: httpx.Client) -> None:
    system = "Zebra-striped assistant of tenant A, answer briefly."  # no other prompt starts with "Zebra"
    r = pin(http, {"system": system, "tenant": "A", "label": "tenant A's helper"})
    assert r.status_code == 201, r.text
    made = r.json()
    assert made["id"] and made["tenant"] == "A" and made["origin"] == "api" and made["label"] == "tenant A's helper"
    assert made["tokens"] > 0 and made["blocks"] == -(-made["tokens"] // BLOCK) and made["hits"] == 0
    # a chat of A with that system prompt starts with exactly the pinned tokens: every one is cached
    assert chat_cached(srv, USER_A, ask(system)) >= made["tokens"]
    assert chat_cached(srv, USER_A, ask(system, "Another question.")) >= made["tokens"]
    # B's identical chat cannot read A's namespace: at most the few tokens of the system header, if B
    # cached another system prompt before
    assert chat_cached(srv, USER_B, ask(system)) < 8
    (listed,) = client_pins(srv, ADMIN)
    assert listed["id"] == made["id"] and listed["hits"] == 2 and listed["hit_tokens"] == 2 * made["tokens"]


def test_pinning_a_prefix_again_answers_its_pin(http: httpx.Client) -> None:
    body = {"system": "You are pinned twice."}
    first = pin(http, body)
    again = pin(http, {**body, "tenant": "A"})  # the admin's own tenant is the default
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json()["id"] == first.json()["id"]
    other = pin(http, {**body, "tenant": "B"})  # another namespace: another pin
    assert other.status_code == 201 and other.json()["id"] != first.json()["id"]


def test_a_messages_pin_covers_the_turns_a_chat_continues(srv: BackgroundServer, http: httpx.Client) -> None:
    turns = [{"role": "system", "content": "You are a few-shot assistant."},
             {"role": "user", "content": "Two plus two?"}, {"role": "assistant", "content": "Four."}]
    system_only = pin(http, {"system": turns[0]["content"]}).json()
    r = pin(http, {"messages": turns})
    assert r.status_code == 201, r.text
    longer = r.json()
    assert longer["tokens"] > system_only["tokens"] and longer["label"] == "You are a few-shot assistant."
    assert chat_cached(srv, USER_A, [*turns, {"role": "user", "content": "Three plus three?"}]) >= longer["tokens"]


def test_user_keys_may_only_list_their_own_tenants_pins(srv: BackgroundServer, http: httpx.Client) -> None:
    a = pin(http, {"system": "You are A's listed assistant.", "tenant": "A"}).json()
    b = pin(http, {"system": "You are B's listed assistant.", "tenant": "B"}).json()
    for key in (USER_A, USER_B):
        refused = pin(http, {"system": "You are not allowed."}, key)
        assert refused.status_code == 403 and refused.json()["error"]["type"] == "permission_error"
        gone = http.delete(f"/v1/cache/pins/{a['id']}", headers=auth(key))
        assert gone.status_code == 403
    assert [p["id"] for p in client_pins(srv, USER_A)] == [a["id"]]
    assert [p["id"] for p in client_pins(srv, USER_B)] == [b["id"]]
    assert {p["id"] for p in client_pins(srv, ADMIN)} == {a["id"], b["id"]}
    budget = http.get("/v1/cache/pins", headers=auth(USER_B)).json()["budget"]
    assert budget == {"used_blocks": b["blocks"], "budget_blocks": BUDGET_BLOCKS // 4}  # its share, its pins
    admin_budget = http.get("/v1/cache/pins", headers=auth(ADMIN)).json()["budget"]
    assert admin_budget == {"used_blocks": a["blocks"] + b["blocks"], "budget_blocks": BUDGET_BLOCKS}
    assert http.get("/v1/cache/pins").status_code == 401


def test_the_budget_refuses_with_a_clear_error(srv: BackgroundServer, http: httpx.Client) -> None:
    huge = pin(http, {"system": " ".join(f"zq{i}" for i in range(150))})
    assert huge.status_code == 400
    error = huge.json()["error"]
    assert error["code"] == "pin_refused" and "pin budget" in error["message"] and "--pin-budget" in error["message"]
    made = []
    for k in range(8):  # about 15 blocks each: the budget of 32 takes two
        r = pin(http, {"system": " ".join(f"fill{k}x{i}" for i in range(30))})
        if r.status_code != 201:
            assert r.status_code == 400 and "pin budget" in r.json()["error"]["message"], r.text
            break
        made.append(r.json())
    assert 2 <= len(made) < 8
    used = http.get("/v1/cache/pins", headers=auth(ADMIN)).json()["budget"]["used_blocks"]
    # pins that start alike share their first blocks, counted once
    assert max(p["blocks"] for p in made) < used <= min(sum(p["blocks"] for p in made), BUDGET_BLOCKS)


def test_a_pin_survives_a_storm_and_unpinning_makes_it_evictable(srv: BackgroundServer, http: httpx.Client) -> None:
    system = "You are the assistant that outlives every storm."
    made = pin(http, {"system": system}).json()
    storm(srv)
    assert chat_cached(srv, USER_A, ask(system)) >= made["tokens"]
    r = http.delete(f"/v1/cache/pins/{made['id']}", headers=auth(ADMIN))
    assert r.status_code == 200 and r.json()["id"] == made["id"] and r.json()["hits"] == 1
    assert client_pins(srv, ADMIN) == []
    assert http.delete(f"/v1/cache/pins/{made['id']}", headers=auth(ADMIN)).status_code == 404
    storm(srv)
    assert chat_cached(srv, USER_A, ask(system)) < made["tokens"]


def test_a_pins_blocks_count_as_used_not_cached(srv: BackgroundServer, http: httpx.Client) -> None:
    """Issue 43, finding 9 (c): the pool's figures counted a pin's blocks as `cached` (evictable); as
    docs/pins.md says, they are `used` (nothing can evict them), and `cached` again once unpinned."""
    system = "You are the assistant whose blocks are in use."
    made = pin(http, {"system": system}).json()

    def counted(used: int) -> bool:  # the engine idle, and its published figures recounted
        st = srv.engine.stats()
        return st.num_running == 0 and st.num_waiting == 0 and st.blocks_used == used

    def figures() -> dict[str, Any]:
        body = http.get("/v1/cache/stats", headers=auth(ADMIN)).json()
        blocks = body["blocks"]
        assert blocks["free"] + blocks["used"] + blocks["cached"] == blocks["total"]
        return dict(body)

    wait_until(lambda: counted(made["blocks"]), what="the pin's blocks counted as used")
    body = figures()
    assert body["blocks"]["used"] == body["pins"]["blocks"] == made["blocks"] > 0
    metrics = http.get("/metrics", headers=auth(ADMIN)).text
    assert f'radixserve_kv_blocks{{state="used"}} {float(made["blocks"])}' in metrics
    chat_cached(srv, USER_A, ask(system))  # a chat over the pin: once it ends, the pin's blocks alone are used
    wait_until(lambda: counted(made["blocks"]), what="the chat's blocks released")
    assert http.delete(f"/v1/cache/pins/{made['id']}", headers=auth(ADMIN)).status_code == 200
    wait_until(lambda: counted(0), what="the unpinned blocks counted as cached")
    assert figures()["blocks"]["cached"] >= made["blocks"]


@pytest.mark.parametrize(("body", "says"), [
    ({"system": "x", "messages": [{"role": "user", "content": "y"}]}, "exactly one of"),
    ({}, "exactly one of"),
    ({"system": ""}, "'system' must be a non-empty string"),
    ({"system": "x", "tenant": "C"}, "tenant 'C': no API key belongs to it"),
    ({"system": "x", "label": 5}, "'label' must be a string"),
    ({"messages": [{"role": "tool", "content": "y"}]}, "messages[0] must be"),
    ({"system": "x", "cache_salt": "s"}, "unknown field 'cache_salt'"),
])
def test_bad_pin_bodies_are_refused(http: httpx.Client, body: dict[str, Any], says: str) -> None:
    r = pin(http, body)
    assert r.status_code == 400 and says in r.json()["error"]["message"], r.text


# -- Anthropic cache_control -------------------------------------------------------------------

def claude(srv: BackgroundServer, key: str = USER_A) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key=key, max_retries=0, timeout=120)


def marked(text: str, ttl: str | None = None) -> list[dict[str, Any]]:
    mark = {"type": "ephemeral", **({"ttl": ttl} if ttl else {})}
    return [{"type": "text", "text": text, "cache_control": mark}]


def message(srv: BackgroundServer, system: Any, key: str = USER_A) -> Any:
    return claude(srv, key).messages.create(model=srv.state.model_name, max_tokens=1, system=system,
                                            messages=[{"role": "user", "content": "Say hi."}])


def test_cache_control_pins_the_system_prompt_for_its_time_to_live(srv: BackgroundServer, http: httpx.Client,
                                                                   clock: Clock) -> None:
    system = "You are a cached Claude-style assistant."
    first = message(srv, marked(system))
    (pinned,) = client_pins(srv, ADMIN)
    assert pinned["origin"] == "cache_control" and pinned["tenant"] == "A"
    assert 290 <= pinned["expires_at"] - time.time() <= 310  # Anthropic's default: five minutes
    u = first.usage
    # what the pin's prefill wrote: its tokens but the template's opening, which the tenant had cached
    assert pinned["tokens"] - 16 <= u.cache_creation_input_tokens <= pinned["tokens"]
    count = claude(srv).messages.count_tokens(model=srv.state.model_name, system=system,
                                              messages=[{"role": "user", "content": "Say hi."}]).input_tokens
    assert u.input_tokens + u.cache_creation_input_tokens + (u.cache_read_input_tokens or 0) == count
    second = message(srv, marked(system, "1h")).usage
    assert second.cache_creation_input_tokens == 0 and (second.cache_read_input_tokens or 0) >= pinned["tokens"]
    (refreshed,) = client_pins(srv, ADMIN)
    assert refreshed["id"] == pinned["id"] and 3590 <= refreshed["expires_at"] - time.time() <= 3610
    # B's identical request pins in B's namespace, and reads nothing of A's
    other = message(srv, marked(system), USER_B).usage
    assert pinned["tokens"] - 16 <= other.cache_creation_input_tokens <= pinned["tokens"]
    assert not other.cache_read_input_tokens  # it reads the pin it made, never A's
    clock.offset += 3601  # both times to live pass
    assert client_pins(srv, ADMIN) == []


def test_a_streamed_message_reports_what_its_pin_wrote(srv: BackgroundServer, http: httpx.Client) -> None:
    system = "You are a streamed cached assistant."
    with claude(srv).messages.stream(model=srv.state.model_name, max_tokens=2, system=marked(system),
                                     messages=[{"role": "user", "content": "Say hi."}]) as stream:
        final = stream.get_final_message()
    (pinned,) = client_pins(srv, ADMIN)
    created = final.usage.cache_creation_input_tokens
    assert pinned["tokens"] - 16 <= created <= pinned["tokens"]
    assert final.usage.input_tokens + created + (final.usage.cache_read_input_tokens or 0) == \
        claude(srv).messages.count_tokens(model=srv.state.model_name, system=system,
                                          messages=[{"role": "user", "content": "Say hi."}]).input_tokens


def test_the_request_that_makes_a_pin_reports_its_tokens_as_created(srv: BackgroundServer, http: httpx.Client) -> None:
    """Issue 43, finding 9 (b): docs/pins.md: the request whose mark made the pin has the pin's tokens
    as `cache_creation_input_tokens`, also when an earlier unmarked request had cached them already."""
    system = "You are an assistant cached before you were marked."
    plain = message(srv, system).usage  # unmarked: caches the whole prefix, pins nothing
    assert plain.cache_creation_input_tokens == 0 and client_pins(srv, ADMIN) == []
    first = message(srv, marked(system)).usage
    (pinned,) = client_pins(srv, ADMIN)
    assert first.cache_creation_input_tokens == pinned["tokens"] > 0
    count = claude(srv).messages.count_tokens(model=srv.state.model_name, system=system,
                                              messages=[{"role": "user", "content": "Say hi."}]).input_tokens
    assert first.input_tokens + first.cache_creation_input_tokens + (first.cache_read_input_tokens or 0) == count
    again = message(srv, marked(system)).usage  # the pin exists: read, not created
    assert again.cache_creation_input_tokens == 0 and (again.cache_read_input_tokens or 0) >= pinned["tokens"]


def test_cache_control_over_the_tenants_quota_is_served_unpinned(srv: BackgroundServer, http: httpx.Client) -> None:
    long_system = "You are a terse assistant. " * 8  # about 10 blocks: over the tenant's share of 8
    reply = message(srv, marked(long_system))
    assert reply.usage.cache_creation_input_tokens == 0
    assert client_pins(srv, ADMIN) == []
    unmarked = message(srv, "You are an unmarked assistant.")
    assert unmarked.usage.cache_creation_input_tokens == 0 and client_pins(srv, ADMIN) == []


def test_a_bad_cache_control_is_refused(srv: BackgroundServer, http: httpx.Client) -> None:
    with pytest.raises(anthropic.BadRequestError, match="ttl must be one of"):
        message(srv, marked("You are refused.", "2h"))
    bad = [{"type": "text", "text": "You are refused.", "cache_control": {"type": "persistent"}}]
    with pytest.raises(anthropic.BadRequestError, match="ephemeral"):
        message(srv, bad)


# -- GET /v1/cache/tree ------------------------------------------------------------------------

def test_the_tree_shows_each_caller_its_own_tenant(srv: BackgroundServer, http: httpx.Client) -> None:
    system = "You are the assistant drawn in the tree."
    made = pin(http, {"system": system, "tenant": "B"}).json()
    chat_cached(srv, USER_A, ask(system))
    chat_cached(srv, USER_B, ask(system))
    mine = http.get("/v1/cache/tree", headers=auth(USER_B)).json()
    assert mine["labels"] is True and mine["nodes"]
    assert {n["tenant"] for n in mine["nodes"]} == {"B"} and [ns["tenant"] for ns in mine["namespaces"]] == ["B"]
    ids = {n["id"] for n in mine["nodes"]}
    assert all(n["parent"] is None or n["parent"] in ids for n in mine["nodes"])
    pinned = [n for n in mine["nodes"] if n["pinned"]]
    assert sum(n["tokens"] for n in pinned) == made["tokens"]  # the pinned path is exactly the pin
    assert any(n["label"] for n in pinned)  # a key's holder sees its tenant's text
    everything = http.get("/v1/cache/tree", headers=auth(ADMIN)).json()
    assert {"A", "B"} <= {n["tenant"] for n in everything["nodes"]}
    assert everything["total_tokens"] > mine["total_tokens"]
    one = http.get("/v1/cache/tree?limit=1", headers=auth(ADMIN)).json()
    assert len(one["nodes"]) == 1 and one["nodes"][0]["hidden_tokens"] == one["nodes"][0]["subtree_tokens"] - \
        one["nodes"][0]["tokens"]
    for bad in ("0", "2001", "many"):
        assert http.get(f"/v1/cache/tree?limit={bad}", headers=auth(ADMIN)).status_code == 400


# -- --pin FILE --------------------------------------------------------------------------------

def test_pin_file_lines_are_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "pins.jsonl"
    good.write_text('# pinned at start\n{"system": "You are pinned from a file.", "tenant": "A", "label": "file"}\n\n'
                    '{"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]}\n')
    first, second = load_pin_file(good)
    assert (first.tenant, first.label, second.tenant) == ("A", "file", "default")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"system": "fine"}\n{"system": "unterminated\n')
    with pytest.raises(ValueError, match=r"bad.jsonl line 2: not a JSON object"):
        load_pin_file(bad)
    bad.write_text('{"sytem": "typo"}\n')
    with pytest.raises(ValueError, match=r"line 1: unknown field 'sytem'"):
        load_pin_file(bad)
    with pytest.raises(ValueError, match="tenant 'C': no API key belongs to it"):
        ServerConfig(api_keys=KEYS, pins=[parse_target({"system": "x", "tenant": "C"})])
    from radixserve.cli import main

    assert main(["serve", "--pin", str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read --pin file" in capsys.readouterr().out


def test_pins_of_a_file_are_made_before_the_server_answers(capsys: pytest.CaptureFixture[str]) -> None:
    from tiny_models import tiny_chat_model_dir

    model = str(tiny_chat_model_dir("llama"))
    targets = [parse_target({"system": "You are pinned at start.", "tenant": "B", "label": "start"})]
    config = ServerConfig(port=0, web_dir=None, api_keys=KEYS, pins=targets, shutdown_grace_s=0.5)
    with BackgroundServer(lambda: AsyncEngine(EngineConfig(model=model, num_blocks=NUM_BLOCKS)), config) as s:
        (made,) = client_pins(s, ADMIN)
        assert (made["tenant"], made["origin"], made["label"]) == ("B", "file", "start")
        assert chat_cached(s, USER_B, ask("You are pinned at start.")) >= made["tokens"]
    assert f"radixserve: pinned {made['id']} for tenant B: {made['tokens']} tokens in {made['blocks']} blocks" \
        in capsys.readouterr().out
    huge = [parse_target({"system": " ".join(f"zq{i}" for i in range(150))})]
    too_big = ServerConfig(port=0, web_dir=None, pins=huge, shutdown_grace_s=0.5)
    with pytest.raises(RuntimeError, match="--pin .*pin budget"):
        BackgroundServer(lambda: AsyncEngine(EngineConfig(model=model, num_blocks=NUM_BLOCKS)), too_big).start()


def test_an_open_server_shows_no_prompt_text(tiny_chat_server: BackgroundServer) -> None:
    """Without a key (and without --show-prompt-previews) the tree and the pins carry no text."""
    base = tiny_chat_server.url
    chat_cached(tiny_chat_server, "unused", ask("You are a private open-server assistant."))
    made = httpx.post(f"{base}/v1/cache/pins", json={"system": "You are a private pinned one."}, timeout=60)
    assert made.status_code == 201 and made.json()["label"] is None
    try:
        tree = httpx.get(f"{base}/v1/cache/tree", timeout=60).json()
        assert tree["labels"] is False and tree["nodes"] and all(n["label"] is None for n in tree["nodes"])
        assert any(n["pinned"] for n in tree["nodes"])
        assert [p["label"] for p in httpx.get(f"{base}/v1/cache/pins", timeout=60).json()["data"]] == [None]
    finally:
        assert httpx.delete(f"{base}/v1/cache/pins/{made.json()['id']}", timeout=60).status_code == 200
