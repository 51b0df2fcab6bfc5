"""Does a pinned system prompt stay cached whatever else runs? A real server with a small pool; an admin
pins a ~1,000-token system prompt for tenant A (POST /v1/cache/pins); then, ten times over, other
traffic as large as the whole pool (chats of both tenants with other long system prompts) followed by
one chat of tenant A with the pinned system prompt, whose `cached_tokens` must cover the pin. The
control run is the same without the pin.

    radixserve bench pin-burst --json docs/bench/tenants/pin_burst.json
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

import httpx
from transformers import AutoTokenizer

from radixserve.model.embedded import embedded_model_dir
from radixserve_bench.checks.server_process import Server

MODEL = {"name": ""}  # the served model's name, read from the server
KEYS = "admin-key ops admin\na-key tenant-a user\nb-key tenant-b user\n"
WORDS = ["account", "billing", "refund", "policy", "customer", "order", "shipping", "delay", "warranty", "support",
         "ticket", "escalate", "manager", "verify", "identity", "password", "reset", "invoice", "payment", "card",
         "declined", "subscription", "renewal", "cancel", "plan", "upgrade", "device", "setup", "network", "router",
         "firmware", "update", "error", "code", "restart", "cable", "signal", "outage", "region", "status"]


def text_of_tokens(tokenizer: Any, n: int, rng: random.Random) -> str:
    """Plain sentences of about n tokens."""
    words: list[str] = []
    while len(tokenizer.encode(" ".join(words))) < n:
        words += [rng.choice(WORDS) for _ in range(12)] + ["."]
    return " ".join(words)


def chat(client: httpx.Client, key: str, system: str, question: str) -> int:
    r = client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                    json={"model": MODEL["name"], "max_tokens": 1, "temperature": 0,
                          "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]})
    r.raise_for_status()
    return int((r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0))


def run_once(args: argparse.Namespace, keys: Path, pinned: bool) -> dict[str, Any]:
    rng = random.Random(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(str(embedded_model_dir()))
    system = "You are the support assistant of ACME. " + text_of_tokens(tokenizer, args.system_tokens, rng)
    flags = ["--num-blocks", str(args.num_blocks), "--max-model-len", str(args.max_model_len),
             "--pin-budget", str(args.pin_budget), *args.extra]
    with Server(keys, args.port, flags) as server:
        client = server.client
        MODEL["name"] = server.model("admin-key")
        pin: dict[str, Any] | None = None
        if pinned:
            r = client.post("/v1/cache/pins", headers={"Authorization": "Bearer admin-key"},
                            json={"system": system, "tenant": "tenant-a", "label": "ACME support"})
            r.raise_for_status()
            pin = r.json()
        pool_tokens = args.num_blocks * args.block_size
        checks, burst_tokens = [], 0
        for round_ in range(args.rounds):
            sent = 0
            while sent < pool_tokens:  # other traffic as large as the whole pool
                other = text_of_tokens(tokenizer, args.other_tokens, rng)
                chat(client, rng.choice(["a-key", "b-key"]), other, f"question {round_}-{sent}")
                sent += args.other_tokens
            burst_tokens += sent
            checks.append(chat(client, "a-key", system, f"My order {rng.randrange(10**6)} is late."))
        pins = client.get("/v1/cache/pins", headers={"Authorization": "Bearer admin-key"}).json() if pinned else None
        stats = client.get("/v1/cache/stats", headers={"Authorization": "Bearer admin-key"}).json()
    system_tokens = pin["tokens"] if pin else None
    return {"pinned": pinned, "pin": pin, "checks_cached_tokens": checks, "burst_tokens": burst_tokens,
            "pool_tokens": pool_tokens, "burst_over_pool": burst_tokens / pool_tokens,
            "full_hits": sum(c >= (system_tokens or 0) for c in checks) if pinned else None,
            "pins_after": pins, "evictions": stats.get("evictions")}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--port", type=int, default=8792)
    ap.add_argument("--num-blocks", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16, help="the server's block size (its default)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--pin-budget", type=float, default=0.4)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--other-tokens", type=int, default=800)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("extra", nargs="*", help="more server flags")


def run(args: argparse.Namespace) -> int:
    keys = Path("/tmp/radixserve-pin-burst.keys")
    keys.write_text(KEYS)
    result = {"with_pin": run_once(args, keys, True), "without_pin": run_once(args, keys, False)}
    for name, r in result.items():
        print(name, "checks cached_tokens:", r["checks_cached_tokens"], "burst x pool:", round(r["burst_over_pool"], 1),
              "pin tokens:", r["pin"]["tokens"] if r["pin"] else "-", "full hits:", r["full_hits"])
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0
