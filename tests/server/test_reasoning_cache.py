"""Multi-turn cache hits of a thinking model, measured (docs/bench/reasoning.md): three turns of one
conversation over a tiny model with a Qwen3-like template, each reply a fixed reasoning and answer the
engine generates token by token (reasoning_kit.py), and the prefix-cache hit of every turn read from the
API's own usage (`prompt_tokens_details.cached_tokens`, sessions' `cached_tokens`).

Ways of holding the conversation, each on a fresh server:
- `chat-drop`: chat completions, the client sends back the answers only; the template drops earlier
  reasoning anyway (Qwen3's rule), so the next prompt leaves the cached reply right where its `<think>`
  starts: the previous answer is computed again;
- `chat-keep-off`: a template that renders earlier reasoning it is sent (Qwen3.5's, GLM's), the client
  sends `reasoning_content` back, but --keep-reasoning-in-history is off: the same miss;
- `chat-keep`: the same with --keep-reasoning-in-history: the template renders the reasoning back as it
  was generated, and the whole previous turn hits;
- `session` and `responses`: the server keeps the exact tokens (REST sessions, `previous_response_id`):
  the whole previous turn hits whatever the template does.

Every turn's hit must be what the radix cache can give: the longest prefix the turn's prompt shares with
a sequence computed before on that server (its prompt and generated tokens but the last, which no
forward computed), at most the prompt but its last token. Run with `-s` to print the table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from radixserve import AsyncEngine, EngineConfig
from radixserve.server import BackgroundServer, ServerConfig

pytest.register_assert_rewrite("reasoning_kit")

from reasoning_kit import Replies  # noqa: E402
from server_testkit import rest_client  # noqa: E402

pytest_plugins = ["server_testkit", "reasoning_kit"]

SYSTEM = "You answer questions about European capitals, briefly."
QUESTIONS = ["What is the capital of France?", "And the capital of Italy?", "And the capital of Spain?"]
REASONING = [
    "The user asks for the capital of France. France is in western Europe; its capital and largest city is Paris, "
    "on the Seine. I will answer with the city and one fact.",
    "Now the user asks about Italy. The capital of Italy is Rome, in the Lazio region, on the Tiber. The answer "
    "should match the style of the previous one.",
    "Next is Spain. Spain's capital is Madrid, in the centre of the country. Keep it short, like before.",
]
ANSWERS = [
    "The capital of France is Paris, which is also its largest city.",
    "The capital of Italy is Rome, on the banks of the Tiber.",
    "The capital of Spain is Madrid, right in the middle of the country.",
]
MODES = ["chat-drop", "chat-keep-off", "chat-keep", "session", "responses"]


def reply(k: int) -> str:
    return f"<think>\n{REASONING[k]}\n</think>\n\n{ANSWERS[k]}"


@dataclass
class Turn:
    prompt: int
    cached: int
    reusable: int  # what the radix cache held of this prompt (see the module docstring)
    generated: int
    reasoning: int


@pytest.fixture()
def fresh_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str, bool], tuple[BackgroundServer,
                                                                                            Replies]]]:
    from tiny_models import tiny_reasoning_model_dir

    opened: list[BackgroundServer] = []

    def make(kind: str, keep: bool) -> tuple[BackgroundServer, Replies]:
        model = str(tiny_reasoning_model_dir(kind))
        config = ServerConfig(port=0, web_dir=None, shutdown_grace_s=0.5, keep_reasoning_in_history=keep)
        srv = BackgroundServer(lambda: AsyncEngine(EngineConfig(model=model, num_blocks=512, forced_tokens=False)),
                               config).__enter__()
        opened.append(srv)
        return srv, Replies(srv, monkeypatch)

    try:
        yield make
    finally:
        for srv in opened:
            srv.__exit__(None, None, None)


def reusable(replies: Replies, k: int) -> int:
    prompt = list(replies.requests[k].token_ids)
    best = 0
    for j in range(k):
        computed = list(replies.requests[j].token_ids) + replies.generated[j][:-1]
        n = 0
        while n < min(len(prompt), len(computed)) and prompt[n] == computed[n]:
            n += 1
        best = max(best, n)
    return min(best, len(prompt) - 1)


def run_mode(mode: str, make: Callable[[str, bool], tuple[BackgroundServer, Replies]]) -> list[Turn]:
    kind = "qwen3" if mode in ("chat-drop", "session", "responses") else "qwen3_keep"
    srv, forced = make(kind, mode == "chat-keep")
    model = srv.state.model_name
    usages: list[dict[str, Any]] = []
    if mode.startswith("chat"):
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
        for k, question in enumerate(QUESTIONS):
            messages.append({"role": "user", "content": question})
            forced.force(reply(k))
            body = httpx.post(srv.url + "/v1/chat/completions", json={"model": model, "messages": messages,
                                                                       "max_tokens": 200}, timeout=120).json()
            message = body["choices"][0]["message"]
            assert (message["reasoning_content"], message["content"]) == (REASONING[k], ANSWERS[k])
            sent_back = {"role": "assistant", "content": message["content"]}
            if mode != "chat-drop":
                sent_back["reasoning_content"] = message["reasoning_content"]
            messages.append(sent_back)
            u = body["usage"]
            usages.append({"prompt": u["prompt_tokens"], "cached": u["prompt_tokens_details"]["cached_tokens"],
                           "generated": u["completion_tokens"],
                           "reasoning": u["completion_tokens_details"]["reasoning_tokens"]})
    elif mode == "session":
        http = rest_client(srv)
        sid = http.post("/v1/sessions", json={"system_prompt": SYSTEM, "sampling": {"max_tokens": 200}}).json()["id"]
        for k, question in enumerate(QUESTIONS):
            forced.force(reply(k))
            u = http.post(f"/v1/sessions/{sid}/messages", json={"content": question}).json()["usage"]
            usages.append({"prompt": u["prompt_tokens"], "cached": u["cached_tokens"],
                           "generated": u["completion_tokens"], "reasoning": u["reasoning_tokens"]})
    else:
        previous = None
        for k, question in enumerate(QUESTIONS):
            forced.force(reply(k))
            body = httpx.post(srv.url + "/v1/responses", json={
                "model": model, "instructions": SYSTEM, "input": question, "max_output_tokens": 200,
                "previous_response_id": previous}, timeout=120).json()
            previous = body["id"]
            u = body["usage"]
            usages.append({"prompt": u["input_tokens"], "cached": u["input_tokens_details"]["cached_tokens"],
                           "generated": u["output_tokens"], "reasoning": u["output_tokens_details"]["reasoning_tokens"]})
    turns = []
    for k, u in enumerate(usages):
        assert u["prompt"] == len(forced.requests[k].token_ids)
        turns.append(Turn(u["prompt"], u["cached"], reusable(forced, k), u["generated"], u["reasoning"]))
    return turns


def test_multi_turn_cache_hits_of_a_thinking_model(fresh_server: Callable[..., Any]) -> None:
    results = {mode: run_mode(mode, fresh_server) for mode in MODES}
    print("\n| mode | turn | prompt tokens | cached | computed again | completion (reasoning) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for mode, turns in results.items():
        for k, t in enumerate(turns):
            print(f"| {mode} | {k + 1} | {t.prompt} | {t.cached} | {t.prompt - t.cached} | "
                  f"{t.generated} ({t.reasoning}) |")
    for mode, turns in results.items():
        for k, t in enumerate(turns):
            assert t.cached == t.reusable, (mode, k, t)
            assert 0 < t.reasoning < t.generated
            if k == 0:
                continue
            before = turns[k - 1]
            everything = before.prompt + before.generated - 1  # all the previous turn computed
            if mode in ("chat-drop", "chat-keep-off"):
                # the previous reply is dropped where its <think> began: exactly the previous prompt hits
                assert t.cached == before.prompt, (mode, k, t)
            else:
                assert t.cached == everything, (mode, k, t)
    # what keeping the reasoning costs: longer prompts (the reasoning stays in the context), all of it cached
    assert results["chat-keep"][2].prompt > results["chat-drop"][2].prompt
