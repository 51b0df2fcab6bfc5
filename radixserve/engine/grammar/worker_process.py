"""A grammar compile worker: a separate process that converts, compiles and first-masks constraints.

The parent (engine/grammar/workers.py) runs this file by its path (`python -I worker_process.py`), so
the worker imports llguidance and the standard library only: not radixserve, not torch. It owns the
worker's llguidance tokenizer and nothing else; it keeps no grammar between requests.

Protocol, on stdin/stdout, each message a 4-byte big-endian length and that many bytes of JSON:
- boot (first message): {"tokenizer": tokenizer.json text, "n_vocab", "eos": [ids], "memory_mb",
  "stack_mb", "parser": GrammarLimits.parser()}; answered {"ready": true};
- each request: {"kind": "json" | "regex" | "lark" | "grammar", "value": schema or text}; answered
  {"grammar": llguidance grammar text, "compile_s": seconds} or {"refused": why, in our words}.

Invariants: the worker runs at nice BACKGROUND_NICE (its compiles never compete with the engine step
for the CPU on equal terms); the address space is capped (RLIMIT_AS) before the tokenizer is built; every compile and
first mask run on a thread with `stack_mb` of native stack; a grammar that crashes, exhausts memory or
runs too long ends this process, never the engine (the parent sees its pipe close, or kills it); a
refusal's text names the constraint kind and what is wrong, never the parser's state (llguidance's
verbose errors are off) nor more than a few lines of its message.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import struct
import sys
import threading
import time
from typing import Any, BinaryIO

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

HEADER = struct.Struct(">I")
BACKGROUND_NICE = 10  # compiles run below the engine step's priority, in the workers and in the engine
MAX_MESSAGE = 1 << 30


def read_message(stream: BinaryIO) -> Any:
    """The next message, or None at end of stream."""
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (size,) = HEADER.unpack(header)
    if size > MAX_MESSAGE:
        raise ValueError(f"message of {size} bytes")
    body = stream.read(size)
    return None if len(body) < size else json.loads(body)


def write_message(stream: BinaryIO, message: Any) -> None:
    body = json.dumps(message).encode()
    stream.write(HEADER.pack(len(body)) + body)
    stream.flush()


def grammar_text(kind: str, value: Any, json_options: dict[str, Any]) -> str:
    """llguidance's grammar (its JSON envelope) for a constraint source; raises on what its
    converters cannot read."""
    if kind == "json":
        return str(llguidance.LLMatcher.grammar_from_json_schema(value, defaults=json_options))  # type: ignore[arg-type]
    if kind == "regex":
        return str(llguidance.LLMatcher.grammar_from_regex(str(value)))
    if kind == "lark":
        return str(llguidance.LLMatcher.grammar_from_lark(str(value)))
    # Lark as it is; GBNF (llama.cpp's dialect, which vLLM and llama.cpp accept) converted to Lark
    return str(llguidance.LLMatcher.grammar_from_lark(any_to_lark(str(value))))


def explain(kind: str, error: str) -> str:
    """llguidance's error in our words: which kind of constraint, and the first lines of its message."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    text = " ".join(lines[:3])[:400] if lines else "unknown error"
    if "nimplemented" in text or "not supported" in text:
        return f"this {kind} uses a feature the engine cannot compile: {text}"
    if "limit" in text or "too many" in text or "too large" in text or "fuel" in text:
        return f"this {kind} needs more than the engine's grammar limits allow ({text})"
    return f"invalid {kind}: {text}"


def on_big_stack(stack_mb: int, work: Any) -> Any:
    """`work()` on a fresh thread with `stack_mb` of native stack; its result, or its exception raised."""
    result: list[Any] = []

    def run() -> None:
        try:
            result.append((True, work()))
        except BaseException as e:  # handed to the caller's thread
            result.append((False, e))

    previous = threading.stack_size(stack_mb << 20)
    try:
        thread = threading.Thread(target=run, name="radixserve-grammar-compile")
        thread.start()
    finally:
        threading.stack_size(previous)
    thread.join()
    ok, value = result[0]
    if not ok:
        raise value
    return value


def compile_and_mask(tokenizer: Any, limits: Any, json_options: dict[str, Any], kind: str, value: Any) -> dict[str, Any]:
    """Convert, compile and compute the first token mask of one constraint."""
    started = time.perf_counter()
    try:
        text = grammar_text(kind, value, json_options)
    except Exception as e:  # the converters raise on what they cannot read
        return {"refused": f"cannot compile this {kind}: {' '.join(str(e).split())[:300]}"}
    matcher = llguidance.LLMatcher(tokenizer, text, log_level=0, limits=limits)
    if matcher.is_error():
        return {"refused": explain(kind, str(matcher.get_error()))}
    matcher.compute_bitmask()  # the first mask builds the lexer's first states: where regexes blow up
    if matcher.is_error():
        return {"refused": explain(kind, str(matcher.get_error()))}
    return {"grammar": text, "compile_s": time.perf_counter() - started}


def main() -> None:
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but messages on the parent's pipe
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the whole group: the engine stops us
    os.nice(BACKGROUND_NICE)  # a compile yields the CPU to the engine step: decoding comes first
    boot = read_message(stdin)
    if boot is None:
        return
    memory = boot["memory_mb"] << 20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    tokenizer = llguidance.LLTokenizer(boot["tokenizer"], n_vocab=boot["n_vocab"], eos_token=boot["eos"] or None)
    limits = llguidance.LLParserLimits(**boot["parser"])
    write_message(stdout, {"ready": True})
    while (request := read_message(stdin)) is not None:
        answer = on_big_stack(boot["stack_mb"],
                              lambda r=request: compile_and_mask(tokenizer, limits, boot["json_options"], r["kind"], r["value"]))
        write_message(stdout, answer)


if __name__ == "__main__":
    main()
