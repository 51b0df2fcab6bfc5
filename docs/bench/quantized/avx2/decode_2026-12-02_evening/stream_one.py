"""One streamed, greedy chat reply forced to N tokens (as `radixserve bench peers` forces radixserve's)
to a plain httpx client: its TTFT and decode tok/s. `python stream_one.py [N] [PORT]` against
`radixserve serve --speculation off` on 127.0.0.1."""
import sys
import time

import httpx

n = int(sys.argv[1]) if len(sys.argv) > 1 else 256
port = sys.argv[2] if len(sys.argv) > 2 else "8000"
body = {"model": "SmolLM2-135M-Instruct", "temperature": 0, "stream": True, "max_tokens": n, "min_tokens": n,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]}
started = time.perf_counter()
first = None
chunks = 0
with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120) as r:
    for line in r.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            chunks += 1
            first = first or time.perf_counter()
assert first is not None, "no chunk came"
ended = time.perf_counter()
print(f"chunks {chunks} ttft {1000 * (first - started):.0f} ms decode {n / (ended - first):.1f} tok/s")
