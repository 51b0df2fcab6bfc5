// The dashboard's live picture of the radix tree: an icicle drawn in SVG from GET /v1/cache/tree
// (docs/pins.md). The top row holds the cache namespaces (a tenant each; a request's cache_salt makes
// a "salted" one), each row below one level of the tree; a node's width is its share of its parent's
// tokens (its own edge and everything below it), so the prefixes most requests share are the widest.
// Colour says where its KV lives (device, host memory, both), a green outline that it is pinned, a
// dashed one that a running request holds it; a label shows its first words and hits when it is wide
// enough, the tooltip everything. The server sends at most LIMIT nodes (the largest, connected) and
// leaves labels out for callers without a key unless the operator allows previews.
// Refreshed by the dashboard's poll while the dashboard is visible; a failed fetch is shown in the
// panel's state line and never stops the dashboard's other panels.

import { apiFetch } from "./api.js";
import { errorMessage, fmtInt, h } from "./ui.js";

const LIMIT = 200;
const SVG = "http://www.w3.org/2000/svg";
const ROW_PX = 28;
const GAP_PX = 2;
const LABEL_MIN_PX = 40; // narrower nodes are drawn without text (the tooltip still has it)
const CHAR_PX = 6.6; // about one character of the 11px label font
const LEGEND = [
  ["tier-device", "device"], ["tier-host", "host memory"], ["tier-both", "both tiers"],
  ["pinned", "pinned"], ["locked", "in use"],
];

function svg(tag, attrs = {}, children = []) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  node.append(...children);
  return node;
}

function tooltip(n) {
  const where = { device: "on the device", host: "in host memory", both: "on the device and in host memory" }[n.tier] || n.tier;
  const lines = [
    n.label ? `“${n.label}…”` : "(text hidden)",
    `${fmtInt(n.tokens)} tokens from position ${fmtInt(n.start)}, ${fmtInt(n.subtree_tokens)} with what follows`,
    `${fmtInt(n.hits)} hits · ${where}${n.pinned ? " · pinned" : ""}${n.locked ? " · in use" : ""}`,
  ];
  if (n.hidden_tokens > 0) lines.push(`${fmtInt(n.hidden_tokens)} tokens below not drawn`);
  return lines.join("\n");
}

function fit(text, px) {
  const room = Math.floor((px - 8) / CHAR_PX);
  if (room < 3) return "";
  return text.length <= room ? text : `${text.slice(0, room - 1)}…`;
}

/** Lay the view out: [{kind: "ns"|"node", item, depth, x, w}] with x, w in [0, 1]. */
export function layout(view) {
  const children = new Map(); // parent key -> nodes, largest first
  const keyOf = (n) => (n.parent === null ? `ns:${n.namespace}` : `node:${n.parent}`);
  for (const n of view.nodes) {
    const k = keyOf(n);
    if (!children.has(k)) children.set(k, []);
    children.get(k).push(n);
  }
  for (const list of children.values()) list.sort((a, b) => b.subtree_tokens - a.subtree_tokens || a.id - b.id);
  const boxes = [];
  const total = view.namespaces.reduce((s, ns) => s + ns.tokens, 0) || 1;
  const place = (key, tokens, x, w, depth) => {
    let at = x;
    for (const n of children.get(key) || []) {
      const nw = tokens > 0 ? (w * n.subtree_tokens) / tokens : 0;
      boxes.push({ kind: "node", item: n, depth, x: at, w: nw });
      place(`node:${n.id}`, n.subtree_tokens, at, nw, depth + 1);
      at += nw;
    }
  };
  let x = 0;
  for (const ns of view.namespaces) {
    const w = ns.tokens / total;
    boxes.push({ kind: "ns", item: ns, depth: 0, x, w });
    place(`ns:${ns.id}`, ns.tokens, x, w, 1);
    x += w;
  }
  return boxes;
}

export class TreeView {
  constructor(root) {
    this.root = root;
    this.state = root.querySelector("#tree-state");
    this.view = null;
    this.inFlight = false;
    const legend = h("div", { className: "tree-legend", attrs: { "aria-hidden": "true" } }, LEGEND.map(([cls, text]) =>
      h("span", { className: "legend-item" }, [h("i", { className: `tree-swatch ${cls}` }), h("span", { textContent: text })])));
    this.canvas = svg("svg", { class: "tree-svg", role: "img", "aria-label": "Radix tree: no data yet" });
    this.wrap = h("div", { className: "tree-wrap" }, [this.canvas]);
    this.empty = h("p", { className: "tree-empty", textContent: "Loading the tree…" });
    root.append(legend, this.empty, this.wrap);
    this.width = 0;
    new ResizeObserver(() => {
      if (this.wrap.clientWidth !== this.width) this.draw();
    }).observe(this.wrap);
  }

  /** Fetch the tree and draw it; failures are shown in the state line, never thrown. */
  async refresh() {
    if (this.inFlight) return;
    this.inFlight = true;
    try {
      const view = await apiFetch(`/v1/cache/tree?limit=${LIMIT}`);
      if (!view || !Array.isArray(view.nodes) || !Array.isArray(view.namespaces)) {
        throw new Error("GET /v1/cache/tree: the server sent a reply of an unexpected shape");
      }
      this.view = view;
      this.root.dataset.error = "";
      this.draw();
    } catch (e) {
      this.root.dataset.error = "true";
      this.state.textContent = `Cannot draw: ${errorMessage(e)}`;
    } finally {
      this.inFlight = false;
    }
  }

  draw() {
    const view = this.view;
    this.width = this.wrap.clientWidth;
    if (!view) return;
    const shown = view.nodes.length;
    const pinned = view.nodes.filter((n) => n.pinned).length;
    this.state.textContent = `${fmtInt(shown)} of ${fmtInt(view.total_nodes)} nodes · ${fmtInt(view.total_tokens)} tokens` +
      (pinned ? ` · ${fmtInt(pinned)} pinned` : "") + (view.labels ? "" : " · text hidden");
    this.root.dataset.nodes = String(shown);
    this.empty.hidden = shown > 0;
    this.empty.textContent = "The cache holds no prefixes yet.";
    this.wrap.hidden = shown === 0;
    if (shown === 0 || this.width <= 0) return;
    const boxes = layout(view);
    const depth = boxes.reduce((d, b) => Math.max(d, b.depth), 0) + 1;
    const width = this.width;
    this.canvas.setAttribute("viewBox", `0 0 ${width} ${depth * ROW_PX}`);
    this.canvas.setAttribute("width", String(width));
    this.canvas.setAttribute("height", String(depth * ROW_PX));
    this.canvas.setAttribute("aria-label", `Radix tree: ${this.state.textContent}`);
    this.canvas.replaceChildren(...boxes.filter((b) => b.w * width >= 1).map((b) => this.box(b, width)));
  }

  box(b, width) {
    const x = b.x * width;
    const w = Math.max(1, b.w * width - GAP_PX);
    const y = b.depth * ROW_PX;
    const rect = svg("rect", { x, y, width: w, height: ROW_PX - GAP_PX, rx: 3 });
    if (b.kind === "ns") {
      const ns = b.item;
      const name = `${ns.tenant ?? "shared"}${ns.salted ? " · salted" : ""}`;
      const text = fit(`${name} · ${fmtInt(ns.tokens)} tok`, w);
      return svg("g", { class: "tree-ns", "data-namespace": ns.id }, [
        svg("title", {}, [`Namespace ${name}: ${fmtInt(ns.tokens)} tokens`]), rect,
        ...(text ? [svg("text", { x: x + 5, y: y + ROW_PX / 2 + 3 }, [text])] : []),
      ]);
    }
    const n = b.item;
    const classes = ["tree-node", `tier-${n.tier}`, n.pinned ? "pinned" : "", n.locked ? "locked" : ""].filter(Boolean);
    const words = n.label ? `${n.label} · ` : "";
    const text = w >= LABEL_MIN_PX ? fit(`${words}${fmtInt(n.hits)} hits`, w) : "";
    return svg("g", {
      class: classes.join(" "), "data-node-id": n.id, "data-tier": n.tier, "data-pinned": n.pinned, "data-hits": n.hits,
    }, [svg("title", {}, [tooltip(n)]), rect, ...(text ? [svg("text", { x: x + 5, y: y + ROW_PX / 2 + 3 }, [text])] : [])]);
  }
}
