// Tool calling and JSON in the conversation: an assistant's tool calls (name and pretty-printed
// arguments, with a form to answer them with tool results), tool-result messages, and replies that
// are JSON documents shown pretty-printed in a code block. Everything is built from DOM nodes and
// textContent (never innerHTML): arguments and results are model or user text.

import { renderMarkdown } from "./markdown.js";
import { h } from "./ui.js";

/** `text` parsed, when it is one JSON object or array (what structured output and tools produce); else undefined. */
export function asJson(text) {
  const t = typeof text === "string" ? text.trim() : "";
  if (!(t.startsWith("{") && t.endsWith("}")) && !(t.startsWith("[") && t.endsWith("]"))) return undefined;
  try {
    return JSON.parse(t);
  } catch {
    return undefined;
  }
}

/** `text` pretty-printed when it is JSON, as it is otherwise. */
export function prettyJson(text) {
  const value = asJson(text);
  return value === undefined ? String(text ?? "") : JSON.stringify(value, null, 2);
}

/** A JSON document as a fenced `json` code block (with its copy button). */
export function jsonBlock(text) {
  const body = prettyJson(text);
  const fence = "`".repeat(Math.max(3, ...[...body.matchAll(/`+/g)].map((m) => m[0].length + 1)));
  return renderMarkdown(`${fence}json\n${body}\n${fence}`);
}

/** The ids of `messages`' calls that a later tool message answers. */
export function answeredIds(messages) {
  return new Set(messages.filter((m) => m.role === "tool" && m.tool_call_id).map((m) => m.tool_call_id));
}

/**
 * The tool calls of an assistant message. `answer` (or null when the calls cannot be answered now: the
 * reply is streaming, a later message exists, or the chat is busy) is called with
 * [{tool_call_id, content}] once every unanswered call has a result typed.
 */
export function toolCallsView(msg, answered, answer) {
  const calls = msg.tool_calls || [];
  const wrap = h("div", { className: "tool-calls" });
  const inputs = [];
  calls.forEach((call, i) => {
    const fn = call.function || {};
    const done = answered.has(call.id);
    const card = h("section", {
      className: `tool-call${done ? " tool-call-answered" : ""}`,
      attrs: { "aria-label": `Tool call ${i + 1}: ${fn.name || "?"}` },
      dataset: { callId: call.id || "", name: fn.name || "" },
    }, [
      h("div", { className: "tool-call-head" }, [
        h("span", { className: "tool-call-label", textContent: "Tool call" }),
        h("code", { className: "tool-call-name", textContent: fn.name || "…" }),
        done ? h("span", { className: "chip chip-hit tool-call-state", textContent: "answered" }) : null,
      ]),
      jsonBlock(fn.arguments || ""),
    ]);
    if (!done && answer) {
      const id = `tool-result-${msg.index}-${i}`;
      const input = h("textarea", {
        id, className: "tool-result-input", rows: 3,
        placeholder: '{"result": ...}',
        attrs: { "aria-label": `Result of ${fn.name || "the tool"}` },
      });
      inputs.push({ call, input });
      card.append(h("label", { className: "tool-result-label", textContent: "Result", attrs: { for: id } }), input);
    }
    wrap.append(card);
  });
  if (inputs.length) {
    const send = () => {
      const results = inputs.map(({ call, input }) => ({ tool_call_id: call.id, content: input.value.trim() }));
      const empty = inputs.find((_, k) => !results[k].content);
      if (empty) {
        empty.input.focus();
        empty.input.setAttribute("aria-invalid", "true");
        return;
      }
      answer(results);
    };
    for (const { input } of inputs) {
      input.addEventListener("keydown", (ev) => {
        if (ev.key === "Enter" && (ev.ctrlKey || ev.metaKey)) {
          ev.preventDefault();
          send();
        }
      });
    }
    wrap.append(h("button", {
      type: "button", className: "btn btn-primary btn-tiny act-tool-result",
      textContent: inputs.length > 1 ? "Send results" : "Send result", onclick: send,
    }));
  }
  return wrap;
}

/** The body of a tool-result message: its content, pretty-printed when JSON. */
export function toolResultView(msg) {
  return asJson(msg.content) === undefined
    ? h("pre", { className: "tool-result-text", textContent: msg.content || "" })
    : jsonBlock(msg.content);
}
