// The dashboard's replicas panel, drawn from the `replicas` and `routing` parts of GET /v1/cache/stats
// (`serve --replicas N`, radixserve/scaleout/views.py): the router and its decisions by reason, then a
// card per replica — hit rate, KV blocks used / cached / free as a bar, running / waiting, requests
// routed and in flight, what the router's prefix index holds of it, and its top system prompts.
// A reply without `replicas` is the single-process server: the panel says "single process" and how
// to run replicas.

import { fmtInt, fmtPct, h } from "./ui.js";

const num = (v) => (typeof v === "number" && Number.isFinite(v) ? v : null);
const obj = (v) => (v && typeof v === "object" && !Array.isArray(v) ? v : {});
const TOP_PROMPTS = 2; // system prompts shown per replica, most requests first

function fact(key, label, value) {
  return h("div", { className: "replica-fact", dataset: { key } }, [
    h("span", { className: "replica-fact-label", textContent: label }),
    h("span", { className: "replica-fact-value", textContent: value }),
  ]);
}

/** A segment of the blocks bar, `n` of `total` wide. */
function segment(kind, n, total) {
  const seg = h("span", { className: `replica-seg replica-seg-${kind}` });
  seg.style.width = `${total > 0 ? Math.max(0, Math.min(1, (n ?? 0) / total)) * 100 : 0}%`;
  return seg;
}

export class ReplicasPanel {
  constructor(root) {
    this.root = root;
    this.state = root.querySelector("#replicas-state");
    this.body = root.querySelector("#replicas-body");
  }

  render(stats) {
    const replicas = stats && stats.replicas;
    this.root.hidden = false;
    const many = Array.isArray(replicas);
    this.root.dataset.mode = many ? "replicas" : "single";
    this.state.textContent = many ? `${fmtInt(replicas.length)} ${replicas.length === 1 ? "replica" : "replicas"}` : "single process";
    this.state.classList.toggle("replicas-state-on", many);
    if (!many) {
      this.body.replaceChildren(h("p", { className: "note replicas-single" }, [
        "Single process: one engine serves every request. Start the server with ",
        h("code", { textContent: "--replicas N" }),
        " to run N engine replicas behind this endpoint, each request routed to the replica most likely to hold its prefix.",
      ]));
      return;
    }
    const cards = replicas.length
      ? replicas.map((r) => this.replicaCard(obj(r)))
      : [h("p", { className: "note replicas-empty", textContent: "No replica has reported yet." })];
    this.body.replaceChildren(this.routingLine(obj(stats.routing)), h("div", { className: "replica-cards" }, cards));
  }

  routingLine(routing) {
    const decisions = Object.entries(obj(routing.decisions)).map(([reason, n]) =>
      h("span", { className: "routing-decision", dataset: { reason: String(reason) } }, [
        h("span", { className: "routing-reason", textContent: String(reason) }),
        " ",
        h("span", { className: "routing-count", textContent: fmtInt(num(n)) }),
      ]));
    return h("div", { className: "routing-line" }, [
      h("span", { className: "routing-router" }, [
        "Router ",
        h("strong", { className: "routing-name", textContent: routing.router == null ? "—" : String(routing.router) }),
      ]),
      h("span", { className: "routing-decisions", attrs: { "aria-label": "routing decisions by reason" } },
        decisions.length ? decisions : [h("span", { className: "muted", textContent: "no decisions reported" })]),
    ]);
  }

  replicaCard(r) {
    const id = r.replica == null ? "?" : String(r.replica);
    const view = obj(r.router_view);
    return h("article", { className: "replica-card", dataset: { replica: id } }, [
      h("div", { className: "replica-head" }, [
        h("span", { className: "replica-id", title: id, textContent: id }),
        h("span", { className: "replica-hit" }, [
          h("span", { className: "replica-hit-value", textContent: fmtPct(num(r.hit_rate), 1) }),
          h("span", { className: "replica-hit-label", textContent: " hit rate" }),
        ]),
      ]),
      h("div", { className: "replica-tokens", textContent:
        `${fmtInt(num(r.cached_tokens))} of ${fmtInt(num(r.prompt_tokens))} prompt tokens cached · ${fmtInt(num(r.requests))} requests` }),
      this.blocksBar(obj(r.blocks)),
      h("div", { className: "replica-facts" }, [
        fact("load", "Running / waiting", `${fmtInt(num(r.running))} / ${fmtInt(num(r.waiting))}`),
        fact("routed", "Routed / in flight", `${fmtInt(num(r.routed))} / ${fmtInt(num(r.in_flight))}`),
        fact("router_view", "Router's index", `${fmtInt(num(view.prefixes))} prefixes · ${fmtInt(num(view.tokens))} tokens` +
          (num(view.resyncs) ? ` · ${fmtInt(num(view.resyncs))} ${num(view.resyncs) === 1 ? "resync" : "resyncs"}` : "")),
      ]),
      this.prompts(r.system_prompts),
    ]);
  }

  blocksBar(b) {
    const total = num(b.total) ?? 0;
    const used = num(b.used);
    const cached = num(b.cached);
    const free = num(b.free);
    const summary = `${fmtInt(used)} used · ${fmtInt(cached)} cached · ${fmtInt(free)} free of ${fmtInt(num(b.total))} blocks`;
    return h("div", { className: "replica-blocks" }, [
      h("div", { className: "bar replica-bar", attrs: { role: "img", "aria-label": `KV blocks: ${summary}` } },
        [segment("used", used, total), segment("cached", cached, total)]),
      h("div", { className: "replica-blocks-label", textContent: summary }),
    ]);
  }

  prompts(rows) {
    if (!Array.isArray(rows) || rows.length === 0) {
      return h("p", { className: "note replica-prompts-empty", textContent: "No requests with a system prompt yet." });
    }
    const top = [...rows].map(obj).sort((a, b) => (num(b.requests) ?? 0) - (num(a.requests) ?? 0)).slice(0, TOP_PROMPTS);
    return h("ul", { className: "replica-prompts", attrs: { "aria-label": "top system prompts" } }, top.map((p) => {
      const preview = String(p.preview ?? p.id ?? "") || "(empty)";
      return h("li", { className: "replica-prompt" }, [
        h("span", { className: "replica-prompt-preview", title: String(p.preview ?? ""), textContent: preview }),
        h("span", { className: "replica-prompt-rate", textContent: fmtPct(num(p.hit_rate), 0) }),
        h("span", { className: "replica-prompt-hits", textContent: `${fmtInt(num(p.hit_requests))} / ${fmtInt(num(p.requests))} hit` }),
      ]);
    }));
  }
}
