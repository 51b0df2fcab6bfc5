"""The OpenAI Responses API (/v1/responses) through the official `openai` client against a real server.

Fast tests run the tiny random-weight chat model (its text is noise; greedy makes it repeatable):
the response object and its stream as the client parses them, stored responses (retrieve, delete,
store: false), chains by previous_response_id whose stored token ids APPEND to the previous ones
(and are rendered again when the instructions change), owners (another owner's id is a 404 like an
unknown one), the 400s for what the server cannot honour, disconnects that abort the engine
request, and the shared session byte budget evicting stored responses least recently used first.
The slow tests run the embedded SmolLM2: a 10-turn chain whose every turn hits the cache on the
whole previous conversation but one block, streamed and not.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from radixserve import AsyncEngine, EngineConfig
from radixserve.server import BackgroundServer, ServerConfig
from radixserve.server.owners import OWNER_HEADER
from radixserve.server.responses.store import StoredResponse

pytest.register_assert_rewrite("server_testkit")
from server_testkit import TEST_OWNER, engine_idle, on_server_loop, rest_client, wait_until  # noqa: E402

pytest_plugins = ["server_testkit"]

EVENT_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added"]
CLOSING = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
LONG = 900  # tokens: seconds of generation on the tiny model, whose context is 1024


def client_of(srv: BackgroundServer, key: str = "unused", owner: str | None = TEST_OWNER) -> openai.OpenAI:
    headers = {OWNER_HEADER: owner} if owner is not None else {}
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=120, default_headers=headers)


def stored(srv: BackgroundServer, response_id: str) -> StoredResponse | None:
    """The store's entry, looked at without touching it (no LRU move)."""
    async def look() -> StoredResponse | None:
        assert srv.state.sessions is not None
        return next((e for e in srv.state.sessions if isinstance(e, StoredResponse) and e.id == response_id), None)

    return on_server_loop(srv, look())  # type: ignore[no-any-return]


def stored_count(srv: BackgroundServer) -> int:
    async def count() -> int:
        assert srv.state.sessions is not None
        return sum(isinstance(e, StoredResponse) for e in srv.state.sessions)

    return on_server_loop(srv, count())  # type: ignore[no-any-return]


def aborted(srv: BackgroundServer) -> int:
    return int(srv.engine.stats().requests_finished.get("abort", 0))


def raw_events(srv: BackgroundServer, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """A stream's events as sent: each `event:` line with its `data:` object."""
    import json

    out: list[tuple[str, dict[str, Any]]] = []
    with httpx.Client(base_url=srv.url, timeout=120) as http, \
            http.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        kind = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert kind == data["type"], (kind, data)
                out.append((kind, data))
    return out


def check_object(r: Any, model: str) -> None:
    """What every finished response says, as the client parsed it."""
    assert r.id.startswith("resp_") and r.object == "response" and r.model == model and r.error is None
    assert r.status in ("completed", "incomplete")
    assert (r.incomplete_details is not None and r.incomplete_details.reason == "max_output_tokens") == \
        (r.status == "incomplete")
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert item.status == r.status
    [part] = item.content
    assert part.type == "output_text" and part.annotations == [] and r.output_text == part.text
    u = r.usage
    assert u.total_tokens == u.input_tokens + u.output_tokens and u.output_tokens_details.reasoning_tokens == 0
    assert 0 <= u.input_tokens_details.cached_tokens < u.input_tokens
    assert r.tools == [] and r.text.format.type == "text" and r.tool_choice == "auto"


# -- the object, retrieve, delete, store: false -------------------------------------------------------------

def test_create_retrieve_delete(tiny_chat_server: BackgroundServer) -> None:
    client, model = client_of(tiny_chat_server), tiny_chat_server.state.model_name
    r = client.responses.create(model=model, input="Hello there.", max_output_tokens=6, temperature=0,
                                metadata={"ticket": "42"}, instructions="Be brief.", user="ignored")
    check_object(r, model)
    assert r.status == "incomplete" or r.usage.output_tokens < 6
    assert r.metadata == {"ticket": "42"} and r.instructions == "Be brief." and r.store is True
    assert r.max_output_tokens == 6 and r.temperature == 0 and r.previous_response_id is None
    assert client.responses.retrieve(r.id).model_dump() == r.model_dump()
    assert client.responses.delete(r.id) is None  # the client's type: it reads no body
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
    assert stored(tiny_chat_server, r.id) is None


def test_delete_body_and_message_items(tiny_chat_server: BackgroundServer) -> None:
    model = tiny_chat_server.state.model_name
    http = httpx.Client(base_url=tiny_chat_server.url, timeout=60)
    items = [{"role": "developer", "content": "Answer in one word."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Colour of the sky?"}]},
             {"type": "message", "role": "assistant", "id": "msg_x", "status": "completed",
              "content": [{"type": "output_text", "text": "Blue.", "annotations": []}]},
             {"role": "user", "content": "And grass?"}]
    r = http.post("/v1/responses", json={"model": model, "input": items, "max_output_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    entry = stored(tiny_chat_server, r.json()["id"])
    assert entry is not None and entry.system_prompt is None
    assert [(m.role, m.content) for m in entry.messages[:-1]] == [
        ("system", "Answer in one word."), ("user", "Colour of the sky?"), ("assistant", "Blue."),
        ("user", "And grass?")]
    assert entry.messages[-1].role == "assistant" and entry.busy is None
    gone = http.delete(f"/v1/responses/{r.json()['id']}")
    assert gone.status_code == 200 and gone.json() == {"id": r.json()["id"], "object": "response", "deleted": True}


def test_store_false_is_not_kept(tiny_chat_server: BackgroundServer) -> None:
    client, model = client_of(tiny_chat_server), tiny_chat_server.state.model_name
    before = stored_count(tiny_chat_server)
    r = client.responses.create(model=model, input="Not kept.", max_output_tokens=4, store=False, temperature=0)
    check_object(r, model)
    assert r.store is False and stored_count(tiny_chat_server) == before
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=model, input="Next.", previous_response_id=r.id, max_output_tokens=4)
    assert e.value.body["code"] == "not_found" and e.value.body["param"] == "previous_response_id"


# -- chains: exact tokens appended, instructions rendered again ---------------------------------------------

def test_chain_appends_the_exact_tokens_and_hits_the_cache(tiny_chat_server: BackgroundServer) -> None:
    client, model = client_of(tiny_chat_server), tiny_chat_server.state.model_name
    block = tiny_chat_server.engine.block_size
    tag = secrets.token_hex(4)  # a prompt no other test sent: the first turn misses
    first = client.responses.create(model=model, input=f"Chain {tag}, turn one.", instructions="Be kind.",
                                    max_output_tokens=8, temperature=0)
    second = client.responses.create(model=model, input="Turn two.", instructions="Be kind.",
                                     previous_response_id=first.id, max_output_tokens=8, temperature=0)
    check_object(second, model)
    assert second.previous_response_id == first.id
    a, b = stored(tiny_chat_server, first.id), stored(tiny_chat_server, second.id)
    assert a is not None and b is not None
    assert b.tokens[:len(a.tokens)] == a.tokens and len(b.tokens) > len(a.tokens)
    assert second.usage.input_tokens > len(a.tokens)
    whole = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= whole - block
    # the follow-up's prompt is the stored conversation + its input: the reply's tokens were kept exactly
    assert len(b.tokens) >= second.usage.input_tokens + second.usage.output_tokens


def test_changed_instructions_render_the_history_again(tiny_chat_server: BackgroundServer) -> None:
    client, model = client_of(tiny_chat_server), tiny_chat_server.state.model_name
    formatter = tiny_chat_server.state.formatter
    assert formatter is not None
    tag = secrets.token_hex(4)
    first = client.responses.create(model=model, input=f"Tell me {tag}.", instructions=f"First persona {tag}.",
                                    max_output_tokens=6, temperature=0)
    new = f"Another persona entirely, {tag}."
    second = client.responses.create(model=model, input="Go on.", instructions=new, previous_response_id=first.id,
                                     max_output_tokens=6, temperature=0)
    a, b = stored(tiny_chat_server, first.id), stored(tiny_chat_server, second.id)
    assert a is not None and b is not None
    system = formatter.system_tokens([{"role": "system", "content": new}])
    assert b.system_prompt == new and b.tokens[:len(system)].tolist() == system and b.system_len == len(system)
    assert b.tokens[:len(a.tokens)] != a.tokens  # not appended: rendered again from the system message on
    assert [(m.role, m.content) for m in b.messages] == [
        ("user", f"Tell me {tag}."), ("assistant", first.output_text), ("user", "Go on."),
        ("assistant", second.output_text)]
    assert second.usage.input_tokens_details.cached_tokens < tiny_chat_server.engine.block_size
    # a follow-up with the same instructions appends again; one without any renders without a system message
    third = client.responses.create(model=model, input="More.", instructions=new, previous_response_id=second.id,
                                    max_output_tokens=4, temperature=0)
    c = stored(tiny_chat_server, third.id)
    assert c is not None and c.tokens[:len(b.tokens)] == b.tokens
    fourth = client.responses.create(model=model, input="Plain.", previous_response_id=third.id, max_output_tokens=4,
                                     temperature=0)
    d = stored(tiny_chat_server, fourth.id)
    assert d is not None and d.system_prompt is None and d.system_len == 0 and fourth.instructions is None
    assert d.tokens[:len(system)].tolist() != system and len(d.messages) == 8


# -- streaming -----------------------------------------------------------------------------------------------

def test_stream_events_join_to_the_non_streamed_text(tiny_chat_server: BackgroundServer) -> None:
    model = tiny_chat_server.state.model_name
    ask = {"model": model, "input": "Stream me a line.", "max_output_tokens": 12, "temperature": 0}
    whole = client_of(tiny_chat_server).responses.create(**ask)
    events = raw_events(tiny_chat_server, ask)
    kinds = [k for k, _ in events]
    assert kinds[:4] == EVENT_ORDER and kinds[-4:-1] == CLOSING and kinds[-1] == f"response.{whole.status}"
    assert set(kinds[4:-4]) <= {"response.output_text.delta"}
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    deltas = [d for k, d in events if k == "response.output_text.delta"]
    assert all(d["item_id"] == events[2][1]["item"]["id"] and d["output_index"] == 0 and d["content_index"] == 0
               and d["logprobs"] == [] for d in deltas)
    text = "".join(d["delta"] for d in deltas)
    assert text == whole.output_text and events[-4][1]["text"] == text
    final = events[-1][1]["response"]
    assert final["output"][0]["content"][0]["text"] == text and final["usage"]["output_tokens"] == \
        whole.usage.output_tokens
    assert events[0][1]["response"]["status"] == "in_progress" and events[0][1]["response"]["id"] == final["id"]
    # the client's own stream types parse every event
    parsed = list(client_of(tiny_chat_server).responses.create(**ask, stream=True))
    assert [e.type for e in parsed] == kinds
    assert "".join(e.delta for e in parsed if e.type == "response.output_text.delta") == text


def test_responses_stream_helper_to_a_completed_response(tiny_chat_server: BackgroundServer) -> None:
    client, model = client_of(tiny_chat_server), tiny_chat_server.state.model_name
    ask: dict[str, Any] = {"model": model, "input": "Say anything.", "max_output_tokens": 24, "temperature": 0}
    free = client.responses.create(**ask).output_text
    stop = next((c for c in free[2:] if c.isalnum()), None)
    assert stop is not None, f"no letter to stop at in {free!r}"
    whole = client.responses.create(**ask, extra_body={"stop": [stop]})
    assert whole.status == "completed" and whole.incomplete_details is None and stop not in whole.output_text
    with client.responses.stream(**ask, extra_body={"stop": [stop]}) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == whole.output_text == "".join(deltas)
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_disconnects_abort_the_engine_request_and_keep_nothing(tiny_chat_server: BackgroundServer) -> None:
    model = tiny_chat_server.state.model_name
    before, kept = aborted(tiny_chat_server), stored_count(tiny_chat_server)
    ask = {"model": model, "input": "Write a very long story.", "max_output_tokens": LONG, "temperature": 0}
    with httpx.Client(base_url=tiny_chat_server.url, timeout=60) as http, \
            http.stream("POST", "/v1/responses", json={**ask, "stream": True}) as r:
        rid = None
        for line in r.iter_lines():
            if '"response.created"' in line and line.startswith("data: "):
                rid = line.split('"id":"', 1)[1].split('"', 1)[0]
            if '"response.output_text.delta"' in line:
                break  # the client hangs up mid-stream
    assert rid is not None
    wait_until(lambda: engine_idle(tiny_chat_server), timeout=10, what="the stream's generation aborted")
    assert aborted(tiny_chat_server) == before + 1
    assert stored(tiny_chat_server, rid) is None and stored_count(tiny_chat_server) == kept
    with httpx.Client(base_url=tiny_chat_server.url, timeout=1.0) as http, pytest.raises(httpx.ReadTimeout):
        http.post("/v1/responses", json=ask)  # not streamed: the client gives up
    wait_until(lambda: engine_idle(tiny_chat_server), timeout=10, what="the request's generation aborted")
    assert aborted(tiny_chat_server) == before + 2
    wait_until(lambda: stored_count(tiny_chat_server) == kept, timeout=5, what="the aborted response dropped")
    assert tiny_chat_server.engine.leaked_blocks() == 0


def test_a_response_still_generating_is_in_progress_and_refused_as_previous(tiny_chat_server: BackgroundServer) \
        -> None:
    client, model = client_of(tiny_chat_server), tiny_chat_server.state.model_name
    with client.responses.create(model=model, input="A long one.", max_output_tokens=LONG, temperature=0,
                                 stream=True) as stream:
        rid = None
        for event in stream:
            if event.type == "response.created":
                rid = event.response.id
            if event.type == "response.output_text.delta":
                break
        assert rid is not None
        assert client.responses.retrieve(rid).status == "in_progress"
        with pytest.raises(openai.ConflictError) as e:
            client.responses.create(model=model, input="Next.", previous_response_id=rid, max_output_tokens=2)
        assert e.value.body["code"] == "response_in_progress"
    wait_until(lambda: engine_idle(tiny_chat_server), timeout=10, what="the stream's generation aborted")


def test_an_error_mid_stream_is_an_error_event_and_response_failed(tiny_chat_server: BackgroundServer) -> None:
    client, model = client_of(tiny_chat_server), tiny_chat_server.state.model_name

    async def abort(rid: str) -> None:  # as shutdown does to what is left after the grace period
        tiny_chat_server.engine.abort(rid)

    events = []
    with client.responses.create(model=model, input="A long one.", max_output_tokens=LONG, temperature=0,
                                 stream=True) as stream:
        for event in stream:
            events.append(event)
            if event.type == "response.output_text.delta" and len(events) == 5:
                on_server_loop(tiny_chat_server, abort(events[0].response.id))
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2].code == "unavailable" and "aborted" in events[-2].message
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "server_error" and failed.id == events[0].response.id
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert stored(tiny_chat_server, failed.id) is None
    wait_until(lambda: engine_idle(tiny_chat_server), timeout=10, what="the aborted request gone")


# -- owners and refusals --------------------------------------------------------------------------------------

def test_another_owners_response_is_answered_as_unknown(tiny_chat_server: BackgroundServer) -> None:
    model = tiny_chat_server.state.model_name
    alice, mallory = client_of(tiny_chat_server), client_of(tiny_chat_server, owner=secrets.token_urlsafe(16))
    r = alice.responses.create(model=model, input="Mine.", max_output_tokens=3, temperature=0)
    entry = stored(tiny_chat_server, r.id)
    assert entry is not None
    used = entry.last_used
    for attempt in (lambda: mallory.responses.retrieve(r.id), lambda: mallory.responses.delete(r.id),
                    lambda: mallory.responses.create(model=model, input="x", previous_response_id=r.id)):
        with pytest.raises(openai.NotFoundError) as e:
            attempt()
        assert e.value.body["code"] == "not_found"
    assert entry.last_used == used  # untouched: no LRU move, no longer life
    # without an owner secret the API key is the owner; without either, one anonymous owner
    keyed, other_key = client_of(tiny_chat_server, "key-a", None), client_of(tiny_chat_server, "key-b", None)
    k = keyed.responses.create(model=model, input="Keyed.", max_output_tokens=3)
    assert keyed.responses.retrieve(k.id).id == k.id
    for other in (other_key, alice):
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(k.id)
    http = httpx.Client(base_url=tiny_chat_server.url, timeout=60)
    anon = http.post("/v1/responses", json={"model": model, "input": "Anyone.", "max_output_tokens": 3}).json()
    assert http.get(f"/v1/responses/{anon['id']}").json()["id"] == anon["id"]
    with pytest.raises(openai.NotFoundError):
        keyed.responses.retrieve(anon["id"])
    assert alice.responses.retrieve(r.id).id == r.id


def test_sessions_and_responses_do_not_see_each_other(tiny_chat_server: BackgroundServer) -> None:
    model = tiny_chat_server.state.model_name
    sessions = rest_client(tiny_chat_server)
    sid = sessions.post("/v1/sessions", json={}).json()["id"]
    r = client_of(tiny_chat_server).responses.create(model=model, input="Hi.", max_output_tokens=2)  # same owner
    assert sessions.get(f"/v1/sessions/{r.id}").status_code == 404
    assert r.id not in [s["id"] for s in sessions.get("/v1/sessions").json()["sessions"]]
    assert sessions.get(f"/v1/responses/{sid}").json()["error"]["code"] == "not_found"
    assert sessions.delete(f"/v1/sessions/{sid}").status_code == 204


@pytest.mark.parametrize(("extra", "status", "param"), [
    ({"tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ({"tool_choice": "required"}, 400, "tool_choice"),
    ({"reasoning": {"effort": "huge"}}, 400, "reasoning.effort"),
    ({"background": True, "store": False}, 400, "background"),
    ({"conversation": "conv_1"}, 400, "conversation"),
    ({"include": ["file_search_call.results"]}, 400, "include"),
    ({"text": {"format": {"type": "grammar"}}}, 400, "text.format.type"),
    ({"text": {"verbosity": "high"}}, 400, "text.verbosity"),
    ({"truncation": "middle"}, 400, "truncation"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     "input[0].content[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, 400, "input"),  # answers no call
    ({"input": [{"role": "tool", "content": "x"}]}, 400, "input[0].role"),
    ({"input": []}, 400, "input"),
    ({"input": 7}, 400, "input"),
    ({"input": None}, 400, "input"),
    ({"store": "yes"}, 400, "store"),
    ({"instructions": ["a"]}, 400, "instructions"),
    ({"metadata": {"k": 1}}, 400, "metadata"),
    ({"max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"max_output_tokens": 5000}, 400, "max_output_tokens"),
    ({"temperature": 3}, 400, "temperature"),
    ({"presence_penalty": 9}, 400, "presence_penalty"),
    ({"previous_response_id": 12}, 400, "previous_response_id"),
    ({"previous_response_id": "resp_" + "0" * 48}, 404, "previous_response_id"),
    ({"model": "gpt-4o"}, 404, "model"),
])
def test_bad_requests_are_clear_errors(tiny_chat_server: BackgroundServer, extra: dict[str, Any], status: int,
                                       param: str) -> None:
    body = {"model": tiny_chat_server.state.model_name, "input": "Hi.", "max_output_tokens": 4, **extra}
    r = httpx.post(tiny_chat_server.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert engine_idle(tiny_chat_server)


def test_sampling_extras_are_read(tiny_chat_server: BackgroundServer) -> None:
    client, model = client_of(tiny_chat_server), tiny_chat_server.state.model_name
    ask = {"model": model, "input": "Seeded.", "max_output_tokens": 8, "temperature": 1.0, "top_p": 0.9}
    extra = {"seed": 7, "top_k": 20, "presence_penalty": 0.5, "frequency_penalty": 0.2}
    a = client.responses.create(**ask, extra_body=extra, store=False)
    b = client.responses.create(**ask, extra_body=extra, store=False)
    assert a.output_text == b.output_text and a.temperature == 1.0 and a.top_p == 0.9


# -- the shared byte budget ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_store_server() -> Iterator[BackgroundServer]:
    from tiny_models import tiny_chat_model_dir

    model = str(tiny_chat_model_dir("llama"))
    config = ServerConfig(port=0, web_dir=None, shutdown_grace_s=0.5, max_session_bytes_total=12_000)
    with BackgroundServer(lambda: AsyncEngine(EngineConfig(model=model, num_blocks=256)), config) as srv:
        yield srv


def test_the_session_budget_evicts_stored_responses_least_recently_used(small_store_server: BackgroundServer) -> None:
    srv, client = small_store_server, client_of(small_store_server)
    model, store = srv.state.model_name, srv.state.sessions
    assert store is not None

    def create(i: int) -> str:
        return client.responses.create(model=model, input=f"Item number {i}.", max_output_tokens=4,
                                       temperature=0).id

    order = [create(i) for i in range(3)]
    client.responses.retrieve(order[0])  # used: now the most recent
    order = order[1:] + order[:1]
    while all(stored(srv, rid) is not None for rid in order):
        order.append(create(len(order)))
        assert len(order) < 40, "nothing was evicted"
        assert store.total_bytes <= store.max_bytes
    kept = [rid for rid in order if stored(srv, rid) is not None]
    assert kept == order[len(order) - len(kept):] and order[0] not in kept and len(kept) >= 2
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=model, input="x", previous_response_id=order[0])
    # chat sessions share the budget: a large one displaces the least recently used responses
    sessions = rest_client(srv)
    created = sessions.post("/v1/sessions", json={"system_prompt": "Remember this. " * 60})
    assert created.status_code == 201, created.text
    sid = created.json()["id"]
    left = [rid for rid in kept if stored(srv, rid) is not None]
    assert left == kept[len(kept) - len(left):] and len(left) < len(kept)
    assert store.total_bytes <= store.max_bytes
    assert sessions.delete(f"/v1/sessions/{sid}").status_code == 204


# -- the embedded model -----------------------------------------------------------------------------------------

def final_of(events: list[Any]) -> Any:
    """The response a stream ends with (completed or incomplete), checked against its deltas."""
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete"), last.type
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert last.response.output_text == text
    return last.response


@pytest.mark.slow
def test_ten_turn_chain_hits_the_whole_previous_conversation(chat_server: BackgroundServer) -> None:
    client, model = client_of(chat_server), chat_server.state.model_name
    block = chat_server.engine.block_size
    instructions = f"You are a patient tutor ({secrets.token_hex(4)}). Answer briefly."
    prev: Any = None
    ids: list[str] = []
    figures: list[tuple[int, int, int, int]] = []  # turn, input tokens, cached tokens, previous conversation
    for k in range(1, 11):
        ask: dict[str, Any] = {"model": model, "input": f"Question {k}: tell me one fact about the number {k}.",
                               "instructions": instructions, "max_output_tokens": 24, "temperature": 0}
        if prev is not None:
            ask["previous_response_id"] = prev.id
        # streamed and not, alternately: both store the same conversation
        r = final_of(list(client.responses.create(**ask, stream=True))) if k % 2 == 0 else client.responses.create(**ask)
        check_object(r, model)
        assert client.responses.retrieve(r.id).model_dump() == r.model_dump()
        cached = r.usage.input_tokens_details.cached_tokens
        whole = prev.usage.input_tokens + prev.usage.output_tokens if prev is not None else 0
        figures.append((k, r.usage.input_tokens, cached, whole))
        if prev is not None:
            assert cached >= whole - block, figures[-1]
            a, b = stored(chat_server, prev.id), stored(chat_server, r.id)
            assert a is not None and b is not None and b.tokens[:len(a.tokens)] == a.tokens
        prev = r
        ids.append(r.id)
    print("\n(turn, input_tokens, cached_tokens, previous conversation's tokens):", figures)
    assert figures[-1][2] >= figures[-1][3] - block and figures[-1][3] > 10 * block
    for rid in ids:
        client.responses.delete(rid)


@pytest.mark.slow
def test_embedded_stream_matches_the_non_streamed_reply(chat_server: BackgroundServer) -> None:
    client, model = client_of(chat_server), chat_server.state.model_name
    ask: dict[str, Any] = {"model": model, "input": "What is the capital of France? Answer in one sentence.",
                           "max_output_tokens": 64, "temperature": 0}
    whole = client.responses.create(**ask)
    assert whole.status == "completed" and "Paris" in whole.output_text
    assert final_of(list(client.responses.create(**ask, stream=True))).output_text == whole.output_text
    with client.responses.stream(**ask) as stream:
        final = stream.get_final_response()
    assert final.output_text == whole.output_text and final.status == "completed"
    follow = client.responses.create(model=model, input="And of Italy?", previous_response_id=final.id,
                                     max_output_tokens=64, temperature=0)
    assert "Rome" in follow.output_text
    for r in (whole, final, follow):
        client.responses.delete(r.id)
