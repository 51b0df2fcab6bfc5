// Inline SVG icons (drawn here, stroke-based, 24x24) so the UI never depends on emoji or symbol
// fonts being installed. `decorate(root)` fills every [data-icon] element's leading icon.

const SVG_NS = "http://www.w3.org/2000/svg";

const SHAPES = {
  plus: [["path", { d: "M12 5v14M5 12h14" }]],
  menu: [["path", { d: "M4 6h16M4 12h16M4 18h16" }]],
  close: [["path", { d: "M6 6l12 12M18 6L6 18" }]],
  trash: [["path", { d: "M4 7h16M10 11v6M14 11v6M6 7l1 13h10l1-13M9 7V4h6v3" }]],
  sliders: [
    ["path", { d: "M4 6h9M17 6h3M4 12h3M11 12h9M4 18h11M19 18h1" }],
    ["circle", { cx: 15, cy: 6, r: 2 }], ["circle", { cx: 9, cy: 12, r: 2 }], ["circle", { cx: 17, cy: 18, r: 2 }],
  ],
  stop: [["rect", { x: 6, y: 6, width: 12, height: 12, rx: 2, fill: "currentColor" }]],
  fork: [
    ["circle", { cx: 6, cy: 5, r: 2 }], ["circle", { cx: 18, cy: 5, r: 2 }], ["circle", { cx: 12, cy: 19, r: 2 }],
    ["path", { d: "M6 7v2a3 3 0 0 0 3 3h6a3 3 0 0 0 3-3V7M12 12v5" }],
  ],
  edit: [["path", { d: "M4 20h4L19 9l-4-4L4 16v4zM13 7l4 4" }]],
  copy: [["rect", { x: 9, y: 9, width: 11, height: 11, rx: 2 }], ["path", { d: "M15 5V4H4v11h1" }]],
  send: [["path", { d: "M5 12h14M13 6l6 6-6 6" }]],
};

export function icon(name) {
  const svg = document.createElementNS(SVG_NS, "svg");
  svg.setAttribute("viewBox", "0 0 24 24");
  svg.setAttribute("aria-hidden", "true");
  svg.setAttribute("focusable", "false");
  svg.classList.add("icon");
  for (const [tag, attrs] of SHAPES[name] || []) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
    svg.append(node);
  }
  return svg;
}

export function decorate(root = document) {
  for (const el of root.querySelectorAll("[data-icon]")) {
    if (!el.querySelector("svg.icon")) el.prepend(icon(el.dataset.icon));
  }
}
