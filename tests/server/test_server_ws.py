"""WebSocket chat and session REST against a real uvicorn server (embedded model, small max_tokens)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixserve.chat.template import token_hash
from radixserve.server.sessions import ws as ws_module

pytest.register_assert_rewrite("server_testkit")
from server_testkit import (  # noqa: E402
    OWNED,
    TEST_OWNER_KEY,
    chat,
    connect,
    engine_idle,
    recv_frame,
    request,
    rest_client,
    wait_until,
)

pytest_plugins = ["server_testkit"]
pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0, "max_tokens": 6}


@pytest.fixture()
def recorded(chat_server, monkeypatch) -> list[dict[str, Any]]:  # noqa: ANN001
    """Every engine request the server makes: its prompt ids and generated ids."""
    engine, calls = chat_server.engine, []
    original = engine.generate_validated

    async def generate(request, request_id=None, cancelled=None, placement=None):  # noqa: ANN001, ANN202
        rec = {"prompt": list(request.token_ids), "generated": []}
        calls.append(rec)
        agen = original(request, request_id=request_id, cancelled=cancelled, placement=placement)
        try:
            async for out in agen:
                rec["generated"] += out.outputs[0].token_ids if out.outputs else []
                yield out
        finally:
            await agen.aclose()

    monkeypatch.setattr(engine, "generate_validated", generate)
    return calls


def test_multi_turn_conversation_reuses_every_previous_token(chat_server, recorded) -> None:  # noqa: ANN001
    contents = ["Hi! What is your name?", "What is the capital of France?", "And of Italy?"]

    async def run() -> tuple[str, list[list[dict[str, Any]]]]:
        async with connect(chat_server) as ws:
            created = await request(ws, {"type": "session.create", "system_prompt": "You are a concise assistant.",
                                         "sampling": GREEDY, "req": 1, **OWNED})
            assert created["type"] == "session.created" and created["req"] == 1
            sid = created["session"]["id"]
            return sid, [await chat(ws, sid, c, gen_id=f"turn{k}") for k, c in enumerate(contents)]

    sid, turns = asyncio.run(run())
    assert len(recorded) == len(contents)
    for k, frames in enumerate(turns):
        start, done = frames[0], frames[-1]
        assert start["type"] == "start" and done["type"] == "done", frames
        assert all(f["type"] == "delta" and f["text"] for f in frames[1:-1])
        assert done["usage"]["prompt_tokens"] == len(recorded[k]["prompt"]) == start["prompt_tokens"]
        assert done["usage"]["completion_tokens"] == len(recorded[k]["generated"])
        assert done["finish_reason"] in ("stop", "length") and done["message_index"] == 2 * k + 1
        assert set(done["timing"]) == {"queue_ms", "ttft_ms", "tokens_per_s", "total_ms", "mean_itl_ms", "max_itl_ms"}
        assert done["timing"]["max_itl_ms"] >= done["timing"]["mean_itl_ms"] >= 0
        assert done["timing"]["total_ms"] >= done["timing"]["ttft_ms"] > 0
        if k:
            prev = recorded[k - 1]
            before = prev["prompt"] + prev["generated"]
            # turn k's prompt extends turn k-1's prompt and reply token-for-token
            assert recorded[k]["prompt"][:len(before)] == before
            # every token of earlier turns the model has computed (all but the last sampled one) is a hit
            assert done["usage"]["cached_tokens"] >= len(before) - 1
            assert start["cached_tokens"] == done["usage"]["cached_tokens"]

    session = chat_server.state.sessions.get(sid, TEST_OWNER_KEY)
    tok = chat_server.engine.tokenizer
    replies = [m.content for m in session.messages if m.role == "assistant"]
    for rec, reply in zip(recorded, replies, strict=True):
        ids = [t for t in rec["generated"] if t not in chat_server.engine.eos_token_ids]
        assert tok(reply, add_special_tokens=False)["input_ids"] == ids, "reply text must round-trip for this test"
    text = tok.apply_chat_template(session.template_messages(), tokenize=False, add_generation_prompt=False)
    assert list(session.tokens) == tok(text, add_special_tokens=False)["input_ids"]
    assert list(session.tokens[:len(recorded[-1]["prompt"])]) == recorded[-1]["prompt"]


def test_concurrent_clients_share_one_system_prompt_prefill(chat_server) -> None:  # noqa: ANN001
    clients = 32
    system = "You are a helpful assistant for a shared-prefix load test. Answer in one short sentence."
    http = rest_client(chat_server)
    before = chat_server.engine.stats()

    async def client(i: int) -> dict[str, Any]:
        async with connect(chat_server) as ws:
            created = await request(ws, {"type": "session.create", **OWNED, "system_prompt": system,
                                         "sampling": {"temperature": 0, "max_tokens": 4}})
            frames = await chat(ws, created["session"]["id"], f"Client {i}: say hello.", gen_id="g")
            assert frames[-1]["type"] == "done", frames[-1]
            return {"done": frames[-1], "system_len": created["session"]["num_tokens"]}

    async def run() -> list[dict[str, Any]]:
        return await asyncio.gather(*(client(i) for i in range(clients)))

    results = asyncio.run(run())
    after = chat_server.engine.stats()
    system_len = results[0]["system_len"]
    suffixes = sum(r["done"]["usage"]["prompt_tokens"] - system_len for r in results)
    computed = after.computed_tokens - before.computed_tokens
    assert computed <= system_len + suffixes + clients, (computed, system_len, suffixes)
    assert sum(r["done"]["usage"]["cached_tokens"] >= system_len for r in results) >= clients - 1

    key = token_hash(chat_server.state.sessions.formatter.encode(
        chat_server.state.sessions.formatter.render([{"role": "system", "content": system}], False)))
    stats = http.get("/v1/cache/stats").json()
    row = next(r for r in stats["system_prompts"] if r["id"] == key)
    assert row["requests"] == clients and row["hit_requests"] >= clients - 1
    # an open server shows no prompt text (no key, no --show-prompt-previews): test_server_tenants.py
    assert row["preview"] == "" and row["tenant"] == "default" and row["cached_tokens"] >= (clients - 1) * system_len
    assert stats["requests"] >= clients and 0 < stats["hit_rate"] <= 1
    assert stats["blocks"]["total"] == stats["blocks"]["free"] + stats["blocks"]["used"] + stats["blocks"]["cached"]
    metrics = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(http.get("/metrics").text) for s in fam.samples}
    labels = (("system_prompt", key), ("tenant", "default"))
    labelled = metrics[("radixserve_system_prompt_requests_total", labels)]
    assert labelled == clients  # the prompt's first request counts under its own label too
    assert metrics[("radixserve_system_prompt_hit_requests_total", labels)] >= clients - 2
    assert metrics[("radixserve_prompt_tokens_cached_total", ())] >= after.cached_tokens
    assert metrics[("radixserve_time_to_first_token_seconds_count", ())] >= clients
    assert ("radixserve_kv_blocks", (("state", "free"),)) in metrics


def test_cancel_stops_within_a_step_and_frees_blocks(chat_server, monkeypatch) -> None:  # noqa: ANN001
    """The server asks the engine to abort when the cancel frame arrives; the engine must act on it at
    the next step boundary (at most the step already running completes), and the reply keeps exactly
    the tokens generated by then."""
    sync_engine, steps, aborts = chat_server.engine.engine, [0], []
    step, abort_async, abort_sync = sync_engine.step, chat_server.engine.abort, sync_engine.abort

    def counting_step():  # noqa: ANN202 - engine thread
        out = step()
        steps[0] += 1
        return out

    def recording_abort_async(request_id: str) -> None:  # event-loop thread: the cancel arrived
        aborts.append({"asked_at_step": steps[0]})
        abort_async(request_id)

    def recording_abort_sync(request_id: str):  # noqa: ANN202 - engine thread: the abort is applied
        req = sync_engine.requests.get(request_id)
        if req is not None and aborts:
            aborts[-1].update(applied_at_step=steps[0], generated=req.sequences[0].num_generated)
        return abort_sync(request_id)

    monkeypatch.setattr(sync_engine, "step", counting_step)
    monkeypatch.setattr(chat_server.engine, "abort", recording_abort_async)
    monkeypatch.setattr(sync_engine, "abort", recording_abort_sync)

    async def run() -> tuple[dict[str, Any], float]:
        async with connect(chat_server) as ws:
            sid = (await request(ws, {"type": "session.create", **OWNED,
                                      "sampling": {"temperature": 0}}))["session"]["id"]
            await ws.send(json.dumps({"type": "chat", **OWNED, "session_id": sid,
                                      "content": "Write a long story about a cat.",
                                      "gen_id": "long", "sampling": {"max_tokens": 200}}))
            while (f := await recv_frame(ws))["type"] != "delta":
                pass
            t0 = time.monotonic()
            await ws.send(json.dumps({"type": "cancel", "gen_id": "long", "req": "c"}))
            while f["type"] != "done":
                f = await recv_frame(ws)
            took = time.monotonic() - t0
            # the session is free again and keeps the partial reply
            again = await request(ws, {"type": "session.resume", **OWNED, "session_id": sid})
            assert again["session"]["messages"][-1]["finish_reason"] == "abort"
            assert not again["session"]["busy"]
            return f, took

    done, took = asyncio.run(run())
    assert done["finish_reason"] == "abort" and took < 10
    assert len(aborts) == 1 and "applied_at_step" in aborts[0], aborts
    assert aborts[0]["applied_at_step"] - aborts[0]["asked_at_step"] <= 1
    assert done["usage"]["completion_tokens"] == aborts[0]["generated"] < 200
    wait_until(lambda: engine_idle(chat_server), what="blocks freed after cancel")
    assert chat_server.engine.leaked_blocks() == 0


async def until(predicate: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """`wait_until` for a client coroutine: polls without blocking the client's event loop."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def hold_engine(chat_server, monkeypatch) -> threading.Event:  # noqa: ANN001
    """The engine thread takes no step (so produces no token) until the returned event is set; it still
    applies its commands (adds and aborts), so an abort is answered at once with an empty output."""
    sync_engine, release = chat_server.engine.engine, threading.Event()
    step = sync_engine.step

    def held_step():  # noqa: ANN202 - engine thread
        return step() if release.wait(0.01) else []

    monkeypatch.setattr(sync_engine, "step", held_step)
    return release


def never_answer(chat_server, monkeypatch) -> threading.Event:  # noqa: ANN001
    """The engine never answers a request (as when one step outlasts the disconnect's wait): the
    disconnect ends the generation by cancelling its task. Returns an event set once a request came."""
    called = threading.Event()

    async def generate(request, request_id=None, cancelled=None, placement=None):  # noqa: ANN001, ANN202
        called.set()
        await asyncio.Event().wait()  # until the disconnect cancels the generation's task
        yield

    monkeypatch.setattr(chat_server.engine, "generate_validated", generate)
    monkeypatch.setattr(ws_module, "TEARDOWN_WAIT_S", 0.2)  # how soon it is cancelled does not matter
    return called


@pytest.mark.parametrize("when", ["after_first_delta", "before_first_token", "before_engine_answers"])
def test_disconnect_aborts_records_the_turn_and_frees_blocks(chat_server, monkeypatch, when: str) -> None:  # noqa: ANN001
    """A disconnect aborts the turn, frees its blocks, and records it on the session as an assistant reply
    with finish_reason "abort" and what was generated (possibly nothing), whenever it lands: after the
    first delta, before the engine produced a token (the engine is held), or before the engine answered
    at all (the generation's task is cancelled). A client that comes back sees the aborted turn."""
    wait_until(lambda: engine_idle(chat_server), what="the engine idle before the test")
    aborted_before = chat_server.engine.stats().requests_finished.get("abort", 0)
    release = hold_engine(chat_server, monkeypatch) if when == "before_first_token" else None
    called = never_answer(chat_server, monkeypatch) if when == "before_engine_answers" else None
    content = "Count from one to a hundred."
    # what the session's `busy` was while its turn was being recorded: a reader on another thread (this
    # test) that sees the session free must find the turn in it, so busy is cleared only after
    watched: list[Any] = []  # the Session, once created
    busy_while_recording: list[str | None] = []
    formatter = chat_server.state.formatter
    closed_reply = formatter.closed_reply

    def recording_close(*args: Any, **kwargs: Any) -> Any:  # event-loop thread: the reply is being recorded
        busy_while_recording.append(watched[0].busy if watched else "no session")
        return closed_reply(*args, **kwargs)

    monkeypatch.setattr(formatter, "closed_reply", recording_close)

    def queued() -> bool:
        st = chat_server.engine.stats()
        return st.num_waiting + st.num_running == 1

    async def run() -> tuple[str, dict[str, Any]]:
        async with connect(chat_server) as ws:
            sid = (await request(ws, {"type": "session.create", **OWNED,
                                      "sampling": {"temperature": 0}}))["session"]["id"]
            watched.append(chat_server.state.sessions.get(sid, TEST_OWNER_KEY))
            await ws.send(json.dumps({"type": "chat", **OWNED, "session_id": sid, "content": content,
                                      "gen_id": "g", "sampling": {"max_tokens": 200}}))
            if when == "after_first_delta":
                while (await recv_frame(ws))["type"] != "delta":
                    pass
            elif release is not None:  # committed and queued in the held engine: no token can come
                await until(queued, "the request queued in the held engine")
            else:
                assert called is not None
                await until(called.is_set, "the request handed to the engine")
        # leaving the block closed the socket; wait for the turn to end before releasing the engine
        await until(lambda: not chat_server.state.sessions.get(sid, TEST_OWNER_KEY).busy, "the turn recorded")
        if release is not None:
            release.set()
        async with connect(chat_server) as ws:  # the client comes back
            resumed = await request(ws, {"type": "session.resume", **OWNED, "session_id": sid})
        return sid, resumed["session"]

    try:
        sid, resumed = asyncio.run(run())
    finally:
        if release is not None:
            release.set()
    wait_until(lambda: engine_idle(chat_server), what="blocks freed after disconnect")
    assert chat_server.engine.leaked_blocks() == 0
    # the engine saw an abort unless it never answered (then it never had the request)
    aborted = 0 if when == "before_engine_answers" else 1
    assert chat_server.engine.stats().requests_finished.get("abort", 0) == aborted_before + aborted

    session = chat_server.state.sessions.get(sid, TEST_OWNER_KEY)
    assert busy_while_recording == ["g"]
    user, reply = session.messages
    assert session.busy is None and (user.role, user.content) == ("user", content)
    assert (reply.role, reply.finish_reason) == ("assistant", "abort")
    assert reply.token_start == user.token_end and reply.token_end == len(session.tokens)  # a closed turn
    assert reply.usage is not None
    generated = reply.usage["completion_tokens"]
    # the prompt: the history, the user message and the generation prompt, which opens the reply's tokens
    assert user.token_end < reply.usage["prompt_tokens"] <= reply.token_end - generated
    if when == "after_first_delta":
        assert reply.content and 1 <= generated < 200
    else:
        assert reply.content == "" and generated == 0
    assert not resumed["busy"] and [m["role"] for m in resumed["messages"]] == ["user", "assistant"]
    assert resumed["messages"][-1]["finish_reason"] == "abort" and resumed["messages"][-1]["content"] == reply.content


def test_session_busy_duplicate_and_unknown_gen_ids(chat_server) -> None:  # noqa: ANN001
    async def run() -> list[dict[str, Any]]:
        async with connect(chat_server) as ws:
            created = await request(ws, {"type": "session.create", **OWNED,
                                         "sampling": {"temperature": 0, "max_tokens": 3}})
            sid = created["session"]["id"]
            await ws.send(json.dumps({"type": "chat", **OWNED, "session_id": sid, "content": "one", "gen_id": "a"}))
            errors = [await request(ws, {"type": "chat", **OWNED, "session_id": sid, "content": "two", "gen_id": "a"}),
                      await request(ws, {"type": "chat", **OWNED, "session_id": sid, "content": "two", "gen_id": "b"}),
                      await request(ws, {"type": "cancel", "gen_id": "nope"})]
            frames = []
            while not frames or frames[-1]["type"] != "done":
                frames.append(await recv_frame(ws))
            return errors + [frames[-1]]

    dup, busy, unknown, done = asyncio.run(run())
    assert (dup["type"], dup["code"], dup["gen_id"]) == ("error", "duplicate_gen_id", "a")
    assert (busy["code"], busy["gen_id"]) == ("session_busy", "b")
    assert unknown["code"] == "unknown_gen_id" and done["gen_id"] == "a"


def test_rest_session_lifecycle_fork_and_sse(chat_server) -> None:  # noqa: ANN001
    http = rest_client(chat_server)
    r = http.post("/v1/sessions", json={"system_prompt": "You answer briefly.", "sampling": GREEDY})
    assert r.status_code == 201
    sid = r.json()["id"]
    first = http.post(f"/v1/sessions/{sid}/messages", json={"content": "Name a color."})
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["message"]["role"] == "assistant" and body["message"]["content"]
    assert body["message_index"] == 1 and body["finish_reason"] in ("stop", "length")
    turn1_tokens = body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]

    with http.stream("POST", f"/v1/sessions/{sid}/messages",
                     json={"content": "Another one.", "stream": True}) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events][0] == "start" and events[-1]["type"] == "done"
    assert "".join(e["text"] for e in events if e["type"] == "delta")
    assert events[-1]["usage"]["cached_tokens"] >= turn1_tokens - 1

    history = http.get(f"/v1/sessions/{sid}").json()
    assert [m["role"] for m in history["messages"]] == ["user", "assistant"] * 2
    assert history["messages"][3]["content"] == "".join(e["text"] for e in events if e["type"] == "delta")

    fork = http.post(f"/v1/sessions/{sid}/fork", json={"at_message": 2})
    assert fork.status_code == 201
    child = fork.json()
    assert [m["content"] for m in child["messages"]] == [m["content"] for m in history["messages"][:2]]
    branch = http.post(f"/v1/sessions/{child['id']}/messages", json={"content": "A different question."}).json()
    # the branch shares the parent's first turn blocks
    assert branch["usage"]["cached_tokens"] >= turn1_tokens - 1 and branch["message_index"] == 3
    assert len(http.get(f"/v1/sessions/{sid}").json()["messages"]) == 4  # the parent is untouched

    async def resume() -> dict[str, Any]:
        async with connect(chat_server) as ws:
            return await request(ws, {"type": "session.resume", **OWNED, "session_id": sid, "req": "r"})

    resumed = asyncio.run(resume())  # the WebSocket sees the REST session
    assert resumed["type"] == "session.resumed" and resumed["req"] == "r"
    assert resumed["session"]["messages"] == history["messages"]

    listed = {s["id"] for s in http.get("/v1/sessions").json()["sessions"]}
    assert {sid, child["id"]} <= listed
    assert http.delete(f"/v1/sessions/{sid}").status_code == 204
    for method, path in [("GET", f"/v1/sessions/{sid}"), ("DELETE", f"/v1/sessions/{sid}"),
                         ("POST", f"/v1/sessions/{sid}/messages"), ("POST", f"/v1/sessions/{sid}/fork")]:
        r = http.request(method, path, json={"content": "x", "at_message": 0})
        assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_session"
    assert http.get(f"/v1/sessions/{child['id']}").status_code == 200


def test_sessions_are_private_to_their_owner(chat_server) -> None:  # noqa: ANN001
    """A second client, with another owner secret or none, can neither see nor touch the first client's
    sessions, over REST or the WebSocket; every refusal looks exactly like an unknown session."""
    anon = httpx.Client(base_url=chat_server.url, timeout=60)
    created = anon.post("/v1/sessions", json={"system_prompt": "Private.", "sampling": GREEDY})
    assert created.status_code == 201
    sid, alice_secret = created.json()["id"], created.json()["owner"]  # no secret sent: the server mints one
    assert isinstance(alice_secret, str) and len(alice_secret) >= 16
    alice = httpx.Client(base_url=chat_server.url, timeout=60, headers={"X-Session-Owner": alice_secret})
    assert alice.post(f"/v1/sessions/{sid}/messages", json={"content": "Say one word."}).status_code == 200
    bob_made = anon.post("/v1/sessions", json={}).json()
    bob = httpx.Client(base_url=chat_server.url, timeout=60, headers={"X-Session-Owner": bob_made["owner"]})
    assert bob_made["owner"] != alice_secret

    missing = anon.get("/v1/sessions/no-such-session-id-at-all")
    assert missing.status_code == 404
    for client in (bob, anon):
        listed = {s["id"] for s in client.get("/v1/sessions").json()["sessions"]}
        assert sid not in listed
        for method, path, body in [("GET", f"/v1/sessions/{sid}", None),
                                   ("POST", f"/v1/sessions/{sid}/messages", {"content": "leak it"}),
                                   ("POST", f"/v1/sessions/{sid}/fork", {"at_message": 2}),
                                   ("DELETE", f"/v1/sessions/{sid}", None)]:
            r = client.request(method, path, json=body)
            assert (r.status_code, r.json()) == (404, missing.json()), (method, path, r.text)
    assert {s["id"] for s in bob.get("/v1/sessions").json()["sessions"]} == {bob_made["id"]}

    async def ws_run() -> None:
        async with connect(chat_server) as ws:
            for owner in ({"owner": bob_made["owner"]}, {}, {"owner": alice_secret + "x"}):
                err = await request(ws, {"type": "session.resume", "session_id": sid, **owner})
                assert (err["type"], err["code"]) == ("error", "unknown_session"), err
                err = await request(ws, {"type": "chat", "session_id": sid, "content": "leak", "gen_id": "b", **owner})
                assert (err["type"], err["code"], err["gen_id"]) == ("error", "unknown_session", "b"), err
            # the owner: resume, chat, and a session.create that carries the secret joins the same owner
            resumed = await request(ws, {"type": "session.resume", "session_id": sid, "owner": alice_secret})
            assert resumed["type"] == "session.resumed" and len(resumed["session"]["messages"]) == 2
            frames = await chat(ws, sid, "Another word.", gen_id="a", owner=alice_secret)
            assert frames[-1]["type"] == "done", frames[-1]
            made = await request(ws, {"type": "session.create", "owner": alice_secret})
            assert made["type"] == "session.created" and made["session"]["owner"] == alice_secret
            minted = await request(ws, {"type": "session.create"})
            assert minted["session"]["owner"] not in (alice_secret, bob_made["owner"])
            assert (await request(ws, {"type": "session.resume", "session_id": minted["session"]["id"],
                                       "owner": minted["session"]["owner"]}))["type"] == "session.resumed"
            listed = {s["id"] for s in alice.get("/v1/sessions").json()["sessions"]}
            assert listed == {sid, made["session"]["id"]}

    asyncio.run(ws_run())
    assert len(alice.get(f"/v1/sessions/{sid}").json()["messages"]) == 4  # untouched by the others
    fork = alice.post(f"/v1/sessions/{sid}/fork", json={"at_message": 2})
    assert fork.status_code == 201 and "owner" not in fork.json()
    child = fork.json()["id"]  # forks belong to the forker
    assert child in {s["id"] for s in alice.get("/v1/sessions").json()["sessions"]}
    assert bob.get(f"/v1/sessions/{child}").status_code == 404
    r = anon.post("/v1/sessions", json={}, headers={"X-Session-Owner": "short"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Session-Owner"
    assert alice.delete(f"/v1/sessions/{sid}").status_code == 204
    assert alice.get(f"/v1/sessions/{sid}").status_code == 404


def test_sse_client_disconnect_frees_blocks(chat_server) -> None:  # noqa: ANN001
    http = rest_client(chat_server)
    sid = http.post("/v1/sessions", json={"sampling": {"temperature": 0}}).json()["id"]
    with http.stream("POST", f"/v1/sessions/{sid}/messages",
                     json={"content": "Tell me a long story.", "stream": True, "sampling": {"max_tokens": 200}}) as r:
        for line in r.iter_lines():
            if '"delta"' in line:
                break
    wait_until(lambda: engine_idle(chat_server), what="blocks freed after SSE disconnect")
    session = chat_server.state.sessions.get(sid, TEST_OWNER_KEY)
    wait_until(lambda: session.busy is None, what="the aborted turn recorded on the session")
    assert chat_server.engine.leaked_blocks() == 0


def test_health_static_ui_and_ping(chat_server) -> None:  # noqa: ANN001
    http = rest_client(chat_server, timeout=30)
    assert http.get("/health").json()["status"] == "ok"
    index = http.get("/")
    assert index.status_code == 200 and "radixserve test ui" in index.text
    assert http.get("/app.js").text == "console.log('ui');"
    assert http.get("/v1/nope").json()["error"]["code"] == "not_found"

    async def run() -> dict[str, Any]:
        async with connect(chat_server) as ws:
            return await request(ws, {"type": "ping", "req": {"n": 1}})

    assert asyncio.run(run()) == {"type": "pong", "req": {"n": 1}}
