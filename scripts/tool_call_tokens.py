"""Why an agent's next turn leaves the cached path inside the previous reply: a forced tool call as the
model generated it, token by token, beside the same text as the tokenizer encodes it when the client sends
the call back (docs/bench/hybrid.md, "Sliding-window layers").

    radixserve bench random-checkpoint --family gemma3 --out /tmp/rs-gemma3-tiny
    python scripts/tool_call_tokens.py /tmp/rs-gemma3-tiny
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import openai
from transformers import AutoTokenizer

from radixserve import AsyncEngine, EngineConfig
from radixserve.server import BackgroundServer, ServerConfig

TOOLS: list[Any] = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                   "required": ["city"]}}}]


def main(model: str) -> None:
    name = Path(model).name
    config = ServerConfig(port=0, web_dir=None, shutdown_grace_s=0.5)
    with BackgroundServer(lambda: AsyncEngine(EngineConfig(model=model, sliding_window_kv="all")), config) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")
        messages: list = [{"role": "system", "content": "You are an agent."},
                          {"role": "user", "content": "What is the weather in Paris?"}]
        first = client.chat.completions.create(model=name, messages=messages, tools=TOOLS, tool_choice="required",
                                               max_tokens=100, temperature=0, logprobs=True)
        reply = first.choices[0]
        assert first.usage is not None and reply.logprobs is not None and reply.logprobs.content is not None
        generated = [t.token for t in reply.logprobs.content]
        call = reply.message.tool_calls[0] if reply.message.tool_calls else None
        assert call is not None, "no call parsed"
        messages += [reply.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
        second = client.chat.completions.create(model=name, messages=messages, tools=TOOLS, max_tokens=4, temperature=0)
    tokenizer = AutoTokenizer.from_pretrained(model)
    encoded = [tokenizer.decode([i]) for i in tokenizer.encode("".join(generated), add_special_tokens=False)]
    same = next((i for i, (a, b) in enumerate(zip(generated, encoded)) if a != b), min(len(generated), len(encoded)))
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    print(f"prompt {first.usage.prompt_tokens} tokens, reply {len(generated)}: the next turn read "
          f"{second.usage.prompt_tokens_details.cached_tokens} from the cache")
    print(f"generated: {generated}\nencoded:   {encoded}\nthey part at reply token {same}")


if __name__ == "__main__":
    main(sys.argv[1])
