// Number, time and size formatting for the dashboard. Pure functions, no DOM.

const integer = new Intl.NumberFormat("en-US", { maximumFractionDigits: 0 });

function trimZero(text) {
  return text.replace(/\.0$/, "");
}

function finite(value) {
  return value != null && Number.isFinite(Number(value));
}

/** 950 → "950", 1234 → "1.2k", 56789 → "56.8k", 3_400_000 → "3.4M". */
export function fmtCount(value) {
  if (!finite(value)) return "–";
  const n = Number(value);
  const abs = Math.abs(n);
  for (const [size, suffix] of [
    [1e12, "T"],
    [1e9, "B"],
    [1e6, "M"],
    [1e3, "k"],
  ]) {
    if (abs >= size) {
      const scaled = n / size;
      return trimZero(scaled.toFixed(Math.abs(scaled) >= 100 ? 0 : 1)) + suffix;
    }
  }
  return integer.format(n);
}

/** Rates keep a decimal while small: 0.37, 12.5, 250, 1.2k. */
export function fmtRate(value) {
  if (!finite(value)) return "–";
  const n = Number(value);
  if (Math.abs(n) >= 1000) return fmtCount(n);
  if (Math.abs(n) >= 100) return n.toFixed(0);
  if (Math.abs(n) >= 10 || n === 0) return n.toFixed(1);
  return n.toFixed(2);
}

export function fmtLoss(value) {
  if (!finite(value)) return "–";
  const n = Number(value);
  return Math.abs(n) >= 100 ? n.toFixed(1) : n.toFixed(3);
}

/** A held-out metric: accuracies (0..1) as percentages, anything else like a loss. */
export function fmtMetric(value, name) {
  if (!finite(value)) return "–";
  if (name && /accuracy|rate|fraction/.test(name)) return `${(Number(value) * 100).toFixed(1)}%`;
  return fmtLoss(value);
}

export function fmtExact(value) {
  return value == null ? "" : integer.format(Number(value));
}

/** 1536 → "1.5 KB", 3.2e9 → "3.2 GB". */
export function fmtBytes(value) {
  if (!finite(value)) return "–";
  let n = Number(value);
  for (const unit of ["B", "KB", "MB", "GB", "TB"]) {
    if (Math.abs(n) < 1000 || unit === "TB") return unit === "B" ? `${n.toFixed(0)} B` : `${trimZero(n.toFixed(1))} ${unit}`;
    n /= 1000;
  }
  return "–";
}

function span(seconds) {
  if (seconds < 60) return `${Math.floor(seconds)} s`;
  if (seconds < 3600) return `${Math.floor(seconds / 60)} min`;
  if (seconds < 86400) return `${Math.floor(seconds / 3600)} h`;
  return `${Math.floor(seconds / 86400)} d`;
}

/** Seconds-since-epoch → "just now", "42 s ago", "5 min ago", "3 h ago", "2 d ago"; future times → "in 5 min". */
export function fmtAgo(epochSeconds) {
  if (epochSeconds == null) return "never";
  const delta = Date.now() / 1000 - Number(epochSeconds);
  if (delta < -5) return `in ${span(-delta)}`;
  if (delta < 5) return "just now";
  return `${span(delta)} ago`;
}

/** A duration in seconds → "42 s", "5 min", "3 h", "2 d". */
export function fmtDuration(seconds) {
  if (!finite(seconds)) return "–";
  return span(Math.max(0, Number(seconds)));
}

export function fmtDate(epochSeconds) {
  if (epochSeconds == null) return "";
  return new Date(Number(epochSeconds) * 1000).toLocaleString();
}

export function plural(n, one, many) {
  return `${fmtCount(n)} ${Number(n) === 1 ? one : many}`;
}
