// Time-series charts, drawn by uPlot (vendored: ../vendor/uplot, see VERSION.md there).
//
// A chart is a <figure> from the "tpl-chart" template: a title, a summary ("412 points over 3 h"), the
// plot and an empty-state line. `data-points` on the figure says how many points it shows (tests read it).

import uPlot from "../vendor/uplot/uPlot.esm.js";
import { fromTemplate, setText, slot } from "./dom.js";
import { fmtDuration, plural } from "./format.js";

function cssVar(name, fallback) {
  const value = getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  return value || fallback;
}

export class SeriesChart {
  /**
   * @param {object} options
   * @param {string} options.id         used in data-testid="chart-{id}"
   * @param {string} options.title
   * @param {Array<{label: string, color: string, fill?: string, dots?: boolean}>} options.lines
   * @param {(value: number) => string} options.format
   * @param {string} options.emptyText
   */
  constructor({ id, title, lines, format, emptyText, height = 170, floor = null, range = null }) {
    this.id = id;
    this.floor = floor; // the y axis never starts above this (0 for counts and rates)
    this.range = range; // a fixed y range, e.g. [0, 1] for an accuracy (or a function returning one)
    this.lines = lines;
    this.format = format;
    this.height = height;
    this.figure = fromTemplate("tpl-chart");
    this.figure.dataset.testid = `chart-${id}`;
    this.figure.setAttribute("data-testid", `chart-${id}`);
    this.figure.dataset.points = "0";
    setText(slot(this.figure, "title"), title);
    setText(slot(this.figure, "empty"), emptyText);
    this.plotBox = slot(this.figure, "plot");
    this.plot = null;
    this.data = [[], ...lines.map(() => [])];
    this.observer = new ResizeObserver(() => this.fit());
    this.observer.observe(this.plotBox);
  }

  /** Replace the whole series: `xs` in Unix seconds, one column per line (nulls are gaps). */
  set(xs, columns) {
    this.data = [Array.from(xs), ...columns.map((column) => Array.from(column))];
    this.render();
  }

  /** Add one point at the end (ignored unless newer than the last). Returns whether it was added. */
  append(t, values) {
    const xs = this.data[0];
    if (xs.length && t <= xs[xs.length - 1]) return false;
    xs.push(t);
    values.forEach((value, index) => this.data[index + 1].push(value ?? null));
    this.render();
    return true;
  }

  get points() {
    let count = 0;
    for (let i = 0; i < this.data[0].length; i += 1) {
      if (this.data.slice(1).some((column) => column[i] != null)) count += 1;
    }
    return count;
  }

  render() {
    const count = this.points;
    this.figure.dataset.points = String(count);
    slot(this.figure, "empty").hidden = count > 0;
    this.plotBox.hidden = count === 0;
    setText(slot(this.figure, "summary"), this.summary(count));
    if (count === 0) return;
    if (this.plot) this.plot.setData(this.data);
    else this.fit();
  }

  summary(count) {
    if (!count) return "no data yet";
    const xs = this.data[0];
    const values = this.data.slice(1).flat().filter((v) => v != null);
    const last = this.data[1].filter((v) => v != null).pop();
    const window = xs.length > 1 ? ` over ${fmtDuration(xs[xs.length - 1] - xs[0])}` : "";
    const latest = last != null ? `now ${this.format(last)} · ` : "";
    const range = values.length > 1 ? `min ${this.format(Math.min(...values))} · max ${this.format(Math.max(...values))} · ` : "";
    return `${latest}${range}${plural(count, "point", "points")}${window}`;
  }

  fit() {
    const width = Math.floor(this.plotBox.clientWidth);
    if (width < 50 || this.plotBox.hidden) return;
    if (!this.plot) {
      this.plot = new uPlot(this.options(width), this.data, this.plotBox);
    } else if (Math.abs(this.plot.width - width) > 1) {
      this.plot.setSize({ width, height: this.height });
    }
  }

  options(width) {
    const muted = cssVar("--muted", "#5d6673");
    const grid = cssVar("--border", "#e2e5ea");
    const axis = {
      stroke: muted,
      grid: { stroke: grid, width: 1 },
      ticks: { stroke: grid, width: 1, size: 4 },
      font: "11px system-ui, sans-serif",
    };
    return {
      width,
      height: this.height,
      scales: { x: { time: true }, y: { range: (_u, min, max) => this.yRange(min, max) } },
      legend: { show: this.lines.length > 1, live: false },
      cursor: { drag: { x: true, y: false } },
      axes: [
        axis,
        {
          ...axis,
          values: (_u, ticks) => ticks.map((v) => this.format(v)),
          size: (_u, labels) => (labels && labels.length ? Math.max(...labels.map((l) => String(l).length)) * 7 + 18 : 40),
        },
      ],
      series: [
        {},
        ...this.lines.map((line) => ({
          label: line.label,
          stroke: cssVar(line.color, "#4f46e5"),
          fill: line.fill ? cssVar(line.fill, "transparent") : undefined,
          width: 2,
          spanGaps: true,
          points: { show: Boolean(line.dots), size: 6 },
          value: (_u, v) => (v == null ? "–" : this.format(v)),
        })),
      ],
    };
  }

  /** The y range: fixed when the chart has one, else the data with a margin, never above `floor`, and a
   * sensible window around a single value. */
  yRange(min, max) {
    const fixed = typeof this.range === "function" ? this.range() : this.range;
    if (fixed) return fixed;
    if (min == null || max == null) return [0, 1];
    let lo = min;
    let hi = max;
    if (hi - lo < 1e-12) {
      const pad = Math.abs(hi) * 0.1 || 1;
      lo -= pad;
      hi += pad;
    } else {
      const pad = (hi - lo) * 0.08;
      lo -= pad;
      hi += pad;
    }
    if (this.floor != null && min >= this.floor) lo = this.floor;
    return [lo, hi];
  }

  destroy() {
    this.observer.disconnect();
    if (this.plot) this.plot.destroy();
    this.plot = null;
  }
}
