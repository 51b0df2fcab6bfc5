"""The Markdown table of a `radixserve bench step` result (step_bench.py): one line per (graphs,
overlap, [speculation,] [penalties,] batch) with greedy and top-p side by side (tokens per sequence
per step among them: 1.00 without speculation), the memory floor beside the step time, the host
time per step broken down (schedule / build / post, from engine/step_phases.py), transformers' own
decode forward (hf_step.py) with the step's ratio to it, and, when the result has rows with
penalties on, their cost over the same rows without. A figure a result lacks (written before it
existed, or transformers skipped) shows as "-"."""

from __future__ import annotations

from typing import Any

CPU_GRAPHS_NOTE = (" (CPU: no CUDA graphs; on runs the C++ kernels and decode steps through the compiled CPU step, off "
                   "(--enforce-eager) oneDNN matmuls, SDPA and the Python layers)")


def render_table(result: dict[str, Any]) -> str:
    """One line per (graphs, overlap, [penalties,] batch): greedy and top-p side by side; with
    penalties on, a second table of each row's cost with them over without."""
    rows = result["rows"]
    pen = any(r.get("penalties") == "on" for r in rows)
    spec = any(r.get("speculation") == "on" for r in rows)
    columns = ["graphs", "overlap", *(["speculation"] if spec else []), *(["penalties"] if pen else []), "batch",
               "greedy ms/step (median / mean)", "top-p ms/step (median / mean)", "top-p / greedy", "floor ms",
               "step / floor (greedy / top-p)", "device ms (greedy / top-p)", "unhidden host ms (greedy / top-p)",
               "host ms (greedy / top-p)", "host ms, greedy (schedule / build / post)", "transformers forward ms",
               "step / transformers (greedy / top-p)", "tokens / step (greedy / top-p)", "tok/s (greedy)",
               "roofline (greedy)"]
    kv = {"fp8": ", FP8 KV cache", "fp16": ", fp16 KV cache"}.get(result.get("kv_cache_dtype") or "auto", "")
    if result.get("sliding_window_kv") not in (None, "auto"):
        kv += f", sliding-window K/V: {result['sliding_window_kv']}"
    lines = [f"## decode step: {result['shape']} ({result['dtype']}{kv}, {result['device_name']})", "",
             f"bandwidth {result['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s (copy{_beside(rows)}), context {rows[0]['context']}"
             f", {rows[0]['steps']} timed steps, attention {result['attention_backend']}"
             + (CPU_GRAPHS_NOTE if result["device"] == "cpu" else ""),
             *_notes(result), "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]

    def key(r: dict[str, Any]) -> tuple[str, str, str, str, int]:
        return r["graphs"], r.get("overlap", "-"), r.get("speculation", "off"), r.get("penalties", "off"), r["batch"]

    for graphs, overlap, drafting, penalties, batch in dict.fromkeys(key(r) for r in rows):
        by = {r["sampling"]: r for r in rows if key(r) == (graphs, overlap, drafting, penalties, batch)}
        greedy, top_p = by.get("greedy"), by.get("top-p")

        def cell(r: dict[str, Any] | None, fmt: str) -> str:
            try:
                return "-" if r is None else fmt.format(**r)
            except (KeyError, TypeError, ValueError):  # a result written before the figure existed, or None
                return "-"

        ratio = f"{top_p['ms_median'] / greedy['ms_median']:.2f}x" if greedy and top_p else "-"
        lines.append(
            f"| {graphs} | {overlap} |{f' {drafting} |' if spec else ''}{f' {penalties} |' if pen else ''} {batch} "
            f"| {cell(greedy, '{ms_median:.2f} / {ms_mean:.2f}')} "
            f"| {cell(top_p, '{ms_median:.2f} / {ms_mean:.2f}')} | {ratio} | {cell(greedy or top_p, '{floor_ms:.2f}')} "
            f"| {cell(greedy, '{step_over_floor:.2f}x')} / {cell(top_p, '{step_over_floor:.2f}x')} "
            f"| {cell(greedy, '{device_ms:.2f}')} / {cell(top_p, '{device_ms:.2f}')} "
            f"| {cell(greedy, '{host_unhidden_ms:.3f}')} / {cell(top_p, '{host_unhidden_ms:.3f}')} "
            f"| {cell(greedy, '{host_ms:.3f}')} / {cell(top_p, '{host_ms:.3f}')} "
            f"| {cell(greedy, '{schedule_ms:.3f} / {build_ms:.3f} / {post_ms:.3f}')} "
            f"| {cell(greedy or top_p, '{hf_forward_ms:.2f}')} "
            f"| {cell(greedy, '{step_over_hf:.2f}x')} / {cell(top_p, '{step_over_hf:.2f}x')} "
            f"| {cell(greedy, '{tokens_per_step:.2f}')} / {cell(top_p, '{tokens_per_step:.2f}')} "
            f"| {cell(greedy or top_p, '{tok_s:.1f}')} | {cell(greedy or top_p, '{roofline_fraction:.1%}')} |")
    if pen:
        lines += ["", "| graphs | overlap | batch | sampling | ms/step, penalties off / on (median) | on / off |",
                  "|---|---|---|---|---|---|"]
        for r in rows:
            off = next((o for o in rows if o.get("penalties", "off") == "off" and o["sampling"] == r["sampling"]
                        and key(o)[:3] == key(r)[:3] and o["batch"] == r["batch"]), None)
            if r.get("penalties") == "on" and off is not None:
                lines.append(f"| {r['graphs']} | {r.get('overlap', '-')} | {r['batch']} | {r['sampling']} "
                             f"| {off['ms_median']:.2f} / {r['ms_median']:.2f} | {r['ms_median'] / off['ms_median']:.3f}x |")
    return "\n".join(lines) + "\n"


def _beside(rows: list[dict[str, Any]]) -> str:
    """The range of the copy rates measured beside the rows (CPU runs since they were), else nothing."""
    beside = [r["bandwidth_bytes_per_s"] / 1e9 for r in rows if "bandwidth_bytes_per_s" in r]
    return f", before the engines; again before each row, {min(beside):.1f}-{max(beside):.1f} GB/s, " \
           "which sets the row's floor" if beside else ""


def _notes(result: dict[str, Any]) -> list[str]:
    """What the reader needs to trust the floor, host and transformers columns."""
    notes = ["floor: weights + KV bytes of a step read once at the copy bandwidth; host ms: schedule + build + post "
             "per step (engine/step_phases.py)"]
    hf = result.get("hf_forward") or {}
    if hf.get("skipped"):
        notes.append(f"transformers forward: not run ({hf['skipped']})")
    elif hf.get("source"):
        notes.append(f"transformers forward: AutoModelForCausalLM ({hf['source']} weights, sdpa), one decode forward + "
                     "argmax of the batch with a DynamicCache holding the context (radixserve_bench/hf_step.py)")
    return ["", *(f"- {n}" for n in notes)]
