// The dashboard's speculative-decoding panel, drawn from the `speculation` object of
// GET /v1/cache/stats (docs/protocol.md): tokens per step — generated tokens per sequence per engine
// step, 1 without speculation — since start and over the last 10 s, as a card and a chart; how
// many sequence-steps verified drafts; and per draft source (radix tree, prediction, prompt lookup)
// the draft tokens proposed and the share accepted. The 10 s figure comes from the dashboard's
// samples (dashboard.js). A reply without a `speculation` object (an older server) hides the panel.

import { TimeChart } from "./charts.js";
import { fmtInt, fmtPct, h } from "./ui.js";

const SOURCE_NAMES = { tree: "Radix-tree drafts", prediction: "Prediction drafts", lookup: "Prompt-lookup drafts" };
const SOURCE_HELP = {
  tree: "continuations other requests already generated, from the prefix cache",
  prediction: "the request's own `prediction` (OpenAI Predicted Outputs)",
  lookup: "n-gram matches in the sequence's own prompt and output",
};

const num = (v) => (typeof v === "number" && Number.isFinite(v) ? v : null);

/** Tokens per step with two decimals ("1.84"); "—" when unknown. */
export function fmtPerStep(v) {
  return num(v) === null ? "—" : v.toFixed(2);
}

function card(key, label, value, sub, title = "") {
  return h("div", { className: "stat-card", title, dataset: { key } }, [
    h("div", { className: "stat-label", textContent: label }),
    h("div", { className: "stat-value", textContent: value }),
    h("div", { className: "stat-sub", textContent: sub }),
  ]);
}

export class SpecPanel {
  constructor(root) {
    this.root = root;
    this.state = root.querySelector("#spec-state");
    this.cards = root.querySelector("#spec-cards");
    this.chart = new TimeChart(root.querySelector("#chart-tokens-per-step"), {
      title: "Tokens per step (per sequence)",
      format: (v) => v.toFixed(2),
      series: [{ key: "tpsOverall", label: "since start", color: "#6366f1" }, { key: "tpsRecent", label: "last 10 s", color: "#10b981" }],
    });
  }

  /** `stats`: the latest /v1/cache/stats reply; `series`: the dashboard's samples ({t, values}). */
  render(stats, series) {
    const spec = stats && stats.speculation;
    if (!spec || typeof spec !== "object") {
      this.root.hidden = true;
      return;
    }
    this.root.hidden = false;
    const proposed = num(spec.proposed) ?? 0;
    this.root.dataset.drafting = String(proposed > 0);
    this.state.textContent = proposed > 0 ? `${fmtPct(num(spec.acceptance), 0)} of drafts accepted` : "no drafts yet";
    this.state.classList.toggle("host-state-on", proposed > 0);
    this.chart.update(series);
    const last = series.length ? series[series.length - 1].values : {};
    const recent = num(last.tpsRecent);
    const overall = spec.committed_draws > 0 ? num(spec.tokens_per_step) : null;
    const verify = num(spec.verify_draws);
    const draws = num(spec.committed_draws);
    const cards = [
      card("tokens_per_step", "Tokens per step", fmtPerStep(recent ?? overall),
        `per sequence · ${recent === null ? "since start" : `last 10 s · ${fmtPerStep(overall)} since start`}`,
        "Generated tokens each sequence gained per engine step (1 without speculation)"),
      card("verify_draws", "Verifying steps", fmtInt(verify),
        draws ? `${fmtPct(verify / draws, 1)} of ${fmtInt(draws)} sequence-steps verified drafts` : "sequence-steps that verified drafts"),
    ];
    const sources = spec.by_source && typeof spec.by_source === "object" ? spec.by_source : {};
    for (const [source, c] of Object.entries(sources)) {
      const p = num(c && c.proposed) ?? 0;
      const a = num(c && c.accepted) ?? 0;
      cards.push(card(`source_${source}`, SOURCE_NAMES[source] || `${source} drafts`, p > 0 ? fmtPct(a / p, 1) : "—",
        `${fmtInt(a)} of ${fmtInt(p)} drafted tokens accepted`, SOURCE_HELP[source] || ""));
    }
    this.cards.replaceChildren(...cards);
  }
}
