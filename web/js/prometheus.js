// Parser for the Prometheus text exposition format (version 0.0.4) served at /metrics.
// Invariant: every sample lands in exactly one family — the declared family whose name it extends
// with a histogram/summary suffix (_bucket, _sum, _count, _created), or else a family of its own
// name. A line that is neither a comment, blank, nor a well-formed sample throws, naming the line.

const NAME = /^[a-zA-Z_:][a-zA-Z0-9_:]*/;
const LABEL_NAME = /^[a-zA-Z_][a-zA-Z0-9_]*/;
const SUFFIXES = ["_bucket", "_sum", "_count", "_created", "_total"];

export class PrometheusParseError extends Error {
  constructor(lineNo, message) {
    super(`/metrics line ${lineNo}: ${message}`);
    this.name = "PrometheusParseError";
  }
}

function parseValue(raw, lineNo) {
  if (raw === "+Inf" || raw === "Inf") return Infinity;
  if (raw === "-Inf") return -Infinity;
  if (raw === "NaN") return NaN;
  if (!/^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$/.test(raw)) throw new PrometheusParseError(lineNo, `bad value "${raw}"`);
  return Number(raw);
}

function parseLabels(s, lineNo) {
  // s starts just after "{"; returns [labels, rest after "}"]
  const labels = {};
  let i = 0;
  for (;;) {
    while (s[i] === " ") i++;
    if (s[i] === "}") return [labels, s.slice(i + 1)];
    const m = LABEL_NAME.exec(s.slice(i));
    if (!m) throw new PrometheusParseError(lineNo, "bad label name");
    const key = m[0];
    i += key.length;
    while (s[i] === " ") i++;
    if (s[i] !== "=" || s[i + 1] !== '"') throw new PrometheusParseError(lineNo, `label ${key} lacks ="value"`);
    i += 2;
    let value = "";
    for (;;) {
      if (i >= s.length) throw new PrometheusParseError(lineNo, `unterminated value of label ${key}`);
      const c = s[i];
      if (c === "\\") {
        const n = s[i + 1];
        value += n === "n" ? "\n" : n === "\\" ? "\\" : n === '"' ? '"' : "\\" + (n ?? "");
        i += 2;
      } else if (c === '"') {
        i += 1;
        break;
      } else {
        value += c;
        i += 1;
      }
    }
    labels[key] = value;
    while (s[i] === " ") i++;
    if (s[i] === ",") i += 1;
    else if (s[i] !== "}") throw new PrometheusParseError(lineNo, "expected , or } after a label");
  }
}

/** Parse exposition text into a Map of family name -> {name, type, help, samples:[{name, labels, value}]}. */
export function parsePrometheus(text) {
  if (typeof text !== "string") throw new PrometheusParseError(0, "not text");
  const families = new Map();
  const family = (name) => {
    if (!families.has(name)) families.set(name, { name, type: "untyped", help: "", samples: [] });
    return families.get(name);
  };
  const lines = text.split("\n");
  lines.forEach((rawLine, idx) => {
    const lineNo = idx + 1;
    const line = rawLine.trim();
    if (line === "") return;
    if (line.startsWith("#")) {
      const m = /^#\s*(HELP|TYPE)\s+([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(.*)$/.exec(line);
      if (!m) return; // other comments are allowed and carry nothing
      const fam = family(m[2]);
      if (m[1] === "HELP") fam.help = m[3].replace(/\\n/g, "\n").replace(/\\\\/g, "\\");
      else fam.type = m[3].trim() || "untyped";
      return;
    }
    const nm = NAME.exec(line);
    if (!nm) throw new PrometheusParseError(lineNo, `not a metric sample: "${line.slice(0, 60)}"`);
    const name = nm[0];
    let rest = line.slice(name.length);
    let labels = {};
    if (rest.startsWith("{")) [labels, rest] = parseLabels(rest.slice(1), lineNo);
    const parts = rest.trim().split(/\s+/);
    if (parts.length < 1 || parts.length > 2 || parts[0] === "") {
      throw new PrometheusParseError(lineNo, `expected "value [timestamp]" after ${name}`);
    }
    const value = parseValue(parts[0], lineNo);
    let owner = name;
    for (const suffix of SUFFIXES) {
      const base = name.slice(0, -suffix.length);
      if (name.endsWith(suffix) && families.has(base) && families.get(base).type !== "untyped") {
        owner = base;
        break;
      }
    }
    family(owner).samples.push({ name, labels, value });
  });
  return families;
}

/** Sum of the samples named `sampleName` (any family) whose labels include `match`; null if none. */
export function sampleSum(families, sampleName, match = {}) {
  let total = null;
  for (const fam of families.values()) {
    for (const s of fam.samples) {
      if (s.name !== sampleName) continue;
      if (!Object.entries(match).every(([k, v]) => s.labels[k] === v)) continue;
      total = (total ?? 0) + s.value;
    }
  }
  return total;
}

/** First sample name among `candidates` that is present, so charts survive metric renames. */
export function firstPresent(families, candidates) {
  for (const c of candidates) if (sampleSum(families, c) !== null) return c;
  return null;
}

/**
 * The q-quantile (0..1) of histogram `name` (summed over label sets), interpolated linearly inside
 * the bucket like Prometheus' histogram_quantile; null with no observations.
 */
export function histogramQuantile(families, name, q) {
  const fam = families.get(name);
  if (!fam) return null;
  const byLe = new Map();
  for (const s of fam.samples) {
    if (s.name !== `${name}_bucket` || s.labels.le === undefined) continue;
    const le = s.labels.le === "+Inf" ? Infinity : Number(s.labels.le);
    byLe.set(le, (byLe.get(le) ?? 0) + s.value);
  }
  const buckets = [...byLe.entries()].sort((a, b) => a[0] - b[0]);
  const total = buckets.length ? buckets[buckets.length - 1][1] : 0;
  if (!(total > 0)) return null;
  const rank = q * total;
  let prevLe = 0;
  let prevCount = 0;
  for (const [le, count] of buckets) {
    if (count >= rank) {
      if (le === Infinity) return prevLe; // beyond the last finite bucket: its bound is all we know
      return count === prevCount ? le : prevLe + ((le - prevLe) * (rank - prevCount)) / (count - prevCount);
    }
    prevLe = le;
    prevCount = count;
  }
  return prevLe;
}
