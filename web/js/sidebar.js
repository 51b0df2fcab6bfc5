// The sessions sidebar: the list from GET /v1/sessions (newest first), the unsaved draft at the
// top, switch on click, and delete with an inline two-step confirmation (no blocking confirm()).
// On narrow screens it is an off-canvas drawer; Escape or the scrim closes it.

import { icon } from "./icons.js";
import { fmtTime, h } from "./ui.js";

const CONFIRM_MS = 4000;

export class Sidebar {
  /** @param {{open: (id: string|null) => void, remove: (id: string) => Promise<void>}} handlers */
  constructor(handlers) {
    this.handlers = handlers;
    this.list = document.getElementById("session-list");
    this.empty = document.getElementById("session-empty");
    this.root = document.getElementById("sidebar");
    this.scrim = document.getElementById("scrim");
    this.menuBtn = document.getElementById("menu-btn");
    this.menuBtn.addEventListener("click", () => this.setOpen(true));
    document.getElementById("sidebar-close").addEventListener("click", () => this.setOpen(false));
    this.scrim.addEventListener("click", () => this.setOpen(false));
    this.root.addEventListener("keydown", (ev) => {
      if (ev.key === "Escape" && this.root.classList.contains("open")) {
        this.setOpen(false);
        this.menuBtn.focus();
      }
    });
  }

  setOpen(open) {
    this.root.classList.toggle("open", open);
    this.scrim.hidden = !open;
    this.menuBtn.setAttribute("aria-expanded", String(open));
    if (open) (this.list.querySelector("[aria-current] .session-open, .session-open") || this.root).focus();
  }

  /**
   * @param {{id: string, preview?: string, system_prompt?: string, created?: number, num_messages?: number}[]} sessions
   * @param {string|null} currentId  null while the current chat is an unsaved draft
   * @param {Set<string>} busy  sessions with a generation in flight
   */
  render(sessions, currentId, busy) {
    const items = [];
    if (currentId === null) {
      items.push(h("li", { className: "session-item active draft", attrs: { "aria-current": "page" } }, [
        h("button", { type: "button", className: "session-open", onclick: () => this.handlers.open(null) }, [
          h("span", { className: "session-title", textContent: "New chat" }),
          h("span", { className: "session-meta", textContent: "not sent yet" }),
        ]),
      ]));
    }
    const sorted = [...sessions].sort((a, b) => (b.created || 0) - (a.created || 0));
    for (const s of sorted) items.push(this.item(s, s.id === currentId, busy.has(s.id) || s.busy === true));
    this.list.replaceChildren(...items);
    this.empty.hidden = items.length > 0;
  }

  item(s, active, busy) {
    const title = (s.preview || "").trim() || "Empty chat";
    const n = Number.isFinite(s.num_messages) ? s.num_messages : 0;
    const open = h("button", {
      type: "button", className: "session-open", title,
      onclick: () => {
        this.handlers.open(s.id);
        if (window.matchMedia("(max-width: 799px)").matches) this.setOpen(false);
      },
    }, [
      h("span", { className: "session-title", textContent: title }),
      h("span", { className: "session-meta", textContent: `${fmtTime(s.created)} · ${n} message${n === 1 ? "" : "s"}${busy ? " · replying…" : ""}` }),
    ]);
    const del = h("button", { type: "button", className: "icon-btn session-delete", attrs: { "aria-label": `Delete chat “${title}”` } }, [icon("trash")]);
    let timer = 0;
    const reset = () => {
      clearTimeout(timer);
      delete del.dataset.confirm;
      del.replaceChildren(icon("trash"));
      del.setAttribute("aria-label", `Delete chat “${title}”`);
    };
    del.addEventListener("click", async () => {
      if (!del.dataset.confirm) {
        del.dataset.confirm = "1";
        del.textContent = "Delete?";
        del.setAttribute("aria-label", `Confirm: delete chat “${title}”`);
        timer = setTimeout(reset, CONFIRM_MS);
        return;
      }
      reset();
      del.disabled = true;
      await this.handlers.remove(s.id);
      del.disabled = false;
    });
    del.addEventListener("blur", () => setTimeout(() => document.activeElement !== del && reset(), 150));
    return h("li", { className: `session-item${active ? " active" : ""}`, dataset: { sessionId: s.id }, attrs: active ? { "aria-current": "page" } : {} }, [open, del]);
  }
}
