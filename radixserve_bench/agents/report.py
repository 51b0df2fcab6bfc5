"""The agent workload's Markdown table, read from the results document runner.py builds (nothing here
measures): how the tasks were fitted into the context, each run's token and TTFT figures, cache on
against off, the scheduler phase, errors, and the targets (analysis.evaluate_targets)."""

from __future__ import annotations

from typing import Any

from radixserve_bench.report import number, target_lines

ERRORS_SHOWN = 10


def _pct(x: float | None) -> str:
    return "—" if x is None or x != x else f"{100 * x:.1f}%"


def _ms(x: float | None) -> str:
    return "—" if x is None or x != x else number(x, 0)


def _fitting(w: dict[str, Any]) -> list[str]:
    lines = ["", "## The tasks, fitted into the context", "",
             f"Context {w['context']} tokens. A round trip costs its output plus at most {w['overhead_tokens']} tokens "
             f"(the call's max_tokens and the result's framing, counted by the server). Where a task's drawn round "
             f"trips and outputs would not fit, round trips are cut first (each output keeps at least the low end of "
             f"its range), then every output is scaled by one factor.", "",
             "| task | round trips drawn → kept | output tokens drawn (min–max, sum) | kept (min–max, sum) | scale "
             "| first prompt | longest prompt, at most |", "|---|---:|---:|---:|---:|---:|---:|"]
    for t in w["tasks"]:
        d, k = t["drawn_output_tokens"], t["output_tokens"]
        lines.append(f"| {t['task_id']} | {t['drawn_round_trips']} → {t['round_trips']} "
                     f"| {min(d)}–{max(d)}, {sum(d):,} | {min(k)}–{max(k)}, {sum(k):,} | {t['scale']:.2f} "
                     f"| {t['base_tokens']:,} | {t['max_prompt_tokens']:,} |")
    return lines


def _runs(runs: dict[str, dict[str, Any]]) -> list[str]:
    lines = ["", "## Runs", "",
             "Token figures are the servers' usage summed over every turn; \"turns 2+\" are the turns after the first "
             "of each task. TTFT: the client's, from sending to the first streamed event carrying part of the reply "
             "(a call's name comes out some decode steps after the first token); the server's: arrival to the first "
             "generated token. *Beyond new*: tokens a turn computed beyond the ones it added to the conversation the "
             "server had seen (its tool result), as a share of its prompt, worst turn. *Task computed / prompt*: a "
             "task's computed prompt tokens over its prompt tokens, turns 2+, worst task.", "",
             "| API | cache | turns | errors | calls cut by max_tokens | prompt tokens | cached | computed (prefill) "
             "| cached, turns 2+ | beyond new, worst turn | task computed / prompt, worst | TTFT turn 1, ms "
             "| TTFT turns 2+, ms mean / p50 | server's TTFT, every turn, ms mean |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for api, modes in runs.items():
        for cache, run in modes.items():
            s = run["summary"]
            lines.append(f"| {api} | {cache} | {s['turns']} | {len(run['errors'])} | {s['cut_calls']} "
                         f"| {s['prompt_tokens']:,} | {s['cached_tokens']:,} | {s['computed_tokens']:,} "
                         f"| {_pct(s['later_cached_fraction'])} | {_pct(s['later_beyond_new_fraction_max'])} "
                         f"| {_pct(s['later_task_computed_fraction_max'])} | {_ms(s['ttft_ms_turn1_mean'])} "
                         f"| {_ms(s['ttft_ms_later_mean'])} / {_ms(s['ttft_ms_later_p50'])} "
                         f"| {_ms(s.get('server_ttft_ms_mean'))} |")
    return lines


def _comparison(comparison: dict[str, dict[str, float]]) -> list[str]:
    if not comparison:
        return []
    lines = ["", "## Cache on against cache off", "",
             "| API | mean TTFT of turns 2+, on / off | server's mean TTFT, every turn, on / off "
             "| prefill tokens computed, on / off | cached tokens reported with the cache off |",
             "|---|---:|---:|---:|---:|"]
    for api, c in comparison.items():
        lines.append(f"| {api} | {number(c['ttft_later_ratio'], 3)}× | {number(c.get('server_ttft_ratio'), 3)}× "
                     f"| {number(c['computed_tokens_ratio'], 3)}× "
                     f"| {c['off_cached_tokens']:,} |")
    return lines


def _scheduler(s: dict[str, Any] | None) -> list[str]:
    if s is None:
        return []
    f = lambda key: number(s.get(key), 3)
    paired = (f"Paired with the phase clock step by step, the schedule phase less the step's masks: p50 "
              f"{f('schedule_less_masks_ms_p50')} ms, mean {f('schedule_less_masks_ms_mean')} ms." if s.get("paired") else
              "The step observer and the phase clock saw different steps, so the masks could not be taken out of "
              "the schedule phase step by step.")
    return ["", f"## The scheduler with {s['loops']} agent loops in flight", "",
            f"{s['loops']} loops at once (the APIs in turn), {s['round_trips']} round trips each, tool outputs of "
            f"{s['output_tokens'][0]}–{s['output_tokens'][1]} tokens; {s['requests']} requests in "
            f"{s['duration_s']:.0f} s. *Scheduler CPU*: per engine step, the engine thread's CPU time in "
            f"Scheduler.schedule, launched and commit, less the engine's stop test that commit calls per token "
            f"(what `radixserve bench micro` times without a model or a server, where the stop test is a no-op): "
            f"p50 schedule {f('schedule_cpu_ms_p50')} + launched {f('launched_cpu_ms_p50')} + commit "
            f"{f('commit_cpu_ms_p50')} ms; the stop test (EOS, stop strings, detokenizing) p50 "
            f"{f('stop_test_cpu_ms_p50')} ms. {s.get('busy_steps', 0)} steps ran with at least "
            f"{s.get('busy_threshold', 0)} sequences running, "
            f"their scheduler CPU p50 {f('busy_scheduler_cpu_ms_p50')} ms. The wall-clock phases are the engine's "
            f"phase clock (engine/step_phases.py): its *schedule* phase also holds the grammar masks of the constrained "
            f"rows (every forced call is one) and, in a server, waits for the interpreter lock while the event loop "
            f"parses requests and streams replies. {paired}", "",
            "| steps | scheduler CPU ms p50 / mean / p90 / p99 / max | schedule phase (wall) ms p50 / mean "
            "| grammar masks ms p50 / mean | build / forward / post ms p50 | whole step ms p50 "
            "| running sequences mean / max |", "|---:|---:|---:|---:|---:|---:|---:|",
            f"| {s['steps']} | {f('scheduler_cpu_ms_p50')} / {f('scheduler_cpu_ms_mean')} / {f('scheduler_cpu_ms_p90')} / "
            f"{f('scheduler_cpu_ms_p99')} / {f('scheduler_cpu_ms_max')} | {f('schedule_ms_p50')} / {f('schedule_ms_mean')} "
            f"| {f('mask_ms_p50')} / {f('mask_ms_mean')} | {f('build_ms_p50')} / {number(s.get('forward_ms_p50'), 1)} / "
            f"{f('post_ms_p50')} | {number(s.get('step_ms_p50'), 1)} | {number(s.get('running_mean'), 1)} / "
            f"{s.get('running_max', '—')} |"]


def _errors(results: dict[str, Any]) -> list[str]:
    errors = [f"{api}/{cache}: {e}" for api, modes in results["runs"].items() for cache, run in modes.items()
              for e in run["errors"]]
    if results.get("scheduler"):
        errors += [f"scheduler phase: {e}" for e in results["scheduler"]["errors"]]
    if not errors:
        return []
    more = f" (and {len(errors) - ERRORS_SHOWN} more)" if len(errors) > ERRORS_SHOWN else ""
    return ["", f"## Errors{more}", "", *(f"- {e}" for e in errors[:ERRORS_SHOWN])]


def render(results: dict[str, Any]) -> str:
    w, machine, model = results["workload"], results.get("machine", {}), results.get("model", {})
    o = results.get("options", {})
    p = o.get("params", {})
    lines = [f"# radixserve bench agent — {results.get('date', '')}", "",
             f"Model {model.get('name')} on {machine.get('gpu') or machine.get('cpu')} ({machine.get('cpu_count')} cores, "
             f"{machine.get('torch_threads')} torch threads). Command: `{results.get('command')}`", "",
             f"{len(w['tasks'])} tasks at once, each a system prompt with {len(w['tools'])} tool schemas and a task, "
             f"then forced tool calls (tool_choice required / any, one call, max_tokens {p.get('call_max_tokens')}) each "
             f"answered by a tool output of seeded real text, then a final answer (tool_choice {w['final_tool_choice']}, "
             f"max_tokens {p.get('answer_max_tokens')}); greedy, streamed. Responses history: "
             f"{'previous_response_id chains' if w['responses_mode'] == 'chain' else 'the whole input replayed every turn'}. "
             f"One fresh server per API and cache mode, warmed up with one request of the turn-1 shape."]
    lines += _fitting(w)
    lines += _runs(results["runs"])
    lines += _comparison(results["comparison"])
    lines += _scheduler(results.get("scheduler"))
    lines += _errors(results)
    lines += target_lines(results.get("targets") or [])
    return "\n".join(lines) + "\n"
