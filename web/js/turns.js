// Chat turns: sending a message (or the results of the last reply's tool calls), the generation's
// WebSocket frames (start, delta — text, or a thinking model's `reasoning` — tool_call, done, error),
// stopping it, and reconciling with the server when a turn fails. Invariants: at most one generation
// per session (the server's rule too); a generation's assistant message is `streaming` from the
// moment it is sent until its `done`, its `error`, or the connection drops — then it always ends
// visibly, in the message itself. Deltas are rendered at most once per animation frame.

import { api } from "./api.js";
import { updateMessage } from "./messages.js";
import { errorMessage, newId, toast } from "./ui.js";

const ANNOUNCE_CHARS = 600;

function announce(text) {
  document.getElementById("announcer").textContent = text;
}

export class Turns {
  /**
   * @param {import("./chat.js").ChatController} chat
   * @param {import("./socket.js").ChatSocket} socket
   */
  constructor(chat, socket) {
    this.chat = chat;
    this.socket = socket;
    this.gens = new Map(); // gen_id -> {sessionId, msg, inputs: the user or tool messages it answers}
    this.busy = new Map(); // session id -> gen_id in flight
    this.renderQueued = new Set();
    this.sending = false;
  }

  async send() {
    if (this.sending) return; // a second Enter while the new session is being created
    this.sending = true;
    try {
      await this.sendCurrent();
    } finally {
      this.sending = false;
    }
  }

  async sendCurrent() {
    const chat = this.chat;
    const content = chat.input.value.trim();
    if (!content) return;
    if (chat.currentId !== null && this.busy.has(chat.currentId)) return;
    const sampling = chat.settings.sampling();
    if (!sampling) {
      toast("Max tokens must be a whole number of at least 1.");
      chat.settings.maxTokens.focus();
      return;
    }
    if (!this.socket.isOpen) {
      toast("Not connected to the server — the message was not sent. It stays in the box; try again once connected.");
      return;
    }
    // a new chat's tools (settings, JSON): like its system prompt, fixed once it exists
    const tools = chat.current() ? null : chat.settings.tools();
    if (tools === undefined) {
      toast("Tools must be a JSON array of OpenAI tools, or empty.");
      chat.settings.toolsInput.focus();
      return;
    }
    chat.input.value = "";
    chat.autosize();
    let session = chat.current();
    if (!session) {
      try {
        session = chat.normalize(await api.createSession(chat.draftPrompt, sampling, tools));
      } catch (e) {
        chat.input.value = content;
        toast(`Could not create the chat: ${errorMessage(e)}`);
        return;
      }
      chat.sessions.set(session.id, session);
      chat.summaries.push({ id: session.id, system_prompt: session.system_prompt, created: session.created, num_messages: 0, preview: content.slice(0, 80) });
      chat.currentId = session.id;
      chat.remember(session.id);
    }
    this.generate(session, [{ role: "user", content }], { content, sampling });
  }

  /** Answer the open chat's last reply's tool calls: [{tool_call_id, content}], then generate the next reply. */
  sendToolResults(results) {
    const chat = this.chat;
    const session = chat.current();
    const sampling = chat.settings.sampling();
    if (!session || this.busy.has(session.id) || !sampling) return;
    if (!this.socket.isOpen) {
      toast("Not connected to the server — the results were not sent; try again once connected.");
      return;
    }
    const inputs = results.map((r) => ({ role: "tool", tool_call_id: r.tool_call_id, content: r.content }));
    this.generate(session, inputs, { tool_results: results, sampling });
  }

  /** Show `inputs` and a streaming reply, then send the chat frame (`fields`: content or tool_results, sampling). */
  generate(session, inputs, fields) {
    const chat = this.chat;
    const genId = newId();
    const reply = { role: "assistant", content: "", streaming: true, genId };
    session.messages.push(...inputs, reply);
    this.gens.set(genId, { sessionId: session.id, msg: reply, inputs });
    this.busy.set(session.id, genId);
    chat.showCurrent();
    chat.messagesEl.scrollTop = chat.messagesEl.scrollHeight; // your own message is always in view
    try {
      this.socket.send({ type: "chat", session_id: session.id, gen_id: genId, ...fields });
    } catch (e) {
      this.finish(genId, { error: errorMessage(e) });
    }
  }

  stop() {
    const { currentId, stopBtn } = this.chat;
    const genId = currentId !== null ? this.busy.get(currentId) : undefined;
    if (!genId) return;
    try {
      this.socket.send({ type: "cancel", gen_id: genId });
      stopBtn.disabled = true;
      setTimeout(() => (stopBtn.disabled = false), 1500);
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
        gen.msg.start = { prompt_tokens: f.prompt_tokens, cached_tokens: f.cached_tokens, host_cached_tokens: f.host_cached_tokens };
        this.queueRender(gen);
        return;
      case "delta":
        if (!gen) return;
        if (typeof f.text !== "string") {
          toast("The server sent a delta frame without text.");
          return;
        }
        gen.msg.content += f.text;
        // a thinking model's reasoning comes as deltas with an empty text and the piece in `reasoning`
        if (typeof f.reasoning === "string") gen.msg.reasoning_content = (gen.msg.reasoning_content || "") + f.reasoning;
        this.queueRender(gen);
        return;
      case "tool_call": {
        // a fragment of a tool call: the first names it (id, name), the rest add argument text
        if (!gen || !Number.isInteger(f.index) || typeof f.arguments !== "string") return;
        const calls = (gen.msg.tool_calls ||= []);
        const call = (calls[f.index] ||= { id: f.id || "", type: "function", function: { name: f.name || "", arguments: "" } });
        call.function.arguments += f.arguments;
        this.queueRender(gen);
        return;
      }
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
      const chat = this.chat;
      if (gen.sessionId === chat.currentId) updateMessage(chat.messagesEl, gen.msg, chat.msgHandlers);
    });
  }

  finish(genId, { done, error, code }) {
    const gen = this.gens.get(genId);
    if (!gen) return;
    this.gens.delete(genId);
    if (this.busy.get(gen.sessionId) === genId) this.busy.delete(gen.sessionId);
    const msg = gen.msg;
    msg.streaming = false;
    const chat = this.chat;
    const session = chat.sessions.get(gen.sessionId);
    if (done) {
      msg.finish_reason = done.finish_reason;
      msg.usage = done.usage;
      msg.timing = done.timing;
      if (Array.isArray(done.tool_calls)) msg.tool_calls = done.tool_calls; // the parsed calls, whole
      if (typeof done.reasoning_content === "string") msg.reasoning_content = done.reasoning_content; // as kept
      if (Number.isInteger(done.message_index)) {
        msg.index = done.message_index;
        gen.inputs.forEach((m, j) => (m.index = done.message_index - gen.inputs.length + j));
      }
      // The session's token count (and, without a message_index, its messages) come from the server.
      if (session) this.resync(gen.sessionId, { messages: !Number.isInteger(done.message_index) });
      const summary = chat.summaries.find((s) => s.id === gen.sessionId);
      if (summary && session) summary.num_messages = session.messages.length;
      // Streamed text is re-rendered per delta, so it is not a live region; announce the finished reply.
      const u = done.usage || {};
      const calls = (msg.tool_calls || []).map((c) => `calls ${c.function.name}`).join(", ");
      const said = [msg.content.slice(0, ANNOUNCE_CHARS), calls].filter(Boolean).join(" — ");
      const thought = Number.isInteger(u.reasoning_tokens) && u.reasoning_tokens > 0 ? ` (after thinking for ${u.reasoning_tokens} tokens)` : "";
      announce(`Assistant${thought}: ${said} — ${u.cached_tokens ?? 0} of ${u.prompt_tokens ?? 0} prompt tokens cached.`);
    } else {
      msg.error = error;
      announce(`Reply failed: ${error}`);
      if (code === "unknown_session") chat.refreshList();
      // The server may or may not have kept this turn; reload the session so indices stay true.
      if (session) this.resync(gen.sessionId);
    }
    if (gen.sessionId === chat.currentId) chat.showCurrent();
    else chat.renderSidebar();
  }

  /**
   * Reload a session from the server, after a turn failed or ended without a message index. The
   * server may or may not have recorded that turn; either way the error stays visible and indices
   * match the server's. With `messages: false` only the session's facts are refreshed.
   */
  async resync(id, { messages = true } = {}) {
    if (this.busy.has(id)) return;
    const chat = this.chat;
    try {
      const fresh = chat.normalize(await api.getSession(id));
      const local = chat.sessions.get(id);
      if (!local || this.busy.has(id)) return;
      if (!messages) {
        local.num_tokens = fresh.num_tokens;
        if (id === chat.currentId) chat.settings.showSession(local, chat.draftPrompt);
        return;
      }
      for (const m of local.messages) {
        // An error shown on a message the server kept stays shown.
        const same = Number.isInteger(m.index) && fresh.messages[m.index];
        if (m.error && same && same.role === m.role) same.error = m.error;
      }
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
      chat.sessions.set(id, fresh);
      if (id === chat.currentId) chat.showCurrent();
    } catch (e) {
      if (e.code === "unknown_session") chat.refreshList();
    }
  }
}
