"""Bounds without a running server: the WebSocket send buffer's byte accounting, a session's memory
footprint, the session byte budget, and the JSON guards (depth, lone surrogates, echoed `req`)."""

from __future__ import annotations

import asyncio
import gc
import tracemalloc

import pytest

from radixserve.chat.template import ChatFormatter
from radixserve.sampling_fields import SamplingFields
from radixserve.server.owners import Owner
from radixserve.server.sessions.send_buffer import SendBuffer
from radixserve.server.sessions.store import SessionStore
from radixserve.server.validation import ApiError, check_req, parse_json_text

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fmt() -> ChatFormatter:
    from radixserve.model.embedded import embedded_model_dir
    from radixserve.model.loader import load_tokenizer

    return ChatFormatter(load_tokenizer(embedded_model_dir()))


ME = Owner.of("bounds-units-owner-secret")


def test_send_buffer_counts_bytes_and_overflows_instead_of_growing() -> None:
    async def run() -> None:
        buf = SendBuffer(limit_bytes=10_000)
        frame = "é" * 1000  # 2,000 bytes of UTF-8
        accepted = 0
        while buf.put(frame):  # nobody is writing: the buffer must refuse, not grow
            accepted += 1
            assert buf.pending_bytes <= 10_000
            assert accepted < 100
        assert accepted == 5 and buf.overflowed
        assert buf.pending_bytes == 0 and buf.peak_bytes == 10_000  # dropped at once
        assert not buf.put("x")  # nothing more is queued after the overflow

        ok = SendBuffer(limit_bytes=100)
        assert ok.put("y" * 500)  # one frame larger than the limit still goes when nothing else waits
        assert not ok.put("z") and ok.overflowed

        flowing = SendBuffer(limit_bytes=3_000)
        for _ in range(50):  # a reader that keeps up never overflows
            assert flowing.put(frame)
            item = await flowing.get()
            assert item.text == frame and flowing.pending_bytes == 2_000
            flowing.sent(item)
            assert flowing.pending_bytes == 0

    asyncio.run(run())


def test_session_footprint_is_close_to_its_tokens_and_text(fmt: ChatFormatter) -> None:
    store = SessionStore(fmt, max_sessions=8, ttl_s=100, max_bytes=10**9)
    store.create("warm up the template and tokenizer caches", SamplingFields(), ME)
    prompt = "Every idle session should cost about what its tokens and text weigh. " * 1500  # ~100 KB
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        s = store.create(prompt, SamplingFields(), ME)
        gc.collect()
        grown = sum(d.size_diff for d in tracemalloc.take_snapshot().compare_to(before, "filename"))
    finally:
        tracemalloc.stop()
    tokens = len(s.tokens)
    assert tokens > 15_000
    ideal = 4 * tokens + len(prompt)  # int32 token ids + the prompt's text
    assert grown <= 1.25 * ideal, f"{grown} bytes held for {tokens} tokens and {len(prompt)} characters"
    assert s.footprint() >= ideal and store.total_bytes == sum(x.footprint() for x in store)


def test_session_byte_budget(fmt: ChatFormatter) -> None:
    size = SessionStore(fmt, max_sessions=1, ttl_s=100).create("alpha " * 500, {}, ME).footprint()
    budget = int(2.5 * size)  # room for two such sessions, not three
    store = SessionStore(fmt, max_sessions=100, ttl_s=100, max_bytes=budget)
    a = store.create("alpha " * 500, SamplingFields(), ME)
    b, c = store.create("bravo " * 500, SamplingFields(), ME), store.create("delta " * 500, SamplingFields(), ME)
    assert store.total_bytes <= budget and store.evicted == 1
    assert [s.id for s in store.list(ME)] == [c.id, b.id]  # the least recently used one went
    assert a.counted_bytes == 0 and store.total_bytes == b.footprint() + c.footprint()
    b.busy = c.busy = "g"  # nothing idle left to evict
    with pytest.raises(ApiError) as e:
        store.create("hotel " * 500, SamplingFields(), ME)
    assert e.value.status == 429 and store.total_bytes <= budget
    with pytest.raises(ApiError) as e:
        SessionStore(fmt, max_sessions=100, ttl_s=100, max_bytes=size // 2).create("alpha " * 500, {}, ME)
    assert (e.value.code, e.value.status) == ("too_large", 413)  # larger than the whole budget: never fits
    b.busy = c.busy = None
    for s in store.list(ME):
        store.delete(s.id, ME)
    assert store.total_bytes == 0 and len(store) == 0


@pytest.mark.parametrize("text", ["[" * 65 + "]" * 65, '{"a":' * 65 + "1" + "}" * 65, "[" * 100000])
def test_json_depth_is_limited_before_parsing(text: str) -> None:
    with pytest.raises(ApiError) as e:
        parse_json_text(text, 10**6)
    assert e.value.code == "bad_json" and "nest" in e.value.message


def test_json_depth_ignores_brackets_inside_strings() -> None:
    assert parse_json_text('{"a": "' + "[" * 500 + '\\"]"}', 10**6) == {"a": "[" * 500 + '"]'}
    assert parse_json_text("[" * 64 + "]" * 64, 10**6) is not None


@pytest.mark.parametrize("text,param", [
    ('{"content": "\\udc00"}', "content"), ('{"m": [1, {"t": "x\\ud800"}]}', "m[1].t"),
    ('{"a": {"\\ud800": 1}}', "a"), ('{"\\ud800": 1}', None), ('["\\ud800"]', "[0]"),
])
def test_lone_surrogates_are_refused(text: str, param: str | None) -> None:
    with pytest.raises(ApiError) as e:
        parse_json_text(text, 10**6)
    assert e.value.code == "invalid_field" and "surrogate" in e.value.message and e.value.param == param
    e.value.message.encode("utf-8")  # the error itself must be encodable (no surrogate echoed back)


@pytest.mark.parametrize("req,ok", [
    (1, True), ("s", True), (None, True), ({"n": [1, {"m": 2}]}, True), ([[[[[1]]]]], False),
    ("x" * 2000, False), ({"k": "v" * 2000}, False),
])
def test_req_must_be_small_and_shallow(req: object, ok: bool) -> None:
    if ok:
        check_req(req)
    else:
        with pytest.raises(ApiError) as e:
            check_req(req)
        assert e.value.code == "invalid_field" and e.value.param == "req"
