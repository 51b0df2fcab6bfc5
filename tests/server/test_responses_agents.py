"""The Responses API as agents use it, through the official `openai` client against a real server on 127.0.0.1.

The tiny random-weight chat model (tests/tiny_models.py) answers: its text means nothing, so what is
checked holds whatever it says — `text.format` constraining the reply (`responses.parse` returns
`output_parsed`, streamed too), `include: ["message.output_text.logprobs"]` with `top_logprobs` on
the parts and on the streamed deltas, background responses (polled, cancelled, streamed and left,
holding their generation slot, settled at shutdown), `truncation: "auto"` dropping the oldest turns,
`max_tool_calls`, function calls through the SDK's stream helpers, and a 3-turn tool loop by
previous_response_id whose turns 2 and 3 hit the cache on the whole previous conversation, streamed
and not. Replies a random model would not write (three calls) are scripted (reasoning_kit.Replies).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from radixserve import AsyncEngine, EngineConfig
from radixserve.server import BackgroundServer, ServerConfig
from radixserve.server.owners import OWNER_HEADER
from radixserve.server.responses.background import _TASKS
from radixserve.server.responses.store import StoredResponse

pytest.register_assert_rewrite("server_testkit", "reasoning_kit")
from reasoning_kit import Replies  # noqa: E402
from server_testkit import TEST_OWNER, engine_idle, on_server_loop, wait_until  # noqa: E402
from tool_fixtures import SCHEMAS, TOOLS  # noqa: E402

pytest_plugins = ["server_testkit", "reasoning_kit"]

RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses shape: flat
# the same two tools without descriptions or optional parameters: a 3-turn loop fits the tiny context
SHORT_TOOLS = [{"type": "function", "name": t["name"],
                "parameters": {**t["parameters"], "properties": {k: v for k, v in t["parameters"]["properties"].items()
                                                                 if k in t["parameters"]["required"]}}}
               for t in RESPONSES_TOOLS]
LONG = 900  # tokens: seconds of generation on the tiny model, whose context is 1024
# a prompt with the tools rendered is ~800 tokens of the tiny model's 1024: calls get the rest
CALL_TOKENS = 200


def client_of(srv: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120,
                         default_headers={OWNER_HEADER: TEST_OWNER})


def stored(srv: BackgroundServer, response_id: str) -> StoredResponse | None:
    async def look() -> StoredResponse | None:
        assert srv.state.sessions is not None
        return next((e for e in srv.state.sessions if isinstance(e, StoredResponse) and e.id == response_id), None)

    return on_server_loop(srv, look())  # type: ignore[no-any-return]


def aborted(srv: BackgroundServer) -> int:
    return int(srv.engine.stats().requests_finished.get("abort", 0))


def generations(srv: BackgroundServer) -> int:
    async def held() -> int:
        return srv.state.generations.total

    return on_server_loop(srv, held())  # type: ignore[no-any-return]


def poll(client: openai.OpenAI, response_id: str) -> Any:
    """The background response once it has left queued / in_progress."""
    seen: list[Any] = []

    def ended() -> bool:
        seen.append(client.responses.retrieve(response_id))
        return seen[-1].status not in ("queued", "in_progress")

    wait_until(ended, timeout=60, what=f"background response {response_id} to end")
    return seen[-1]


def calls_of(r: Any) -> list[Any]:
    return [o for o in r.output if o.type == "function_call"]


def valid_call(call: Any) -> dict[str, Any]:
    assert call.type == "function_call" and call.call_id and call.id.startswith("fc_") and call.name in SCHEMAS
    args: dict[str, Any] = json.loads(call.arguments)
    jsonschema.validate(args, SCHEMAS[call.name])
    return args


# -- text.format: structured output, responses.parse -----------------------------------------------------------

class Forecast(BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    sunny: bool
    level: int = Field(ge=0, le=9)


def test_parse_returns_output_parsed(tiny_chat_server: BackgroundServer) -> None:
    client, model = client_of(tiny_chat_server), tiny_chat_server.state.model_name
    ask: dict[str, Any] = {"model": model, "input": "Forecast for Paris?", "max_output_tokens": 60}
    for temperature in (0.0, 1.0):
        r = client.responses.parse(**ask, text_format=Forecast, temperature=temperature)
        assert r.status == "completed" and isinstance(r.output_parsed, Forecast), r.output_text
        fmt = r.text.format
        assert fmt.type == "json_schema" and fmt.name == "Forecast" and fmt.strict is True
        assert fmt.schema_["properties"]["city"]["enum"] == ["Paris", "Rome", "Oslo"]
        assert client.responses.retrieve(r.id).text == r.text
    with client.responses.stream(**ask, text_format=Forecast, temperature=0) as stream:
        done = [e for e in stream if e.type == "response.output_text.done"]
        final = stream.get_final_response()
    assert isinstance(final.output_parsed, Forecast) and done[0].parsed == final.output_parsed
    # json_object: the reply is an object from its first token (a random model rarely closes one)
    obj = client.responses.create(model=model, input="Any JSON.", max_output_tokens=8, temperature=0,
                                  text={"format": {"type": "json_object"}}, store=False)
    assert obj.output_text.startswith("{") and obj.text.format.type == "json_object"
    free = client.responses.create(model=model, input="Any JSON.", max_output_tokens=8, temperature=0, store=False)
    assert not free.output_text.startswith("{")  # the same request without the format: the model's own noise


@pytest.mark.parametrize(("fmt", "param"), [
    ({"type": "xml"}, "text.format.type"),
    ({"type": "json_schema", "schema": {"type": "object"}}, "text.format.name"),
    ({"type": "json_schema", "name": "bad name!", "schema": {"type": "object"}}, "text.format.name"),
    ({"type": "json_schema", "name": "S", "schema": ["not", "a", "schema"]}, "text.format.schema"),
    ({"type": "json_schema", "name": "S", "schema": {"type": "object"}, "strict": "yes"}, "text.format.strict"),
    ({"type": "json_schema", "name": "Bad", "schema": {"type": "no-such-type"}}, "text.format.schema"),  # the engine's
    ("json", "text.format"),
])
def test_bad_text_formats_name_the_path(tiny_chat_server: BackgroundServer, fmt: Any, param: str) -> None:
    body = {"model": tiny_chat_server.state.model_name, "input": "Hi.", "max_output_tokens": 4,
            "text": {"format": fmt}}
    for stream in (False, True):  # refused before a stream opens
        r = httpx.post(tiny_chat_server.url + "/v1/responses", json={**body, "stream": stream}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert "response_format" not in r.json()["error"]["message"]


def test_a_reasoning_item_without_text_is_skipped(tiny_chat_server: BackgroundServer) -> None:
    """As clients send back the reasoning items they got (no content): wherever it stands; one with text
    must precede the assistant turn it belongs to."""
    body = {"model": tiny_chat_server.state.model_name, "max_output_tokens": 1, "store": False}
    empty = {"type": "reasoning", "summary": [], "encrypted_content": None}
    said = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Hmm."}]}
    for reasoning, status in ((empty, 200), (said, 400)):
        history = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}, reasoning,
                   {"role": "user", "content": "Again."}]
        r = httpx.post(tiny_chat_server.url + "/v1/responses", json={**body, "input": history}, timeout=60)
        assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == "input[2]"


# -- logprobs ------------------------------------------------------------------------------------------------------

def test_output_text_logprobs(tiny_chat_server: BackgroundServer) -> None:
    client, model = client_of(tiny_chat_server), tiny_chat_server.state.model_name
    ask: dict[str, Any] = {"model": model, "input": "Hello there.", "max_output_tokens": 12, "temperature": 0,
                           "include": ["message.output_text.logprobs"], "store": False}
    r = client.responses.create(**ask, top_logprobs=3)
    assert r.top_logprobs == 3 and r.status == "incomplete"
    [part] = r.output[0].content
    assert len(part.logprobs) == r.usage.output_tokens  # one entry a generated token (no end token: it was cut)
    for lp in part.logprobs:
        assert [t.logprob for t in lp.top_logprobs] == sorted((t.logprob for t in lp.top_logprobs), reverse=True)
        assert len(lp.top_logprobs) == 3 and lp.logprob <= 0 and isinstance(lp.bytes, list)
        assert lp.top_logprobs[0].token == lp.token and lp.top_logprobs[0].logprob == pytest.approx(lp.logprob)  # greedy
    # streamed: the deltas' logprobs are the part's, in order, and so are the done event's
    with client.responses.stream(**ask, top_logprobs=3) as stream:
        events = list(stream)
    deltas = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    [done] = [e for e in events if e.type == "response.output_text.done"]
    assert [(lp.token, lp.logprob) for lp in deltas] == [(lp.token, lp.logprob) for lp in done.logprobs]
    # the same greedy reply: its tokens, their logprobs up to a cached prefix's rounding
    assert [lp.token for lp in deltas] == [lp.token for lp in part.logprobs]
    assert [lp.logprob for lp in deltas] == pytest.approx([lp.logprob for lp in part.logprobs], abs=1e-3)
    # without the include, none (top_logprobs alone is only echoed); 0 alternatives: the tokens alone
    plain = client.responses.create(**{**ask, "include": None}, top_logprobs=3)
    assert plain.output[0].content[0].logprobs == [] and plain.top_logprobs == 3
    bare = client.responses.create(**ask)
    assert len(bare.output[0].content[0].logprobs) == bare.usage.output_tokens
    assert all(lp.top_logprobs == [] for lp in bare.output[0].content[0].logprobs)
    # many entries: the body and the stream's closing events are built off the event loop; the store counts them
    big = client.responses.create(**{**ask, "store": True, "max_output_tokens": 60}, top_logprobs=20)
    entry = stored(tiny_chat_server, big.id)
    assert entry is not None and entry.logprob_entries == 60 * 21
    assert client.responses.retrieve(big.id).output[0].content[0].logprobs == big.output[0].content[0].logprobs
    with client.responses.stream(**{**ask, "max_output_tokens": 60}, top_logprobs=20) as stream:
        streamed = list(stream)[-1].response  # response.incomplete: cut at max_output_tokens
    assert [lp.token for lp in streamed.output[0].content[0].logprobs] == \
        [lp.token for lp in big.output[0].content[0].logprobs]
    for extra, param in (({"top_logprobs": 21}, "top_logprobs"), ({"include": "message.output_text.logprobs"},
                                                                  "include")):
        bad = httpx.post(tiny_chat_server.url + "/v1/responses", json={**ask, **extra}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text


# -- background ----------------------------------------------------------------------------------------------------

def test_background_runs_without_its_client_and_is_polled(tiny_chat_server: BackgroundServer) -> None:
    client, model = client_of(tiny_chat_server), tiny_chat_server.state.model_name
    before = generations(tiny_chat_server)
    r = client.responses.create(model=model, input="Write a long story.", max_output_tokens=200, temperature=0,
                                background=True)
    assert r.background is True and r.status in ("queued", "in_progress") and r.output == []
    final = poll(client, r.id)
    assert final.status == "incomplete" and final.usage.output_tokens == 200 and final.output_text
    assert final.background is True and final.id == r.id
    wait_until(lambda: generations(tiny_chat_server) == before, what="the run's slot released")
    # the same generation in the foreground writes the same reply
    fg = client.responses.create(model=model, input="Write a long story.", max_output_tokens=200, temperature=0,
                                 store=False)
    assert fg.output_text == final.output_text and fg.background is False
    # it continues like any stored response
    follow = client.responses.create(model=model, input="More.", previous_response_id=r.id, max_output_tokens=4)
    assert follow.usage.input_tokens_details.cached_tokens >= final.usage.input_tokens
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, input="x", background=True, store=False)
    assert e.value.body["param"] == "background"


def test_cancel(tiny_chat_server: BackgroundServer) -> None:
    client, model = client_of(tiny_chat_server), tiny_chat_server.state.model_name
    before, slots = aborted(tiny_chat_server), generations(tiny_chat_server)
    r = client.responses.create(model=model, input="A very long story.", max_output_tokens=LONG, temperature=0,
                                background=True)
    wait_until(lambda: client.responses.retrieve(r.id).status == "in_progress", what="the run to start")
    assert generations(tiny_chat_server) == slots + 1  # the POST has answered; the run keeps its slot
    cancelled = client.responses.cancel(r.id)
    assert cancelled.status == "cancelled" and cancelled.id == r.id and cancelled.background is True
    wait_until(lambda: engine_idle(tiny_chat_server), what="the cancelled request gone")
    assert aborted(tiny_chat_server) == before + 1 and generations(tiny_chat_server) == slots
    assert client.responses.retrieve(r.id).status == "cancelled"
    assert client.responses.cancel(r.id).status == "cancelled"  # again: as it is
    entry = stored(tiny_chat_server, r.id)
    assert entry is not None and entry.busy is None
    with pytest.raises(openai.BadRequestError) as e:  # nothing to continue from
        client.responses.create(model=model, input="Go on.", previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id"
    # a foreground response, a finished background one, an unknown id
    fg = client.responses.create(model=model, input="Hi.", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.cancel(fg.id)
    assert e.value.body["message"] == "Cannot cancel a synchronous response."
    done = poll(client, client.responses.create(model=model, input="Hi.", max_output_tokens=2, background=True).id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.cancel(done.id)
    assert e.value.body["message"] == f"Cannot cancel a {done.status} response."
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_" + "0" * 48)
    # DELETE of a running background response cancels it
    running = client.responses.create(model=model, input="Another long one.", max_output_tokens=LONG,
                                      temperature=0, background=True)
    client.responses.delete(running.id)
    wait_until(lambda: engine_idle(tiny_chat_server), what="the deleted run's request gone")
    assert stored(tiny_chat_server, running.id) is None and generations(tiny_chat_server) == slots


def test_background_stream_goes_on_after_the_client_leaves(tiny_chat_server: BackgroundServer) -> None:
    client, model = client_of(tiny_chat_server), tiny_chat_server.state.model_name
    ask: dict[str, Any] = {"model": model, "input": "A long story, streamed.", "max_output_tokens": 300,
                           "temperature": 0}
    seen = []
    with client.responses.create(**ask, background=True, stream=True) as stream:
        for event in stream:
            seen.append(event)
            if event.type == "response.output_text.delta" and len(seen) > 6:
                break  # the client hangs up mid-stream
    rid = seen[0].response.id
    assert seen[0].type == "response.created" and seen[0].response.background is True
    # it streams again from any event while it runs, then ends as a whole stream does
    replay = list(client.responses.retrieve(rid, stream=True, starting_after=seen[2].sequence_number))
    assert replay[0].sequence_number == seen[3].sequence_number and replay[0].type == seen[3].type
    assert replay[-1].type == "response.incomplete"
    final = poll(client, rid)
    assert final.status == "incomplete" and final.usage.output_tokens == 300
    assert "".join(e.delta for e in seen + replay[len(seen) - 3:] if e.type == "response.output_text.delta") \
        == final.output_text
    with pytest.raises(openai.BadRequestError) as e:  # ended: nothing to follow
        client.responses.retrieve(rid, stream=True)
    assert e.value.body["param"] == "stream"


@pytest.fixture()
def own_server() -> Iterator[BackgroundServer]:
    from tiny_models import tiny_chat_model_dir

    model = str(tiny_chat_model_dir("llama"))
    config = ServerConfig(port=0, web_dir=None, shutdown_grace_s=0.2, max_generations_per_client=1)
    with BackgroundServer(lambda: AsyncEngine(EngineConfig(model=model, num_blocks=256)), config) as srv:
        yield srv


def test_shutdown_aborts_and_settles_background_runs(own_server: BackgroundServer) -> None:
    client, model = client_of(own_server), own_server.state.model_name
    r = client.responses.create(model=model, input="A very long story.", max_output_tokens=LONG, temperature=0,
                                background=True)
    wait_until(lambda: client.responses.retrieve(r.id).status == "in_progress", what="the run to start")
    entry, state = stored(own_server, r.id), own_server.state
    assert entry is not None and state.generations.total == 1
    with pytest.raises(openai.RateLimitError) as e:  # its slot is this client's one
        client.responses.create(model=model, input="Meanwhile.", max_output_tokens=2)
    assert e.value.body["code"] == "too_many_generations"
    own_server.__exit__(None, None, None)  # the fixture's exit then finds it stopped
    assert entry.busy is None and entry.body["status"] == "failed" and entry.body["error"]["code"] == "server_error"
    assert state.generations.total == 0 and not state.inflight.ids
    assert not [t for t in _TASKS if r.id in t.get_name()]


# -- truncation ----------------------------------------------------------------------------------------------------

def test_truncation_auto_drops_the_oldest_turns(tiny_chat_server: BackgroundServer) -> None:
    client, model = client_of(tiny_chat_server), tiny_chat_server.state.model_name
    tokenizer, context = tiny_chat_server.engine.tokenizer, tiny_chat_server.engine.max_model_len
    tag = secrets.token_hex(4)

    def text(k: int) -> str:  # about 40% of the context
        words = f"{tag} turn {k}: " + " ".join(["the quick brown fox"] * 200)
        ids = tokenizer(words, add_special_tokens=False)["input_ids"][:int(context * 0.4)]
        return str(tokenizer.decode(ids))

    ask: dict[str, Any] = {"model": model, "instructions": "Be brief.", "max_output_tokens": 4, "temperature": 0,
                           "truncation": "auto"}
    first = client.responses.create(**ask, input=text(1))
    second = client.responses.create(**ask, input=text(2), previous_response_id=first.id)
    a, b = stored(tiny_chat_server, first.id), stored(tiny_chat_server, second.id)
    assert a is not None and b is not None and b.tokens[:len(a.tokens)] == a.tokens  # fits: appended exactly
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    with pytest.raises(openai.BadRequestError) as e:  # disabled: the chain no longer fits
        client.responses.create(**{**ask, "truncation": "disabled"}, input=text(3), previous_response_id=second.id)
    assert e.value.body["code"] == "context_too_long"
    third = client.responses.create(**ask, input=text(3), previous_response_id=second.id)
    assert third.truncation == "auto" and third.usage.input_tokens + 4 <= context
    c = stored(tiny_chat_server, third.id)
    assert c is not None and c.system_prompt == "Be brief." and c.system_len == a.system_len
    assert c.tokens[:c.system_len] == a.tokens[:a.system_len]  # the instructions are kept
    kept = [m.content for m in c.messages if m.role == "user"]
    assert kept == [text(2), text(3)]  # the oldest turn went, the fewest that make it fit
    with pytest.raises(openai.BadRequestError) as e:  # one turn alone too long: refused as with disabled
        client.responses.create(**ask, input=text(1) + text(2) + text(3))
    assert e.value.body["code"] == "context_too_long"


# -- tools: max_tool_calls, the stream helpers, a 3-turn loop ------------------------------------------------------

HERMES_CALLS = "".join(f'<tool_call>\n{{"name": "add", "arguments": {{"a": {k}, "b": 1}}}}\n</tool_call>\n'
                       for k in range(3))


def test_max_tool_calls(tiny_chat_server: BackgroundServer, replies: Any) -> None:
    client, model = client_of(tiny_chat_server), tiny_chat_server.state.model_name
    scripted: Replies = replies(tiny_chat_server)
    ask: dict[str, Any] = {"model": model, "input": "Add things.", "tools": RESPONSES_TOOLS, "store": False,
                           "max_output_tokens": CALL_TOKENS}
    for most, expected in ((None, 3), (2, 2), (5, 3)):
        scripted.script([HERMES_CALLS[i:i + 9] for i in range(0, len(HERMES_CALLS), 9)])
        r = client.responses.create(**ask, **({"max_tool_calls": most} if most is not None else {}))
        assert r.max_tool_calls == most and [json.loads(c.arguments)["a"] for c in calls_of(r)] == \
            list(range(expected))
    # one call allowed: a forced reply's grammar writes one, where parallel calls made more
    forced = {**ask, "tool_choice": "required", "temperature": 1.0}
    seed = next(k for k in range(40) if len(calls_of(client.responses.create(**forced, extra_body={"seed": k}))) > 1)
    one = client.responses.create(**forced, max_tool_calls=1, extra_body={"seed": seed})
    assert len(calls_of(one)) == 1 and one.parallel_tool_calls is True
    valid_call(calls_of(one)[0])
    # none allowed: the tools are not offered, and the reply is not read for calls
    scripted.script([HERMES_CALLS])
    none = client.responses.create(**ask, max_tool_calls=0)
    assert calls_of(none) == [] and none.output_text == HERMES_CALLS and none.max_tool_calls == 0
    assert "Add two integers" not in scripted.prompt_text()
    bad = httpx.post(tiny_chat_server.url + "/v1/responses", json={**ask, "tool_choice": "required",
                                                                     "max_tool_calls": 0}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tool_calls", bad.text


def test_function_calls_through_the_stream_helpers(tiny_chat_server: BackgroundServer) -> None:
    """output_item.added -> function_call_arguments.delta* -> .done -> output_item.done per call, in the
    order the SDK's accumulator needs; get_final_response() has the calls."""
    client, model = client_of(tiny_chat_server), tiny_chat_server.state.model_name
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        with client.responses.stream(model=model, input="Weather in Paris?", tools=RESPONSES_TOOLS,  # type: ignore[arg-type]
                                     tool_choice=choice, max_output_tokens=CALL_TOKENS, temperature=0) as stream:
            events = list(stream)
            final = stream.get_final_response()
        calls = calls_of(final)
        assert calls and final.status == "completed" and all(valid_call(c) is not None for c in calls)
        if isinstance(choice, dict):
            assert [c.name for c in calls] == ["get_weather"]
        for index, call in enumerate(final.output):
            mine = [e for e in events if getattr(e, "output_index", None) == index]
            kinds = [e.type for e in mine]
            assert kinds[0] == "response.output_item.added" and kinds[-2:] == [
                "response.function_call_arguments.done", "response.output_item.done"], kinds
            assert set(kinds[1:-2]) == {"response.function_call_arguments.delta"}
            added, deltas, done = mine[0], mine[1:-2], mine[-2]
            assert added.item.type == "function_call" and added.item.call_id == call.call_id
            assert added.item.name == call.name and added.item.status == "in_progress"
            assert "".join(d.delta for d in deltas) == done.arguments == call.arguments
            assert deltas[-1].snapshot == call.arguments and mine[-1].item.status == "completed"
        assert events[-1].type == "response.completed"
        assert [e.sequence_number for e in events] == list(range(len(events)))
        kept = calls_of(client.responses.retrieve(final.id))
        assert [(c.call_id, c.arguments) for c in kept] == [(c.call_id, c.arguments) for c in calls]


@pytest.mark.parametrize("stream", [False, True])
def test_three_turn_tool_loop_hits_the_whole_previous_conversation(tiny_chat_server: BackgroundServer,
                                                                    stream: bool) -> None:
    client, model = client_of(tiny_chat_server), tiny_chat_server.state.model_name
    block = tiny_chat_server.engine.block_size

    def create(**kw: Any) -> Any:
        # one call a turn, short tools: the tools take much of the tiny model's context already
        ask = {"model": model, "tools": SHORT_TOOLS, "max_output_tokens": 60, "temperature": 0,
               "instructions": "Use the tools.", "parallel_tool_calls": False, **kw}
        if not stream:
            return client.responses.create(**ask)
        events = list(client.responses.create(**ask, stream=True))
        assert events[-1].type in ("response.completed", "response.incomplete")
        return events[-1].response

    def results(r: Any) -> list[dict[str, Any]]:
        return [{"type": "function_call_output", "call_id": c.call_id, "output": json.dumps({"ok": valid_call(c)})}
                for c in calls_of(r)]

    first = create(input="Weather in Paris, then add 2 and 3.", tool_choice={"type": "function", "name": "get_weather"})
    assert len(calls_of(first)) == 1 and first.status == "completed"
    second = create(input=results(first), previous_response_id=first.id, tool_choice={"type": "function", "name": "add"})
    assert len(calls_of(second)) == 1 and second.previous_response_id == first.id
    third = create(input=results(second), previous_response_id=second.id, max_output_tokens=6)
    assert calls_of(third) == [] and third.output[-1].type == "message"
    for prev, turn in ((first, second), (second, third)):
        whole = prev.usage.input_tokens + prev.usage.output_tokens
        assert turn.usage.input_tokens > whole
        assert turn.usage.input_tokens_details.cached_tokens >= whole - block, (turn.usage, whole)
        a, b = stored(tiny_chat_server, prev.id), stored(tiny_chat_server, turn.id)
        assert a is not None and b is not None and b.tokens[:len(a.tokens)] == a.tokens
    conversation = stored(tiny_chat_server, third.id)
    assert conversation is not None
    assert [m.role for m in conversation.messages] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
