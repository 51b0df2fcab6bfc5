"""Findings of issue 43's red-team round, each reproduced against a real server on 127.0.0.1 over the
tiny random-weight chat model (tests/tiny_models.py), or on the unit it lives in.

- Finding 7: stored responses (POST /v1/responses, `store` by default) are charged to the per-client
  session creation rate (rate_limit.py), so a flood of them with fresh owner secrets is refused with
  429 after the burst and cannot evict another owner's session or stored response.
- Finding 8: /v1/messages/count_tokens holds a generation slot (admission.py), so it is refused at the
  per-client cap like a generation; and the prompt worker's queue runs a generation's tokenizing
  before any count_tokens work still waiting (prompt_worker.py), so a flood of count_tokens delays a
  victim's tokenizing by at most the one job already running.
- Finding 12 (b): `tool_choice: "auto"` without tools is a 400 naming `tool_choice` (as OpenAI's and
  vLLM's); "none" without tools stays plain chat.
- Finding 9 (a): a sampling value the sampler's float32 arithmetic cannot take (a repetition_penalty
  of 1e-300 is 0 in float32: logits / 0) is a 400 naming the field, not a 500; the other float fields'
  extremes are served.

Nothing here bounds wall-clock time: orders and refusals are decided by the code, not by timing.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from radixserve import AsyncEngine, EngineConfig
from radixserve.chat.template import ChatFormatter
from radixserve.model.loader import load_tokenizer
from radixserve.server import BackgroundServer, ServerConfig
from radixserve.server.owners import OWNER_HEADER
from radixserve.server.pipeline import prompt_worker
from radixserve.server.pipeline.prompt_worker import INLINE_CHARS, PromptWorker, background_work

pytest.register_assert_rewrite("server_testkit")
from server_testkit import on_server_loop  # noqa: E402

BURST = 4
ANTHROPIC = {"anthropic-version": "2023-06-01"}


def new_worker() -> PromptWorker:
    from tiny_models import tiny_chat_model_dir

    return PromptWorker(ChatFormatter(load_tokenizer(tiny_chat_model_dir("llama"))))


def new_secret() -> str:
    return secrets.token_urlsafe(16)


@pytest.fixture(scope="module")
def srv() -> Iterator[BackgroundServer]:
    """A small store (8 places) and a creation allowance of BURST that hardly refills (one per 1,000 s)."""
    from tiny_models import tiny_chat_model_dir

    model = str(tiny_chat_model_dir("llama"))
    config = ServerConfig(port=0, web_dir=None, shutdown_grace_s=0.5, max_sessions=8,
                          session_create_rate=0.001, session_create_burst=BURST)
    with BackgroundServer(lambda: AsyncEngine(EngineConfig(model=model, num_blocks=256)), config) as s:
        yield s


def http(srv: BackgroundServer, secret: str | None = None, local_address: str | None = None) -> httpx.Client:
    transport = httpx.HTTPTransport(local_address=local_address) if local_address else None
    headers = {OWNER_HEADER: secret} if secret is not None else {}
    return httpx.Client(base_url=srv.url, timeout=120, headers=headers, transport=transport)


def ask(srv: BackgroundServer, **extra: Any) -> dict[str, Any]:
    return {"model": srv.state.model_name, "input": "Hello there.", "max_output_tokens": 1, "temperature": 0,
            **extra}


# -- finding 7: stored responses and the creation rate ---------------------------------------------------

def test_a_flood_of_stored_responses_is_rate_limited_and_evicts_no_victim(srv: BackgroundServer) -> None:
    """Measured: 1,100 stored responses, each with a fresh owner secret, all 200, evicted another
    tenant's session and stored response. Here the store holds 8 and the allowance is 4."""
    victim_secret = new_secret()
    with http(srv, victim_secret, local_address="127.0.0.2") as victim:  # its own address, its own allowance
        made = victim.post("/v1/sessions", json={"system_prompt": "I was here first."})
        assert made.status_code == 201, made.text
        sid = made.json()["id"]
        kept = victim.post("/v1/responses", json=ask(srv))
        assert kept.status_code == 200, kept.text
        rid = kept.json()["id"]

        codes, refusals = [], []
        with http(srv) as attacker:
            for _ in range(3 * BURST):  # more than the store holds
                r = attacker.post("/v1/responses", json=ask(srv), headers={OWNER_HEADER: new_secret()})
                codes.append(r.status_code)
                if r.status_code == 429:
                    refusals.append(r)
            assert codes == [200] * BURST + [429] * (2 * BURST), codes
            err = refusals[0].json()["error"]
            assert err["code"] == "rate_limited" and "stored responses" in err["message"]
            assert int(refusals[0].headers["Retry-After"]) >= 1
            # a response not kept takes no place, so it is not charged
            assert attacker.post("/v1/responses", json=ask(srv, store=False)).status_code == 200
            # sessions and stored responses share one allowance
            assert attacker.post("/v1/sessions", json={}).status_code == 429

        assert victim.get(f"/v1/sessions/{sid}").status_code == 200
        assert victim.get(f"/v1/responses/{rid}").status_code == 200


# -- finding 8: count_tokens and the generation caps -----------------------------------------------------

def test_count_tokens_is_refused_at_the_per_client_generation_cap(srv: BackgroundServer) -> None:
    cfg, limits = srv.state.config, srv.state.generations
    saved = cfg.max_generations_per_client
    body = {"model": srv.state.model_name, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}

    async def hold() -> Any:
        return limits.acquire("127.0.0.1", cfg)  # the client's one slot, as a running generation holds it

    cfg.max_generations_per_client = 1
    try:
        slot = on_server_loop(srv, hold())
        with http(srv) as client:
            r = client.post("/v1/messages/count_tokens", json=body, headers=ANTHROPIC)
            assert r.status_code == 429, r.text
            assert r.json()["error"]["type"] == "rate_limit_error" and int(r.headers["Retry-After"]) >= 1

            async def release() -> None:
                slot.release()

            on_server_loop(srv, release())
            r = client.post("/v1/messages/count_tokens", json=body, headers=ANTHROPIC)
            assert r.status_code == 200 and r.json()["input_tokens"] > 0, r.text
        assert limits.total == 0  # the slot went back when the count was answered
    finally:
        cfg.max_generations_per_client = saved


def test_generation_tokenizing_runs_before_queued_count_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Measured: 48 looping count_tokens connections took a victim's 18k-character chat from 0.06 s
    to 3.4 s, queued behind them on the one tokenizer thread. A generation's job now goes before every
    count_tokens job still waiting: it waits for at most the one already running."""
    worker = new_worker()
    running, gate, order = threading.Event(), threading.Event(), []
    real = prompt_worker._chat_tokens

    def recorded(formatter: Any, messages: Any, tools: Any) -> Any:
        tag = messages[-1]["content"].split()[0]
        if tag == "running":
            running.set()
            gate.wait()
        order.append(tag)
        return real(formatter, messages, tools)

    monkeypatch.setattr(prompt_worker, "_chat_tokens", recorded)
    pad = " x" * INLINE_CHARS  # long enough to go to the worker thread

    def chat(tag: str) -> list[dict[str, Any]]:
        return [{"role": "user", "content": tag + pad}]

    async def main() -> None:
        first = asyncio.create_task(worker.chat_tokens(chat("running")))
        await asyncio.to_thread(running.wait)  # the worker is busy with it
        with background_work():  # the tasks take the context they are created in
            counts = [asyncio.create_task(worker.chat_tokens(chat(f"count{i}"))) for i in range(5)]
        generation = asyncio.create_task(worker.chat_tokens(chat("generation")))
        await asyncio.sleep(0)  # every task has queued its job
        gate.set()
        await asyncio.gather(first, generation, *counts)

    try:
        asyncio.run(main())
    finally:
        gate.set()
        worker.close()
    assert order == ["running", "generation", *(f"count{i}" for i in range(5))]


def test_a_closed_worker_cancels_what_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    worker = new_worker()
    running, gate = threading.Event(), threading.Event()
    real = prompt_worker._chat_tokens

    def blocking(formatter: Any, messages: Any, tools: Any) -> Any:
        running.set()
        gate.wait()
        return real(formatter, messages, tools)

    monkeypatch.setattr(prompt_worker, "_chat_tokens", blocking)
    chat = [{"role": "user", "content": " x" * INLINE_CHARS}]

    async def main() -> None:
        first = asyncio.create_task(worker.chat_tokens(chat))
        await asyncio.to_thread(running.wait)
        waiting = asyncio.create_task(worker.chat_tokens(chat))
        await asyncio.sleep(0)
        worker.close()
        gate.set()
        assert len((await first)[0]) > INLINE_CHARS // 2  # the running job still answers
        with pytest.raises(asyncio.CancelledError):
            await waiting
        # after close, small and large work runs inline
        assert (await worker.chat_tokens(chat))[0] == real(worker.formatter, chat, None)[0]

    asyncio.run(main())


# -- finding 12 (b): tool_choice without tools -----------------------------------------------------------

def test_tool_choice_auto_without_tools_is_a_400_naming_it(srv: BackgroundServer) -> None:
    chat = {"model": srv.state.model_name, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
    with http(srv) as client:
        for extra in ({"tool_choice": "auto"}, {"tool_choice": "auto", "tools": []}):
            r = client.post("/v1/chat/completions", json={**chat, **extra})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "tool_choice" and "tools" in err["message"]
        assert client.post("/v1/chat/completions", json={**chat, "tool_choice": "none"}).status_code == 200


# -- finding 9 (a): float32 traps in the sampling fields -------------------------------------------------

def test_a_repetition_penalty_that_is_zero_in_float32_is_a_400(srv: BackgroundServer) -> None:
    chat = {"model": srv.state.model_name, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    with http(srv) as client:
        for value in (1e-300, 1e-40, 1e-9):
            r = client.post("/v1/chat/completions", json={**chat, "repetition_penalty": value})
            assert r.status_code == 400, (value, r.text)
            err = r.json()["error"]
            assert err["param"] == "repetition_penalty" and "repetition_penalty" in err["message"], err
        # the other float fields' extremes are values the sampler takes
        for extra in ({"temperature": 1e-300}, {"top_p": 1e-300}, {"min_p": 1e-300}, {"temperature": 2.0},
                      {"presence_penalty": 2.0, "frequency_penalty": -2.0}, {"repetition_penalty": 2.0},
                      {"repetition_penalty": 0.01, "temperature": 1e-300}, {"logit_bias": {"5": 100}}):
            r = client.post("/v1/chat/completions", json={**chat, "seed": 1, **extra})
            assert r.status_code == 200, (extra, r.text)


def test_sampling_params_refuse_what_float32_cannot_hold() -> None:
    import torch

    from radixserve.sampling_params import MIN_REPETITION_PENALTY, SamplingParams

    for value in (1e-300, 1e-40, MIN_REPETITION_PENALTY / 2):
        with pytest.raises(ValueError, match="repetition_penalty"):
            SamplingParams(repetition_penalty=value)
    # the smallest accepted penalty is a normal float32, and a logit far beyond any model's divided by it is finite
    smallest = torch.tensor(MIN_REPETITION_PENALTY, dtype=torch.float32)
    assert smallest >= torch.finfo(torch.float32).tiny
    assert torch.isfinite(torch.tensor(1e6, dtype=torch.float32) / smallest)
