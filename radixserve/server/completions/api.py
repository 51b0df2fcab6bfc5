"""OpenAI's legacy POST /v1/completions, as vLLM serves it: a prompt (or several) continued as plain
text, no chat template.

Parsing and planning are request.py's (onto the one pipeline, server/pipeline/); this module runs a
parsed request and shapes its replies. Each prompt is its own engine request, all running at once;
prompt p's sample s is choice p × n + s (vLLM's order). A choice's `text` is the echoed prompt (with
`echo`) then the generated text; its `logprobs` the legacy object (server/completions/logprobs.py),
the echoed prompt's tokens first; `prompt_logprobs` (vLLM's, when asked) the prompt's. `usage` sums
the prompts, each counted once whatever n, their drafts too (completion_tokens_details, as chat's).
With max_tokens 0 (only with echo) the engine runs one token, which is dropped: `completion_tokens`
0, `finish_reason` "length".

Streaming: `text_completion` chunks, one choice each; a choice's first chunk starts with its echoed
prompt (text and logprobs); a chunk whose tokens have no text yet (held back: a partial UTF-8
character, a possible stop string) is still sent when logprobs were asked, so the chunks' texts and
logprobs concatenate to the non-streamed choice's; the last chunk of a choice carries its
finish_reason; with `stream_options.include_usage` a `choices: []` chunk with usage, then `[DONE]`.

Guards as the chat endpoint's: API key (middleware), a generation slot, every prompt admitted and
checked by the engine before a response starts, and a client that leaves aborts every prompt's
request (non-streamed: until_done_or_gone cancels the work; streamed: the EventStream closes the
generator, whose `finally` cancels the per-prompt tasks, each closing its engine stream).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing, suppress
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from radixserve.core import CompletionOutput, RequestOutput, TokenLogprob, Usage
from radixserve.server.api_errors import openai_stream_error
from radixserve.server.completions.logprobs import (
    Entry,
    LegacyLogprobs,
    generated_items,
    prompt_items,
    prompt_logprobs_body,
)
from radixserve.server.completions.request import CompletionRequest, parse_completion_request
from radixserve.server.http_util import EventStream, dumps, respond, sse
from radixserve.server.openai_chat.shapes import usage_dict
from radixserve.server.pipeline.logprobs import OFFLOAD_ENTRIES, TokenTexts
from radixserve.server.pipeline.prediction import merged_drafts, prediction_counts
from radixserve.server.state import ServerState


@dataclass
class _Choice:
    """One choice as it is produced: what it has had so far; `started` once its first delta (which
    carries the echoed prompt) has gone out."""

    logprobs: LegacyLogprobs | None  # None: `logprobs` not asked
    text: list[str] = field(default_factory=list)
    items: list[Entry] = field(default_factory=list)  # its logprob entries, the echoed prompt's first
    finish_reason: str | None = None
    started: bool = False


@dataclass
class _Run:
    """A request's outputs as they arrive, shared by the streamed and the non-streamed reply."""

    req: CompletionRequest
    texts: TokenTexts
    choices: list[_Choice]
    usage: list[Usage]  # per prompt, from its latest output
    prompt_lps: list[list[TokenLogprob | None] | None]  # per prompt, from its first output

    @classmethod
    def of(cls, req: CompletionRequest, texts: TokenTexts) -> _Run:
        k = req.logprobs
        choices = [_Choice(None if k is None else LegacyLogprobs(texts, k)) for _ in range(len(req.plan.prompts) * req.n)]
        return cls(req, texts, choices, [Usage() for _ in req.plan.prompts], [None] * len(req.plan.prompts))

    def take(self, p: int, out: RequestOutput) -> list[tuple[int, str, list[Entry], str | None]]:
        """Record prompt p's output; (choice index, new text, new entries, finish reason) per choice it moved."""
        self.usage[p] = out.usage
        if out.prompt_logprobs is not None:
            self.prompt_lps[p] = out.prompt_logprobs
        moved = []
        for o in out.outputs:
            i = p * self.req.n + o.index
            choice = self.choices[i]
            text, items = self._visible(o)
            # the echoed prompt leads the choice's first delta (its prompt logprobs come with or before it)
            if not choice.started and (o.token_ids or o.finish_reason):
                choice.started = True
                if self.req.echo:
                    text = self.req.echo_texts[p] + text
                    items = (prompt_items(self.req.plan.prompts[p].tokens, self.prompt_lps[p])
                             if choice.logprobs is not None else []) + items
            reason = self._finish(o.finish_reason)
            choice.text.append(text)
            choice.items.extend(items)
            choice.finish_reason = reason or choice.finish_reason
            moved.append((i, text, items, reason))
        return moved

    def _visible(self, o: CompletionOutput) -> tuple[str, list[Entry]]:
        if self.req.echo_only:  # max_tokens 0: the one token run is not part of the reply
            return "", []
        return o.text, generated_items(o.logprobs) if self.req.logprobs is not None else []

    def _finish(self, reason: str | None) -> str | None:
        if self.req.echo_only and reason in ("stop", "length"):
            return "length"  # max_tokens 0 is reached at once, whatever the dropped token was
        return reason

    def usage_body(self) -> dict[str, Any]:
        u = self.usage
        generated = 0 if self.req.echo_only else sum(x.completion_tokens for x in u)
        body = usage_dict(Usage(sum(x.prompt_tokens for x in u), sum(x.cached_tokens for x in u), generated,
                                sum(x.host_cached_tokens for x in u), merged_drafts(x.speculation for x in u)))
        body["completion_tokens_details"].update(prediction_counts(x.speculation for x in u))  # each prompt's own
        return body

    def prompt_logprobs(self, p: int) -> list[Any] | None:
        k = self.req.prompt_logprobs
        return None if k is None else prompt_logprobs_body(self.req.plan.prompts[p].tokens, self.prompt_lps[p], k, self.texts)


async def completions(request: Request) -> Response:
    state: ServerState = request.app.state.server
    req = await parse_completion_request(state, request)  # refusals raise here: a JSON error, never a stream
    return await respond(request.receive, req.plan.ask.stream, lambda: EventStream(_stream_chunks(state, req)),
                         lambda: _completion(state, req))


async def _outputs(state: ServerState, req: CompletionRequest) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Every prompt's engine outputs, (prompt index, output), as they come. Closing this (or an engine
    error, raised here) cancels the prompts still running, which aborts their engine requests."""
    queue: asyncio.Queue[tuple[int, RequestOutput] | Exception | None] = asyncio.Queue()

    async def pump(p: int) -> None:
        try:
            async with aclosing(req.plan.stream(state, p)) as outputs:
                async for out in outputs:
                    queue.put_nowait((p, out))
        except Exception as e:  # the consumer raises it, and the others are cancelled
            queue.put_nowait(e)
        else:
            queue.put_nowait(None)

    tasks = [asyncio.ensure_future(pump(p)) for p in range(len(req.plan.prompts))]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with suppress(asyncio.CancelledError):
                await task


async def _completion(state: ServerState, req: CompletionRequest) -> Response:
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    run = _Run.of(req, state.token_texts())
    async with aclosing(_outputs(state, req)) as outputs:
        async for p, out in outputs:
            run.take(p, out)

    def render() -> bytes:
        choices: list[dict[str, Any]] = [{"index": i, "text": "".join(c.text),
                    "logprobs": c.logprobs.body(c.items) if c.logprobs is not None else None,
                    "finish_reason": c.finish_reason or "abort"} for i, c in enumerate(run.choices)]
        if req.prompt_logprobs is not None:  # vLLM's extension: each choice carries its prompt's
            lists = [run.prompt_logprobs(p) for p in range(len(req.plan.prompts))]
            for i, choice in enumerate(choices):
                choice["prompt_logprobs"] = lists[i // req.n]
        return dumps({"id": rid, "object": "text_completion", "created": created, "model": req.model,
                      "choices": choices, "usage": run.usage_body()}).encode("utf-8")

    # many logprobs make megabytes of JSON: built in a worker thread, off the event loop (as chat's)
    large = sum(len(c.items) for c in run.choices) * ((req.logprobs or 0) + 1) > OFFLOAD_ENTRIES \
        or req.prompt_logprobs is not None and sum(len(p.tokens) for p in req.plan.prompts) > OFFLOAD_ENTRIES
    return Response(await asyncio.to_thread(render) if large else render(), media_type="application/json")


async def _stream_chunks(state: ServerState, req: CompletionRequest) -> AsyncGenerator[str, None]:
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

    def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
        body: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created, "model": req.model,
                                "choices": choices}
        if req.plan.ask.include_usage:
            body["usage"] = usage
        return sse(body)

    run = _Run.of(req, state.token_texts())
    finished = False
    try:
        async with aclosing(_outputs(state, req)) as outputs:
            async for p, out in outputs:
                for i, text, items, reason in run.take(p, out):
                    logprobs = run.choices[i].logprobs
                    if text or reason or (logprobs is not None and items):
                        yield chunk([{"index": i, "text": text, "finish_reason": reason,
                                      "logprobs": logprobs.body(items) if logprobs is not None and items else None}])
        finished = True
    except Exception as e:  # the stream has started: the error is an event, then [DONE]
        yield sse(openai_stream_error(e, state.metrics))
    if req.plan.ask.include_usage and finished:
        yield chunk([], run.usage_body())
    yield "data: [DONE]\n\n"


ROUTES = [Route("/v1/completions", completions, methods=["POST"])]
