"""`radixserve chat` and `radixserve generate`: the engine from a terminal.

The chat keeps the conversation as token IDs and appends each turn's tokens (never re-tokenizing
the history), so every turn after the first hits the prefix cache; each turn prints cached prompt
tokens / prompt tokens (and how many of them were loaded back from the host-memory tier, when any
were), time to first token, decode speed and the reply's tokens (how many of them were accepted
drafts of speculative decoding, when any were).
"""

from __future__ import annotations

import argparse
import sys
import time

from radixserve.chat.template import ChatFormatter
from radixserve.config import EngineConfig
from radixserve.core import RequestOutput
from radixserve.engine.engine import LLMEngine
from radixserve.sampling_params import SamplingParams


def _stream(engine: LLMEngine, prompt: list[int] | str, params: SamplingParams, echo: bool) -> tuple[list[int], RequestOutput]:
    rid = engine.add_request(prompt, params)
    ids: list[int] = []
    last: RequestOutput | None = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id != rid:
                continue
            for c in out.outputs:
                ids.extend(c.token_ids)
                if echo:
                    print(c.text, end="", flush=True)
            last = out
    assert last is not None and last.finished
    return ids, last


def _figures(out: RequestOutput) -> str:
    u = out.usage
    pct = 100.0 * u.cached_tokens / u.prompt_tokens if u.prompt_tokens else 0.0
    host = f", {u.host_cached_tokens} loaded from host memory" if u.host_cached_tokens > 0 else ""
    d = u.speculation
    drafted = f" ({d.accepted} drafted)" if d is not None and d.accepted > 0 else ""
    return (f"[cached {u.cached_tokens}/{u.prompt_tokens} prompt tokens ({pct:.0f}%{host}) · "
            f"TTFT {out.timing.ttft_ms:.0f} ms · {out.tokens_per_s():.1f} tok/s · "
            f"{u.completion_tokens} tokens{drafted}]")


def run_chat(config: EngineConfig, args: argparse.Namespace) -> int:
    print("loading model…", file=sys.stderr, flush=True)
    engine = LLMEngine(config)
    fmt = ChatFormatter(engine.tokenizer)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    tokens = fmt.encode(fmt.render(messages, add_generation_prompt=False))
    print(f"radixserve chat · {engine.model_name} · Ctrl-D or /exit to quit, /reset to start over", flush=True)
    while True:
        try:
            text = input("\nyou> ").strip()
        except EOFError:
            print()
            return 0
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            messages = messages[:1] if args.system else []
            tokens = fmt.encode(fmt.render(messages, add_generation_prompt=False))
            continue
        if not text:
            continue
        turn = fmt.append_user(messages, text)
        prompt = tokens + turn.user + turn.generation_prompt
        if len(prompt) >= engine.max_seq_len:
            print(f"(the conversation reached the {engine.max_seq_len}-token context; /reset to start over)")
            continue
        print("assistant> ", end="", flush=True)
        start = time.monotonic()
        generated, out = _stream(engine, prompt, params, echo=True)
        messages.append({"role": "user", "content": text})
        closed = fmt.closed_reply(messages, generated, tuple(engine.eos_token_ids))
        messages.append({"role": "assistant", "content": fmt.decode(generated)})
        tokens = prompt + closed
        print(f"\n{_figures(out)} ({time.monotonic() - start:.1f} s)", flush=True)


def run_generate(config: EngineConfig, args: argparse.Namespace) -> int:
    engine = LLMEngine(config)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    for text in args.prompts:
        prompt: list[int] | str = text
        if args.chat:
            fmt = ChatFormatter(engine.tokenizer)
            prompt = fmt.prompt_tokens([{"role": "user", "content": text}])
        print(f"### {text}")
        _, out = _stream(engine, prompt, params, echo=True)
        print(f"\n{_figures(out)}", flush=True)
    return 0
