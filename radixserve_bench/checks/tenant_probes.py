"""What one tenant can learn about another's cached prompts, measured against a real server with two
tenants (`--api-keys`), as an attacker would try it.

oracle: the victim (tenant A) sends a prompt that ends in an 8-token secret. The attacker guesses the
  secret token by token: for each position it sends known prefix + the tokens it has + one candidate
  (the right one among wrong ones) and reads what it can read with its own key: the reply's
  `cached_tokens` and `host_cached_tokens`, and what `/v1/cache/stats`, `/metrics` and `/v1/cache/tree`
  show it after each probe. The same probe sequence is run on two fresh servers, one where the
  victim's prompt is cached and one where it is not: the attacker learns nothing if every
  observation is identical. The control runs the same attack with a key of the victim's own tenant,
  which recovers the secret (that is the cache doing its job).
ttft: the victim caches a long prompt; the attacker sends 30 probes that begin with that prompt and 30
  that match nothing, interleaved, each under a fresh `cache_salt` so it never hits its own cache, and
  the medians of their time to first token are compared. The control does the same inside tenant A.

    radixserve bench tenant-probes --json docs/bench/tenants/tenant_probes.json
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from radixserve_bench.checks.server_process import Server

KEYS = "victim-key tenant-a user\nattacker-key tenant-b user\ninsider-key tenant-a user\nadmin-key ops admin\n"
SECRET_LEN = 8
CANDIDATES = 8  # per position: the right token among 7 wrong ones, in random order


MODEL = {"name": ""}  # the served model's name, read from the first server


def complete(client: httpx.Client, key: str, prompt: list[int], **extra: Any) -> dict[str, Any]:
    r = client.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                    json={"model": MODEL["name"], "prompt": prompt, "max_tokens": 1, "temperature": 0, **extra})
    r.raise_for_status()
    return r.json()


def observe(client: httpx.Client, key: str) -> dict[str, Any]:
    """Everything about the cache the key may read, with times and clocks left out (they differ by run)."""
    auth = {"Authorization": f"Bearer {key}"}
    stats = client.get("/v1/cache/stats", headers=auth).json()
    metrics = client.get("/metrics", headers=auth).text
    tree = client.get("/v1/cache/tree", headers=auth).json()
    counts = {m.group(1): m.group(2) for m in re.finditer(r"^(radixserve_\S*(?:cached|hit|tokens|requests)\S*) (\S+)$",
                                                            metrics, re.M)}
    return {"stats": _numbers(stats), "metrics": counts,
            "tree": [(n.get("tokens"), n.get("subtree_tokens"), n.get("tier"), n.get("hits")) for n in tree.get("nodes", [])]}


def _numbers(value: Any, path: str = "") -> dict[str, Any]:
    """The JSON's leaves, but not times, rates of time or utilizations."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_numbers(v, f"{path}.{k}"))
        return out
    if isinstance(value, list):
        return _numbers(dict(enumerate(value)), path)
    if re.search(r"(_s|_ms|seconds|utilization|uptime|per_step|latency|time)", path):
        return {}
    return {path: value}


def attack(client: httpx.Client, key: str, known: list[int], secret: list[int], vocab: int, seed: int,
           salt: str | None = None) -> tuple[list[int], list[Any]]:
    """Guess the secret token by token; the tokens guessed (the candidate that hit most, the first on
    a tie) and every observation, in order."""
    rng = random.Random(seed)
    guessed: list[int] = []
    observations: list[Any] = []
    for i in range(SECRET_LEN):
        wrong = rng.sample([t for t in range(100, vocab) if t != secret[i]], CANDIDATES - 1)
        candidates = wrong + [secret[i]]
        rng.shuffle(candidates)
        scores = []
        for c in candidates:
            tail = [rng.randrange(100, vocab) for _ in range(3)]  # never a hit: the probe's own end
            extra = {"cache_salt": salt} if salt else {}
            usage = complete(client, key, known + guessed + [c] + tail, **extra)["usage"]
            details = usage.get("prompt_tokens_details") or {}
            seen = (details.get("cached_tokens", 0), details.get("host_cached_tokens", 0))
            observations.append({"probe": [i, c], "usage": seen, "view": observe(client, key)})
            scores.append(seen[0])
        guessed.append(candidates[scores.index(max(scores))])
    return guessed, observations


def run_oracle(args: argparse.Namespace, keys: Path) -> dict[str, Any]:
    rng = random.Random(args.seed)
    results: dict[str, Any] = {}
    runs: list[dict[str, Any]] = []
    for victim_cached in (True, False):
        with Server(keys, args.port, args.extra) as server:
            client = server.client
            MODEL["name"] = server.model("victim-key")
            vocab = server.vocab
            known = [rng.randrange(100, vocab) for _ in range(args.known)] if not runs else runs[0]["known"]
            secret = [rng.randrange(100, vocab) for _ in range(SECRET_LEN)] if not runs else runs[0]["secret"]
            if victim_cached:
                complete(client, "victim-key", known + secret + [101, 102])
            guessed, observations = attack(client, "attacker-key", known, secret, vocab, args.seed)
            runs.append({"known": known, "secret": secret, "guessed": guessed, "observations": observations})
            if victim_cached:
                insider, _ = attack(client, "insider-key", known, secret, vocab, args.seed + 1)
                results["inside_tenant"] = {"guessed": insider, "recovered": insider == secret}
    cached, uncached = runs[0]["observations"], runs[1]["observations"]
    differing = [a["probe"] for a, b in zip(cached, uncached) if a != b]
    results["cross_tenant"] = {
        "probes": len(cached), "identical_with_and_without_victim": not differing, "differing_probes": differing,
        "correct_tokens_guessed": sum(g == s for g, s in zip(runs[0]["guessed"], runs[0]["secret"])),
        "chance_per_token": 1 / CANDIDATES,
        # what each observation holds, and the last one in full: the attacker did read something
        "fields_per_observation": {k: len(v) for k, v in cached[-1]["view"].items()},
        "last_observation": cached[-1],
    }
    return results


def ttft(client: httpx.Client, key: str, prompt: list[int], salt: str | None) -> float:
    body: dict[str, Any] = {"model": MODEL["name"], "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True}
    if salt:
        body["cache_salt"] = salt
    start = time.perf_counter()
    with client.stream("POST", "/v1/completions", headers={"Authorization": f"Bearer {key}"}, json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                return time.perf_counter() - start
    raise AssertionError("no token came")


def run_ttft(args: argparse.Namespace, keys: Path) -> dict[str, Any]:
    rng = random.Random(args.seed + 7)
    out: dict[str, Any] = {}
    with Server(keys, args.port, args.extra) as server:
        client, vocab = server.client, server.vocab
        MODEL["name"] = server.model("victim-key")
        victim = [rng.randrange(100, vocab) for _ in range(args.ttft_len)]
        complete(client, "victim-key", victim + [101])
        for name, key in (("cross_tenant", "attacker-key"), ("inside_tenant", "insider-key")):
            times: dict[str, list[float]] = {"matches_victim": [], "matches_nothing": []}
            for i in range(args.probes):
                for kind in times:
                    head = victim if kind == "matches_victim" else [rng.randrange(100, vocab) for _ in victim]
                    # a fresh salt per probe across tenants (it never hits its own cache); inside tenant A
                    # no salt, or it would not share the victim's namespace
                    salt = f"probe-{name}-{kind}-{i}" if name == "cross_tenant" else None
                    times[kind].append(ttft(client, key, head + [rng.randrange(100, vocab) for _ in range(4)], salt))
            match, nothing = statistics.median(times["matches_victim"]), statistics.median(times["matches_nothing"])
            spread = statistics.pstdev(times["matches_nothing"])
            out[name] = {"median_ttft_s": {"matches_victim": match, "matches_nothing": nothing},
                         "ratio": match / nothing, "stdev_matches_nothing_s": spread,
                         "within_noise": abs(match - nothing) <= 2 * spread, "probes_each": args.probes,
                         "times_s": times}
    out["prompt_tokens"] = args.ttft_len + 4
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--port", type=int, default=8791)
    ap.add_argument("--known", type=int, default=48, help="tokens of the prompt the attacker knows")
    ap.add_argument("--ttft-len", type=int, default=1300, help="tokens of the victim's long prompt")
    ap.add_argument("--probes", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=["oracle", "ttft"], default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("extra", nargs="*", help="more server flags")


def run(args: argparse.Namespace) -> int:
    keys = Path("/tmp/radixserve-tenant-probes.keys")
    keys.write_text(KEYS)
    result: dict[str, Any] = {}
    if args.only in (None, "oracle"):
        result["oracle"] = run_oracle(args, keys)
        print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "differing_probes"}
                          for k, v in result["oracle"].items()}, indent=1))
    if args.only in (None, "ttft"):
        result["ttft"] = run_ttft(args, keys)
        print(json.dumps({k: v for k, v in result["ttft"].items() if k != "prompt_tokens"}, indent=1, default=str)[:2000])
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0
