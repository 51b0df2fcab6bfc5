// The chat controller: owns the client-side state (session summaries, loaded sessions, generations in
// flight keyed by gen_id) and turns user actions and WebSocket frames into state changes and renders.
// Invariants: at most one generation per session (the server's rule too); a generation's assistant
// message is `streaming` from the moment it is sent until its `done`, `error`, or the connection drops;
// every failure ends visibly, in the message or as a toast.

import { api } from "./api.js";
import { renderConversation, updateMessage } from "./messages.js";
import { SettingsPanel } from "./settings.js";
import { Sidebar } from "./sidebar.js";
import { errorMessage, h, newId, toast } from "./ui.js";

const CURRENT_KEY = "radixserve.currentSession";
const LOADING_RETRIES = 60;
const LOADING_RETRY_MS = 2000;

export class ChatController {
  /** @param {import("./socket.js").ChatSocket} socket */
  constructor(socket) {
    this.socket = socket;
    this.summaries = [];
    this.sessions = new Map(); // id -> {id, system_prompt, messages, num_tokens, created, sampling}
    this.gens = new Map(); // gen_id -> {sessionId, msg}
    this.busy = new Map(); // session id -> gen_id
    this.currentId = null; // null = unsaved draft
    this.draftPrompt = "";
    this.renderQueued = new Set();
    this.loadToken = 0;
    this.lastListError = "";

    this.messagesEl = document.getElementById("messages");
    this.input = document.getElementById("composer-input");
    this.form = document.getElementById("composer");
    this.sendBtn = document.getElementById("send-btn");
    this.stopBtn = document.getElementById("stop-btn");
    this.msgHandlers = { fork: (at, text) => this.fork(at, text), copy: (text, btn) => this.copy(text, btn) };

    this.sidebar = new Sidebar({ open: (id) => this.open(id), remove: (id) => this.remove(id) });
    this.settings = new SettingsPanel({
      promptEdited: (text) => (this.draftPrompt = text),
      applyPrompt: (text) => this.newChat(text),
    });
    this.draftPrompt = this.settings.storedPrompt();

    document.getElementById("new-chat").addEventListener("click", () => this.newChat(this.settings.storedPrompt()));
    this.form.addEventListener("submit", (ev) => {
      ev.preventDefault();
      this.send();
    });
    this.input.addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
        ev.preventDefault();
        this.send();
      }
    });
    this.input.addEventListener("input", () => this.autosize());
    this.stopBtn.addEventListener("click", () => this.stop());
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
    this.sidebar.render(this.summaries, this.currentId, new Set(this.busy.keys()));
  }

  showCurrent() {
    const session = this.current();
    const messages = session ? session.messages : [];
    const empty = h("div", { className: "empty-chat" }, [
      h("h1", { textContent: session ? "No messages yet" : "Start a conversation" }),
      h("p", { textContent: "Replies stream in token by token. Each reply shows how many prompt tokens came from the prefix cache." }),
    ]);
    renderConversation(this.messagesEl, messages, this.msgHandlers, empty);
    this.settings.showSession(session, this.draftPrompt);
    this.renderSidebar();
    this.syncComposer();
  }

  syncComposer() {
    const busy = this.currentId !== null && this.busy.has(this.currentId);
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
    if (!this.busy.has(id) || force) {
      try {
        const session = this.normalize(await api.getSession(id));
        if (this.busy.has(id)) return; // a generation started meanwhile; its local state is newer
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

  async send() {
    const content = this.input.value.trim();
    if (!content) return;
    if (this.currentId !== null && this.busy.has(this.currentId)) return;
    const sampling = this.settings.sampling();
    if (!sampling) {
      toast("Max tokens must be a whole number of at least 1.");
      this.settings.maxTokens.focus();
      return;
    }
    if (!this.socket.isOpen) {
      toast("Not connected to the server — the message was not sent. It stays in the box; try again once connected.");
      return;
    }
    this.input.value = "";
    this.autosize();
    let session = this.current();
    if (!session) {
      try {
        session = this.normalize(await api.createSession(this.draftPrompt, sampling));
      } catch (e) {
        this.input.value = content;
        toast(`Could not create the chat: ${errorMessage(e)}`);
        return;
      }
      this.sessions.set(session.id, session);
      this.summaries.push({ id: session.id, system_prompt: session.system_prompt, created: session.created, num_messages: 0, preview: content.slice(0, 80) });
      this.currentId = session.id;
      this.remember(session.id);
    }
    const genId = newId();
    const user = { role: "user", content };
    const reply = { role: "assistant", content: "", streaming: true, genId };
    session.messages.push(user, reply);
    this.gens.set(genId, { sessionId: session.id, msg: reply, user });
    this.busy.set(session.id, genId);
    this.showCurrent();
    try {
      this.socket.send({ type: "chat", session_id: session.id, content, gen_id: genId, sampling });
    } catch (e) {
      this.finish(genId, { error: errorMessage(e) });
    }
  }

  stop() {
    const genId = this.currentId !== null ? this.busy.get(this.currentId) : undefined;
    if (!genId) return;
    try {
      this.socket.send({ type: "cancel", gen_id: genId });
      this.stopBtn.disabled = true;
      setTimeout(() => (this.stopBtn.disabled = false), 1500);
    } catch (e) {
      toast(`Could not stop: ${errorMessage(e)}`);
    }
  }

  // ---- server frames -------------------------------------------------------------------------

  handleFrame(f) {
    const gen = typeof f.gen_id === "string" ? this.gens.get(f.gen_id) : undefined;
    switch (f.type) {
      case "start":
        if (!gen) return;
        gen.msg.start = { prompt_tokens: f.prompt_tokens, cached_tokens: f.cached_tokens };
        this.queueRender(gen);
        return;
      case "delta":
        if (!gen) return;
        if (typeof f.text !== "string") {
          toast("The server sent a delta frame without text.");
          return;
        }
        gen.msg.content += f.text;
        this.queueRender(gen);
        return;
      case "done":
        if (!gen) return;
        this.finish(f.gen_id, { done: f });
        return;
      case "error": {
        const text = `${f.message || "Server error"} (${f.code || "error"})`;
        if (gen) this.finish(f.gen_id, { error: text, code: f.code });
        else toast(`Server error: ${text}`);
        return;
      }
      case "_disconnected":
        for (const genId of [...this.gens.keys()]) {
          this.finish(genId, { error: "The connection dropped, so the server stopped this reply." });
        }
        return;
      case "auth.ok":
      case "session.created":
      case "session.resumed":
        return;
      default:
        toast(`The server sent an unknown frame type "${String(f.type).slice(0, 40)}".`);
    }
  }

  queueRender(gen) {
    if (this.renderQueued.has(gen)) return;
    this.renderQueued.add(gen);
    requestAnimationFrame(() => {
      this.renderQueued.delete(gen);
      if (gen.sessionId === this.currentId) updateMessage(this.messagesEl, gen.msg, this.msgHandlers);
    });
  }

  finish(genId, { done, error, code }) {
    const gen = this.gens.get(genId);
    if (!gen) return;
    this.gens.delete(genId);
    if (this.busy.get(gen.sessionId) === genId) this.busy.delete(gen.sessionId);
    const msg = gen.msg;
    msg.streaming = false;
    const session = this.sessions.get(gen.sessionId);
    if (done) {
      msg.finish_reason = done.finish_reason;
      msg.usage = done.usage;
      msg.timing = done.timing;
      if (Number.isInteger(done.message_index)) {
        msg.index = done.message_index;
        gen.user.index = done.message_index - 1;
      }
      if (session && Number.isFinite(done.usage && done.usage.prompt_tokens)) {
        session.num_tokens = done.usage.prompt_tokens + (done.usage.completion_tokens || 0);
      }
      const summary = this.summaries.find((s) => s.id === gen.sessionId);
      if (summary && session) summary.num_messages = session.messages.length;
    } else {
      msg.error = error;
      if (code === "unknown_session") this.refreshList();
      // The server may or may not have kept this turn; reload the session so indices stay true.
      if (session) this.resync(gen.sessionId);
    }
    if (gen.sessionId === this.currentId) this.showCurrent();
    else this.renderSidebar();
  }

  /**
   * Reload a session from the server after a turn failed. The server may or may not have recorded
   * the failed turn; either way the error stays visible and indices match the server's.
   */
  async resync(id) {
    if (this.busy.has(id)) return;
    try {
      const fresh = this.normalize(await api.getSession(id));
      const local = this.sessions.get(id);
      if (!local || this.busy.has(id)) return;
      const known = local.messages.filter((m) => Number.isInteger(m.index)).length;
      const pending = local.messages.filter((m) => !Number.isInteger(m.index));
      const failure = pending.find((m) => m.error);
      if (fresh.messages.length > known) {
        const last = fresh.messages[fresh.messages.length - 1];
        if (failure && last.role === "assistant") last.error = failure.error;
        else if (failure) fresh.messages.push({ role: "assistant", content: "", error: failure.error });
      } else {
        fresh.messages.push(...pending);
      }
      this.sessions.set(id, fresh);
      if (id === this.currentId) this.showCurrent();
    } catch (e) {
      if (e.code === "unknown_session") this.refreshList();
    }
  }

  /** After a reconnect: reload the list and the open chat, which the server may have changed. */
  async onReconnected() {
    await this.refreshList();
    if (this.currentId !== null) await this.resync(this.currentId);
  }
}
