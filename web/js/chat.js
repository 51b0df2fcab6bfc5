// The chat controller: owns the client-side session state (summaries for the sidebar, loaded sessions
// with their messages, which chat is open) and the session actions — new, open, fork, delete, copy.
// Turns (sending, streaming, stopping, answering tool calls) live in turns.js. A loaded session's messages carry `index`
// equal to their position on the server, which fork and message_index use; messages without one are
// local only (a turn the server refused or has not confirmed yet).

import { api } from "./api.js";
import { renderConversation, updateMessage } from "./messages.js";
import { SettingsPanel } from "./settings.js";
import { answeredIds } from "./tools_view.js";
import { Sidebar } from "./sidebar.js";
import { Turns } from "./turns.js";
import { errorMessage, h, toast } from "./ui.js";

const CURRENT_KEY = "radixserve.currentSession";
const LOADING_RETRIES = 60;
const LOADING_RETRY_MS = 2000;

export class ChatController {
  /** @param {import("./socket.js").ChatSocket} socket */
  constructor(socket) {
    this.socket = socket;
    this.summaries = [];
    this.sessions = new Map(); // id -> {id, system_prompt, messages, num_tokens, created, sampling}
    this.currentId = null; // null = unsaved draft
    this.draftPrompt = "";
    this.loadToken = 0;
    this.lastListError = "";
    this.shownId = undefined; // the chat the message list shows, to keep the reader's scroll place

    this.messagesEl = document.getElementById("messages");
    this.input = document.getElementById("composer-input");
    this.form = document.getElementById("composer");
    this.sendBtn = document.getElementById("send-btn");
    this.stopBtn = document.getElementById("stop-btn");
    this.msgHandlers = {
      fork: (at, text) => this.fork(at, text),
      copy: (text, btn) => this.copy(text, btn),
      toolState: (msg) => this.toolState(msg),
    };

    this.sidebar = new Sidebar({ open: (id) => this.open(id), remove: (id) => this.remove(id) });
    this.settings = new SettingsPanel({
      promptEdited: (text) => (this.draftPrompt = text),
      applyPrompt: (text) => this.newChat(text),
    });
    this.draftPrompt = this.settings.storedPrompt();
    this.turns = new Turns(this, socket);

    document.getElementById("new-chat").addEventListener("click", () => this.newChat(this.settings.storedPrompt()));
    this.form.addEventListener("submit", (ev) => {
      ev.preventDefault();
      this.turns.send();
    });
    this.input.addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
        ev.preventDefault();
        this.turns.send();
      } else if (ev.key === "Escape" && !this.stopBtn.hidden) {
        ev.preventDefault();
        this.turns.stop();
      }
    });
    this.input.addEventListener("input", () => this.autosize());
    this.stopBtn.addEventListener("click", () => this.turns.stop());
    this.messagesEl.addEventListener("click", (ev) => {
      const btn = ev.target.closest(".code-copy");
      if (btn) this.copy(btn.closest(".code-block").querySelector("code").textContent, btn);
    });
  }

  async start() {
    let saved = null;
    try {
      saved = localStorage.getItem(CURRENT_KEY);
    } catch {
      /* no storage: start with a draft */
    }
    this.showCurrent();
    // While the model loads the API answers 503; keep trying for a while (the toast says why).
    for (let attempt = 0; attempt < LOADING_RETRIES; attempt++) {
      if (await this.refreshList()) break;
      await new Promise((resolve) => setTimeout(resolve, LOADING_RETRY_MS));
    }
    if (saved && this.currentId === null && this.summaries.some((s) => s.id === saved)) await this.open(saved);
  }

  // ---- state helpers -------------------------------------------------------------------------

  current() {
    return this.currentId === null ? null : this.sessions.get(this.currentId) || null;
  }

  remember(id) {
    try {
      if (id) localStorage.setItem(CURRENT_KEY, id);
      else localStorage.removeItem(CURRENT_KEY);
    } catch {
      /* ignore */
    }
  }

  /** Reload the sessions list; returns false when it failed (the failure is shown). */
  async refreshList() {
    try {
      this.summaries = await api.listSessions();
      this.lastListError = "";
      this.renderSidebar();
      return true;
    } catch (e) {
      const message = `Could not load chats: ${errorMessage(e)}`;
      if (message !== this.lastListError) toast(message); // retries repeat it; say it once
      this.lastListError = message;
      this.renderSidebar();
      return false;
    }
  }

  renderSidebar() {
    this.sidebar.render(this.summaries, this.currentId, new Set(this.turns.busy.keys()));
  }

  showCurrent() {
    const session = this.current();
    const messages = session ? session.messages : [];
    const empty = h("div", { className: "empty-chat" }, [
      h("h1", { textContent: session ? "No messages yet" : "Start a conversation" }),
      h("p", { textContent: "Replies stream in token by token. Each reply shows how many prompt tokens came from the prefix cache." }),
    ]);
    renderConversation(this.messagesEl, messages, this.msgHandlers, empty, { opened: this.shownId !== this.currentId });
    this.shownId = this.currentId;
    this.settings.showSession(session, this.draftPrompt);
    this.renderSidebar();
    this.syncComposer();
  }

  syncComposer() {
    const busy = this.currentId !== null && this.turns.busy.has(this.currentId);
    this.sendBtn.hidden = busy;
    this.stopBtn.hidden = !busy;
    this.form.setAttribute("aria-busy", String(busy));
  }

  autosize() {
    this.input.style.height = "auto";
    this.input.style.height = `${Math.min(this.input.scrollHeight, 240)}px`;
  }

  normalize(session) {
    // Server messages carry no indices; their position is the index `fork` and `message_index` use.
    session.messages = session.messages.map((m, index) => ({ ...m, index }));
    return session;
  }

  /**
   * Which of `msg`'s tool calls later messages answer, and how to answer the rest: only the open
   * chat's last message, while no generation runs there (`answer` null otherwise).
   */
  toolState(msg) {
    const session = this.current();
    const messages = session ? session.messages : [];
    const last = messages.length > 0 && messages[messages.length - 1] === msg;
    const idle = this.currentId !== null && !this.turns.busy.has(this.currentId);
    return {
      answered: answeredIds(messages),
      answer: last && idle && !msg.streaming ? (results) => this.turns.sendToolResults(results) : null,
    };
  }

  // ---- user actions --------------------------------------------------------------------------

  newChat(prompt) {
    this.currentId = null;
    this.draftPrompt = prompt;
    this.remember(null);
    this.showCurrent();
    this.input.focus();
  }

  async open(id, { force = false } = {}) {
    if (id === null) {
      this.newChat(this.draftPrompt);
      return;
    }
    const token = ++this.loadToken;
    this.currentId = id;
    this.remember(id);
    if (this.sessions.has(id) && !force) {
      this.showCurrent();
      return;
    }
    if (!this.turns.busy.has(id) || force) {
      try {
        const session = this.normalize(await api.getSession(id));
        if (this.turns.busy.has(id)) return; // a generation started meanwhile; its local state is newer
        this.sessions.set(id, session);
      } catch (e) {
        toast(`Could not open the chat: ${errorMessage(e)}`);
        if (e.code === "unknown_session") {
          this.summaries = this.summaries.filter((s) => s.id !== id);
          if (token === this.loadToken) this.newChat(this.draftPrompt);
        }
        return;
      }
    }
    if (token === this.loadToken) this.showCurrent();
  }

  async remove(id) {
    try {
      await api.deleteSession(id);
    } catch (e) {
      if (e.code !== "unknown_session") {
        toast(`Could not delete the chat: ${errorMessage(e)}`);
        return;
      }
    }
    this.sessions.delete(id);
    this.summaries = this.summaries.filter((s) => s.id !== id);
    if (this.currentId === id) this.newChat(this.draftPrompt);
    else this.renderSidebar();
    toast("Chat deleted.", "info");
  }

  async fork(atMessage, editText) {
    const parent = this.currentId;
    if (parent === null) return;
    try {
      const child = this.normalize(await api.forkSession(parent, atMessage));
      this.sessions.set(child.id, child);
      this.summaries.push({
        id: child.id, system_prompt: child.system_prompt, created: child.created, num_messages: child.messages.length,
        preview: (child.messages[0] && child.messages[0].content.slice(0, 80)) || "",
      });
      await this.open(child.id);
      this.refreshList();
      toast(`Forked at message ${atMessage}: the new chat shares the cached prefix.`, "info");
      if (editText !== null) {
        this.input.value = editText;
        this.autosize();
        this.input.focus();
      }
    } catch (e) {
      toast(`Could not fork the chat: ${errorMessage(e)}`);
    }
  }

  async copy(text, btn) {
    try {
      await navigator.clipboard.writeText(text);
      const old = btn.textContent;
      btn.textContent = "Copied";
      setTimeout(() => (btn.textContent = old), 1200);
    } catch {
      toast("Copy failed: the browser denied clipboard access.");
    }
  }

  /** After a reconnect: reload the list and the open chat, which the server may have changed. */
  async onReconnected() {
    await this.refreshList();
    if (this.currentId !== null) await this.turns.resync(this.currentId);
  }
}
