"""The sampling-field table (radixserve/sampling_fields.py) and what is generated from it.

Without a server: the table agrees with SamplingFields and SamplingParams (names, neutral values =
defaults), the session allow-list and the SamplingParams fields passed are the table's, and the new
SamplingParams fields are validated. Against the tiny chat server, on every API (chat, completions,
Responses, Anthropic Messages, REST sessions, WebSocket sessions): the table walked — every field
accepted in range under each API's name and refused out of range with that API's 400 naming it,
names of other APIs ignored (or refused by a session's `sampling` object, which takes exactly its
own), beam search refusing what the table says it excludes — and each new field doing what it
says (`ignore_eos`, `stop_token_ids`, `min_tokens`, `bad_words`, `allowed_token_ids`).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import MISSING, fields
from typing import Any

import httpx
import pytest
from tiny_models import TINY_VOCAB, tiny_chat_model_dir

from radixserve.model.loader import load_tokenizer
from radixserve.sampling_fields import (
    FIELDS,
    PASSED,
    TABLE,
    Api,
    Feature,
    Kind,
    SamplingField,
    SamplingFields,
    api_name,
    api_names,
)
from radixserve.sampling_params import SamplingParams
from radixserve.server import BackgroundServer
from radixserve.server.pipeline.sampling import SAMPLING_KEYS, build_sampling_params, parse_sampling, read_sampling
from radixserve.server.validation import ApiError

pytest.register_assert_rewrite("server_testkit")
from server_testkit import OWNED, chat, connect, engine_idle, request, rest_client, wait_until  # noqa: E402

pytest_plugins = ["server_testkit"]

FOX = 372  # " fox" in the tiny tokenizer (checked below)
PROMPT = "The quick brown fox jumps over the lazy dog. Hello, how are you today?"
HTTP_APIS = (Api.CHAT, Api.COMPLETIONS, Api.RESPONSES, Api.ANTHROPIC, Api.SESSION)


# -- the table, without a server ---------------------------------------------------------------------------

def test_every_row_is_a_typed_field_whose_neutral_value_is_the_default() -> None:
    typed = {f.name for f in fields(SamplingFields)}
    params = {f.name: f for f in fields(SamplingParams)}
    for row in TABLE:
        assert row.name in typed, row.name
        if row.name == "max_tokens":  # unset: clamped to the context left (build_sampling_params)
            continue
        p = params[row.name]
        default = p.default_factory() if p.default_factory is not MISSING else p.default
        assert row.neutral == default, row.name
    assert set(PASSED) <= set(params), set(PASSED) - set(params)
    assert set(PASSED) == {r.name for r in TABLE} - {"max_tokens"} | {
        "logprobs", "prompt_logprobs", "structured", "skip_special_tokens", "prediction"}


def test_allow_lists_come_from_the_table() -> None:
    assert SAMPLING_KEYS == api_names(Api.SESSION) == tuple(r.name for r in TABLE)
    anthropic = api_names(Api.ANTHROPIC)
    assert "stop_sequences" in anthropic and "stop" not in anthropic and "max_tokens" in anthropic
    assert api_names(Api.CHAT)[:0] == () and "max_completion_tokens" in api_names(Api.CHAT)
    assert "max_output_tokens" in api_names(Api.RESPONSES) and "max_tokens" not in api_names(Api.RESPONSES)
    for new in ("min_tokens", "bad_words", "allowed_token_ids", "stop_token_ids", "ignore_eos"):
        assert all(new in api_names(api) for api in Api), new
    beams = {r.name for r in TABLE for ex in r.excludes if ex.feature is Feature.BEAM_SEARCH}
    assert beams == {"temperature", "top_p", "top_k", "min_p", "stop", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "logit_bias", "min_tokens", "bad_words", "allowed_token_ids"}


def samples(row: SamplingField) -> tuple[Any, Any]:
    """An in-range value of `row` (one a one-token reply can take) and an out-of-range one."""
    if row.kind is Kind.FLOAT:
        assert row.high is not None and row.low is not None
        return row.high, row.high + 0.5
    if row.kind is Kind.INT:
        assert row.low is not None
        ok = int(row.high) if row.high is not None else int(row.low)
        return ok, int(row.low) - 1
    return {Kind.BOOL: (True, "yes"), Kind.STRINGS: (["zz"], [""]), Kind.WORDS: (["zz"], [""]),
            Kind.TOKEN_IDS: ([FOX], [-1]), Kind.LOGIT_BIAS: ({str(FOX): 100}, {str(FOX): 101})}[row.kind]


@pytest.mark.parametrize("row", TABLE, ids=lambda r: r.name)
def test_each_field_reads_the_same_under_every_api_name(row: SamplingField) -> None:
    ok, bad = samples(row)
    expected = read_sampling({row.name: ok}, Api.SESSION)
    for api in Api:
        for name in row.names[api]:
            assert read_sampling({name: ok}, api) == expected, (api, name)
            with pytest.raises(ApiError) as e:
                read_sampling({name: bad}, api)
            assert (e.value.code, e.value.status, e.value.param) == ("invalid_field", 400, name)
            assert name in e.value.message


@pytest.mark.parametrize("value", [4, 3.5, -1, True])
def test_sampling_params_refuse_a_bad_min_tokens(value: object) -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=value)  # type: ignore[arg-type]
    SamplingParams(max_tokens=3, min_tokens=3)


@pytest.mark.parametrize("kw", [
    {"bad_words": "fox"}, {"bad_words": [""]}, {"bad_words": [1]}, {"bad_words": ["x"] * 129},
    {"allowed_token_ids": []}, {"allowed_token_ids": [-1]}, {"allowed_token_ids": [True]},
    {"allowed_token_ids": [2**31]}, {"stop_token_ids": [-1]}, {"stop_token_ids": 5}, {"ignore_eos": 1},
])
def test_sampling_params_validate_the_new_fields(kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(kw))):
        SamplingParams(**kw)


def test_min_tokens_over_max_tokens_is_a_400_naming_it() -> None:
    sampling = read_sampling({"min_tokens": 9, "max_tokens": 4}, Api.CHAT)
    with pytest.raises(ApiError) as e:
        build_sampling_params(sampling, prompt_len=1, max_model_len=64, default_max_tokens=None)
    assert (e.value.param, e.value.status) == ("min_tokens", 400)
    params = build_sampling_params(read_sampling({"min_tokens": 4, "bad_words": ["fox"], "allowed_token_ids": [5],
                                                  "stop_token_ids": [7], "ignore_eos": True, "max_tokens": 4},
                                                 Api.ANTHROPIC), prompt_len=1, max_model_len=64, default_max_tokens=None)
    assert (params.min_tokens, params.bad_words, params.allowed_token_ids, params.stop_token_ids, params.ignore_eos) \
        == (4, ["fox"], [5], [7], True)


def test_a_turn_takes_its_sessions_fields_unless_it_sets_them() -> None:
    session = parse_sampling({"temperature": 0, "bad_words": ["a"], "ignore_eos": True})
    turn = SamplingFields(temperature=0.5, structured=None, skip_special_tokens=False)
    merged = turn.with_defaults(session)
    assert (merged.temperature, merged.bad_words, merged.ignore_eos, merged.skip_special_tokens) == \
        (0.5, ["a"], True, False)
    assert session.to_json() == {"temperature": 0.0, "bad_words": ["a"], "ignore_eos": True}
    with pytest.raises(ApiError) as e:
        parse_sampling({"stop_sequences": ["x"]})  # Anthropic's name, not a session's
    assert e.value.param == "sampling"


# -- against a server, every API --------------------------------------------------------------------------

def body_of(api: Api, srv: BackgroundServer, values: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """A request of `api` setting `values` (by the API's own names) and `max_tokens` (by its name)."""
    model = srv.state.model_name
    limit = {api_name(api, "max_tokens"): max_tokens}
    if api is Api.CHAT:
        return {"model": model, "messages": [{"role": "user", "content": PROMPT}], **limit, **values}
    if api is Api.COMPLETIONS:
        return {"model": model, "prompt": PROMPT, **limit, **values}
    if api is Api.RESPONSES:
        return {"model": model, "input": PROMPT, "store": False, **limit, **values}
    if api is Api.ANTHROPIC:
        return {"model": model, "messages": [{"role": "user", "content": PROMPT}], **limit, **values}
    return {"content": PROMPT, "sampling": {**limit, **values}}


class Reply:
    def __init__(self, api: Api, r: httpx.Response) -> None:
        self.api, self.status, self.json = api, r.status_code, r.json()

    def error(self) -> tuple[str | None, str]:
        """(param, message) of a 400 in the API's shape (Anthropic's names no param: its message does)."""
        assert self.status == 400, self.json
        err = self.json["error"]
        if self.api is Api.ANTHROPIC:
            assert self.json["type"] == "error" and err["type"] == "invalid_request_error", self.json
            return None, err["message"]
        assert err["code"] == "invalid_field", self.json
        return err["param"], err["message"]

    def text(self) -> str:
        j = self.json
        assert self.status == 200, j
        if self.api is Api.CHAT:
            return str(j["choices"][0]["message"]["content"] or "")
        if self.api is Api.COMPLETIONS:
            return str(j["choices"][0]["text"])
        if self.api is Api.RESPONSES:
            return "".join(p["text"] for item in j["output"] for p in item["content"])
        if self.api is Api.ANTHROPIC:
            return "".join(b["text"] for b in j["content"] if b["type"] == "text")
        return str(j["message"]["content"] or "")

    def tokens(self) -> int:
        u = self.json["usage"]
        return int(u["output_tokens"] if self.api in (Api.RESPONSES, Api.ANTHROPIC) else u["completion_tokens"])

    def by_length(self) -> bool:
        """Did the reply end at its max_tokens (rather than on EOS or a stop)?"""
        j = self.json
        if self.api in (Api.CHAT, Api.COMPLETIONS):
            return bool(j["choices"][0]["finish_reason"] == "length")
        if self.api is Api.RESPONSES:
            return bool(j["status"] == "incomplete")
        if self.api is Api.ANTHROPIC:
            return bool(j["stop_reason"] == "max_tokens")
        return bool(j["finish_reason"] == "length")


class Client:
    """One HTTP client over every API of a server; sessions made once, as TEST_OWNER."""

    def __init__(self, srv: BackgroundServer) -> None:
        self.srv, self.http = srv, rest_client(srv, timeout=120)
        self.session: str | None = None
        self.turns = 0  # of the session: a fresh one every few, so its history stays far from the context

    def send(self, api: Api, values: dict[str, Any], max_tokens: int = 1) -> Reply:
        body = body_of(api, self.srv, values, max_tokens)
        if api is Api.SESSION:
            if self.session is None or self.turns >= 6:
                self.session, self.turns = self.http.post("/v1/sessions", json={}).json()["id"], 0
            reply = Reply(api, self.http.post(f"/v1/sessions/{self.session}/messages", json=body))
            self.turns += reply.status == 200
            return reply
        path = {Api.CHAT: "/v1/chat/completions", Api.COMPLETIONS: "/v1/completions", Api.RESPONSES: "/v1/responses",
                Api.ANTHROPIC: "/v1/messages"}[api]
        return Reply(api, self.http.post(path, json=body))

    def by_name(self, api: Api, fields: dict[str, Any], max_tokens: int = 1) -> Reply:
        """`fields` by their table names, sent under `api`'s names."""
        return self.send(api, {api_name(api, k): v for k, v in fields.items()}, max_tokens)


@pytest.fixture(scope="module")
def client(tiny_chat_server: BackgroundServer) -> Client:
    tokenizer = load_tokenizer(tiny_chat_model_dir("llama"))
    assert tokenizer.encode(" fox", add_special_tokens=False) == [FOX]
    return Client(tiny_chat_server)


def no_leaks(srv: BackgroundServer) -> None:
    wait_until(lambda: engine_idle(srv), what="the engine idle with no blocks held")


@pytest.mark.parametrize("api", HTTP_APIS, ids=lambda a: a.value)
def test_the_table_walked_on_every_api(client: Client, api: Api) -> None:
    """Every field the API can express: accepted in range, refused out of range with the API's 400
    naming it; a name only other APIs use is ignored (refused by a session's `sampling` object)."""
    for row in TABLE:
        ok, bad = samples(row)
        for name in row.names.get(api, ()):
            accepted = client.send(api, {name: ok})
            assert accepted.status == 200 and accepted.tokens() <= 1, (name, accepted.json)
            param, message = client.send(api, {name: bad}).error()
            assert param in (name, None) and name in message, (api, name, message)
        for name in {n for other in Api for n in row.names.get(other, ())} - set(row.names.get(api, ())):
            foreign = client.send(api, {name: bad})
            if api is Api.SESSION:
                assert foreign.error()[0] == "sampling", foreign.json
            else:
                assert foreign.status == 200, (api, name, foreign.json)  # unknown fields are ignored
    no_leaks(client.srv)


def test_beam_search_refuses_what_the_table_excludes(client: Client) -> None:
    base = {"use_beam_search": True, "n": 2}
    for row in TABLE:
        for ex in row.excludes:
            assert ex.feature is Feature.BEAM_SEARCH
            ok, _ = samples(row)
            if ok == (row.neutral if ex.allowed is None else ex.allowed):  # another in-range value, not allowed
                assert row.low is not None and row.high is not None or row.kind is Kind.INT, row.name
                ok = ok + 1 if row.kind is Kind.INT else (row.low + row.high) / 2  # type: ignore[operator]
            value = ok
            param, message = client.send(Api.CHAT, {**base, row.names[Api.CHAT][0]: value}, 2).error()
            assert param == row.names[Api.CHAT][0] and "use_beam_search" in message, message
    allowed = {r.name: r.neutral if ex.allowed is None else ex.allowed for r in TABLE for ex in r.excludes}
    allowed |= {"ignore_eos": True, "stop_token_ids": [FOX], "seed": 3}
    r = client.send(Api.CHAT, {**base, **{k: v for k, v in allowed.items() if v is not None}}, 2)
    assert r.status == 200 and len(r.json["choices"]) == 2, r.json
    no_leaks(client.srv)


@pytest.mark.parametrize("api", HTTP_APIS, ids=lambda a: a.value)
def test_ignore_eos_runs_past_eos(client: Client, api: Api) -> None:
    eos = client.srv.engine.eos_token_ids[0]
    forced = {"temperature": 0, "logit_bias": {str(eos): 100}}
    stopped = client.by_name(api, forced, max_tokens=5)
    assert not stopped.by_length() and stopped.tokens() <= 1, stopped.json
    ran = client.by_name(api, {**forced, "ignore_eos": True}, max_tokens=5)
    assert ran.by_length() and ran.tokens() == 5, ran.json
    no_leaks(client.srv)


@pytest.mark.parametrize("api", HTTP_APIS, ids=lambda a: a.value)
def test_stop_token_ids_end_the_reply(client: Client, api: Api) -> None:
    forced = {"temperature": 0, "logit_bias": {str(FOX): 100}}
    assert client.by_name(api, forced, max_tokens=4).text() == " fox" * 4
    stopped = client.by_name(api, {**forced, "stop_token_ids": [FOX]}, max_tokens=4)
    assert not stopped.by_length() and stopped.tokens() == 1, stopped.json
    no_leaks(client.srv)


# The three below need the engine's side of the fields (the masks in the step: engine/, another change)

@pytest.mark.parametrize("api", HTTP_APIS, ids=lambda a: a.value)
def test_min_tokens_holds_off_stop_tokens_and_eos(client: Client, api: Api) -> None:
    eos = client.srv.engine.eos_token_ids[0]
    for forced in ({"logit_bias": {str(FOX): 100}, "stop_token_ids": [FOX]}, {"logit_bias": {str(eos): 100}}):
        held = client.by_name(api, {"temperature": 0, "min_tokens": 3, **forced}, max_tokens=8)
        assert held.status == 200 and held.tokens() >= 3, (forced, held.json)
        assert not held.by_length(), held.json  # once min_tokens are out, the forced stop ends it
    no_leaks(client.srv)


@pytest.mark.parametrize("api", HTTP_APIS, ids=lambda a: a.value)
def test_bad_words_are_never_generated(client: Client, api: Api) -> None:
    r = client.by_name(api, {"temperature": 0, "logit_bias": {str(FOX): 100}, "bad_words": ["fox"]}, max_tokens=6)
    assert r.status == 200 and "fox" not in r.text() and r.tokens() >= 1, r.json
    # a word of two tokens: its second is masked only right after its first, so " fox" still comes but
    # never twice in a row (the text may still read " fox fox" through other tokens: the ban is on ids)
    pair = client.by_name(api, {"temperature": 0, "logit_bias": {str(FOX): 100}, "bad_words": ["fox fox"]},
                          max_tokens=6)
    assert pair.status == 200 and pair.text().startswith(" fox") and pair.text() != " fox" * 6, pair.json
    no_leaks(client.srv)


@pytest.mark.parametrize("api", HTTP_APIS, ids=lambda a: a.value)
def test_allowed_token_ids_are_all_that_is_sampled(client: Client, api: Api) -> None:
    r = client.by_name(api, {"temperature": 1.0, "seed": 11, "allowed_token_ids": [FOX], "ignore_eos": True},
                       max_tokens=5)
    assert r.status == 200 and r.text() == " fox" * 5, r.json
    past = client.by_name(api, {"allowed_token_ids": [TINY_VOCAB]})  # past the vocabulary
    param, message = past.error()
    assert param in ("allowed_token_ids", None) and "allowed_token_ids" in message, past.json
    no_leaks(client.srv)


def test_websocket_turns_take_the_new_fields(tiny_chat_server: BackgroundServer) -> None:
    eos = tiny_chat_server.engine.eos_token_ids[0]
    sampling = {"temperature": 0, "max_tokens": 4, "logit_bias": {str(eos): 100}, "ignore_eos": True}

    async def over_ws() -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
        async with connect(tiny_chat_server) as ws:
            created = await request(ws, {"type": "session.create", "sampling": sampling, **OWNED})
            sid = created["session"]["id"]
            assert created["session"]["sampling"]["ignore_eos"] is True
            ran = await chat(ws, sid, PROMPT, "g1")
            stopped = await chat(ws, sid, PROMPT, "g2", sampling={"logit_bias": {str(FOX): 100},
                                                                   "stop_token_ids": [FOX]})
            bad = await chat(ws, sid, PROMPT, "g3", sampling={"min_tokens": -1})
            return ran, stopped, bad

    ran, stopped, bad = asyncio.run(over_ws())
    assert ran[-1]["type"] == "done" and ran[-1]["finish_reason"] == "length", ran[-1]
    assert ran[-1]["usage"]["completion_tokens"] == 4
    assert stopped[-1]["type"] == "done" and stopped[-1]["finish_reason"] == "stop", stopped[-1]
    assert stopped[-1]["usage"]["completion_tokens"] == 1
    assert bad[-1]["type"] == "error" and bad[-1]["code"] == "invalid_field" and "min_tokens" in bad[-1]["message"]
    no_leaks(tiny_chat_server)


def test_the_ranges_are_finite_and_ordered() -> None:
    for row in TABLE:
        if row.low is not None and row.high is not None:
            assert math.isfinite(row.low) and math.isfinite(row.high) and row.low < row.high, row.name
    assert FIELDS["temperature"].range_text() == "[0, 2]" and FIELDS["top_p"].range_text() == "(0, 1]"
