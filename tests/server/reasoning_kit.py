"""Servers over tiny thinking models and replies forced on them, for the reasoning tests (a pytest plugin:
test modules list it in `pytest_plugins`).

`reasoning_servers(kind)` is a real server on 127.0.0.1 over the tiny checkpoint whose tokenizer and chat
template are of `kind` (tests/tiny_models.py: "qwen3", "qwen3_keep", "qwen3_opened", "harmony"), one per
kind for the whole run. `Replies` makes the model write given text:
- `force(text)`: the next engine request runs on the real engine under a grammar that admits exactly
  the tokens `text` encodes to, one step a token (the engine's forced tokens are off), so decoding,
  streaming, usage and the cache are the engine's own;
- `script(pieces)`: the next engine request is answered by outputs holding exactly these text pieces,
  one token each, without running the model: tags split across pieces however a test wants.
Both record every engine request they see (its prompt ids and sampling parameters).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from radixserve import AsyncEngine, EngineConfig
from radixserve.core import CompletionOutput, RequestOutput, Timing, Usage
from radixserve.engine.intake import ValidatedRequest
from radixserve.server import BackgroundServer, ServerConfig
from radixserve.structured import StructuredOutput


@pytest.fixture(scope="session")
def reasoning_servers() -> Iterator[Callable[[str], BackgroundServer]]:
    from tiny_models import tiny_reasoning_model_dir

    servers: dict[str, BackgroundServer] = {}

    def get(kind: str) -> BackgroundServer:
        if kind not in servers:
            model = str(tiny_reasoning_model_dir(kind))
            # one step a token, also where a grammar leaves no choice: a forced reply is generated (and its
            # tokens cached) as a free one would be
            srv = BackgroundServer(lambda: AsyncEngine(EngineConfig(model=model, num_blocks=512, forced_tokens=False)),
                                   ServerConfig(port=0, web_dir=None, shutdown_grace_s=0.5))
            servers[kind] = srv.__enter__()
        return servers[kind]

    try:
        yield get
    finally:
        for srv in servers.values():
            srv.__exit__(None, None, None)


class Replies:
    """Replies forced on a server's engine (see the module docstring); undone by the test's monkeypatch."""

    def __init__(self, srv: BackgroundServer, monkeypatch: pytest.MonkeyPatch) -> None:
        self.srv = srv
        self.queue: list[tuple[str, Any]] = []  # ("force", text) or ("script", (pieces, finish))
        self.requests: list[ValidatedRequest] = []
        self.generated: list[list[int]] = []  # each request's generated ids (its first sample's)
        engine = srv.engine
        original = engine.generate_validated

        async def generate(request: ValidatedRequest, request_id: str | None = None,
                           cancelled: Callable[[], bool] | None = None, placement: Any = None,
                           ) -> AsyncIterator[RequestOutput]:
            kind, what = self.queue.pop(0) if self.queue else ("engine", None)
            if kind == "force":
                params = dataclasses.replace(request.params, structured=StructuredOutput(grammar=self.grammar(str(what))))
                request = engine.intake.check(request.token_ids, params, request.priority)
            self.requests.append(request)
            generated: list[int] = []
            self.generated.append(generated)
            if kind == "script":
                for out in _scripted(request, what, request_id or "scripted"):
                    yield out
                return
            agen = original(request, request_id=request_id, cancelled=cancelled, placement=placement)
            try:
                async for out in agen:
                    generated += out.outputs[0].token_ids if out.outputs else []
                    yield out
            finally:
                await agen.aclose()

        monkeypatch.setattr(engine, "generate_validated", generate)

    def force(self, text: str) -> None:
        """`text` may end with an end-of-sequence token (<|return|>, <|call|>): a grammar may not name one,
        it ends where the grammar does, and decoding drops it anyway."""
        tokenizer = self.srv.engine.tokenizer
        for eos in self.srv.engine.eos_token_ids:
            end = str(tokenizer.convert_ids_to_tokens(eos))
            text = text.removesuffix(end)
        self.queue.append(("force", text))

    def script(self, pieces: list[str], finish: str = "stop") -> None:
        self.queue.append(("script", (pieces, finish)))

    def prompt_text(self, k: int = -1) -> str:
        """Request `k`'s prompt as text, special tokens kept."""
        return str(self.srv.engine.tokenizer.decode(self.requests[k].token_ids, skip_special_tokens=False))

    def grammar(self, text: str) -> str:
        """A Lark grammar admitting exactly the tokens `text` encodes to (as a model writes text: its
        tokenizer's own split, added tokens as themselves), so a later prompt that holds the same text
        holds the same tokens."""
        ids = self.srv.engine.tokenizer(text, add_special_tokens=False)["input_ids"]
        return "start: " + " ".join(f"<[{i}]>" for i in ids) + "\n"


def _scripted(request: ValidatedRequest, script: Any, rid: str) -> Iterator[RequestOutput]:
    """Outputs holding `script`'s (pieces, finish reason), one token a piece, for every sample."""
    pieces, finish = script
    n = request.params.n
    now = time.monotonic()
    for k, piece in enumerate(pieces):
        last = k == len(pieces) - 1
        usage = Usage(prompt_tokens=len(request.token_ids), completion_tokens=k + 1)
        outputs = [CompletionOutput(i, [k + 10], piece, finish if last else None) for i in range(n)]
        yield RequestOutput(rid, outputs, usage, Timing(arrival=now, first_scheduled=now, first_token=now,
                                                        finished=now if last else None), finished=last)


@pytest.fixture()
def replies(monkeypatch: pytest.MonkeyPatch) -> Callable[[BackgroundServer], Replies]:
    """`replies(srv)`: a `Replies` of that server for this test."""
    made: dict[int, Replies] = {}

    def of(srv: BackgroundServer) -> Replies:
        if id(srv) not in made:
            made[id(srv)] = Replies(srv, monkeypatch)
        return made[id(srv)]

    return of


def sse_events(lines: Iterator[str]) -> list[dict[str, Any]]:
    """The `data:` JSON objects of an SSE stream (not the final [DONE])."""
    return [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]
