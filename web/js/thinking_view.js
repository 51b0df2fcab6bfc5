// The "Thinking" block of a thinking model's reply: its reasoning in a <details> above the answer —
// while it streams, the `delta` frames' `reasoning` pieces; once kept, the message's
// `reasoning_content` — with the reasoning's token count (usage.reasoning_tokens) when the server
// has sent it. Open while the model thinks, collapsed once the answer (text or tool calls) starts; a
// reader's own opening or closing wins over that. A streaming reply's bubble is rebuilt every frame,
// so the reader's choice lives on the message (`thinkingOpen`), not in the DOM.

import { renderMarkdown } from "./markdown.js";
import { fmtInt, h } from "./ui.js";

/** Whether `msg` carries reasoning to show (a non-thinking model's replies carry none). */
export function hasReasoning(msg) {
  return typeof msg.reasoning_content === "string" && msg.reasoning_content.length > 0;
}

function answerStarted(msg) {
  return Boolean(msg.content) || Boolean(msg.tool_calls && msg.tool_calls.length);
}

/** Whether `msg` is streaming its reasoning and no answer yet (the streaming caret is then in the block). */
export function stillThinking(msg) {
  return Boolean(msg.streaming) && hasReasoning(msg) && !answerStarted(msg);
}

/** The reasoning tokens of a finished reply, or null when not known (still streaming, or an old reply). */
export function reasoningTokens(msg) {
  const n = msg.usage && msg.usage.reasoning_tokens;
  return Number.isInteger(n) ? n : null;
}

/** The block for `msg` (which hasReasoning). */
export function thinkingView(msg) {
  const thinking = stillThinking(msg);
  // a reply that ended with no answer (cut by max tokens, stopped) is all reasoning: left open
  const open = typeof msg.thinkingOpen === "boolean" ? msg.thinkingOpen : !answerStarted(msg);
  const tokens = reasoningTokens(msg);
  const summary = h("summary", { className: "thinking-summary" }, [
    h("span", { className: "thinking-label", textContent: thinking ? "Thinking…" : "Thinking" }),
    tokens === null ? null : h("span", {
      className: "thinking-tokens", dataset: { value: String(tokens) },
      textContent: `${fmtInt(tokens)} ${tokens === 1 ? "token" : "tokens"}`,
    }),
  ]);
  const body = h("div", { className: "thinking-body" }, [renderMarkdown(msg.reasoning_content)]);
  if (thinking) body.append(h("span", { className: "cursor", attrs: { "aria-hidden": "true" } }));
  const details = h("details", { className: `thinking${thinking ? " thinking-live" : ""}`, open }, [summary, body]);
  // a click (or Enter / Space on the focused summary) toggles after this runs: remember where it goes
  summary.addEventListener("click", () => (msg.thinkingOpen = !details.open));
  return details;
}
