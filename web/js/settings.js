// The session settings panel: the system-prompt editor, a new chat's tools (OpenAI function tools as
// JSON) and the sampling controls (temperature, top-p, max tokens). Sampling applies to every message sent and persists in localStorage. A saved
// session's system prompt is fixed — its tokens head the cached prefix — so editing it offers to
// start a new chat with the edited prompt instead of pretending to change the old one.

import { fmtInt, fmtTime, h } from "./ui.js";

const SAMPLING_KEY = "radixserve.sampling";
const PROMPT_KEY = "radixserve.systemPrompt";
const TOOLS_KEY = "radixserve.tools";
export const DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant.";
const DEFAULTS = { temperature: 0.7, top_p: 0.95, max_tokens: 256 };

function load(key, fallback) {
  try {
    const raw = localStorage.getItem(key);
    return raw === null ? fallback : JSON.parse(raw);
  } catch {
    return fallback;
  }
}

function save(key, value) {
  try {
    localStorage.setItem(key, JSON.stringify(value));
  } catch {
    /* storage unavailable: settings last for this page only */
  }
}

export class SettingsPanel {
  /** @param {{promptEdited: (text: string) => void, applyPrompt: (text: string) => void}} handlers */
  constructor(handlers) {
    this.handlers = handlers;
    this.root = document.getElementById("settings");
    this.prompt = document.getElementById("system-prompt");
    this.note = document.getElementById("system-prompt-note");
    this.apply = document.getElementById("apply-system");
    this.facts = document.getElementById("session-facts");
    this.temperature = document.getElementById("temperature");
    this.topP = document.getElementById("top-p");
    this.maxTokens = document.getElementById("max-tokens");
    this.toolsInput = document.getElementById("tools");
    this.toolsNote = document.getElementById("tools-note");
    const storedTools = load(TOOLS_KEY, "");
    this.toolsInput.value = typeof storedTools === "string" ? storedTools : "";
    this.toolsInput.addEventListener("input", () => {
      if (this.savedPrompt !== null) return; // a saved chat's tools are fixed, as its prompt is
      save(TOOLS_KEY, this.toolsInput.value);
      this.toolsInput.setAttribute("aria-invalid", String(this.tools() === undefined));
    });
    this.toggleBtn = document.getElementById("settings-btn");
    this.savedPrompt = null; // the current saved session's prompt, null for a draft

    const s = { ...DEFAULTS, ...load(SAMPLING_KEY, {}) };
    this.temperature.value = String(s.temperature);
    this.topP.value = String(s.top_p);
    this.maxTokens.value = String(s.max_tokens);
    this.showSampling();
    for (const input of [this.temperature, this.topP, this.maxTokens]) {
      input.addEventListener("input", () => {
        this.showSampling();
        const v = this.sampling();
        if (v) save(SAMPLING_KEY, v);
      });
    }
    this.prompt.addEventListener("input", () => {
      if (this.savedPrompt === null) {
        save(PROMPT_KEY, this.prompt.value);
        this.handlers.promptEdited(this.prompt.value);
      }
      this.apply.hidden = this.savedPrompt === null || this.prompt.value === this.savedPrompt;
    });
    this.apply.addEventListener("click", () => {
      save(PROMPT_KEY, this.prompt.value);
      this.handlers.applyPrompt(this.prompt.value);
    });
    this.toggleBtn.addEventListener("click", () => this.setOpen(!this.root.classList.contains("open")));
    document.getElementById("settings-close").addEventListener("click", () => {
      this.setOpen(false);
      this.toggleBtn.focus();
    });
    this.root.addEventListener("keydown", (ev) => {
      if (ev.key === "Escape" && this.root.classList.contains("open")) {
        this.setOpen(false);
        this.toggleBtn.focus();
      }
    });
  }

  setOpen(open) {
    this.root.classList.toggle("open", open);
    this.toggleBtn.setAttribute("aria-expanded", String(open));
    if (open) this.prompt.focus();
  }

  showSampling() {
    document.getElementById("temperature-out").textContent = Number(this.temperature.value).toFixed(2);
    document.getElementById("top-p-out").textContent = Number(this.topP.value).toFixed(2);
    const ok = this.sampling() !== null;
    this.maxTokens.setAttribute("aria-invalid", String(!ok));
  }

  /** The sampling object for a chat frame, or null when max tokens is not a positive integer. */
  sampling() {
    const maxTokens = Number(this.maxTokens.value);
    if (!Number.isInteger(maxTokens) || maxTokens < 1) return null;
    return { temperature: Number(this.temperature.value), top_p: Number(this.topP.value), max_tokens: maxTokens };
  }

  /** The tools for a new chat: an array (maybe empty), or undefined when the text is not a JSON array. */
  tools() {
    const text = this.toolsInput.value.trim();
    if (!text) return [];
    try {
      const value = JSON.parse(text);
      return Array.isArray(value) ? value : undefined;
    } catch {
      return undefined;
    }
  }

  storedPrompt() {
    const p = load(PROMPT_KEY, DEFAULT_SYSTEM_PROMPT);
    return typeof p === "string" ? p : DEFAULT_SYSTEM_PROMPT;
  }

  /** Show a draft (editable prompt) or a saved session (fixed prompt, facts). */
  showSession(session, draftPrompt) {
    if (!session) {
      this.savedPrompt = null;
      this.prompt.value = draftPrompt;
      this.note.textContent = "Sent with your first message. Chats that share a system prompt reuse its cached KV blocks.";
      this.apply.hidden = true;
      this.facts.replaceChildren();
      this.toolsInput.readOnly = false;
      const stored = load(TOOLS_KEY, "");
      this.toolsInput.value = typeof stored === "string" ? stored : "";
      this.toolsNote.textContent = "OpenAI function tools the model may call in the next new chat. A call shows its arguments; type the result to answer it.";
      return;
    }
    // a saved chat's tools are rendered into its first tokens: shown, not editable
    this.toolsInput.readOnly = true;
    this.toolsInput.value = session.tools && session.tools.length ? JSON.stringify(session.tools, null, 2) : "";
    this.toolsNote.textContent = session.tools && session.tools.length ? "Fixed for this chat." : "This chat has no tools.";
    this.savedPrompt = session.system_prompt || "";
    if (document.activeElement !== this.prompt) this.prompt.value = this.savedPrompt;
    this.note.textContent = "Fixed for this chat (its tokens head the cached prefix). Edit it to start a new chat.";
    this.apply.hidden = this.prompt.value === this.savedPrompt;
    const rows = [
      ["Session", session.id.slice(0, 12)],
      ["Created", fmtTime(session.created)],
      ["Messages", fmtInt(session.messages.length)],
      ["Context tokens", fmtInt(session.num_tokens)],
    ];
    this.facts.replaceChildren(h("h3", { textContent: "This chat" }), h("dl", {}, rows.flatMap(([k, v]) => [
      h("dt", { textContent: k }), h("dd", { textContent: v }),
    ])));
  }
}
