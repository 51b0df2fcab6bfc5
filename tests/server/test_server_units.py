"""Server building blocks without a running server: chat-template token bookkeeping, sessions,
system-prompt counters and request validation (tokenizer of the embedded model; no model weights)."""

from __future__ import annotations

import copy
import math

import pytest

from radixserve.chat.template import FALLBACK_TEMPLATE, ChatFormatter, token_hash
from radixserve.engine.intake import Intake, Limits
from radixserve.errors import RequestError
from radixserve.sampling_fields import SamplingFields
from radixserve.server.hosts import host_allowed, origin_allowed, split_host
from radixserve.server.owners import Owner, parse_secret
from radixserve.server.pipeline.sampling import build_sampling_params, parse_sampling
from radixserve.server.pipeline.stream import api_error_from
from radixserve.server.request_guard import refusal
from radixserve.server.sessions.store import SessionStore
from radixserve.server.system_prompts import NONE_KEY, OTHER_KEY, SystemPromptTracker
from radixserve.server.validation import ApiError, parse_json_text

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokenizer():  # noqa: ANN201
    from radixserve.model.embedded import embedded_model_dir
    from radixserve.model.loader import load_tokenizer

    return load_tokenizer(embedded_model_dir())


@pytest.fixture()
def fmt(tokenizer) -> ChatFormatter:  # noqa: ANN001
    return ChatFormatter(tokenizer)


def full_tokens(tokenizer, messages) -> list[int]:  # noqa: ANN001
    """The reference: render the whole conversation and tokenize it in one go."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def play(fmt: ChatFormatter, system: str | None, turns: list[tuple[str, str, bool]]) -> tuple[list, list[int]]:
    """Build a conversation incrementally; each reply is tokenized as the model would emit it, ending
    with the end-of-turn token when `stopped` (else cut by length)."""
    history = [{"role": "system", "content": system}] if system is not None else []
    tokens = fmt.encode(fmt.render(history, add_generation_prompt=False))
    end = fmt.tokenizer.convert_tokens_to_ids("<|im_end|>")
    for user, reply, stopped in turns:
        t = fmt.append_user(history, user)
        prompt = tokens + t.user + t.generation_prompt
        history = history + [{"role": "user", "content": user}]
        generated = fmt.encode(reply) + ([end] if stopped else [])
        tokens = prompt + generated + fmt.close_assistant(history, generated, (end,))
        history = history + [{"role": "assistant", "content": reply}]
    return history, tokens


@pytest.mark.parametrize("system", ["You are terse.", None])
def test_incremental_tokens_equal_full_retokenization(fmt: ChatFormatter, tokenizer, system) -> None:  # noqa: ANN001
    turns = [("Hi there!", "Hello! How can I help you today?", True),
             ("What is 2+2?", "2 + 2 = 4", False),  # stopped by length: the whole end-of-turn is appended
             ("Thanks", "You're welcome.", True)]
    history, tokens = play(fmt, system, turns)
    assert tokens == full_tokens(tokenizer, history)
    assert fmt.incremental_fallbacks == 0


def test_generation_prompt_and_closing_follow_the_template(fmt: ChatFormatter, tokenizer) -> None:  # noqa: ANN001
    history = [{"role": "system", "content": "S"}]
    t = fmt.append_user(history, "question")
    opened = tokenizer.apply_chat_template(history + [{"role": "user", "content": "question"}], tokenize=False,
                                           add_generation_prompt=True)
    before = fmt.render(history, add_generation_prompt=False)
    assert fmt.decode(t.user + t.generation_prompt) == fmt.decode(fmt.encode(opened[len(before):]))
    assert tokenizer.decode(t.generation_prompt) == "<|im_start|>assistant\n"
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    h = history + [{"role": "user", "content": "question"}]
    assert tokenizer.decode(fmt.close_assistant(h, [42, end], (end,))) == "\n"
    assert tokenizer.decode(fmt.close_assistant(h, [42, 43], (end,))) == "<|im_end|>\n"
    assert tokenizer.decode(fmt.close_assistant(h, [], (end,))) == "<|im_end|>\n"


def test_tokenizer_without_template_uses_chatml(tokenizer) -> None:  # noqa: ANN001
    bare = copy.copy(tokenizer)
    bare.chat_template = None
    fmt = ChatFormatter(bare)
    assert fmt.template == FALLBACK_TEMPLATE
    text = fmt.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert fmt.implicit_prefix_len == len(fmt.encode("<|im_start|>user\n"))


def test_template_that_rewrites_history_falls_back_and_counts(tokenizer) -> None:  # noqa: ANN001
    odd = copy.copy(tokenizer)
    odd.chat_template = "{{ messages[-1]['role'] }}:{{ messages[-1]['content'] }}\n" \
                        "{% if add_generation_prompt %}A:{% endif %}"
    fmt = ChatFormatter(odd)
    t = fmt.append_user([{"role": "user", "content": "first"}], "second")
    assert fmt.incremental_fallbacks == 1
    # history kept as the model saw it; the new message appended after the common text prefix "user:"
    assert fmt.decode(t.user) == "second\n"
    assert fmt.decode(t.generation_prompt) == "A:"


def test_system_tokens_and_implicit_prefix(fmt: ChatFormatter) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x"}]
    assert fmt.tokenizer.decode(fmt.system_tokens(msgs)) == "<|im_start|>system\nBe brief.<|im_end|>\n"
    assert fmt.system_tokens(msgs[1:]) == []
    # SmolLM2's template injects a default system prompt when there is none: that is the shared preamble
    preamble = fmt.render([{"role": "user", "content": "x"}], False).split("<|im_start|>user")[0]
    assert fmt.implicit_prefix_len == len(fmt.encode(preamble + "<|im_start|>user\n"))


def test_token_hash_is_stable_and_distinguishes() -> None:
    assert token_hash([1, 2, 3]) == token_hash([1, 2, 3])
    assert token_hash([1, 2, 3]) != token_hash([1, 2, 4]) != token_hash([1, 2])
    assert len(token_hash([7])) == 12 and int(token_hash([7]), 16) >= 0


ME, THEM = Owner.of("owner-secret-of-me-0"), Owner.of("owner-secret-of-them-0")


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_sessions_fork_shares_exact_prefix(fmt: ChatFormatter) -> None:
    store = SessionStore(fmt, max_sessions=8, ttl_s=100)
    s = store.create("Sys", SamplingFields(temperature=0.0), ME)
    assert fmt.tokenizer.decode(list(s.tokens)) == "<|im_start|>system\nSys<|im_end|>\n" and s.system_len == len(s.tokens)
    from radixserve.server.sessions.store import Message

    for role, text in [("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d")]:
        start = len(s.tokens)
        s.tokens.extend(fmt.encode(f"<|im_start|>{role}\n{text}<|im_end|>\n"))
        s.messages.append(Message(role, text, start, len(s.tokens)))
    child = store.fork(s.id, 2, ME)
    assert child.id != s.id and [m.content for m in child.messages] == ["a", "b"]
    assert child.tokens == s.tokens[:s.messages[2].token_start]
    assert store.fork(s.id, 4, ME).tokens == s.tokens and store.fork(s.id, 0, ME).tokens == s.tokens[:s.system_len]
    with pytest.raises(ApiError) as e:
        store.fork(s.id, 5, ME)
    assert e.value.code == "invalid_field"


def test_sessions_cap_expiry_and_unknown(fmt: ChatFormatter) -> None:
    clock = FakeClock()
    store = SessionStore(fmt, max_sessions=2, ttl_s=10, clock=clock)
    a, b = store.create(None, SamplingFields(), ME), store.create(None, SamplingFields(), ME)
    clock.now = 1
    store.get(a.id, ME)  # a is now the most recently used: b goes first
    c = store.create(None, SamplingFields(), ME)
    assert store.evicted == 1 and {s.id for s in store.list(ME)} == {a.id, c.id}
    with pytest.raises(ApiError) as e:
        store.get(b.id, ME)
    assert (e.value.code, e.value.status) == ("unknown_session", 404)
    a.busy, c.busy = "g1", "g2"
    with pytest.raises(ApiError) as e:
        store.create(None, SamplingFields(), ME)
    assert e.value.status == 429
    a.busy = c.busy = None
    clock.now = 100
    for bad in (a.id, 123, None, "", "x" * 500):
        with pytest.raises(ApiError):
            store.get(bad, ME)
    assert store.list(ME) == [] and len(store) == 0 and store.expired == 2
    d = store.create(None, SamplingFields(), ME)
    store.delete(d.id, ME)
    with pytest.raises(ApiError):
        store.delete(d.id, ME)
    assert len({store.create(None, SamplingFields(), ME).id for _ in range(2)}) == 2


def test_sessions_belong_to_their_owner(fmt: ChatFormatter) -> None:
    clock = FakeClock()
    store = SessionStore(fmt, max_sessions=3, ttl_s=10, clock=clock)
    mine, theirs = store.create(None, SamplingFields(), ME), store.create("S", SamplingFields(), THEM)
    assert store.list(ME) == [mine] and store.list(THEM) == [theirs] and store.list(None) == []
    assert store.get(mine.id, ME) is mine
    for owner in (THEM, None, Owner.of("owner-secret-of-me-1")):
        for act in (lambda o: store.get(mine.id, o), lambda o: store.delete(mine.id, o),
                    lambda o: store.fork(mine.id, 0, o)):
            with pytest.raises(ApiError) as e:
                act(owner)
            assert (e.value.code, e.value.status, e.value.message) == (
                "unknown_session", 404, "unknown, deleted or expired session")
    clock.now = 5
    with pytest.raises(ApiError):
        store.get(theirs.id, ME)  # a foreign access does not refresh the session: it still expires at 10
    store.get(mine.id, ME)
    clock.now = 12
    assert store.list(THEM) == [] and store.list(ME) == [mine]
    child = store.fork(mine.id, 0, ME)
    assert {s.id for s in store.list(ME)} == {child.id, mine.id} and store.list(THEM) == []
    assert child.owner == mine.owner == ME.digest and len(ME.digest) == 32  # only the SHA-256 is stored
    assert "owner" not in mine.to_json() and "owner" not in mine.summary()
    assert store.delete(mine.id, ME) is mine and store.list(ME) == [child]


@pytest.mark.parametrize("value", [5, "", "short", "x" * 21, "x" * 257, "has space inside it", "new\nline-in-the-secret",
                                   "caf\u00e9-owner-secret-x", ["owner-secret-in-a-list"]])
def test_owner_secret_format(value: object) -> None:
    with pytest.raises(ApiError) as e:
        parse_secret(value, "owner")
    assert (e.value.code, e.value.param) == ("invalid_field", "owner")
    assert parse_secret(None, "owner") is None and parse_secret("A-b_c.d~e+f/g=h0123456", "owner") == "A-b_c.d~e+f/g=h0123456"


def test_system_prompt_labels_are_bounded_and_monotonic() -> None:
    tr = SystemPromptTracker(labels=2)
    seen: dict[str, int] = {}
    for round_ in range(5):
        for k in ("p1", "p2", "p3", "p4"):
            tr.record(k, k.upper(), 10, 30, 12 if round_ else 0)
        tr.record(NONE_KEY, "", 5, 20, 5)
        for label, c in tr.labelled.items():
            assert c.requests >= seen.get(label, 0)
            seen[label] = c.requests
    assert set(tr.labelled) == {NONE_KEY, OTHER_KEY, "p1", "p2"}
    assert sum(c.requests for c in tr.labelled.values()) == tr.total.requests == 25
    # labels go to the first prompts seen, from their first request on; the rest count under "other"
    assert tr.labelled["p1"].requests == tr.labelled["p2"].requests == 5 and tr.labelled[OTHER_KEY].requests == 5 + 5
    table = tr.table(top=3)
    assert [r["id"] for r in table][-1] == OTHER_KEY and sum(r["requests"] for r in table) == 25
    p1 = next(r for r in table if r["id"] == "p1")
    assert (p1["requests"], p1["hit_requests"], p1["cached_tokens"], p1["computed_tokens"]) == (5, 4, 48, 102)
    assert math.isclose(p1["hit_rate"], 0.8)


def test_system_prompt_first_request_counts_under_its_own_label() -> None:
    tr = SystemPromptTracker(labels=1)
    tr.record("p1", "P1", 10, 30, 0)
    assert tr.labelled["p1"].requests == 1 and tr.labelled[OTHER_KEY].requests == 0
    tr.record("p2", "P2", 10, 30, 0)  # the one label is taken: p2 counts under "other", from its first request
    tr.record("p1", "P1", 10, 30, 10)
    assert (tr.labelled["p1"].requests, tr.labelled["p1"].hit_requests, tr.labelled[OTHER_KEY].requests) == (2, 1, 1)
    assert "p2" not in tr.labelled


def test_system_prompt_tracker_drops_rare_rows_when_full() -> None:
    tr = SystemPromptTracker(labels=1, max_tracked=3)
    for i in range(10):
        tr.record(f"k{i}", "", 4, 10, 0)
    assert len(tr.exact) <= 3
    assert sum(r["requests"] for r in tr.table(top=2)) == 10


@pytest.mark.parametrize("text,code", [
    ("{", "bad_json"), ("", "bad_json"), ("NaN", "bad_json"), ('{"a": Infinity}', "bad_json"),
    ("[" * 30000 + "]" * 30000, "bad_json"), ("x" * 70000, "too_large"), ("é" * 40000, "too_large"),
])
def test_parse_json_text_rejects(text: str, code: str) -> None:
    with pytest.raises(ApiError) as e:
        parse_json_text(text, 64 * 1024)
    assert e.value.code == code and e.value.message


@pytest.mark.parametrize("sampling", [
    [], "x", {"temperature": -1}, {"temperature": 2.5}, {"temperature": "1"}, {"top_p": 0}, {"top_p": 1.5},
    {"max_tokens": 0}, {"max_tokens": 1.5}, {"max_tokens": True}, {"seed": "s"}, {"stop": [1]}, {"stop": [""]},
    {"stop": ["a"] * 9}, {"bogus": 1}, {"top_k": -1}, {"temperature": float("nan")}, {"min_p": -0.1},
    {"min_p": 1.5}, {"min_p": "0.1"}, {"presence_penalty": 2.5}, {"frequency_penalty": "x"},
    {"repetition_penalty": 0}, {"logit_bias": {"a": 1}}, {"logit_bias": {"3": 100.5}}, {"logit_bias": 5},
])
def test_parse_sampling_rejects(sampling: object) -> None:
    with pytest.raises(ApiError) as e:
        parse_sampling(sampling)
    assert e.value.code == "invalid_field" and e.value.status == 400
    if isinstance(sampling, dict) and set(sampling) <= {"presence_penalty", "frequency_penalty", "repetition_penalty",
                                                        "logit_bias"}:
        assert e.value.param == next(iter(sampling))


def test_parse_sampling_takes_penalties_into_the_params() -> None:
    s = parse_sampling({"presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.3,
                        "logit_bias": {"7": -100, "12": 2}, "temperature": 0})
    p = build_sampling_params(s, prompt_len=1, max_model_len=9, default_max_tokens=None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -1.0, 1.3)
    assert p.logit_bias == {7: -100.0, 12: 2.0} and p.has_penalties
    assert not build_sampling_params(parse_sampling({"repetition_penalty": 1, "logit_bias": {}}), prompt_len=1,
                                     max_model_len=9, default_max_tokens=None).has_penalties


def test_sampling_defaults_clamp_to_the_context() -> None:
    s = parse_sampling({"temperature": 0, "stop": "END", "seed": 3})
    assert s == SamplingFields(temperature=0.0, stop=["END"], seed=3)
    p = build_sampling_params(s, prompt_len=90, max_model_len=100, default_max_tokens=512)
    assert p.max_tokens == 10 and p.temperature == 0.0 and p.stop == ["END"] and p.seed == 3
    assert build_sampling_params(SamplingFields(), prompt_len=10, max_model_len=100, default_max_tokens=None).max_tokens == 90
    # a prompt that leaves no room is the engine's intake to refuse (once), as the API's context_too_long
    full = build_sampling_params(SamplingFields(), prompt_len=100, max_model_len=100, default_max_tokens=5)
    assert full.max_tokens == 1
    with pytest.raises(RequestError) as refused:
        Intake(None, Limits(vocab=200, max_seq_len=100)).check(list(range(100)), full)
    err = api_error_from(refused.value)
    assert (err.code, err.status) == ("context_too_long", 400) and "100" in err.message
    assert build_sampling_params(parse_sampling({"min_p": 0.05}), prompt_len=1, max_model_len=9,
                                 default_max_tokens=None).min_p == 0.05
    assert build_sampling_params(SamplingFields(max_tokens=10), prompt_len=90, max_model_len=100,
                                 default_max_tokens=None).max_tokens == 10
    with pytest.raises(ApiError) as e:
        build_sampling_params(SamplingFields(max_tokens=11), prompt_len=90, max_model_len=100, default_max_tokens=None)
    assert e.value.code == "context_too_long" and "100" in e.value.message


def test_cli_flags_build_a_server_config(monkeypatch) -> None:  # noqa: ANN001
    import argparse

    from radixserve.server.cli import add_server_arguments, server_config_from_args
    from radixserve.server.config import ServerConfig

    p = argparse.ArgumentParser()
    add_server_arguments(p)
    monkeypatch.delenv("RADIXSERVE_API_KEY", raising=False)
    defaults = server_config_from_args(p.parse_args([]))
    assert (defaults.host, defaults.port, defaults.api_key, defaults.allowed_origins) == ("127.0.0.1", 8000, None, [])
    assert defaults.allowed_hosts == []
    cfg = server_config_from_args(p.parse_args(["--port", "0", "--api-key", "k", "--allowed-origins",
                                                "http://a.example/, http://b.example", "--no-web",
                                                "--allowed-hosts", "Chat.Example, box.lan:8000",
                                                "--max-prompt-tokens", "100", "--session-ttl", "5",
                                                "--ws-send-buffer-bytes", "65536",
                                                "--max-session-bytes-total", "1000000"]))
    assert cfg.port == 0 and cfg.api_key == "k" and cfg.web_dir is None and cfg.max_prompt_tokens == 100
    assert cfg.ws_send_buffer_bytes == 65536 and cfg.max_session_bytes_total == 1_000_000
    assert cfg.allowed_origins == ["http://a.example", "http://b.example"] and cfg.session_ttl_s == 5
    assert cfg.allowed_hosts == ["chat.example", "box.lan:8000"]
    with pytest.raises(ValueError, match="allowed_hosts"):
        ServerConfig(allowed_hosts=["http://chat.example/"])
    monkeypatch.setenv("RADIXSERVE_API_KEY", "from-env")
    assert server_config_from_args(p.parse_args([])).api_key == "from-env"
    for bad in ({"port": 70000}, {"max_sessions": 0}, {"api_key": ""}, {"default_top_p": 0.0},
                {"ws_send_buffer_bytes": 0}, {"max_session_bytes_total": -1}):
        with pytest.raises(ValueError):
            ServerConfig(**bad)


@pytest.mark.parametrize("value,expected", [
    ("127.0.0.1:8000", ("127.0.0.1", 8000)), ("LocalHost", ("localhost", None)), ("localhost.:80", ("localhost", 80)),
    ("[::1]:8000", ("::1", 8000)), ("[::1]", ("::1", None)), ("::1", ("::1", None)),
    ("a-b_c.example", ("a-b_c.example", None)),
    ("", None), ("evil.example:99999", None), ("127.0.0.1:", None), ("a b", None), ("http://x", None), ("x/y", None),
    ("user@host", None), ("[::1", None), ("[::1]x", None), ("host:port", None), ("h\u00e9.example", None),
])
def test_split_host(value: str, expected: tuple[str, int | None] | None) -> None:
    assert split_host(value) == expected


def test_host_allow_list_defaults_and_widening() -> None:
    for host in ("127.0.0.1:8000", "127.0.0.1", "localhost:1", "LOCALHOST", "[::1]:8000", "[::1]"):
        assert host_allowed(host, "127.0.0.1", [])
    for host in (None, "", "evil.example:8000", "0.0.0.0:8000", "[::]:8000", "127.0.0.2", "localhost.evil.example",
                 "127.0.0.1.nip.io:8000", "[::1]:8000\r\nX: y"):
        assert not host_allowed(host, "127.0.0.1", []), host
    assert host_allowed("192.168.1.5:8000", "192.168.1.5", [])  # the bound address
    assert host_allowed("[fe80::1]:8000", "fe80::1", [])
    for wildcard in ("0.0.0.0", "::", "[::]"):  # binding every address adds no name
        assert not host_allowed(f"{wildcard.strip('[]')}:8000", wildcard, [])
        assert not host_allowed("192.168.1.5:8000", wildcard, [])
    extra = ["box.lan", "pinned.example:9000"]
    assert host_allowed("box.lan:8000", "0.0.0.0", extra) and host_allowed("BOX.lan", "0.0.0.0", extra)
    assert host_allowed("pinned.example:9000", "0.0.0.0", extra)
    assert not host_allowed("pinned.example:8000", "0.0.0.0", extra)
    assert not host_allowed("sub.box.lan", "0.0.0.0", extra)
    assert host_allowed("anything.example", "127.0.0.1", ["*"]) and host_allowed(None, "127.0.0.1", ["*"])


def test_origin_allowed_same_origin_and_listed() -> None:
    assert origin_allowed(None, "127.0.0.1:8000", "http", [])  # not a browser
    assert origin_allowed("http://127.0.0.1:8000", "127.0.0.1:8000", "http", [])
    assert origin_allowed("http://LOCALHOST:8000/", "localhost:8000", "http", [])
    assert origin_allowed("http://127.0.0.1", "127.0.0.1:80", "http", [])  # default port, written or not
    assert origin_allowed("https://box.lan", "box.lan", "https", [])
    for origin in ("http://evil.example", "http://localhost:8000", "https://127.0.0.1:8000", "http://127.0.0.1:8001",
                   "null", "", "http://127.0.0.1:8000/path", "http://u@127.0.0.1:8000", "file://"):
        assert not origin_allowed(origin, "127.0.0.1:8000", "http", []), origin
    assert not origin_allowed("http://127.0.0.1:8000", None, "http", [])
    assert origin_allowed("http://app.example", "127.0.0.1:8000", "http", ["http://app.example"])
    assert not origin_allowed("http://app.example.evil", "127.0.0.1:8000", "http", ["http://app.example"])
    assert origin_allowed("null", "127.0.0.1:8000", "http", ["*"])


def test_refusal_picks_the_check_by_request_kind() -> None:
    def why(kind: str, method: str, headers: dict[str, str]) -> str | None:
        scope = {"type": kind, "method": method, "scheme": "ws" if kind == "websocket" else "http"}
        err = refusal(scope, headers, [], "127.0.0.1", [])
        return None if err is None else f"{err.status} {err.code}"

    local, evil = {"host": "127.0.0.1:8000"}, {"origin": "http://evil.example"}
    assert why("http", "GET", {"host": "evil.example:8000"}) == "421 forbidden_host"
    assert why("http", "GET", {}) == "421 forbidden_host"
    assert why("http", "GET", {**local, **evil}) is None  # reads are left to CORS
    for method in ("POST", "PUT", "PATCH", "DELETE"):
        assert why("http", method, {**local, **evil}) == "403 forbidden_origin"
        assert why("http", method, local) is None
        assert why("http", method, {**local, "origin": "http://127.0.0.1:8000"}) is None
    assert why("websocket", "GET", {**local, **evil}) == "403 forbidden_origin"
    assert why("websocket", "GET", {**local, "origin": "http://127.0.0.1:8000"}) is None
