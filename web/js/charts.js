// Hand-drawn time-series line charts on <canvas> (no dependency). A chart owns its <figure>: a
// caption with a live legend, and a canvas whose aria-label states the latest values, so the data is
// reachable without seeing pixels. Redraws on resize and on theme change; draws at devicePixelRatio.

const PAD = { left: 44, right: 12, top: 10, bottom: 22 };
const WINDOW_STEP_S = 30;

function cssVar(name, fallback) {
  const v = getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  return v || fallback;
}

/** Tick step and axis max so the axis shows ~4 round steps (whole numbers when `integer`). */
function niceScale(maxValue, integer) {
  const raw = Math.max(maxValue, 1) / 4; // an all-zero series still gets a readable 0..1 axis
  const exp = 10 ** Math.floor(Math.log10(raw));
  const factors = integer ? [1, 2, 5, 10] : [1, 2, 2.5, 5, 10];
  let step = factors.map((f) => f * exp).find((s) => s >= raw) ?? 10 * exp;
  if (integer) step = Math.max(1, Math.round(step));
  const steps = maxValue > 0 ? Math.max(1, Math.ceil(maxValue / step)) : 4; // all zero: four empty steps
  return { step, max: step * steps };
}

export class TimeChart {
  /**
   * @param {HTMLElement} figure
   * @param {{title: string, series: {key: string, label: string, color: string}[],
   *          format: (v: number) => string, yMax?: number, integer?: boolean,
   *          minWindowS?: number, maxWindowS?: number}} spec
   */
  constructor(figure, spec) {
    this.figure = figure;
    this.spec = { minWindowS: 30, maxWindowS: 300, ...spec };
    this.samples = [];
    figure.replaceChildren();
    const cap = document.createElement("figcaption");
    const title = document.createElement("span");
    title.className = "chart-title";
    title.textContent = spec.title;
    this.legend = document.createElement("span");
    this.legend.className = "chart-legend";
    cap.append(title, this.legend);
    this.canvas = document.createElement("canvas");
    this.canvas.setAttribute("role", "img");
    this.canvas.height = 160;
    figure.append(cap, this.canvas);
    figure.dataset.points = "0";
    this.legendItems = spec.series.map((s) => {
      const item = document.createElement("span");
      item.className = "legend-item";
      const swatch = document.createElement("i");
      swatch.style.background = s.color;
      const text = document.createElement("span");
      item.append(swatch, text);
      this.legend.append(item);
      return text;
    });
    this.resizeObserver = new ResizeObserver(() => this.draw());
    this.resizeObserver.observe(figure);
    this.render();
  }

  /** Replace the data: `samples` is [{t: ms epoch, values: {key: number|null}}], oldest first. */
  update(samples) {
    this.samples = samples;
    this.render();
  }

  render() {
    const last = this.samples[this.samples.length - 1];
    const parts = [];
    this.spec.series.forEach((s, i) => {
      const v = last ? last.values[s.key] : null;
      const shown = v === null || v === undefined || Number.isNaN(v) ? "—" : this.spec.format(v);
      this.legendItems[i].textContent = `${s.label} ${shown}`;
      parts.push(`${s.label} ${shown}`);
    });
    this.figure.dataset.points = String(this.samples.length);
    this.canvas.setAttribute(
      "aria-label",
      `${this.spec.title}: ${this.samples.length ? parts.join(", ") : "no data yet"} (${this.samples.length} samples)`,
    );
    this.draw();
  }

  draw() {
    const canvas = this.canvas;
    const dpr = window.devicePixelRatio || 1;
    const width = Math.max(120, canvas.clientWidth);
    const height = Math.max(80, canvas.clientHeight || 160);
    if (canvas.width !== Math.round(width * dpr) || canvas.height !== Math.round(height * dpr)) {
      canvas.width = Math.round(width * dpr);
      canvas.height = Math.round(height * dpr);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const grid = cssVar("--chart-grid", "#e5e7eb");
    const text = cssVar("--text-muted", "#6b7280");
    ctx.font = "11px system-ui, sans-serif";
    const plotW = width - PAD.left - PAD.right;
    const plotH = height - PAD.top - PAD.bottom;

    // The x axis spans the recorded history (at least minWindowS, at most maxWindowS), ending now.
    const now = this.samples.length ? this.samples[this.samples.length - 1].t : Date.now();
    const first = this.samples.length ? this.samples[0].t : now;
    const span = Math.ceil((now - first) / 1000 / WINDOW_STEP_S) * WINDOW_STEP_S; // round labels: thirds of 30 s steps
    const windowS = Math.min(this.spec.maxWindowS, Math.max(this.spec.minWindowS, span));
    const t0 = now - windowS * 1000;
    const visible = this.samples.filter((s) => s.t >= t0);
    let dataMax = 0;
    for (const s of visible) for (const ser of this.spec.series) {
      const v = s.values[ser.key];
      if (Number.isFinite(v)) dataMax = Math.max(dataMax, v);
    }
    const scale = this.spec.yMax !== undefined ? { step: this.spec.yMax / 4, max: this.spec.yMax } : niceScale(dataMax, this.spec.integer);
    const maxV = scale.max;
    const x = (t) => PAD.left + ((t - t0) / (windowS * 1000)) * plotW;
    const y = (v) => PAD.top + plotH - (v / maxV) * plotH;

    ctx.strokeStyle = grid;
    ctx.fillStyle = text;
    ctx.lineWidth = 1;
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (let v = 0; v <= maxV + scale.step / 2; v += scale.step) {
      const yy = Math.round(y(v)) + 0.5;
      ctx.beginPath();
      ctx.moveTo(PAD.left, yy);
      ctx.lineTo(width - PAD.right, yy);
      ctx.stroke();
      ctx.fillText(this.spec.format(v), PAD.left - 6, yy);
    }
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    for (let k = 0; k <= 3; k++) {
      const secsAgo = Math.round((windowS * (3 - k)) / 3);
      ctx.fillText(secsAgo === 0 ? "now" : `−${secsAgo}s`, PAD.left + (plotW * k) / 3, height - PAD.bottom + 6);
    }

    if (visible.length === 0) {
      ctx.textAlign = "center";
      ctx.textBaseline = "middle";
      ctx.fillText("Waiting for data…", PAD.left + plotW / 2, PAD.top + plotH / 2);
      return;
    }
    ctx.save();
    ctx.beginPath();
    ctx.rect(PAD.left - 4, PAD.top - 4, plotW + 8, plotH + 8); // a stray value never paints over the axes
    ctx.clip();
    for (const ser of this.spec.series) {
      // Missing values break the line instead of being bridged.
      const runs = [];
      let run = [];
      for (const s of visible) {
        const v = s.values[ser.key];
        if (Number.isFinite(v)) run.push([x(s.t), y(v)]);
        else if (run.length) {
          runs.push(run);
          run = [];
        }
      }
      if (run.length) runs.push(run);
      ctx.strokeStyle = ser.color;
      ctx.fillStyle = ser.color;
      ctx.lineWidth = 2;
      ctx.lineJoin = "round";
      for (const pts of runs) {
        ctx.beginPath();
        pts.forEach(([px, py], i) => (i ? ctx.lineTo(px, py) : ctx.moveTo(px, py)));
        ctx.stroke();
        if (pts.length > 1) {
          ctx.globalAlpha = 0.08;
          ctx.lineTo(pts[pts.length - 1][0], y(0));
          ctx.lineTo(pts[0][0], y(0));
          ctx.closePath();
          ctx.fill();
          ctx.globalAlpha = 1;
        }
      }
      const lastRun = runs[runs.length - 1];
      if (lastRun) {
        const [lx, ly] = lastRun[lastRun.length - 1];
        ctx.beginPath();
        ctx.arc(lx, ly, 3, 0, Math.PI * 2);
        ctx.fill();
      }
    }
    ctx.restore();
  }
}
