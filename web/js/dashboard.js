// The cache dashboard: polls GET /v1/cache/stats and GET /metrics (Prometheus text, parsed here),
// keeps a bounded history and draws it — hit rate, KV blocks, running/waiting requests, token
// throughput — plus stat cards, the host-memory tier panel (host_panel.js), the speculative-decoding
// panel (spec_panel.js: tokens per step, acceptance by draft source), the replicas panel
// (replicas_panel.js), the live picture of the radix tree (tree_view.js), the per-system-prompt hit
// table and a list of every metric family.
// Polls fast while visible and slowly in the background so the charts have history when opened.
// A failed or malformed reply is shown in the status line (and once as a toast), never ignored.

import { api } from "./api.js";
import { TimeChart } from "./charts.js";
import { HostPanel } from "./host_panel.js";
import { firstPresent, histogramQuantile, parsePrometheus, sampleSum } from "./prometheus.js";
import { ReplicasPanel } from "./replicas_panel.js";
import { SpecPanel } from "./spec_panel.js";
import { TreeView } from "./tree_view.js";
import { errorMessage, fmtInt, fmtMs, fmtPct, h, toast } from "./ui.js";

const VISIBLE_POLL_MS = 1000;
const HIDDEN_POLL_MS = 5000;
const MAX_SAMPLES = 600;
const RECENT_WINDOW_MS = 10_000; // hit rate and token rates are averaged over this window
const COLORS = { a: "#6366f1", b: "#10b981", c: "#f59e0b", d: "#ef4444" };

// Metric names from docs/server.md; lists so a renamed metric degrades to "—" rather than breaking.
// A `user` key's /metrics has only its tenant's series (docs/tenants.md): the tenant_* names are its fallback.
const PROMPT_COUNTERS = ["radixserve_prompt_tokens_total", "radixserve_tenant_prompt_tokens_total"];
const GEN_COUNTERS = ["radixserve_generation_tokens_total", "radixserve_tenant_generation_tokens_total"];
const RUNNING_GAUGES = ["radixserve_requests_running"];
const WAITING_GAUGES = ["radixserve_requests_waiting"];
const TTFT_HISTOGRAM = "radixserve_time_to_first_token_seconds";
const STEP_HISTOGRAM = "radixserve_step_seconds";
const STEP_TOKENS = "radixserve_step_tokens";

const num = (v) => (typeof v === "number" && Number.isFinite(v) ? v : null);

export class Dashboard {
  constructor() {
    this.samples = [];
    this.visible = false;
    this.timer = 0;
    this.lastError = "";
    this.inFlight = false;
    this.status = document.getElementById("dash-status");
    this.cards = document.getElementById("stat-cards");
    this.tableBody = document.querySelector("#sp-table tbody");
    this.hostPanel = new HostPanel(document.getElementById("host-panel"));
    this.replicasPanel = new ReplicasPanel(document.getElementById("replicas-panel"));
    this.specPanel = new SpecPanel(document.getElementById("spec-panel"));
    this.treeView = new TreeView(document.getElementById("tree-panel"));
    const pct = (v) => fmtPct(v);
    this.charts = {
      hit: new TimeChart(document.getElementById("chart-hit-rate"), {
        title: "Prefix-cache hit rate", yMax: 1, format: pct,
        series: [{ key: "overall", label: "overall", color: COLORS.a }, { key: "recent", label: "last 10 s", color: COLORS.b }],
      }),
      blocks: new TimeChart(document.getElementById("chart-blocks"), {
        title: "KV blocks", format: fmtInt, integer: true,
        series: [{ key: "used", label: "used", color: COLORS.a }, { key: "cached", label: "cached", color: COLORS.b }, { key: "free", label: "free", color: COLORS.c }],
      }),
      requests: new TimeChart(document.getElementById("chart-requests"), {
        title: "Requests", format: fmtInt, integer: true,
        series: [{ key: "running", label: "running", color: COLORS.a }, { key: "waiting", label: "waiting", color: COLORS.d }],
      }),
      throughput: new TimeChart(document.getElementById("chart-throughput"), {
        title: "Token throughput (10 s average, from /metrics)", format: (v) => (v >= 100 ? fmtInt(v) : String(Number(v.toPrecision(3)))),
        series: [{ key: "prompt", label: "prompt tok/s", color: COLORS.c }, { key: "gen", label: "generated tok/s", color: COLORS.a }],
      }),
    };
    this.metricsDetails = h("details", { className: "metrics-details" }, [h("summary", { textContent: "All metrics" })]);
    document.getElementById("view-dashboard").append(this.metricsDetails);
  }

  start() {
    this.poll();
  }

  setVisible(visible) {
    this.visible = visible;
    if (visible) {
      clearTimeout(this.timer);
      this.poll();
      this.redraw();
    }
  }

  schedule() {
    clearTimeout(this.timer);
    this.timer = setTimeout(() => this.poll(), this.visible ? VISIBLE_POLL_MS : HIDDEN_POLL_MS);
  }

  async poll() {
    if (this.inFlight) return;
    this.inFlight = true;
    if (this.visible) this.treeView.refresh(); // on its own: it shows its own failures
    try {
      const [stats, metricsText] = await Promise.all([api.cacheStats(), api.metricsText()]);
      const families = parsePrometheus(metricsText);
      this.record(stats, families);
      this.setError("");
    } catch (e) {
      this.setError(errorMessage(e));
    } finally {
      this.inFlight = false;
      this.schedule();
    }
  }

  setError(message) {
    if (message) {
      this.status.textContent = `Cannot update: ${message}`;
      this.status.classList.add("error");
      if (message !== this.lastError) toast(`Dashboard: ${message}`);
    } else {
      this.status.classList.remove("error");
      this.status.textContent = `Live · updated ${new Date().toLocaleTimeString()}`;
    }
    this.lastError = message;
  }

  record(stats, families) {
    const t = Date.now();
    const promptName = firstPresent(families, PROMPT_COUNTERS);
    const genName = firstPresent(families, GEN_COUNTERS);
    const counters = {
      prompt: promptName ? sampleSum(families, promptName) : null,
      gen: genName ? sampleSum(families, genName) : null,
    };
    // Rates and the recent hit rate compare against the oldest sample inside RECENT_WINDOW_MS, which
    // smooths the one-second jitter of token counters.
    const base = this.samples.find((x) => t - x.t <= RECENT_WINDOW_MS);
    const rate = (key) => {
      if (!base || counters[key] === null || base.counters[key] === null) return null;
      const dt = (t - base.t) / 1000;
      const d = counters[key] - base.counters[key];
      return dt > 0 && d >= 0 ? d / dt : null; // a counter reset (server restart) gives no rate
    };
    // Hit rate of the prompt tokens admitted in the window (null when there were none). The cached
    // and prompt counters may be bumped at slightly different moments, so clamp to [0, 1].
    const dPrompt = base ? num(stats.prompt_tokens) - num(base.stats.prompt_tokens) : null;
    const dCached = base ? num(stats.cached_tokens) - num(base.stats.cached_tokens) : null;
    const gauge = (names, fallback) => {
      if (num(fallback) !== null) return fallback;
      const n = firstPresent(families, names);
      return n ? sampleSum(families, n) : null;
    };
    const blocks = stats.blocks || {};
    // Tokens per step (per sequence): generated tokens over the sequence-steps that committed them
    const spec = stats.speculation || {};
    const baseSpec = (base && base.stats.speculation) || {};
    const dGen = base ? num(stats.generation_tokens) - num(base.stats.generation_tokens) : null;
    const dDraws = base ? num(spec.committed_draws) - num(baseSpec.committed_draws) : null;
    this.samples.push({
      t, stats, counters,
      values: {
        overall: num(stats.hit_rate),
        recent: dPrompt > 0 && dCached >= 0 ? Math.min(1, dCached / dPrompt) : null,
        used: num(blocks.used), cached: num(blocks.cached), free: num(blocks.free),
        running: gauge(RUNNING_GAUGES, stats.running), waiting: gauge(WAITING_GAUGES, stats.waiting),
        prompt: rate("prompt"), gen: rate("gen"),
        tpsOverall: num(spec.committed_draws) > 0 ? num(spec.tokens_per_step) : null,
        tpsRecent: dDraws > 0 && dGen >= 0 ? dGen / dDraws : null,
      },
    });
    if (this.samples.length > MAX_SAMPLES) this.samples.shift();
    this.families = families;
    if (this.visible) this.redraw();
  }

  redraw() {
    const last = this.samples[this.samples.length - 1];
    if (!last) return;
    const series = this.samples.map((s) => ({ t: s.t, values: s.values }));
    for (const chart of Object.values(this.charts)) chart.update(series);
    this.renderCards(last.stats, this.families);
    this.hostPanel.render(last.stats);
    this.specPanel.render(last.stats, series);
    this.replicasPanel.render(last.stats);
    this.renderTable(last.stats.system_prompts);
    this.renderMetrics(this.families);
  }

  renderCards(s, families) {
    const b = s.blocks || {};
    const tree = s.tree || {};
    const reqHit = num(s.request_hit_rate);
    const evictedBlocks = num(s.evicted_blocks);
    const p50 = histogramQuantile(families, TTFT_HISTOGRAM, 0.5);
    const p95 = histogramQuantile(families, TTFT_HISTOGRAM, 0.95);
    const stepP50 = histogramQuantile(families, STEP_HISTOGRAM, 0.5);
    const steps = sampleSum(families, `${STEP_TOKENS}_count`);
    const tokensPerStep = steps > 0 ? sampleSum(families, `${STEP_TOKENS}_sum`) / steps : null;
    const cards = [
      ["Hit rate", fmtPct(num(s.hit_rate), 1), reqHit === null ? "cached ÷ prompt tokens" : `of tokens · ${fmtPct(reqHit)} of requests hit`],
      ["Cached tokens", fmtInt(num(s.cached_tokens)), `of ${fmtInt(num(s.prompt_tokens))} prompt tokens`],
      ["Requests", fmtInt(num(s.requests)), `${fmtInt(num(s.running))} running · ${fmtInt(num(s.waiting))} waiting`],
      ["TTFT median", p50 === null ? "—" : fmtMs(p50 * 1000), `p95 ${p95 === null ? "—" : fmtMs(p95 * 1000)} · from /metrics`],
      ["KV blocks used", `${fmtInt(num(b.used))} / ${fmtInt(num(b.total))}`, `${fmtInt(num(b.cached))} cached · ${fmtInt(num(b.free))} free`],
      ["Radix tree", `${fmtInt(num(tree.nodes))} nodes`, `${fmtInt(num(tree.tokens))} tokens · ${fmtInt(num(s.evictions))} evictions` +
        (evictedBlocks === null ? "" : ` (${fmtInt(evictedBlocks)} blocks)`)],
      ["Engine step", stepP50 === null ? "—" : fmtMs(stepP50 * 1000), `median · ${tokensPerStep === null ? "—" : fmtInt(tokensPerStep)} tokens/step · from /metrics`],
      ["Sessions", fmtInt(num(s.sessions)), `${fmtInt(num(s.preemptions))} preemptions`],
    ];
    this.cards.replaceChildren(...cards.map(([label, value, sub]) => h("div", { className: "stat-card" }, [
      h("div", { className: "stat-label", textContent: label }),
      h("div", { className: "stat-value", textContent: value }),
      h("div", { className: "stat-sub", textContent: sub }),
    ])));
  }

  renderTable(rows) {
    if (!Array.isArray(rows) || rows.length === 0) {
      this.tableBody.replaceChildren(h("tr", {}, [h("td", { colSpan: 6, className: "empty", textContent: "No requests with a system prompt yet." })]));
      return;
    }
    const sorted = [...rows].sort((a, b) => (num(b.requests) ?? 0) - (num(a.requests) ?? 0));
    // an admin sees every tenant's prompts (each row names its tenant); the text is "" where it is
    // hidden (an open server without --show-prompt-previews): the row shows the prompt's id instead
    const tenants = new Set(rows.map((r) => r.tenant));
    const label = (r) => {
      const text = String(r.preview ?? "") || (r.id ? `#${String(r.id).slice(0, 12)}` : "(empty)");
      return tenants.size > 1 && r.tenant ? `[${r.tenant}] ${text}` : text;
    };
    this.tableBody.replaceChildren(...sorted.map((r) => {
      const rate = num(r.hit_rate);
      const bar = h("div", { className: "bar", attrs: { role: "meter", "aria-valuemin": "0", "aria-valuemax": "100", "aria-valuenow": String(Math.round((rate ?? 0) * 100)), "aria-label": "hit rate" } }, [
        h("span", { className: "bar-fill" }),
      ]);
      bar.firstChild.style.width = `${Math.max(0, Math.min(1, rate ?? 0)) * 100}%`;
      return h("tr", {}, [
        h("td", { className: "sp-preview", title: String(r.preview ?? ""), textContent: label(r) }),
        h("td", { className: "num", textContent: fmtInt(num(r.requests)) }),
        h("td", { className: "num", textContent: fmtInt(num(r.hit_requests)) }),
        h("td", { className: "num", textContent: fmtInt(num(r.cached_tokens)) }),
        h("td", { className: "num", textContent: fmtInt(num(r.computed_tokens)) }),
        h("td", {}, [h("div", { className: "rate-cell" }, [bar, h("span", { textContent: fmtPct(rate, 0) })])]),
      ]);
    }));
  }

  renderMetrics(families) {
    if (!families) return;
    const rows = [...families.values()].filter((f) => f.samples.length > 0).map((f) => {
      const plain = f.samples.filter((s) => s.name === f.name || s.name === `${f.name}_total` || s.name === `${f.name}_count`);
      const value = plain.reduce((acc, s) => acc + (Number.isFinite(s.value) ? s.value : 0), 0);
      return h("tr", {}, [
        h("td", { className: "mono", title: f.help, textContent: f.name }),
        h("td", { textContent: f.type }),
        h("td", { className: "num", textContent: plain.length ? (Number.isInteger(value) ? fmtInt(value) : value.toPrecision(4)) : "—" }),
        h("td", { className: "muted", textContent: f.help }),
      ]);
    });
    const table = h("table", { className: "metrics-table" }, [
      h("thead", {}, [h("tr", {}, ["Metric", "Type", "Value", "Help"].map((t) => h("th", { scope: "col", textContent: t })))]),
      h("tbody", {}, rows),
    ]);
    const summary = this.metricsDetails.querySelector("summary");
    summary.textContent = `All metrics (${rows.length} families from /metrics)`;
    this.metricsDetails.replaceChildren(summary, h("div", { className: "table-wrap" }, [table]));
  }
}
