"""Fair session capacity (issue 24, item 3): one owner must not be able to evict everyone else's sessions.

Each owner has a share of `--max-sessions` and of `--max-session-bytes-total` (`--owner-share`); when
the store is full, the least recently used idle session of the owner most over its share goes, and an
owner over its share is refused (429 + Retry-After) rather than displace an owner within it. Session
creation (and forks) are rate limited per client address (`--session-create-rate`, `--session-create-burst`).

Units run on SessionStore and the rate limiter directly; the floods run against a real server (tiny
random-weight model, 127.0.0.1) exactly as the red team measured them: 1,024+ creations by one owner
in about a second, and large sessions under the byte budget.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from radixserve import AsyncEngine, EngineConfig
from radixserve.chat.template import ChatFormatter
from radixserve.sampling_fields import SamplingFields
from radixserve.server import BackgroundServer, ServerConfig
from radixserve.server.owners import OWNER_HEADER, Owner
from radixserve.server.sessions.store import SessionStore
from radixserve.server.validation import ApiError

pytest.register_assert_rewrite("server_testkit")
from server_testkit import connect, on_server_loop, recv_frame, write_tiny_chat_model  # noqa: E402

pytestmark = pytest.mark.slow

FLOOD = 1100  # more creations than the server holds sessions (1,024 by default)
BIG_PROMPT = "Sessions must fit in the budget. " * 400  # ~13 KB of text, ~2.8k tokens: ~25 KB a session


def new_secret() -> str:
    return secrets.token_urlsafe(16)  # 128 bits, the shortest secret the server accepts


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# -- units: SessionStore shares -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def fmt() -> ChatFormatter:
    from radixserve.model.embedded import embedded_model_dir
    from radixserve.model.loader import load_tokenizer

    return ChatFormatter(load_tokenizer(embedded_model_dir()))


def test_a_flood_by_one_owner_evicts_its_own_sessions_first(fmt: ChatFormatter) -> None:
    clock = FakeClock()
    store = SessionStore(fmt, max_sessions=64, ttl_s=1e6, clock=clock, owner_share=0.25)
    victim, attacker, other = Owner.of(new_secret()), Owner.of(new_secret()), Owner.of(new_secret())
    kept = store.create(None, SamplingFields(), victim)
    others = [store.create(None, SamplingFields(), other) for _ in range(20)]  # over its share (16) too, but less so
    made = []
    for i in range(200):
        clock.now = i + 1.0  # the victim's session is by far the least recently used one
        made.append(store.create(None, SamplingFields(), attacker))
    assert store.get(kept.id, victim) is kept
    assert len(store) == 64 and store.evicted == 1 + 20 + 200 - 64
    # once the store was full, each new session of the owner most over its share (the attacker) took
    # the place of that owner's own least recently used one; the other owner over its share lost nothing
    assert {s.id for s in store.list(attacker)} == {s.id for s in made[-43:]} and len(store.list(other)) == 20
    assert {s.id for s in others} == {s.id for s in store.list(other)}
    assert store.owner_usage(attacker) == (43, sum(s.footprint() for s in made[-43:]))


def test_the_most_over_its_byte_share_is_evicted_first(fmt: ChatFormatter) -> None:
    size = SessionStore(fmt, max_sessions=1, ttl_s=100).create(BIG_PROMPT, {}, Owner.of(new_secret())).footprint()
    store = SessionStore(fmt, max_sessions=1000, ttl_s=100, max_bytes=10 * size, owner_share=0.25)
    victim, attacker = Owner.of(new_secret()), Owner.of(new_secret())
    kept = store.create("0 " + BIG_PROMPT, SamplingFields(), victim)  # one large session, within its 2.5-session share
    for i in range(30):
        store.create(f"{i} {BIG_PROMPT}", SamplingFields(), attacker)
        assert store.total_bytes <= store.max_bytes
    assert store.get(kept.id, victim) is kept and store.evicted > 0
    assert store.total_bytes == sum(s.footprint() for s in store) == sum(store.owner_usage(o)[1] for o in (victim,
                                                                                                            attacker))


def test_an_owner_over_its_share_cannot_displace_others(fmt: ChatFormatter) -> None:
    store = SessionStore(fmt, max_sessions=8, ttl_s=100, owner_share=0.25)
    victim, attacker = Owner.of(new_secret()), Owner.of(new_secret())
    kept = store.create(None, SamplingFields(), victim)
    mine = [store.create(None, SamplingFields(), attacker) for _ in range(7)]
    for s in mine:
        s.busy = "g"  # nothing of the attacker's own is idle
    with pytest.raises(ApiError) as e:
        store.create(None, SamplingFields(), attacker)
    assert (e.value.code, e.value.status) == ("too_many_sessions", 429)
    assert e.value.retry_after is not None and e.value.retry_after >= 1
    assert store.get(kept.id, victim) is kept and len(store) == 8
    # an owner within its share still gets a session: from the owner most over its share, were any idle
    mine[0].busy = None
    assert store.create(None, SamplingFields(), victim) and mine[0].id not in {s.id for s in store}
    assert store.get(kept.id, victim) is kept


def test_one_owner_alone_may_use_the_whole_store(fmt: ChatFormatter) -> None:
    """The share only bites under contention: a lone owner keeps the old least-recently-used rule."""
    store = SessionStore(fmt, max_sessions=10, ttl_s=100, owner_share=0.25)
    me = Owner.of(new_secret())
    made = [store.create(None, SamplingFields(), me) for _ in range(12)]
    assert len(store.list(me)) == 10 and {s.id for s in store.list(me)} == {s.id for s in made[2:]}


def test_creation_rate_limiter_is_per_client_and_refills() -> None:
    from radixserve.server.rate_limit import CreationRateLimiter

    clock = FakeClock()
    limiter = CreationRateLimiter(clock=clock, max_clients=4)
    for _ in range(10):
        limiter.check("10.0.0.1", rate=5.0, burst=10)
    with pytest.raises(ApiError) as e:
        limiter.check("10.0.0.1", rate=5.0, burst=10)
    assert (e.value.code, e.value.status, e.value.retry_after) == ("rate_limited", 429, 1)
    limiter.check("10.0.0.2", rate=5.0, burst=10)  # another client has its own bucket
    clock.now += 0.2  # one more creation's worth
    limiter.check("10.0.0.1", rate=5.0, burst=10)
    with pytest.raises(ApiError):
        limiter.check("10.0.0.1", rate=5.0, burst=10)
    for _ in range(100):
        limiter.check("10.0.0.1", rate=0.0, burst=10)  # rate 0: no limit
    for i in range(50):  # memory is bounded whatever the number of clients
        limiter.check(f"10.1.0.{i}", rate=5.0, burst=10)
    assert len(limiter) <= 4


# -- against a real server ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fair_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    from radixserve.model.embedded import embedded_model_dir

    model = write_tiny_chat_model(tmp_path_factory.mktemp("tiny-fair"), embedded_model_dir(), max_positions=16384)
    config = ServerConfig(port=0, web_dir=None, shutdown_grace_s=0.5)  # default session limits
    with BackgroundServer(lambda: AsyncEngine(EngineConfig(model=str(model), num_blocks=256)), config) as srv:
        yield srv


@pytest.fixture()
def server(fair_server: BackgroundServer) -> Iterator[BackgroundServer]:
    """The server with no sessions, and its config and budget as they were after the test."""
    cfg, store = fair_server.state.config, fair_server.state.sessions
    saved = dict(vars(cfg)), store.max_bytes

    async def clear() -> None:
        for s in list(store):
            store._remove(s)
        limiter = getattr(fair_server.state, "creation_limiter", None)
        if limiter is not None:
            limiter.clear()

    on_server_loop(fair_server, clear())
    try:
        yield fair_server
    finally:
        vars(cfg).update(saved[0])
        store.max_bytes = saved[1]
        on_server_loop(fair_server, clear())


def client(srv: BackgroundServer, secret: str, local_address: str | None = None) -> httpx.Client:
    transport = httpx.HTTPTransport(local_address=local_address) if local_address else None
    return httpx.Client(base_url=srv.url, timeout=60, headers={OWNER_HEADER: secret}, transport=transport)


def test_a_victims_session_survives_another_owners_flood_of_creations(server: BackgroundServer) -> None:
    """Measured: 1,024 session creations by another owner in 0.8 s made the victim's session 404."""
    server.state.config.session_create_rate = 0.0  # the share alone must protect the victim
    victim_secret, attacker_secret = new_secret(), new_secret()
    victim = client(server, victim_secret)
    sid = victim.post("/v1/sessions", json={"system_prompt": "I was here first."}).json()["id"]

    async def flood() -> list[dict[str, Any]]:
        async with connect(server, max_size=None) as ws:
            frame = json.dumps({"type": "session.create", "owner": attacker_secret})
            start = time.monotonic()
            for _ in range(FLOOD):  # pipelined, as fast as the server takes them
                await ws.send(frame)
            replies = [await recv_frame(ws) for _ in range(FLOOD)]
            assert time.monotonic() - start < 60
            return replies

    replies = asyncio.run(flood())
    assert all(r["type"] == "session.created" for r in replies), {r.get("code") for r in replies}
    assert victim.get(f"/v1/sessions/{sid}").status_code == 200  # the victim's session survived
    attacker = client(server, attacker_secret)
    listed = attacker.get("/v1/sessions").json()["sessions"]
    assert len(listed) == server.state.config.max_sessions - 1  # the attacker's own sessions went instead
    assert attacker.get(f"/v1/sessions/{replies[0]['session']['id']}").status_code == 404
    assert attacker.get(f"/v1/sessions/{replies[-1]['session']['id']}").status_code == 200


def test_a_victims_session_survives_large_sessions_under_the_byte_budget(server: BackgroundServer) -> None:
    """Measured: 100 large sessions under the byte budget made the victim's session 404."""
    server.state.config.session_create_rate = 0.0
    server.state.sessions.max_bytes = 1_000_000  # ~40 of these sessions
    victim, attacker = client(server, new_secret()), client(server, new_secret())
    made = victim.post("/v1/sessions", json={"system_prompt": "victim " + BIG_PROMPT})
    assert made.status_code == 201, made.text
    sid = made.json()["id"]
    for i in range(100):
        r = attacker.post("/v1/sessions", json={"system_prompt": f"{i} {BIG_PROMPT}"})
        assert r.status_code == 201, r.text
    store = server.state.sessions
    assert store.total_bytes <= store.max_bytes and store.evicted > 0
    assert victim.get(f"/v1/sessions/{sid}").status_code == 200


def test_session_creation_is_rate_limited_per_client(server: BackgroundServer) -> None:
    cfg = server.state.config
    cfg.session_create_rate, cfg.session_create_burst = 5.0, 10
    secret = new_secret()
    http = client(server, secret)
    codes = [http.post("/v1/sessions", json={}).status_code for _ in range(30)]
    assert codes[:10] == [201] * 10 and codes.count(429) >= 15, codes
    r = http.post("/v1/sessions", json={})
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limited"
    assert int(r.headers["Retry-After"]) >= 1
    sid = next(s["id"] for s in http.get("/v1/sessions").json()["sessions"])
    assert http.post(f"/v1/sessions/{sid}/fork", json={"at_message": 0}).status_code == 429  # forks count too

    async def ws_create() -> dict[str, Any]:
        async with connect(server) as ws:
            await ws.send(json.dumps({"type": "session.create", "owner": secret, "req": 3}))
            return await recv_frame(ws)

    err = asyncio.run(ws_create())
    assert (err["type"], err["code"], err["req"]) == ("error", "rate_limited", 3) and err["retry_after"] >= 1
    # another client address has its own allowance (all of 127.0.0.0/8 is loopback)
    assert client(server, secret, local_address="127.0.0.2").post("/v1/sessions", json={}).status_code == 201
    time.sleep(0.3)  # 5 a second: one more creation's worth
    assert http.post("/v1/sessions", json={}).status_code == 201
