// The dashboard's host-memory tier panel, drawn from the `host` and `swaps` objects of
// GET /v1/cache/stats (docs/protocol.md): host blocks used / free as a bar, the prompt tokens the
// tier served, write-back and load-back traffic (bytes, time, bandwidth), swaps and dropped blocks.
// With the tier off (`host.enabled` false) it says "off" and how to turn it on; a reply without a
// `host` object (an older server) hides the panel.

import { fmtBytes, fmtInt, fmtMs, fmtPct, h } from "./ui.js";

const num = (v) => (typeof v === "number" && Number.isFinite(v) ? v : null);

function card(key, label, value, sub) {
  return h("div", { className: "stat-card", dataset: { key } }, [
    h("div", { className: "stat-label", textContent: label }),
    h("div", { className: "stat-value", textContent: value }),
    h("div", { className: "stat-sub", textContent: sub }),
  ]);
}

/** "12.0 MiB/s"; "—" before any copy has completed (no time measured yet). */
function bandwidth(bytes, seconds) {
  return bytes !== null && seconds !== null && seconds > 0 ? `${fmtBytes(bytes / seconds)}/s` : "—";
}

function copyCard(key, label, c) {
  const bytes = num(c.bytes);
  const seconds = num(c.seconds);
  return card(key, label, fmtBytes(bytes),
    `${fmtInt(num(c.blocks))} blocks · ${seconds === null ? "—" : fmtMs(seconds * 1000)} · ${bandwidth(bytes, seconds)}`);
}

export class HostPanel {
  constructor(root) {
    this.root = root;
    this.state = root.querySelector("#host-state");
    this.body = root.querySelector("#host-body");
  }

  render(stats) {
    const host = stats && stats.host;
    if (!host || typeof host !== "object") {
      this.root.hidden = true;
      return;
    }
    this.root.hidden = false;
    const on = host.enabled === true;
    this.root.dataset.enabled = String(on);
    this.state.textContent = on ? "on" : "off";
    this.state.classList.toggle("host-state-on", on);
    if (!on) {
      this.body.replaceChildren(h("p", { className: "note host-off" }, [
        "Off: evicted prefixes are dropped. Start the server with ",
        h("code", { textContent: "--host-cache-mb" }),
        " to keep them in host memory and load them back on a hit.",
      ]));
      return;
    }
    this.body.replaceChildren(this.blocksBar(host.blocks || {}), h("div", { className: "stat-cards host-cards" }, this.cards(stats, host)));
  }

  blocksBar(b) {
    const total = num(b.total) ?? 0;
    const used = num(b.used) ?? 0;
    const fill = h("span", { className: "bar-fill" });
    fill.style.width = `${total > 0 ? Math.max(0, Math.min(1, used / total)) * 100 : 0}%`;
    const bar = h("div", { className: "bar host-bar", attrs: {
      role: "meter", "aria-label": "host blocks used", "aria-valuemin": "0",
      "aria-valuemax": String(total), "aria-valuenow": String(used),
    } }, [fill]);
    return h("div", { className: "host-blocks" }, [
      h("div", { className: "host-blocks-label" }, [
        h("span", { className: "host-blocks-used", textContent: `${fmtInt(used)} / ${fmtInt(total)} blocks used` }),
        h("span", { className: "host-blocks-free", textContent: `${fmtInt(num(b.free))} free` }),
      ]),
      bar,
    ]);
  }

  cards(stats, host) {
    const hit = num(host.hit_tokens);
    const cached = num(stats.cached_tokens);
    const swaps = stats.swaps || {};
    return [
      card("hit_tokens", "Host hit tokens", fmtInt(hit),
        cached ? `${fmtPct(hit / cached, 1)} of cached tokens came from host memory` : "prompt tokens loaded back"),
      card("held", "Held only in host", `${fmtInt(num(host.tokens))} tokens`, `${fmtInt(num(host.nodes))} radix-tree nodes`),
      card("dropped", "Dropped", `${fmtInt(num(host.dropped_blocks))} blocks`, "least recently used, to make room"),
      copyCard("write_back", "Write-back", host.write_back || {}),
      copyCard("load_back", "Load-back", host.load_back || {}),
      card("swaps", "Swaps", `${fmtInt(num(swaps.out))} out · ${fmtInt(num(swaps.in))} in`,
        `of ${fmtInt(num(stats.preemptions))} preemptions (the rest recompute)`),
    ];
  }
}
