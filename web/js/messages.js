// Renders one conversation: user and assistant turns, the live streaming turn, and each assistant
// turn's cache figures (prompt tokens, cached tokens and %, the part loaded back from the host-memory
// tier when there is one, TTFT, tokens/s, output tokens and, when speculative decoding drafted for
// it, how many of them were accepted drafts and from which sources), a thinking model's reasoning in a
// collapsible block above the answer (thinking_view.js), an assistant's tool calls and the tool
// results answering them, and JSON replies pretty-printed (tools_view.js). Message objects
// are plain data owned by the chat controller; this module keeps a WeakMap from message to its
// element so a streamed delta re-renders only its own bubble.

import { icon } from "./icons.js";
import { renderMarkdown } from "./markdown.js";
import { hasReasoning, stillThinking, thinkingView } from "./thinking_view.js";
import { asJson, jsonBlock, toolCallsView, toolResultView } from "./tools_view.js";
import { fmtInt, fmtMs, fmtPct, fmtRate, h } from "./ui.js";

const nodes = new WeakMap();

function chip(cls, label, value, title) {
  return h("span", { className: `chip ${cls}`, title: title || "", dataset: { value: String(value ?? "") } }, [
    h("span", { className: "chip-label", textContent: label }),
    h("span", { className: "chip-value", textContent: "" }),
  ]);
}

function setChip(node, text) {
  node.querySelector(".chip-value").textContent = text;
}

function metaFor(msg) {
  const meta = h("div", { className: "msg-meta" });
  const usage = msg.usage || msg.start || null;
  if (usage && Number.isFinite(usage.prompt_tokens)) {
    const p = chip("meta-prompt", "prompt", usage.prompt_tokens, "Tokens in the prompt, history included");
    setChip(p, `${fmtInt(usage.prompt_tokens)} tok`);
    const ratio = usage.prompt_tokens > 0 ? usage.cached_tokens / usage.prompt_tokens : NaN;
    const c = chip("meta-cached", "cached", usage.cached_tokens, "Prompt tokens served from the radix prefix cache");
    setChip(c, `${fmtInt(usage.cached_tokens)} (${fmtPct(ratio)})`);
    if (usage.cached_tokens > 0) c.classList.add("chip-hit");
    meta.append(p, c);
    if (usage.host_cached_tokens > 0) {
      const host = chip("meta-host", "from host", usage.host_cached_tokens, "Cached prompt tokens loaded back from the host-memory tier");
      setChip(host, `${fmtInt(usage.host_cached_tokens)} tok`);
      meta.append(host);
    }
  }
  const t = msg.timing;
  if (t) {
    const ttft = chip("meta-ttft", "TTFT", t.ttft_ms, "Time to first token, queueing included");
    setChip(ttft, fmtMs(t.ttft_ms));
    const tps = chip("meta-tps", "speed", t.tokens_per_s, "Decode speed after the first token");
    setChip(tps, fmtRate(t.tokens_per_s));
    meta.append(ttft, tps);
  }
  if (msg.usage && Number.isFinite(msg.usage.completion_tokens)) {
    const out = chip("meta-completion", "output", msg.usage.completion_tokens, "Generated tokens");
    setChip(out, `${fmtInt(msg.usage.completion_tokens)} tok`);
    meta.append(out);
  }
  const drafted = draftedChip(msg.usage);
  if (drafted) meta.append(drafted);
  if (msg.finish_reason === "length" || msg.finish_reason === "abort") {
    const why = msg.finish_reason === "length" ? "hit max tokens" : "stopped";
    meta.append(h("span", { className: `chip chip-finish finish-${msg.finish_reason}`, textContent: why, dataset: { value: msg.finish_reason } }));
  }
  return meta;
}

/**
 * "32 of 80 tok (tree)": the reply's tokens that were accepted drafts, of all it generated, and the
 * sources that gave them, most first (usage.speculation, docs/protocol.md). Null when nothing was
 * drafted for it; drafts proposed but none kept still show, as "0 of 80 tok".
 */
function draftedChip(usage) {
  const spec = usage && usage.speculation;
  if (!spec || !Number.isFinite(spec.proposed) || spec.proposed <= 0) return null;
  const accepted = Number.isFinite(spec.accepted) ? spec.accepted : 0;
  const sources = Object.entries(spec.by_source || {}).filter(([, c]) => c && c.accepted > 0)
    .sort((a, b) => b[1].accepted - a[1].accepted);
  const node = chip("meta-drafted", "drafted", accepted,
    "Generated tokens that were accepted drafts of speculative decoding — " +
    Object.entries(spec.by_source || {}).map(([s, c]) => `${s}: ${fmtInt(c.accepted)} of ${fmtInt(c.proposed)} drafted tokens accepted`).join("; "));
  node.dataset.sources = sources.map(([s]) => s).join(",");
  const where = sources.length ? ` (${sources.map(([s]) => s).join(", ")})` : "";
  setChip(node, `${fmtInt(accepted)} of ${fmtInt(usage.completion_tokens)} tok${where}`);
  if (accepted > 0) node.classList.add("chip-hit");
  return node;
}

function bodyFor(msg, handlers) {
  const body = h("div", { className: "msg-body" });
  if (msg.role === "assistant") {
    if (hasReasoning(msg)) body.append(thinkingView(msg));
    // a finished reply that is one JSON document (structured output) is shown pretty-printed
    if (msg.content) body.append(!msg.streaming && asJson(msg.content) !== undefined ? jsonBlock(msg.content) : renderMarkdown(msg.content));
    if (msg.tool_calls && msg.tool_calls.length) {
      const state = handlers.toolState ? handlers.toolState(msg) : { answered: new Set(), answer: null };
      body.append(toolCallsView(msg, state.answered, state.answer));
    }
    if (msg.streaming && !stillThinking(msg)) { // while it thinks, the caret is in the Thinking block
      if (!msg.content && !hasReasoning(msg)) {
        body.append(h("span", { className: "msg-pending", textContent: msg.start ? "Thinking…" : "Waiting for the server…" }));
      }
      body.append(h("span", { className: "cursor", attrs: { "aria-hidden": "true" } }));
    }
  } else if (msg.role === "tool") {
    body.append(toolResultView(msg));
  } else {
    body.textContent = msg.content;
  }
  if (msg.error) body.append(h("p", { className: "msg-error", attrs: { role: "alert" }, textContent: msg.error }));
  return body;
}

function actionsFor(msg, handlers) {
  const actions = h("div", { className: "msg-actions" });
  if (msg.streaming || !Number.isInteger(msg.index)) return actions;
  if (msg.role === "assistant") {
    actions.append(h("button", {
      type: "button", className: "btn btn-ghost btn-tiny act-fork",
      attrs: { "aria-label": `Fork the chat after message ${msg.index + 1}` },
      onclick: () => handlers.fork(msg.index + 1, null),
    }, [icon("fork"), "Fork from here"]));
    actions.append(h("button", {
      type: "button", className: "btn btn-ghost btn-tiny act-copy",
      attrs: { "aria-label": "Copy this reply" },
      onclick: (ev) => handlers.copy(msg.content || JSON.stringify(msg.tool_calls || [], null, 2), ev.currentTarget.lastChild),
    }, [icon("copy"), h("span", { textContent: "Copy" })]));
  } else if (msg.role === "user") {
    actions.append(h("button", {
      type: "button", className: "btn btn-ghost btn-tiny act-edit",
      attrs: { "aria-label": `Edit message ${msg.index + 1} in a new fork` },
      onclick: () => handlers.fork(msg.index, msg.content),
    }, [icon("edit"), "Edit in a fork"]));
  }
  return actions;
}

function build(msg, handlers) {
  const role = msg.role === "assistant" ? "Assistant" : msg.role === "user" ? "You" : msg.role === "tool" ? "Tool result" : msg.role;
  const article = h("article", {
    className: `msg msg-${msg.role}${msg.streaming ? " msg-streaming" : ""}${msg.error ? " msg-failed" : ""}`,
    attrs: { "aria-label": `${role} message`, "aria-busy": msg.streaming ? "true" : "false" },
    dataset: msg.genId ? { genId: msg.genId } : {},
  }, [h("div", { className: "msg-role", textContent: role }), bodyFor(msg, handlers)]);
  if (msg.role === "assistant") article.append(metaFor(msg));
  article.append(actionsFor(msg, handlers));
  nodes.set(msg, article);
  return article;
}

function isPinned(container) {
  return container.scrollHeight - container.scrollTop - container.clientHeight < 80;
}

/**
 * Rebuild the whole conversation (`empty` is shown when there are no messages). Scrolls to the end
 * for a newly opened chat, or when the reader was already at the end; otherwise keeps their place.
 */
export function renderConversation(container, messages, handlers, empty, { opened = true } = {}) {
  const pinned = opened || isPinned(container);
  const top = container.scrollTop;
  container.replaceChildren(...(messages.length ? messages.map((m) => build(m, handlers)) : [empty]));
  container.scrollTop = pinned ? container.scrollHeight : top;
}

/**
 * Re-render one message in place (if it is on screen), keeping the view pinned to the bottom, and the
 * keyboard focus on its Thinking toggle when it was there.
 */
export function updateMessage(container, msg, handlers) {
  const old = nodes.get(msg);
  if (!old || !old.isConnected) return;
  const pinned = isPinned(container);
  const focused = document.activeElement;
  const keepFocus = focused && old.contains(focused) && focused.matches(".thinking-summary");
  const fresh = build(msg, handlers);
  old.replaceWith(fresh);
  const summary = keepFocus ? fresh.querySelector(".thinking-summary") : null;
  if (summary) summary.focus({ preventScroll: true });
  if (pinned) container.scrollTop = container.scrollHeight;
}
