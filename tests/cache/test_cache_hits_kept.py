"""A request keeps every cached token whatever it may generate later (issue 24, item 1).

The reproduction: two conversations share the chat template's opening, so the tree splits inside a
block and the second conversation's path carries its own copy of the straddled block. A follow-up
whose `max_tokens` is unset (the `openai` client's default: the server makes it the context left,
so the request counts as pool-sized) used to take only the part of its match before that split —
16 cached tokens instead of 250 — because the rule against wedges decided the match by the
request's longest possible length. The match is now always whole; only when the pool runs dry
does the sequence's lock stop pinning the blocks it does not use (`SequenceCache.reserve`).
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from tiny_models import tiny_model_dir

from radixserve import LLM, AsyncEngine, EngineConfig, SamplingParams
from radixserve.engine.beam_search import BeamSearchParams
from radixserve.engine.engine import LLMEngine
from radixserve.server import BackgroundServer, ServerConfig

pytest.register_assert_rewrite("server_testkit")
from server_testkit import write_tiny_chat_model  # noqa: E402

pytest_plugins = ["server_testkit"]

OPENING = list(range(10, 30))  # 20 tokens: conversations diverge inside the second 16-token block


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run(engine: LLMEngine, limit: int = 2000) -> None:
    for _ in range(limit):
        if not engine.has_unfinished():
            return
        engine.step()
        engine.check_integrity()
    raise AssertionError("engine did not finish")


def follow_up_cached(block_size: int, num_blocks: int, max_tokens: int | None, host_cache_mb: float = 0.0) -> int:
    """cached_tokens of a follow-up behind a mid-block split; `None`: max_tokens is whatever the
    context has left, as the server sets it when a client sends none."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir("llama")), block_size=block_size, num_blocks=num_blocks,
                                    max_num_batched_tokens=256, host_cache_mb=host_cache_mb))
    engine.add_request(OPENING + list(range(100, 150)), greedy(4))
    engine.add_request(OPENING + list(range(200, 250)), greedy(4))
    run(engine)
    prompt = OPENING + list(range(200, 250)) + list(range(300, 340))
    rid = engine.add_request(prompt, greedy(max_tokens or engine.max_seq_len - len(prompt)))
    engine.step()  # admitted: the hit is decided
    (seq,) = [s for s in engine.live_sequences() if s.request.request_id == rid]
    cached = seq.request.cached_tokens
    engine.abort(rid)
    run(engine)
    assert engine.leaked_blocks() == 0
    return cached


@pytest.mark.parametrize(("block_size", "num_blocks"), [(16, 32), (16, 24), (8, 64), (32, 16), (4, 128), (16, 256)])
def test_follow_up_without_max_tokens_keeps_every_hit_after_a_mid_block_split(block_size: int, num_blocks: int) -> None:
    bounded = follow_up_cached(block_size, num_blocks, 8)
    assert bounded == 70  # the whole first turn: 20 + 50 tokens
    assert follow_up_cached(block_size, num_blocks, None) == bounded


def test_follow_up_without_max_tokens_keeps_every_hit_with_a_host_tier() -> None:
    assert follow_up_cached(16, 32, None, host_cache_mb=0.25) == follow_up_cached(16, 32, 8, host_cache_mb=0.25) == 70


def test_pool_sized_request_behind_a_split_uses_its_hit_and_still_finishes() -> None:
    """The liveness side: the whole match is taken, the request grows to fill the pool, and the lock
    gives up what it pins beyond the sequence's own blocks when the pool runs dry."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir("llama")), block_size=16, num_blocks=8,
                                    max_num_batched_tokens=64))
    engine.add_request(OPENING + [40, 41, 42], greedy(1))
    engine.add_request(OPENING + [50, 51, 52], greedy(1))
    run(engine)
    prompt = OPENING + [50, 51, 52, 53]
    rid = engine.add_request(prompt, greedy(engine.max_seq_len - len(prompt)))  # ends with all 128 slots used
    engine.step()
    (seq,) = engine.live_sequences()
    assert seq.request.cached_tokens == 23
    run(engine)
    assert not engine.has_unfinished() and engine.leaked_blocks() == 0
    assert engine.stats_totals.stalled_steps == 0, rid


@pytest.mark.parametrize(("beam_width", "num_blocks"), [(1, 24), (1, 28), (2, 25), (2, 28)])
def test_beam_search_behind_a_split_computes_the_prompt_once(beam_width: int, num_blocks: int) -> None:
    """Each beam step is a request of its parent's tokens plus one; every step adds a superseded copy
    of the straddled block to the path, so the pinned blocks grew until the old rule cut each request
    back to the part before the split and it recomputed the whole prompt (1,000-3,000 tokens for a
    320-token prompt here). Now the prompt is computed once; with one beam, not a token more."""
    llm = LLM(model=str(tiny_model_dir("llama")), block_size=16, num_blocks=num_blocks, max_num_batched_tokens=512)
    engine, m = llm.engine, 16
    engine.add_request(OPENING + list(range(100, 120)), greedy(1))
    run(engine)
    prompt = OPENING + list(range(150, 470))  # 340 tokens of a pool of 384 to 448, behind the split at 20
    before = engine.stats().computed_tokens
    out = llm.beam_search([prompt], BeamSearchParams(beam_width=beam_width, max_tokens=m, ignore_eos=True))[0]
    computed = engine.stats().computed_tokens - before
    assert out.usage.cached_tokens == len(OPENING)
    once = len(prompt) - len(OPENING) + (m - 1) * beam_width
    if beam_width == 1:
        assert computed == once
    else:  # two beams contend for the pool: a pruned branch may be evicted and a few tokens recomputed
        assert once <= computed < once + len(prompt) // 2, computed
    assert engine.leaked_blocks() == 0


def openai_follow_up(model: Path, max_tokens: int | None) -> tuple[int, int]:
    """On a fresh server whose pool is as large as the context (the CPU default): two conversations
    sharing the template's opening, a first turn, then its follow-up through the `openai` client.
    Returns the follow-up's (prompt_tokens, cached_tokens)."""
    config = ServerConfig(port=0, web_dir=None)
    with BackgroundServer(lambda: AsyncEngine(EngineConfig(model=str(model), num_blocks=64)), config) as srv:
        assert srv.engine.engine.max_seq_len == srv.engine.engine.pool.num_blocks * 16 == 1024
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        name = client.models.list().data[0].id
        first = {"role": "user", "content": "Tell me about the history of the harbour and its ships."}
        for content in ("Tell me about apples.", first["content"]):
            client.chat.completions.create(model=name, max_tokens=4, messages=[{"role": "user", "content": content}])
        follow_up = [first, {"role": "assistant", "content": "It was built long ago " * 8},
                     {"role": "user", "content": "And then?"}]
        extra = {} if max_tokens is None else {"max_tokens": max_tokens}
        r = client.chat.completions.create(model=name, messages=follow_up, stop=["."], **extra)  # type: ignore[arg-type]
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        return r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens or 0


def test_openai_client_without_max_tokens_gets_the_same_cached_tokens(chat_server: BackgroundServer,
                                                                      tmp_path: Path) -> None:
    """The measured failure through the `openai` client (16 cached tokens unset, 250 with max_tokens 8)."""
    model = write_tiny_chat_model(tmp_path / "tiny", Path(chat_server.engine.engine.model_dir), max_positions=1024)
    unset, bounded = openai_follow_up(model, None), openai_follow_up(model, 8)
    assert unset == bounded and bounded[1] > 40, (unset, bounded)
