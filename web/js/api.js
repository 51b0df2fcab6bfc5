// REST client for the session/cache endpoints of docs/protocol.md.
// Owns the API key (kept in sessionStorage, tab-scoped) and the session owner secret (kept in
// localStorage, so a reload or another tab sees the same chats; the server shows each owner only
// its own sessions), and turns every failure — network error, non-2xx status, body that is not the
// JSON the protocol promises — into an ApiError with a readable message, so callers never fail silently.

const KEY_STORAGE = "radixserve.apiKey";
const OWNER_STORAGE = "radixserve.owner";
const OWNER_HEADER = "X-Session-Owner";
const OWNER_SECRET = /^[A-Za-z0-9_.~+/=-]{22,256}$/; // the server's accepted form (>= 128 bits); a shorter stored one is replaced
let memoryOwner = ""; // when storage is disabled: the chats last as long as the page

export class ApiError extends Error {
  constructor(code, message, status = 0) {
    super(message);
    this.name = "ApiError";
    this.code = code;
    this.status = status;
  }
}

let authRequiredHandler = () => {};

export function onAuthRequired(handler) {
  authRequiredHandler = handler;
}

export function getApiKey() {
  try {
    return sessionStorage.getItem(KEY_STORAGE) || "";
  } catch {
    return "";
  }
}

export function setApiKey(key) {
  try {
    if (key) sessionStorage.setItem(KEY_STORAGE, key);
    else sessionStorage.removeItem(KEY_STORAGE);
  } catch {
    /* storage disabled: the key lives only as long as this call chain */
  }
}

/** A fresh 32-byte secret, URL-safe base64 (what the server mints too). */
function mintOwner() {
  const bytes = crypto.getRandomValues(new Uint8Array(32));
  return btoa(String.fromCharCode(...bytes)).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

/** This browser's session owner secret, made on first use and kept in localStorage. */
export function getOwner() {
  let stored = "";
  try {
    stored = localStorage.getItem(OWNER_STORAGE) || "";
  } catch {
    /* storage disabled: fall back to memoryOwner */
  }
  if (OWNER_SECRET.test(stored)) return stored;
  if (!memoryOwner) memoryOwner = mintOwner();
  try {
    localStorage.setItem(OWNER_STORAGE, memoryOwner);
  } catch {
    /* memoryOwner keeps it for this page */
  }
  return memoryOwner;
}

function describe(method, path) {
  return `${method} ${path.split("?")[0]}`;
}

async function readError(res, what) {
  const text = await res.text().catch(() => "");
  try {
    const body = JSON.parse(text);
    const err = body && body.error;
    if (err && typeof err.message === "string") {
      return new ApiError(String(err.code || "http_" + res.status), err.message, res.status);
    }
  } catch {
    /* fall through to a generic message */
  }
  const snippet = text.trim().slice(0, 120);
  return new ApiError("http_" + res.status, `${what} failed: HTTP ${res.status}${snippet ? ` — ${snippet}` : ""}`, res.status);
}

/**
 * Fetch `path` and return its parsed JSON (or null for 204). `expect` ("json" | "text") picks the body kind.
 * Throws ApiError for every failure.
 */
export async function apiFetch(path, { method = "GET", body, expect = "json", signal } = {}) {
  const what = describe(method, path);
  const headers = {};
  const key = getApiKey();
  if (key) headers["Authorization"] = `Bearer ${key}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  if (path.startsWith("/v1/sessions")) headers[OWNER_HEADER] = getOwner();
  let res;
  try {
    res = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body), signal });
  } catch (e) {
    if (e && e.name === "AbortError") throw e;
    throw new ApiError("network", `${what}: cannot reach the server (${e && e.message ? e.message : e})`);
  }
  if (res.status === 401) {
    authRequiredHandler(key ? "The API key was rejected." : "");
    throw await readError(res, what);
  }
  if (!res.ok) throw await readError(res, what);
  if (res.status === 204) return null;
  const text = await res.text();
  if (expect === "text") return text;
  try {
    return JSON.parse(text);
  } catch {
    throw new ApiError("bad_response", `${what}: the server sent a malformed reply (not JSON)`, res.status);
  }
}

/** Throw a readable ApiError unless `cond` holds; used to validate reply shapes. */
export function expectShape(cond, what) {
  if (!cond) throw new ApiError("bad_response", `${what}: the server sent a reply of an unexpected shape`);
}

export const api = {
  async listSessions() {
    const r = await apiFetch("/v1/sessions");
    expectShape(r && Array.isArray(r.sessions), "GET /v1/sessions");
    return r.sessions;
  },
  async getSession(id) {
    const r = await apiFetch(`/v1/sessions/${encodeURIComponent(id)}`);
    expectShape(r && typeof r.id === "string" && Array.isArray(r.messages), "GET /v1/sessions/{id}");
    return r;
  },
  async createSession(systemPrompt, sampling, tools = null) {
    const body = { sampling };
    if (systemPrompt) body.system_prompt = systemPrompt;
    if (tools && tools.length) body.tools = tools;
    const r = await apiFetch("/v1/sessions", { method: "POST", body });
    expectShape(r && typeof r.id === "string", "POST /v1/sessions");
    return r;
  },
  async forkSession(id, atMessage) {
    const r = await apiFetch(`/v1/sessions/${encodeURIComponent(id)}/fork`, { method: "POST", body: { at_message: atMessage } });
    expectShape(r && typeof r.id === "string", "POST /v1/sessions/{id}/fork");
    return r;
  },
  async deleteSession(id) {
    await apiFetch(`/v1/sessions/${encodeURIComponent(id)}`, { method: "DELETE" });
  },
  async cacheStats() {
    const r = await apiFetch("/v1/cache/stats");
    expectShape(r && typeof r === "object" && r.blocks && typeof r.blocks === "object", "GET /v1/cache/stats");
    return r;
  },
  async metricsText() {
    return apiFetch("/metrics", { expect: "text" });
  },
};
