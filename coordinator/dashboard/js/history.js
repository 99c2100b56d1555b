// A run's history: the whole series from GET /runs/{name}/series when the run is opened, then each new
// point from the live feed. Survives reloads and restarts of `serve`: the coordinator keeps it.

import { api, runPath } from "./api.js";
import { SeriesChart } from "./charts.js";
import { $ } from "./dom.js";
import { fmtBytes, fmtCount, fmtLoss, fmtMetric, fmtRate } from "./format.js";
import { state } from "./store.js";

const CHARTS = [
  {
    id: "loss",
    title: "Loss",
    lines: [
      { label: "training (peers' mean)", color: "--chart-line", fill: "--chart-fill" },
      { label: "held-out (checkpoints)", color: "--chart-warm", dots: true },
    ],
    columns: ["loss", "eval_loss"],
    format: fmtLoss,
    emptyText: "Waiting for loss reports…",
  },
  {
    id: "metric",
    title: "Held-out metric",
    lines: [{ label: "metric", color: "--chart-warm", dots: true }],
    columns: ["metric"],
    format: (v) => fmtMetric(v, history.metricName),
    range: () => (isFraction(history.metricName) ? [0, 1] : null),
    emptyText: "Measured on each checkpoint the coordinator saves (every few minutes of training).",
  },
  {
    id: "sps",
    floor: 0,
    title: "Samples / s",
    lines: [{ label: "samples/s", color: "--chart-alt", fill: "--chart-alt-fill" }],
    columns: ["samples_per_second"],
    format: fmtRate,
    emptyText: "Waiting for throughput reports…",
  },
  {
    id: "peers",
    floor: 0,
    title: "Peers online",
    lines: [{ label: "peers", color: "--chart-line", fill: "--chart-fill" }],
    columns: ["peers"],
    format: (v) => (Number.isInteger(v) ? fmtCount(v) : v.toFixed(1)),
    emptyText: "No peer has joined yet.",
  },
  {
    id: "rounds",
    floor: 0,
    title: "Averaging rounds",
    lines: [{ label: "swarm epoch", color: "--chart-alt" }],
    columns: ["global_epoch"],
    format: fmtCount,
    emptyText: "No averaging round yet.",
  },
  {
    id: "bytes",
    floor: 0,
    title: "Traffic between peers",
    lines: [{ label: "bytes sent + received", color: "--chart-line" }],
    columns: ["bytes"],
    format: fmtBytes,
    emptyText: "No traffic reported yet.",
  },
];

function isFraction(name) {
  return Boolean(name) && /accuracy|rate|fraction/.test(name);
}

const history = { run: null, metricName: null, charts: new Map(), loading: null, pending: [] };

/** Build the charts once, into the overview's chart grid. */
export function setupHistory() {
  const grid = $("charts");
  for (const spec of CHARTS) {
    const chart = new SeriesChart(spec);
    history.charts.set(spec.id, { chart, spec });
    grid.append(chart.figure);
  }
}

/** Draw the selected run's whole history (called when a run is opened). */
export async function loadHistory(name) {
  history.run = name;
  history.pending = [];
  for (const { chart, spec } of history.charts.values()) chart.set([], spec.columns.map(() => []));
  const loading = api(`${runPath(name)}/series`);
  history.loading = loading;
  let series;
  try {
    series = await loading;
  } catch {
    return;
  } finally {
    if (history.loading === loading) history.loading = null;
  }
  if (history.run !== name) return;
  history.metricName = series.metric_name;
  const metric = history.charts.get("metric");
  metric.chart.figure.querySelector('[data-slot="title"]').textContent = series.metric_name
    ? `Held-out ${series.metric_name.replaceAll("_", " ")}`
    : "Held-out metric";
  for (const { chart, spec } of history.charts.values()) {
    chart.set(series.t, spec.columns.map((column) => series[column]));
  }
  // points that arrived on the live feed while the history was on its way
  for (const point of history.pending.splice(0)) addPoint(name, point);
}

/** A new point from the live feed. */
export function addPoint(name, point) {
  if (!point || name !== history.run) return;
  if (history.loading) {
    history.pending.push(point);
    return;
  }
  for (const { chart, spec } of history.charts.values()) {
    chart.append(point.t, spec.columns.map((column) => point[column]));
  }
}

/** Fetch the points taken since the last one drawn (after the live feed was down), then draw them. */
export async function catchUp(name) {
  if (name !== history.run || history.loading) return;
  const xs = history.charts.get("peers").chart.data[0];
  const since = xs.length ? xs[xs.length - 1] : null;
  let series;
  try {
    series = await api(`${runPath(name)}/series${since != null ? `?since=${since}` : ""}`);
  } catch {
    return;
  }
  if (name !== history.run) return;
  series.t.forEach((t, i) => {
    const point = Object.fromEntries(Object.keys(series).map((key) => [key, Array.isArray(series[key]) ? series[key][i] : null]));
    point.t = t;
    addPoint(name, point);
  });
}

/** The loss's change over the whole history (for the loss card), or null. */
export function lossTrend() {
  const entry = history.charts.get("loss");
  if (!entry || state.selected !== history.run) return null;
  const values = entry.chart.data[1].filter((v) => v != null);
  if (values.length < 2) return null;
  return { delta: values[values.length - 1] - values[0], since: entry.chart.data[0][0] };
}

export function metricName() {
  return history.metricName;
}
