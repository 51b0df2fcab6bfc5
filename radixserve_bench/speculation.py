"""Speculative decoding's figures in `radixserve bench`: per run, tokens per step and draft acceptance;
per workload, speculation on / off and radixserve / transformers prompt lookup; the issue's targets;
the report's table.

Per run (speculation_metrics): for a radixserve system, from the engine's counters over the measured
run (radix.py's spec_counters): **tokens per step** = generated tokens / committed draws (generated
tokens per sequence per step: 1.0 without speculation), draft tokens proposed and accepted in all and
per source (tree, prediction, lookup) and the acceptance rate; for transformers prompt lookup, tokens
per step = output tokens / the generation steps its streamer saw. Decode speed per request
(`decode_tok_s_*`, metrics.py) comes from the client's token stamps for every system alike.

Per workload (spec_ratios, from the medians of the repeats, so the published ratios are computed from
the figures in the same document): every radixserve system with speculation / radixserve-nospec on mean
decode tok/s per request (and on the second ask's, for regenerate), and radixserve / hf-prompt-lookup
on the same prompts (edit-prediction's prompts are edit's: its peer figure is edit's).
"""

from __future__ import annotations

from typing import Any

from radixserve.core import DRAFT_SOURCES
from radixserve_bench.driver import RunTrace
from radixserve_bench.systems import NOSPEC, PROMPT_LOOKUP, REFERENCE
from radixserve_bench.workloads import SPEC_WORKLOADS

DECODE_METRICS = ("decode_tok_s_mean", "decode_tok_s_p50")
STEP_METRICS = ("tokens_per_step",)
DRAFT_METRICS = ("spec_proposed", "spec_accepted", "acceptance_rate",
                 *(f"spec_{kind}_{source}" for source in DRAFT_SOURCES for kind in ("proposed", "accepted")))
COMPARED = (*SPEC_WORKLOADS, "random")  # the workloads with a speculation table
PEER_PROMPTS = {"edit": "edit", "edit-prediction": "edit", "regenerate": "regenerate"}  # whose peer figures
# batch-1 goals: speculation on / off, mean decode tok/s per request (regenerate: its second ask)
BATCH1_GOALS = {"regenerate": 3.0, "edit-prediction": 2.5, "edit": 1.8}
RANDOM_GOAL = 0.97  # random, speculation on / off, at any batch: drafting must cost next to nothing
PEER_GOAL = 1.5  # edit at batch 1: radixserve / transformers prompt lookup
BATCH16_GOAL = 1.3  # edit and edit-prediction at 16+ clients: speculation on / off


def expected_metrics(system: str, workload: str) -> tuple[str, ...]:
    """What a run of `system` on `workload` must report for the speculation table."""
    if workload not in COMPARED:
        return ()
    if system.startswith("radixserve"):
        return DECODE_METRICS + STEP_METRICS + DRAFT_METRICS
    return DECODE_METRICS + (STEP_METRICS if system == PROMPT_LOOKUP else ())


def speculation_metrics(trace: RunTrace, engine: dict[str, float]) -> dict[str, float]:
    """Tokens per step and draft counts of one run (see the module docstring); {} for a system that
    reports neither engine counters nor steps."""
    m: dict[str, float] = {}
    if engine.get("committed_draws"):
        m["tokens_per_step"] = engine["generation_tokens"] / engine["committed_draws"]
    elif trace.records and all(r.steps for r in trace.records):
        m["tokens_per_step"] = sum(r.output_len for r in trace.records) / sum(r.steps or 0 for r in trace.records)
    if "committed_draws" in engine:
        proposed = sum(engine.get(f"spec_proposed_{s}", 0.0) for s in DRAFT_SOURCES)
        accepted = sum(engine.get(f"spec_accepted_{s}", 0.0) for s in DRAFT_SOURCES)
        m |= {"spec_proposed": proposed, "spec_accepted": accepted,
              "acceptance_rate": accepted / proposed if proposed else 0.0,
              **{k: engine.get(k, 0.0) for k in DRAFT_METRICS[3:]}}
    return m


def _medians(results: dict, workload: str) -> dict[str, dict[str, float]]:
    return {name: entry.get("median") or {} for name, entry in results["results"].get(workload, {}).items()}


def _decode_key(workload: str, m: dict[str, float]) -> str:
    """The decode speed a workload is judged on: regenerate's second ask (the one the tree can draft)."""
    return "decode_tok_s_turn2" if workload.startswith("regenerate") and "decode_tok_s_turn2" in m else "decode_tok_s_mean"


def spec_ratios(results: dict) -> dict[str, dict[str, Any]]:
    """Per compared workload: `on_off` (system -> on / off ratio), `vs_peer` (radixserve / prompt
    lookup), the decode figure each was computed on, and the load's clients."""
    out: dict[str, dict[str, Any]] = {}
    for workload in COMPARED:
        med = _medians(results, workload)
        if not med:
            continue
        load = results["workloads"][workload]["load"]
        entry: dict[str, Any] = {"clients": load["concurrency"] if load["mode"] != "open" else None, "on_off": {}}
        off = med.get(NOSPEC, {})
        key = _decode_key(workload, off)
        entry["decode_metric"] = key
        for name, m in med.items():
            if name.startswith("radixserve") and name != NOSPEC and off.get(key) and key in m:
                entry["on_off"][name] = {"on": m[key], "off": off[key], "ratio": m[key] / off[key]}
        peer = _medians(results, PEER_PROMPTS[workload]).get(PROMPT_LOOKUP, {}) if workload in PEER_PROMPTS else {}
        ref = med.get(REFERENCE, {})
        if peer.get("decode_tok_s_mean") and "decode_tok_s_mean" in ref:
            entry["vs_peer"] = {"radixserve": ref["decode_tok_s_mean"], "peer": peer["decode_tok_s_mean"],
                                "peer_workload": PEER_PROMPTS[workload],
                                "ratio": ref["decode_tok_s_mean"] / peer["decode_tok_s_mean"]}
        if entry["on_off"] or "vs_peer" in entry:
            out[workload] = entry
    return out


def target_values(results: dict) -> list[tuple[str, str, float, float | None]]:
    """(name, op, goal, value) of the speculation targets that apply to the loads this run used."""
    out: list[tuple[str, str, float, float | None]] = []
    ratios = results.get("speculation", {})
    for workload in COMPARED:
        if workload not in results["results"]:
            continue
        r = ratios.get(workload, {})
        clients = results["workloads"][workload]["load"]["concurrency"]
        on_off = r.get("on_off", {}).get(REFERENCE, {}).get("ratio")
        what = "second ask's " if r.get("decode_metric") == "decode_tok_s_turn2" else ""
        name = f"{workload} {what}decode tok/s per request, speculation on / off ({clients} client{'s' * (clients != 1)})"
        if workload == "random":
            out.append((name, ">=", RANDOM_GOAL, on_off))
        elif clients == 1 and workload in BATCH1_GOALS:
            out.append((name, ">=", BATCH1_GOALS[workload], on_off))
        elif clients >= 16 and workload.startswith("edit"):
            out.append((name, ">=", BATCH16_GOAL, on_off))
        if workload == "edit" and clients == 1:
            out.append(("edit decode tok/s per request, radixserve / transformers prompt lookup (1 client)", ">=",
                        PEER_GOAL, r.get("vs_peer", {}).get("ratio")))
    return out


def _n(x: float | None, digits: int = 1) -> str:
    return "—" if x is None else f"{x:,.{digits}f}"


def _acceptance(m: dict[str, float]) -> str:
    if "spec_proposed" not in m:
        return "—"
    if not m["spec_proposed"]:
        return "none drafted"
    parts = [f"{src} {m.get(f'spec_accepted_{src}', 0):,.0f}/{m.get(f'spec_proposed_{src}', 0):,.0f}"
             for src in DRAFT_SOURCES if m.get(f"spec_proposed_{src}")]
    return f"{m['acceptance_rate']:.0%} ({', '.join(parts)})"


def report_lines(results: dict, workload: str) -> list[str]:
    """The speculation table of one workload, and its ratios with their operands."""
    med = _medians(results, workload)
    if workload not in COMPARED or not any("tokens_per_step" in m or "decode_tok_s_mean" in m for m in med.values()):
        return []
    regen = workload.startswith("regenerate")
    lines = ["", "Speculative decoding: decode speed per request (client-side), tokens per step, drafts:", "",
             "| system | decode tok/s per request, mean / p50 |" + (" second ask, mean |" if regen else "")
             + " tokens / step | drafts accepted / proposed (by source) |",
             "|---|---:|" + ("---:|" if regen else "") + "---:|---|"]
    for name, m in med.items():
        lines.append(f"| {name} | {_n(m.get('decode_tok_s_mean'))} / {_n(m.get('decode_tok_s_p50'))} |"
                     + (f" {_n(m.get('decode_tok_s_turn2'))} |" if regen else "")
                     + f" {_n(m.get('tokens_per_step'), 2)} | {_acceptance(m)} |")
    r = results.get("speculation", {}).get(workload, {})
    for name, v in r.get("on_off", {}).items():
        lines.append(f"- {name} / {NOSPEC} ({r['decode_metric']}): {_n(v['on'])} / {_n(v['off'])} tok/s "
                     f"= {v['ratio']:.2f}x")
    if "vs_peer" in r:
        v = r["vs_peer"]
        lines.append(f"- {REFERENCE} / {PROMPT_LOOKUP} (decode_tok_s_mean; the peer on {v['peer_workload']}'s "
                     f"prompts): {_n(v['radixserve'])} / {_n(v['peer'])} tok/s = {v['ratio']:.2f}x")
    return lines
