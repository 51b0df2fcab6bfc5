"""The structured workload's Markdown table and the issue's targets, both read from the results
document runner.py builds (nothing here measures).

Targets (issue 26): 100% of constrained replies valid, greedy and sampled (a reply cut by max_tokens
is counted apart and named in the note, not as a miss); 100% of required/named tool calls valid;
the constrained decode step at the step test's batch <= 1.10x the unconstrained one (measured with
forced tokens off, so both modes decode one token per row per step; the run with them on is shown
beside it, per step and per token); tool-call
grammars compile in <= 20 ms at p50 and a cached constraint is found in <= 0.1 ms; forced tokens
finish the fixed-keys schema in >= 1.3x fewer steps.
"""

from __future__ import annotations

from typing import Any

from radixserve_bench.results import Target

FAILURES_SHOWN = 12


def evaluate_targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    v, tools, c, step, forced = r["validity"], r["tools"], r["compile"], r["step_no_forced"], r["forced"]
    cut = v["all"]["length"]
    targets = [
        Target("schema replies valid, greedy + sampled (% of finished replies)", ">=", 100.0,
               v["all"]["valid_pct_of_finished"],
               f"{v['all']['valid']}/{v['all']['replies']} replies; {cut} cut by max_tokens={v['max_tokens']}" if cut else ""),
        Target("required/named tool calls valid (%)", ">=", 100.0, tools["all"]["valid_pct_of_finished"],
               f"{tools['all']['length']} cut by max_tokens" if tools["all"]["length"] else ""),
        Target(f"constrained / unconstrained decode step, batch {step['batch']} (mean; forced tokens off)", "<=", 1.10,
               step["ratio_step_mean"], f"on {r.get('machine', {}).get('gpu') or 'CPU'}; with forced tokens on: "
               f"{r['step']['ratio_step_mean']:.2f}x per step, {r['step']['ratio_ms_per_token']:.2f}x per token"),
        Target("tool-call grammar compile p50 (ms, cold)", "<=", 20.0, c["tool_calls"]["cold"].get("p50_ms")),
        Target("cached constraint lookup p50 (ms)", "<=", 0.1, c["schemas"]["cached"].get("p50_ms")),
        Target("fixed-keys schema: steps without / with forced tokens", ">=", 1.3, forced["steps_ratio_off_on"],
               "" if forced["same_text"] else "the two replies differ in text"),
    ]
    return [t.as_dict() for t in targets]


def _f(x: Any, fmt: str = "{:.2f}") -> str:
    return "-" if x is None or x != x else fmt.format(x)


def _tally_row(label: str, t: dict[str, Any]) -> str:
    return (f"| {label} | {t['replies']} | {t['valid']} | {t['invalid']} | {t['length']} | {t['error']} "
            f"| {_f(t['valid_pct'], '{:.1f}%')} | {_f(t['valid_pct_of_finished'], '{:.1f}%')} |")


def _spread(s: dict[str, float]) -> str:
    return " / ".join(_f(s.get(k), "{:.3f}") for k in ("p50_ms", "p95_ms", "max_ms")) if s else "-"


def render(r: dict[str, Any]) -> str:
    v, tools, c, step, forced = r["validity"], r["tools"], r["compile"], r["step"], r["forced"]
    model, machine = r.get("model", {}), r.get("machine", {})
    lines = [f"## Structured output: {model.get('name', '?')} on {machine.get('gpu') or machine.get('cpu', '?')} "
             f"({machine.get('torch_threads', '?')} torch threads), {r.get('date', '')}", "",
             f"{v['schemas']} JSON schemas x {len(v['modes'])} replies ({', '.join(v['modes'])}; sampled at temperature "
             f"{v['temperature']}), {tools['tools']} tools x (required, named) x {len(tools['modes'])} replies, "
             f"max_tokens {v['max_tokens']}; tool-call format {tools['format']}; run took {r['total_seconds']:.0f} s.", "",
             "### Targets", "", "| target | value | threshold | met | note |", "|---|---|---|---|---|"]
    for t in r["targets"]:
        met = {True: "yes", False: "**no**", None: "not measured"}[t["met"]]
        lines.append(f"| {t['name']} | {_f(t['value'], '{:.3f}')} | {t['op']} {t['threshold']:g} | {met} | {t['note']} |")
    head = ["| replies | n | valid | invalid | length | error | valid % | valid % of finished |",
            "|---|---|---|---|---|---|---|---|"]
    lines += ["", "### Validity (json.loads + jsonschema Draft 2020-12, formats checked)", "", *head,
              _tally_row("schemas, all", v["all"]), _tally_row("schemas, greedy", v["greedy"]),
              _tally_row("schemas, sampled", v["sampled"])]
    lines += [_tally_row(f"family {f}", t) for f, t in v["families"].items()]
    lines += [_tally_row(f"tools, {k}", tools[k]["all"]) for k in ("required", "named")]
    lines += ["", f"Tool calls under `required` that picked the tool the question was written for: "
                  f"{_f(tools['required_picked_intended_pct'], '{:.0f}%')} (not a target: the grammar lets the model pick). "
                  f"Forced tokens in the schema replies: {v['forced_tokens']} of {v['generated_tokens']} generated "
                  f"({_f(100 * v['forced_tokens'] / max(1, v['generated_tokens']), '{:.1f}%')}); "
                  f"mask time {_f(v['mask_ms_per_row'], '{:.3f}')} ms per constrained row."]
    failures = v["failures"] + tools["failures"]
    if failures:
        lines += ["", f"Replies not valid ({len(failures)}; first {min(len(failures), FAILURES_SHOWN)}):", "",
                  "| reply | verdict | why | tokens | text |", "|---|---|---|---|---|"]
        for f in failures[:FAILURES_SHOWN]:
            text = f["text"].replace("|", "\\|").replace("\n", " ")[:120]
            lines.append(f"| {f['key']} | {f['verdict']} | {f['why'][:100]} | {f['tokens']} | `{text}` |")
    lines += ["", "### Grammar compile (ms: p50 / p95 / max)", "",
              "| constraints | n | compiled | cold (compile() call) | cold (in the worker) | cached lookup |",
              "|---|---|---|---|---|---|"]
    for label, key in (("JSON schemas", "schemas"), ("tool parameters (as JSON schemas)", "tool_parameters"),
                       ("tool calls (required + each named)", "tool_calls")):
        x = c[key]
        compiled = f"{x['compiled']}" + (f" (+{len(x['already_cached'])} already cached)" if x["already_cached"] else "")
        lines.append(f"| {label} | {x['constraints']} | {compiled} | {_spread(x['cold'])} | "
                     f"{_spread(x['cold_in_worker'])} | {_spread(x['cached'])} |")
    if any(c[k]["already_cached"] for k in ("schemas", "tool_parameters", "tool_calls")):
        lines += ["", "Already cached: equal to a constraint compiled before it (a tool's parameters equal to a schema of "
                      "the catalog), so not timed as cold."]
    lines += ["", f"The llguidance tokenizer (built once per engine) took {c['schemas']['tokenizer_ms']:.0f} ms."
              + (f" Failed to compile: {', '.join(c['schemas']['failed'])}." if c["schemas"]["failed"] else "")]
    lines += ["", f"### Decode step at batch {step['batch']} ({step['rounds']} rounds x {step['timed_steps_per_round']} "
                  f"timed steps per mode, prompt {step['prompt_tokens']} tokens, temperature {step['temperature']})", "",
              "| forced tokens | mode | steps | step ms mean / median | tokens / step | ms / token | mask ms / step "
              "| tokens forced |", "|---|---|---|---|---|---|---|---|"]
    for forced_mode, s in (("off", r["step_no_forced"]), ("on", step)):
        for label in ("unconstrained", "constrained"):
            x = s[label]
            lines.append(f"| {forced_mode} | {label} | {x['steps']} | {x['step_ms_mean']:.2f} / {x['step_ms_median']:.2f} | "
                         f"{x['tokens_per_step']:.2f} | {x['ms_per_token']:.3f} | {x['mask_ms_per_step']:.3f} "
                         f"| {x['forced_tokens']} |")
    for forced_mode, s in (("off", r["step_no_forced"]), ("on", step)):
        lines += ["", f"Forced tokens {forced_mode}: constrained / unconstrained step mean {s['ratio_step_mean']:.3f}x, "
                      f"median {s['ratio_step_median']:.3f}x, per token {s['ratio_ms_per_token']:.3f}x."]
    lines += ["", "### Forced tokens (the fixed-keys schema, greedy, alone on an engine)", "",
              "| forced tokens | engine steps | tokens | forced | finish |", "|---|---|---|---|---|"]
    for mode in ("on", "off"):
        x = forced[mode]
        lines.append(f"| {mode} | {x['steps']} | {x['tokens']} | {x['forced_tokens']} | {x['finish_reason']} |")
    lines += ["", f"Steps off / on: {forced['steps_ratio_off_on']:.2f}x; same text: {forced['same_text']}. "
                  f"Reply (on): `{forced['on']['text'][:200]}`", ""]
    return "\n".join(lines) + "\n"
