"""The agent workload's HTTP client: runs agent loops against a radixserve server on one of three APIs,
streamed, and records what each turn's response says about its prompt.

A loop is one task: turn 1 sends the system prompt, the tools and the task; each reply must be one
tool call (forced: chat and Responses `tool_choice: "required"`, Anthropic `{"type": "any"}`, one call
per turn, `call_max_tokens`); its result, the task's next tool output, goes back as the next turn's
new input; after the last output the final turn asks for a short answer (`answer_max_tokens`) under
the plan's `final_tool_choice`: "auto" (the default: the tools stay in the prompt, as in every turn
before, and the reply may be text or a call) or "none" (on this server a "none" turn renders no tools,
so its prompt differs from the conversation's from the system prompt on). Greedy. How the history
travels is each API's own:

- chat: the client keeps the messages: the assistant message with its `tool_calls` as streamed, then
  a `tool` message with the output.
- Responses: `previous_response_id` chains (`mode="chain"`): each turn sends only a
  `function_call_output` item, with `instructions` and `tools` again (the API does not carry them
  over); or, with `mode="replay"`, the whole input each turn (the user message, every `function_call`
  and `function_call_output` item), `store: false`.
- Anthropic Messages: the client keeps the messages: the assistant's `tool_use` block, then a user
  message with the `tool_result` block.

Per turn it records the prompt tokens and cached tokens as the response's usage reports them (chat
`prompt_tokens` / `prompt_tokens_details.cached_tokens`, Responses `input_tokens` /
`input_tokens_details.cached_tokens`, Anthropic `input_tokens + cache_read_input_tokens +
cache_creation_input_tokens` / `cache_read_input_tokens`: Anthropic's input_tokens counts only what
was not read from the cache), the completion tokens, the finish reason, the time to the first event
carrying reply content (TTFT: chat's first chunk with a tool-call or text delta, Responses' first
output item or text delta, Anthropic's first content block) and to the last event.

Runs as its own process (`python -m radixserve_bench.agents.client PLAN.json OUT.json`, started by
runner.py) so that its streams' parsing never competes with the server for one interpreter: only the
standard library and httpx are imported. Invariants: a loop that gets an HTTP error or a forced turn
without a call stops, and the error is recorded with the turn (never silently dropped); the run is
bounded by the plan's timeout.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

APIS = ("chat", "responses", "anthropic")
RESPONSES_MODES = ("chain", "replay")
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "anthropic": "/v1/messages"}


@dataclass
class LoopTask:
    task_id: str
    api: str  # one of APIS
    user: str  # the task, turn 1's user message
    outputs: list[str]  # tool outputs, one per round trip, in order


@dataclass
class ClientPlan:
    url: str
    model: str
    system: str
    tools: list[dict[str, Any]]  # {name, description, parameters}: shaped per API here
    tasks: list[LoopTask]
    call_max_tokens: int = 96
    answer_max_tokens: int = 16
    responses_mode: str = "chain"
    final_tool_choice: str = "auto"  # the final turn's: "auto" or "none" (see body())
    concurrency: int = 4  # loops in flight
    timeout_s: float = 3600.0

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ClientPlan:
        return cls(**{**data, "tasks": [LoopTask(**t) for t in data["tasks"]]})


@dataclass
class TurnRecord:
    task_id: str
    api: str
    turn: int  # 1-based
    kind: str  # "call" (a forced tool call) or "answer" (the final turn)
    send_s: float  # after the run's start
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    finish: str | None = None
    call_name: str | None = None
    error: str | None = None


@dataclass
class Reply:
    """One streamed response as the loop needs it."""

    first_s: float | None = None  # monotonic time of the first event carrying content
    usage: dict[str, int] = field(default_factory=dict)  # prompt, cached, completion
    finish: str | None = None
    call_id: str | None = None
    call_name: str | None = None
    arguments: str = ""
    text: str = ""
    response_id: str | None = None  # Responses: for previous_response_id


async def sse_events(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of a server-sent event stream's `data:` lines (chat's `[DONE]` ends it)."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


class Loop:
    """The conversation of one task on one API: builds each turn's body and reads each reply."""

    def __init__(self, plan: ClientPlan, task: LoopTask) -> None:
        self.plan, self.task = plan, task

    def body(self, turn: int, final: bool) -> dict[str, Any]:
        raise NotImplementedError

    def read(self, event: dict[str, Any], reply: Reply, now: float) -> None:
        raise NotImplementedError

    def absorb(self, reply: Reply, output: str | None) -> None:
        """The reply joins the history, then `output` (the call's result; None after the final turn)."""
        raise NotImplementedError


class ChatLoop(Loop):
    def __init__(self, plan: ClientPlan, task: LoopTask) -> None:
        super().__init__(plan, task)
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": plan.system},
                                               {"role": "user", "content": task.user}]
        self.tools = [{"type": "function", "function": t} for t in plan.tools]

    def body(self, turn: int, final: bool) -> dict[str, Any]:
        return {"model": self.plan.model, "messages": self.messages, "tools": self.tools,
                "tool_choice": self.plan.final_tool_choice if final else "required", "parallel_tool_calls": False,
                "max_tokens": self.plan.answer_max_tokens if final else self.plan.call_max_tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}

    def read(self, event: dict[str, Any], reply: Reply, now: float) -> None:
        for choice in event.get("choices") or []:
            delta = choice.get("delta") or {}
            for call in delta.get("tool_calls") or []:
                reply.first_s = reply.first_s or now
                reply.call_id = call.get("id") or reply.call_id
                fn = call.get("function") or {}
                reply.call_name = fn.get("name") or reply.call_name
                reply.arguments += fn.get("arguments") or ""
            if delta.get("content"):
                reply.first_s = reply.first_s or now
                reply.text += delta["content"]
            reply.finish = choice.get("finish_reason") or reply.finish
        usage = event.get("usage")
        if usage:
            reply.usage = {"prompt": usage["prompt_tokens"], "completion": usage["completion_tokens"],
                           "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}

    def absorb(self, reply: Reply, output: str | None) -> None:
        if reply.call_id is None:
            self.messages.append({"role": "assistant", "content": reply.text})
            return
        self.messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": reply.call_id, "type": "function", "function": {"name": reply.call_name, "arguments": reply.arguments}}]})
        if output is not None:
            self.messages.append({"role": "tool", "tool_call_id": reply.call_id, "content": output})


class ResponsesLoop(Loop):
    def __init__(self, plan: ClientPlan, task: LoopTask) -> None:
        super().__init__(plan, task)
        self.chain = plan.responses_mode == "chain"
        self.items: list[dict[str, Any]] = [{"role": "user", "content": task.user}]  # replay: the whole input
        self.pending: list[dict[str, Any]] = list(self.items)  # chain: what the next turn sends
        self.previous: str | None = None
        self.tools = [{"type": "function", **t, "strict": False} for t in plan.tools]

    def body(self, turn: int, final: bool) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.plan.model, "instructions": self.plan.system, "tools": self.tools,
            "tool_choice": self.plan.final_tool_choice if final else "required", "parallel_tool_calls": False,
            "max_output_tokens": self.plan.answer_max_tokens if final else self.plan.call_max_tokens,
            "temperature": 0, "stream": True}
        if self.chain:
            body |= {"input": self.pending, "store": True}
            if self.previous is not None:
                body["previous_response_id"] = self.previous
        else:
            body |= {"input": self.items, "store": False}
        return body

    def read(self, event: dict[str, Any], reply: Reply, now: float) -> None:
        kind = event.get("type", "")
        if kind == "response.output_item.added" or kind.endswith(".delta"):
            reply.first_s = reply.first_s or now
        if kind in ("response.completed", "response.incomplete", "response.failed"):
            r = event["response"]
            reply.response_id = r["id"]
            reply.finish = r.get("status")
            usage = r.get("usage") or {}
            if usage:
                reply.usage = {"prompt": usage["input_tokens"], "completion": usage["output_tokens"],
                               "cached": (usage.get("input_tokens_details") or {}).get("cached_tokens", 0)}
            for item in r.get("output") or []:
                if item.get("type") == "function_call" and reply.call_id is None:
                    reply.call_id, reply.call_name, reply.arguments = item["call_id"], item["name"], item["arguments"]
                elif item.get("type") == "message":
                    reply.text += "".join(p.get("text", "") for p in item.get("content") or [])

    def absorb(self, reply: Reply, output: str | None) -> None:
        self.previous = reply.response_id
        result = ([{"type": "function_call_output", "call_id": reply.call_id, "output": output}]
                  if output is not None and reply.call_id is not None else [])
        if reply.call_id is not None:
            self.items.append({"type": "function_call", "call_id": reply.call_id, "name": reply.call_name,
                               "arguments": reply.arguments})
        else:
            self.items.append({"role": "assistant", "content": reply.text})
        self.items += result
        self.pending = result


class AnthropicLoop(Loop):
    def __init__(self, plan: ClientPlan, task: LoopTask) -> None:
        super().__init__(plan, task)
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": task.user}]
        self.tools = [{"name": t["name"], "description": t["description"], "input_schema": t["parameters"]}
                      for t in plan.tools]

    def body(self, turn: int, final: bool) -> dict[str, Any]:
        return {"model": self.plan.model, "system": self.plan.system, "messages": self.messages, "tools": self.tools,
                "tool_choice": ({"type": self.plan.final_tool_choice} if final
                                else {"type": "any", "disable_parallel_tool_use": True}),
                "max_tokens": self.plan.answer_max_tokens if final else self.plan.call_max_tokens,
                "temperature": 0, "stream": True}

    def read(self, event: dict[str, Any], reply: Reply, now: float) -> None:
        kind = event.get("type")
        usage = (event.get("message") or {}).get("usage") if kind == "message_start" else event.get("usage")
        if usage:
            fresh = usage.get("input_tokens", 0)
            read, written = usage.get("cache_read_input_tokens") or 0, usage.get("cache_creation_input_tokens") or 0
            reply.usage = {"prompt": fresh + read + written, "cached": read,
                           "completion": usage.get("output_tokens", 0)}
        if kind == "content_block_start":
            reply.first_s = reply.first_s or now
            block = event["content_block"]
            if block.get("type") == "tool_use" and reply.call_id is None:
                reply.call_id, reply.call_name = block["id"], block["name"]
        elif kind == "content_block_delta":
            delta = event["delta"]
            if delta.get("type") == "input_json_delta":
                reply.arguments += delta.get("partial_json", "")
            elif delta.get("type") == "text_delta":
                reply.text += delta.get("text", "")
        elif kind == "message_delta":
            reply.finish = (event.get("delta") or {}).get("stop_reason") or reply.finish

    def absorb(self, reply: Reply, output: str | None) -> None:
        if reply.call_id is None:
            self.messages.append({"role": "assistant", "content": [{"type": "text", "text": reply.text or "."}]})
            return
        try:
            arguments = json.loads(reply.arguments or "{}")
        except json.JSONDecodeError:  # a call cut by max_tokens: its input as far as it went
            arguments = {"_partial": reply.arguments}
        self.messages.append({"role": "assistant", "content": [
            {"type": "tool_use", "id": reply.call_id, "name": reply.call_name, "input": arguments}]})
        if output is not None:
            self.messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": reply.call_id, "content": output}]})


LOOPS: dict[str, type[Loop]] = {"chat": ChatLoop, "responses": ResponsesLoop, "anthropic": AnthropicLoop}


async def run_turn(client: httpx.AsyncClient, loop: Loop, turn: int, final: bool, start: float) -> tuple[TurnRecord, Reply]:
    api = loop.task.api
    record = TurnRecord(loop.task.task_id, api, turn, "answer" if final else "call", time.monotonic() - start)
    reply = Reply()
    sent = time.monotonic()
    async with client.stream("POST", PATHS[api], json=loop.body(turn, final)) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            record.error = f"HTTP {response.status_code}: {text[:400]}"
            return record, reply
        async for event in sse_events(response):
            if event.get("type") == "error" or ("error" in event and "choices" not in event):
                record.error = f"stream error: {json.dumps(event)[:400]}"
            loop.read(event, reply, time.monotonic())
    done = time.monotonic()
    record.e2e_s = done - sent
    record.ttft_s = (reply.first_s - sent) if reply.first_s is not None else None
    record.prompt_tokens, record.cached_tokens = reply.usage.get("prompt"), reply.usage.get("cached")
    record.completion_tokens, record.finish, record.call_name = reply.usage.get("completion"), reply.finish, reply.call_name
    if not final and reply.call_id is None and record.error is None:
        record.error = f"no tool call in a forced turn (finish {reply.finish!r}, text {reply.text[:80]!r})"
    if not reply.usage and record.error is None:
        record.error = "the response reported no usage"
    return record, reply


async def run_loop(client: httpx.AsyncClient, plan: ClientPlan, task: LoopTask, start: float,
                   records: list[TurnRecord]) -> None:
    loop = LOOPS[task.api](plan, task)
    rounds = len(task.outputs)
    for k in range(rounds + 1):  # turn k + 1: a forced call for k < rounds, then the answer
        final = k == rounds
        record, reply = await run_turn(client, loop, k + 1, final, start)
        records.append(record)
        if record.error is not None:
            return
        loop.absorb(reply, None if final else task.outputs[k])


async def run_plan(plan: ClientPlan) -> list[TurnRecord]:
    records: list[TurnRecord] = []
    queue = list(reversed(plan.tasks))
    limits = httpx.Limits(max_connections=plan.concurrency + 4, max_keepalive_connections=plan.concurrency + 4)
    async with httpx.AsyncClient(base_url=plan.url, timeout=httpx.Timeout(plan.timeout_s), limits=limits) as client:
        start = time.monotonic()

        async def worker() -> None:
            while queue:
                await run_loop(client, plan, queue.pop(), start, records)

        try:
            await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(min(plan.concurrency, len(queue))))),
                                   plan.timeout_s)
        except asyncio.TimeoutError:
            raise RuntimeError(f"the agent loops exceeded {plan.timeout_s:.0f} s") from None
    return sorted(records, key=lambda r: r.send_s)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m radixserve_bench.agents.client PLAN.json OUT.json", file=sys.stderr)
        return 2
    plan = ClientPlan.from_json(json.loads(Path(argv[0]).read_text()))
    started = time.monotonic()
    records = asyncio.run(run_plan(plan))
    Path(argv[1]).write_text(json.dumps({"duration_s": time.monotonic() - started,
                                         "records": [asdict(r) for r in records]}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
