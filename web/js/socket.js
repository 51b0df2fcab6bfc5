// The chat WebSocket (GET /v1/chat/ws): one connection, reconnected with capped exponential backoff
// plus jitter after any drop. Owns the connection state the header shows, so it is never optimistic:
// "open" only between the socket's open and close events. A heartbeat ping detects half-open
// connections. Frames that are not JSON objects with a `type` are reported, never dropped silently.
// Session frames carry this browser's owner secret (browsers cannot set headers on a WebSocket).

import { getOwner } from "./api.js";

const BASE_DELAY_MS = 500;
const MAX_DELAY_MS = 15000;
const HEARTBEAT_MS = 20000;
const HEARTBEAT_TIMEOUT_MS = 10000;
const REQUEST_TIMEOUT_MS = 15000;
const SESSION_FRAMES = new Set(["session.create", "session.resume", "chat"]); // need the `owner` field

export class ChatSocket {
  /**
   * @param {{url: () => string, onFrame: (f: object) => void, onState: (s: object) => void,
   *          onBadFrame: (msg: string) => void, onAuthRequired: (msg: string) => void}} opts
   */
  constructor(opts) {
    this.opts = opts;
    this.ws = null;
    this.attempt = 0;
    this.retryTimer = 0;
    this.heartbeatTimer = 0;
    this.livenessTimer = 0;
    this.pending = new Map(); // req id -> {resolve, reject, timer}
    this.nextReq = 1;
    this.authBlocked = false;
    this.state = { name: "idle" };
  }

  setState(name, extra = {}) {
    this.state = { name, ...extra };
    this.opts.onState(this.state);
  }

  get isOpen() {
    return this.ws !== null && this.ws.readyState === WebSocket.OPEN;
  }

  connect() {
    clearTimeout(this.retryTimer);
    if (this.ws) return;
    this.authBlocked = false;
    this.setState(this.attempt === 0 ? "connecting" : "reconnecting", { attempt: this.attempt });
    let ws;
    try {
      ws = new WebSocket(this.opts.url());
    } catch (e) {
      this.scheduleReconnect(`cannot open the WebSocket (${e.message})`);
      return;
    }
    this.ws = ws;
    ws.onopen = () => {
      this.attempt = 0;
      this.setState("open");
      this.startHeartbeat();
    };
    ws.onmessage = (ev) => this.handleMessage(ev.data);
    ws.onclose = (ev) => this.handleClose(ws, ev);
    // onerror is always followed by onclose, which does the bookkeeping.
  }

  /** Skip the remaining backoff wait (the header's "Reconnect now"). */
  reconnectNow() {
    this.attempt = Math.max(this.attempt, 1);
    if (this.ws) this.ws.close(4001, "reconnect");
    else this.connect();
  }

  handleMessage(data) {
    this.markAlive();
    if (typeof data !== "string") {
      this.opts.onBadFrame("The server sent a binary WebSocket frame; expected JSON text.");
      return;
    }
    let frame;
    try {
      frame = JSON.parse(data);
    } catch {
      this.opts.onBadFrame(`The server sent a malformed frame (not JSON): ${data.slice(0, 80)}`);
      return;
    }
    if (!frame || typeof frame !== "object" || Array.isArray(frame) || typeof frame.type !== "string") {
      this.opts.onBadFrame(`The server sent a frame without a type: ${data.slice(0, 80)}`);
      return;
    }
    if (frame.type === "pong") return;
    if (frame.type === "error" && frame.code === "unauthorized") {
      this.authBlocked = true;
      this.opts.onAuthRequired(frame.message || "The server needs an API key.");
    }
    if (frame.req !== undefined && this.pending.has(frame.req)) {
      const p = this.pending.get(frame.req);
      this.pending.delete(frame.req);
      clearTimeout(p.timer);
      if (frame.type === "error") p.reject(Object.assign(new Error(frame.message || frame.code), { code: frame.code }));
      else p.resolve(frame);
      return;
    }
    this.opts.onFrame(frame);
  }

  handleClose(ws, ev) {
    if (ws !== this.ws) return;
    this.ws = null;
    this.stopHeartbeat();
    for (const [, p] of this.pending) {
      clearTimeout(p.timer);
      p.reject(Object.assign(new Error("connection lost"), { code: "disconnected" }));
    }
    this.pending.clear();
    this.opts.onFrame({ type: "_disconnected" });
    if (ev.code === 1008 || this.authBlocked) {
      this.setState("auth");
      this.opts.onAuthRequired(ev.reason || "The server needs an API key.");
      return;
    }
    this.scheduleReconnect(ev.code === 1000 ? "" : `code ${ev.code}${ev.reason ? `: ${ev.reason}` : ""}`);
  }

  scheduleReconnect(reason) {
    this.attempt += 1;
    const exp = Math.min(MAX_DELAY_MS, BASE_DELAY_MS * 2 ** (this.attempt - 1));
    const delay = Math.round(exp * (0.8 + 0.4 * Math.random()));
    this.setState("reconnecting", { attempt: this.attempt, retryAt: Date.now() + delay, reason });
    clearTimeout(this.retryTimer);
    this.retryTimer = setTimeout(() => this.connect(), delay);
  }

  startHeartbeat() {
    this.stopHeartbeat();
    this.heartbeatTimer = setInterval(() => {
      if (!this.isOpen) return;
      this.ws.send(JSON.stringify({ type: "ping" }));
      clearTimeout(this.livenessTimer);
      this.livenessTimer = setTimeout(() => this.ws && this.ws.close(4000, "heartbeat timeout"), HEARTBEAT_TIMEOUT_MS);
    }, HEARTBEAT_MS);
  }

  markAlive() {
    clearTimeout(this.livenessTimer);
  }

  stopHeartbeat() {
    clearInterval(this.heartbeatTimer);
    clearTimeout(this.livenessTimer);
  }

  /** Send a frame; throws when the socket is not open so the caller can tell the user. */
  send(frame) {
    if (!this.isOpen) throw new Error("Not connected to the server — the message was not sent.");
    this.ws.send(JSON.stringify(SESSION_FRAMES.has(frame.type) ? { ...frame, owner: getOwner() } : frame));
  }

  /** Send a frame carrying a fresh `req` and resolve with the server's reply to it. */
  request(frame) {
    const req = this.nextReq++;
    return new Promise((resolve, reject) => {
      try {
        this.send({ ...frame, req });
      } catch (e) {
        reject(e);
        return;
      }
      const timer = setTimeout(() => {
        this.pending.delete(req);
        reject(new Error(`No reply to ${frame.type} within ${REQUEST_TIMEOUT_MS / 1000} s`));
      }, REQUEST_TIMEOUT_MS);
      this.pending.set(req, { resolve, reject, timer });
    });
  }
}
