// DOM helpers shared by the views: element construction (text only, never HTML strings), the toast
// area where every server or network error is shown, and number/time formatting.

import { icon } from "./icons.js";

/** Create an element; `props` sets properties (className, textContent, ...) and `attrs` attributes. */
export function h(tag, props = {}, children = []) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(props)) {
    if (v === undefined || v === null) continue;
    if (k === "attrs") for (const [a, av] of Object.entries(v)) node.setAttribute(a, av);
    else if (k === "dataset") Object.assign(node.dataset, v);
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node[k] = v;
  }
  node.append(...children.filter((c) => c !== null && c !== undefined && c !== false));
  return node;
}

const TOAST_MS = 8000;

/** Show a message in the toast area; errors stay until dismissed or replaced by a newer copy. */
export function toast(message, kind = "error") {
  const area = document.getElementById("toasts");
  for (const old of area.children) {
    if (old.dataset.message === message) old.remove(); // the newest copy of a repeated error wins
  }
  const close = h("button", { type: "button", className: "toast-close", attrs: { "aria-label": "Dismiss" } }, [icon("close")]);
  const node = h("div", { className: `toast toast-${kind}`, dataset: { message } }, [
    h("span", { className: "toast-text", textContent: message }),
    close,
  ]);
  close.addEventListener("click", () => node.remove());
  area.append(node);
  while (area.children.length > 4) area.firstElementChild.remove();
  if (kind !== "error") setTimeout(() => node.remove(), TOAST_MS);
  return node;
}

export function errorMessage(e) {
  if (!e) return "Unknown error";
  return e.message || String(e);
}

export function fmtInt(n) {
  return Number.isFinite(n) ? Math.round(n).toLocaleString("en-US") : "—";
}

export function fmtPct(ratio, digits = 0) {
  return Number.isFinite(ratio) ? `${(ratio * 100).toFixed(digits)}%` : "—";
}

export function fmtMs(ms) {
  if (!Number.isFinite(ms)) return "—";
  return ms >= 1000 ? `${(ms / 1000).toFixed(2)} s` : `${Math.round(ms)} ms`;
}

/** Bytes in binary units (KiB, MiB, GiB), three significant digits. */
export function fmtBytes(n) {
  if (!Number.isFinite(n)) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) {
    n /= 1024;
    i += 1;
  }
  return i === 0 ? `${Math.round(n)} B` : `${n >= 100 ? Math.round(n) : n.toPrecision(3)} ${units[i]}`;
}

export function fmtRate(v) {
  return Number.isFinite(v) ? `${v >= 100 ? Math.round(v) : v.toFixed(1)} tok/s` : "—";
}

export function fmtTime(epochSeconds) {
  if (!Number.isFinite(epochSeconds)) return "";
  const d = new Date(epochSeconds * 1000);
  const sameDay = d.toDateString() === new Date().toDateString();
  return sameDay ? d.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" }) : d.toLocaleDateString();
}

export function newId() {
  if (globalThis.crypto && typeof crypto.randomUUID === "function") return crypto.randomUUID();
  return `g${Date.now().toString(36)}${Math.random().toString(36).slice(2, 10)}`;
}
