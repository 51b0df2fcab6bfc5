// A small, safe Markdown subset for assistant messages, built only from DOM nodes and textContent —
// never innerHTML — so model or user text can't inject markup. Supports fenced code blocks (an
// unclosed fence runs to the end, which is what a streaming reply looks like mid-block), headings,
// lists, block quotes, paragraphs and inline code/bold/italic/links (http, https and mailto only).

const FENCE = /^\s{0,3}(`{3,}|~{3,})\s*([\w+#.-]*)\s*$/;
const HEADING = /^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const BULLET = /^\s*[-*+]\s+(.*)$/;
const ORDERED = /^\s*(\d{1,9})[.)]\s+(.*)$/;
const QUOTE = /^\s{0,3}>\s?(.*)$/;
const INLINE = /(`+)([\s\S]*?[^`]|[^`])\1(?!`)|\*\*(?=\S)([\s\S]*?\S)\*\*|(?<![\w*])\*(?=\S)([^*]*?\S)\*(?![\w*])|(?<!\w)_(?=\S)([^_]*?\S)_(?!\w)|\[([^\]\n]+)\]\(((?:https?:\/\/|mailto:)[^\s)]+)\)/;

function el(tag, className) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  return node;
}

/** Append inline-formatted `text` to `parent`. */
export function renderInline(text, parent) {
  let rest = text;
  while (rest.length > 0) {
    const m = INLINE.exec(rest);
    if (!m) {
      parent.append(rest);
      return;
    }
    if (m.index > 0) parent.append(rest.slice(0, m.index));
    if (m[1] !== undefined) {
      const code = el("code");
      // CommonMark: one leading and trailing space are stripped when both are present.
      const body = m[2];
      code.textContent = body.length > 2 && body.startsWith(" ") && body.endsWith(" ") ? body.slice(1, -1) : body;
      parent.append(code);
    } else if (m[3] !== undefined) {
      const b = el("strong");
      renderInline(m[3], b);
      parent.append(b);
    } else if (m[4] !== undefined || m[5] !== undefined) {
      const i = el("em");
      renderInline(m[4] !== undefined ? m[4] : m[5], i);
      parent.append(i);
    } else {
      const a = el("a");
      a.href = m[7];
      a.target = "_blank";
      a.rel = "noopener noreferrer";
      renderInline(m[6], a);
      parent.append(a);
    }
    rest = rest.slice(m.index + m[0].length);
  }
}

function appendLines(lines, parent) {
  lines.forEach((line, i) => {
    if (i > 0) parent.append(el("br"));
    renderInline(line, parent);
  });
}

function codeBlock(lang, lines, open) {
  const wrap = el("div", "code-block");
  const head = el("div", "code-head");
  const label = el("span", "code-lang");
  label.textContent = lang || "code";
  const copy = el("button", "code-copy");
  copy.type = "button";
  copy.textContent = "Copy";
  copy.setAttribute("aria-label", `Copy ${lang || "code"} block`);
  head.append(label, copy);
  const pre = el("pre");
  const code = el("code");
  if (lang) code.dataset.lang = lang;
  code.textContent = lines.join("\n");
  pre.append(code);
  pre.tabIndex = 0; // wide blocks scroll horizontally; keyboard users need to reach them
  if (open) wrap.classList.add("code-open");
  wrap.append(head, pre);
  return wrap;
}

/** Render `text` into a DocumentFragment. */
export function renderMarkdown(text) {
  const frag = document.createDocumentFragment();
  const lines = String(text).replace(/\r\n?/g, "\n").split("\n");
  let i = 0;
  let para = [];
  const flushPara = () => {
    if (para.length) {
      const p = el("p");
      appendLines(para, p);
      frag.append(p);
      para = [];
    }
  };
  while (i < lines.length) {
    const line = lines[i];
    const fence = FENCE.exec(line);
    if (fence) {
      flushPara();
      const marker = fence[1];
      const body = [];
      i += 1;
      let closed = false;
      while (i < lines.length) {
        const close = lines[i].trim();
        if (close.startsWith(marker[0].repeat(marker.length)) && /^[`~]+$/.test(close)) {
          closed = true;
          i += 1;
          break;
        }
        body.push(lines[i]);
        i += 1;
      }
      frag.append(codeBlock(fence[2], body, !closed));
      continue;
    }
    if (line.trim() === "") {
      flushPara();
      i += 1;
      continue;
    }
    const heading = HEADING.exec(line);
    if (heading) {
      flushPara();
      const h = el(`h${Math.min(6, heading[1].length + 2)}`, "md-heading");
      renderInline(heading[2], h);
      frag.append(h);
      i += 1;
      continue;
    }
    if (BULLET.test(line) || ORDERED.test(line)) {
      flushPara();
      const ordered = !BULLET.test(line);
      const re = ordered ? ORDERED : BULLET;
      const list = el(ordered ? "ol" : "ul");
      if (ordered) {
        const start = Number(ORDERED.exec(line)[1]);
        if (start !== 1) list.start = start;
      }
      let item = null;
      while (i < lines.length && lines[i].trim() !== "" && !FENCE.test(lines[i])) {
        const m = re.exec(lines[i]);
        if (m) {
          item = el("li");
          renderInline(ordered ? m[2] : m[1], item);
          list.append(item);
        } else if ((ordered ? BULLET : ORDERED).test(lines[i])) {
          break;
        } else {
          item.append(el("br"));
          renderInline(lines[i].trim(), item); // lazy continuation line
        }
        i += 1;
      }
      frag.append(list);
      continue;
    }
    if (QUOTE.test(line)) {
      flushPara();
      const quoted = [];
      while (i < lines.length && QUOTE.test(lines[i])) {
        quoted.push(QUOTE.exec(lines[i])[1]);
        i += 1;
      }
      const bq = el("blockquote");
      bq.append(renderMarkdown(quoted.join("\n")));
      frag.append(bq);
      continue;
    }
    para.push(line);
    i += 1;
  }
  flushPara();
  return frag;
}
