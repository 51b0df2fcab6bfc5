"""Does one hostile structured-output client slow everyone else's decoding? A real `radixserve serve`
(the embedded model) on 127.0.0.1; a victim streams a 400-token completion (ignore_eos), first alone
(the control), then beside a benign neighbour sending the attacker's requests without their
constraints (what any second client costs: its replies share the batch), then while an attacker from
another address (127.0.0.2) sends, one request at a time and back to back, issue 43's attacks in
turn: a lexer-blow-up regex with a fresh N each time, a GBNF rule chain whose conversion is quadratic,
a 5,000-rule Lark chain and a 5,000-`$ref` schema. Reported: the victim's tokens a second and largest
gap between tokens in each condition, each round, and the server's RSS before and after the attacks;
`--rounds` repeats the three conditions and keeps every figure.

    radixserve bench attack --rounds 3 --json docs/bench/structured-attacks/attack.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from radixserve_bench.checks.server_process import Server

KEYS = "victim-key tenant-a user\nattacker-key tenant-b user\n"
VICTIM_TOKENS = 400


def attacks(model: str, n: int) -> list[dict[str, Any]]:
    chain = "start: r0\n" + "\n".join(f'r{i}: "a" r{i + 1}' for i in range(5000)) + '\nr5000: "b"\n'
    gbnf = "root ::= r0\n" + "\n".join(f'r{i} ::= r{i + 1} "a"' for i in range(3000)) + '\nr3000 ::= "a"\n'
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(5000)}
    defs["d5000"] = {"type": "integer"}
    base = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
    return [{**base, "structured_outputs": {"regex": f"((b{{{n}}}){{100}}){{100}}"}},
            {**base, "structured_outputs": {"grammar": gbnf}},
            {**base, "structured_outputs": {"grammar": chain}},
            {**base, "response_format": {"type": "json_schema",
                                         "json_schema": {"name": "r", "schema": {"$defs": defs, "$ref": "#/$defs/d0"}}}}]


async def victim(url: str, model: str) -> dict[str, float]:
    # the legacy completions API: it honours ignore_eos, so the victim always decodes VICTIM_TOKENS
    body = {"model": model, "prompt": "Tell me a long story.", "stream": True, "max_tokens": VICTIM_TOKENS,
            "ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True}}
    gaps: list[float] = []
    tokens = 0
    async with httpx.AsyncClient(base_url=url, timeout=600, headers={"Authorization": "Bearer victim-key"}) as c:
        started = last = time.monotonic()
        async with c.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0]["text"]:
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now
    elapsed = time.monotonic() - started
    return {"stream_s": round(elapsed, 3), "tokens": tokens, "tokens_per_s": round(tokens / elapsed, 2),
            "max_gap_s": round(max(gaps[1:] or [0.0]), 3), "chunks": len(gaps)}


def neighbours(model: str, n: int) -> list[dict[str, Any]]:
    """What the attacks ask but the constraints: the same prompt and reply length, from the same address."""
    return [{k: v for k, v in body.items() if k not in ("structured_outputs", "response_format")}
            for body in attacks(model, n)]


async def attacker(url: str, model: str, stop: asyncio.Event, tally: dict[str, int], hostile: bool) -> None:
    transport = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
    async with httpx.AsyncClient(base_url=url, timeout=600, transport=transport,
                                 headers={"Authorization": "Bearer attacker-key"}) as c:
        n = 50
        while not stop.is_set():
            for body in (attacks if hostile else neighbours)(model, n):
                if stop.is_set():
                    break
                r = await c.post("/v1/chat/completions", json=body)
                reason = r.json()["choices"][0]["finish_reason"] if r.status_code == 200 else r.json()["error"]["code"]
                key = f"{r.status_code}:{reason}"
                tally[key] = tally.get(key, 0) + 1
            n += 1


async def beside(url: str, model: str, hostile: bool) -> tuple[dict[str, float], dict[str, int]]:
    """The victim's stream while the other client sends its requests back to back."""
    stop, tally = asyncio.Event(), dict[str, int]()
    flood = asyncio.create_task(attacker(url, model, stop, tally, hostile))
    await asyncio.sleep(2.0)  # the attacks are under way
    try:
        return await victim(url, model), tally
    finally:
        stop.set()
        await flood


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=8431)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)


def run(args: argparse.Namespace) -> int:
    keys = Path("/tmp/radixserve-structured-attack.keys")
    keys.write_text(KEYS)
    rounds = []
    with Server(keys, args.port) as server:
        model = server.model("victim-key")
        url = f"http://127.0.0.1:{args.port}"
        proc = psutil.Process(server.proc.pid) if server.proc is not None else None
        asyncio.run(victim(url, model))  # warm-up: the first request builds caches
        rss_before = proc.memory_info().rss if proc is not None else 0
        for _ in range(args.rounds):
            control = asyncio.run(victim(url, model))
            neighboured, plain = asyncio.run(beside(url, model, hostile=False))
            under_attack, tally = asyncio.run(beside(url, model, hostile=True))
            rounds.append({"control": control, "benign_neighbour": neighboured, "attacked": under_attack,
                           "neighbour_requests": plain, "attacks": tally,
                           "slowdown_vs_alone": round(control["tokens_per_s"] / under_attack["tokens_per_s"], 2),
                           "slowdown_vs_benign_neighbour": round(neighboured["tokens_per_s"]
                                                                 / under_attack["tokens_per_s"], 2)})
            print(json.dumps(rounds[-1]), flush=True)
        rss_after = proc.memory_info().rss if proc is not None else 0
        alive = server.client.get("/health").status_code == 200
    result = {"victim_tokens": VICTIM_TOKENS, "rounds": rounds, "server_alive_after": alive,
              "rss_mb_before": rss_before >> 20, "rss_mb_after": rss_after >> 20}
    print(json.dumps(result, indent=1))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0
