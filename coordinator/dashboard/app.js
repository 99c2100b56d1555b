// The coordinator's live dashboard: plain ES module, no dependencies, no build step.
//
// Data: GET /api/v1/runs (every 10 s), the selected run's websocket feed /api/v1/runs/{name}/live
// (snapshot, then updates), with a fallback poll of /runs/{name} + /leaderboard while the socket is
// down, and GET /api/v1/leaderboard for the "All runs" tab.
//
// Safety: every string from the API is inserted with textContent / setAttribute (never innerHTML);
// volunteer names and device names are user-controlled. The organizer token lives in sessionStorage.

const API = "/api/v1";
const TOKEN_KEY = "volunteer-coordinator.organizer-token";
const RUNS_REFRESH_MS = 10_000;
const POLL_MS = 5_000;
const PING_MS = 20_000;
const BACKOFF_BASE_MS = 1_000;
const BACKOFF_MAX_MS = 30_000;
const HISTORY_LIMIT = 240;
const TICK_MS = 5_000;
const SVG_NS = "http://www.w3.org/2000/svg";

const $ = (id) => document.getElementById(id);

const state = {
  runs: [],
  runsLoaded: false,
  selected: null,
  run: null,
  leaderboard: null,
  unknown: false,
  lastUpdate: 0,
  apiDown: false,
  history: new Map(),
  tab: "run",
  overall: null,
  busy: false,
};

const live = {
  socket: null,
  run: null,
  attempt: 0,
  reconnectTimer: 0,
  reconnectAt: 0,
  pingTimer: 0,
  pollTimer: 0,
};

// ------------------------------------------------------------------------------------ formatting
const integer = new Intl.NumberFormat("en-US", { maximumFractionDigits: 0 });

function trimZero(text) {
  return text.replace(/\.0$/, "");
}

/** 950 → "950", 1234 → "1.2k", 56789 → "56.8k", 3_400_000 → "3.4M". */
function fmtCount(value) {
  if (value == null || !Number.isFinite(Number(value))) return "–";
  const n = Number(value);
  const abs = Math.abs(n);
  const units = [
    [1e12, "T"],
    [1e9, "B"],
    [1e6, "M"],
    [1e3, "k"],
  ];
  for (const [size, suffix] of units) {
    if (abs >= size) {
      const scaled = n / size;
      const digits = Math.abs(scaled) >= 100 ? 0 : 1;
      return trimZero(scaled.toFixed(digits)) + suffix;
    }
  }
  return integer.format(n);
}

/** Rates keep a decimal while small: 0.37, 12.5, 250, 1.2k. */
function fmtRate(value) {
  if (value == null || !Number.isFinite(Number(value))) return "–";
  const n = Number(value);
  if (Math.abs(n) >= 1000) return fmtCount(n);
  if (Math.abs(n) >= 100) return n.toFixed(0);
  if (Math.abs(n) >= 10 || n === 0) return n.toFixed(1);
  return n.toFixed(2);
}

function fmtLoss(value) {
  if (value == null || !Number.isFinite(Number(value))) return "–";
  const n = Number(value);
  return Math.abs(n) >= 100 ? n.toFixed(1) : n.toFixed(3);
}

function fmtExact(value) {
  return value == null ? "" : integer.format(Number(value));
}

/** Seconds-since-epoch → "just now", "42 s ago", "5 min ago", "3 h ago", "2 d ago". */
function fmtAgo(epochSeconds) {
  if (epochSeconds == null) return "never";
  const seconds = Math.max(0, Date.now() / 1000 - Number(epochSeconds));
  if (seconds < 5) return "just now";
  if (seconds < 60) return `${Math.floor(seconds)} s ago`;
  if (seconds < 3600) return `${Math.floor(seconds / 60)} min ago`;
  if (seconds < 86400) return `${Math.floor(seconds / 3600)} h ago`;
  return `${Math.floor(seconds / 86400)} d ago`;
}

function fmtDate(epochSeconds) {
  if (epochSeconds == null) return "";
  return new Date(Number(epochSeconds) * 1000).toLocaleString();
}

function plural(n, one, many) {
  return `${fmtCount(n)} ${Number(n) === 1 ? one : many}`;
}

// ------------------------------------------------------------------------------------ DOM helpers
/** Build an element. Strings in `children` become text nodes, so API data is never parsed as HTML. */
function el(tag, props = {}, children = []) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (value == null || value === false) continue;
    if (key === "text") node.textContent = String(value);
    else if (key === "class") node.className = value;
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of [].concat(children)) {
    if (child != null && child !== false) node.append(child);
  }
  return node;
}

function svg(tag, attrs = {}) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, String(value));
  return node;
}

function setText(id, text, title) {
  const node = $(id);
  if (!node) return;
  if (node.textContent !== text) node.textContent = text;
  if (title !== undefined) node.title = title;
}

function relativeTime(epochSeconds) {
  const node = el("time", { class: "ago", text: fmtAgo(epochSeconds) });
  if (epochSeconds != null) {
    node.dataset.ts = String(epochSeconds);
    node.dateTime = new Date(Number(epochSeconds) * 1000).toISOString();
    node.title = fmtDate(epochSeconds);
  }
  return node;
}

// ------------------------------------------------------------------------------------ HTTP
class ApiError extends Error {
  constructor(status, code, detail) {
    super(detail);
    this.status = status;
    this.code = code;
  }
}

async function api(path, options = {}) {
  let response;
  try {
    response = await fetch(API + path, { cache: "no-store", ...options });
  } catch (error) {
    markApi(false);
    throw new ApiError(0, "network", "the coordinator cannot be reached");
  }
  markApi(true);
  let body = null;
  try {
    body = await response.json();
  } catch {
    body = null;
  }
  if (!response.ok) {
    const detail = body && typeof body.detail === "string" ? body.detail : `${response.status} ${response.statusText}`;
    throw new ApiError(response.status, body && body.error ? body.error : "http_error", detail);
  }
  return body;
}

function runPath(name) {
  return `/runs/${encodeURIComponent(name)}`;
}

function markApi(reachable) {
  if (state.apiDown === !reachable) return;
  state.apiDown = !reachable;
  renderConnection();
}

// ------------------------------------------------------------------------------------ connection status
function renderConnection() {
  const node = $("connection");
  let mode;
  let label;
  let title = "";
  if (!navigator.onLine || state.apiDown) {
    mode = "offline";
    label = "Offline";
    title = "The coordinator cannot be reached; retrying.";
  } else if (live.run && !state.unknown && !(live.socket && live.socket.readyState === WebSocket.OPEN)) {
    if (!state.lastUpdate && live.attempt === 0) {
      mode = "connecting";
      label = "Connecting…";
    } else {
      mode = "reconnecting";
      label = "Reconnecting…";
      const wait = Math.max(0, Math.round((live.reconnectAt - Date.now()) / 1000));
      title = `The live feed is down; polling every ${POLL_MS / 1000} s. Next attempt in ${wait} s.`;
    }
  } else if (!state.runsLoaded) {
    mode = "connecting";
    label = "Connecting…";
  } else {
    mode = "live";
    label = "Live";
    title = live.run && !state.unknown ? "Receiving live updates." : "Connected to the coordinator.";
  }
  node.dataset.state = mode;
  setText("connection-label", label);
  node.title = title;
}

// ------------------------------------------------------------------------------------ runs list
async function loadRuns() {
  try {
    const runs = await api("/runs");
    state.runs = Array.isArray(runs) ? runs : [];
    state.runsLoaded = true;
  } catch {
    renderConnection();
    return;
  }
  // The list can be fresher or staler than the live feed; the feed wins for the selected run.
  if (state.run) {
    const index = state.runs.findIndex((r) => r.name === state.run.name);
    if (index >= 0 && state.lastUpdate && Date.now() - state.lastUpdate < RUNS_REFRESH_MS) {
      state.runs[index] = state.run;
    }
  }
  if (!state.selected) {
    const chosen = chooseDefaultRun();
    if (chosen) selectRun(chosen, { replaceHash: true });
  } else if (state.unknown && state.runs.some((r) => r.name === state.selected)) {
    // A run that did not exist when it was asked for has been created since: subscribe now.
    state.unknown = false;
    connect(state.selected);
  }
  renderRuns();
  if (!state.run) renderRun();
  renderConnection();
  if (state.tab === "overall") loadOverall();
}

function chooseDefaultRun() {
  const fromHash = runFromHash();
  if (fromHash) return fromHash;
  const active = state.runs.find((r) => r.state === "active");
  return (active || state.runs[0] || {}).name || null;
}

function runFromHash() {
  const params = new URLSearchParams(location.hash.replace(/^#/, ""));
  const name = params.get("run");
  return name && name.trim() ? name.trim() : null;
}

function renderRuns() {
  const list = $("runs-list");
  $("runs-empty").hidden = !state.runsLoaded || state.runs.length > 0;
  setText("runs-count", state.runsLoaded ? plural(state.runs.length, "run", "runs") : "");
  const items = state.runs.map((run) => {
    const stats = run.stats || {};
    const selected = run.name === state.selected;
    const link = el(
      "a",
      {
        class: "run-link",
        href: `#run=${encodeURIComponent(run.name)}`,
        "aria-current": selected ? "page" : null,
        "data-testid": "run-item",
        "data-run": run.name,
      },
      [
        el("span", { class: "run-link-top" }, [
          el("span", { class: "run-link-name", text: run.name }),
          stateBadge(run.state),
        ]),
        el("span", { class: "run-link-meta" }, [
          el("span", { class: "run-link-task", text: run.task }),
          el("span", { text: plural(stats.active_peers || 0, "peer", "peers"), "data-testid": "run-item-peers" }),
          el("span", { text: `${fmtRate(stats.samples_per_second || 0)} samples/s`, "data-testid": "run-item-sps" }),
        ]),
      ],
    );
    return el("li", {}, link);
  });
  list.replaceChildren(...items);
}

function stateBadge(runState) {
  const known = ["active", "paused", "finished"].includes(runState) ? runState : "unknown";
  return el("span", { class: `badge badge-${known}`, text: runState || "unknown" });
}

// ------------------------------------------------------------------------------------ selection
function selectRun(name, { replaceHash = false } = {}) {
  if (replaceHash && runFromHash() !== name) {
    history.replaceState(null, "", `#run=${encodeURIComponent(name)}`);
  }
  if (name === state.selected && live.run === name) return;
  state.selected = name;
  state.unknown = false;
  state.lastUpdate = 0;
  state.leaderboard = null;
  state.run = state.runs.find((r) => r.name === name) || null;
  setOrganizerMessage("", "");
  renderRuns();
  renderRun();
  connect(name);
}

function onHashChange() {
  const name = runFromHash();
  if (name && name !== state.selected) selectRun(name);
}

// ------------------------------------------------------------------------------------ live feed
function connect(name) {
  disconnect();
  live.run = name;
  live.attempt = 0;
  openSocket();
}

function disconnect() {
  clearTimeout(live.reconnectTimer);
  stopPing();
  stopPoll();
  if (live.socket) retire(live.socket);
  live.socket = null;
  live.run = null;
}

/** Close a socket we no longer want without tripping the browser's "closed before established" error. */
function retire(socket) {
  if (socket.readyState === WebSocket.CONNECTING) {
    socket.addEventListener("open", () => socket.close(1000, "run switched"), { once: true });
  } else if (socket.readyState === WebSocket.OPEN) {
    socket.close(1000, "run switched");
  }
}

function openSocket() {
  const name = live.run;
  if (!name) return;
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  let socket;
  try {
    socket = new WebSocket(`${scheme}//${location.host}${API}${runPath(name)}/live`);
  } catch {
    scheduleReconnect();
    return;
  }
  live.socket = socket;
  renderConnection();
  socket.addEventListener("open", () => {
    if (socket !== live.socket) return;
    renderConnection();
    startPing(socket);
  });
  socket.addEventListener("message", (event) => {
    if (socket !== live.socket) return;
    let message;
    try {
      message = JSON.parse(event.data);
    } catch {
      return;
    }
    handleMessage(name, message);
  });
  socket.addEventListener("close", (event) => {
    if (socket !== live.socket) return;
    live.socket = null;
    stopPing();
    if (event.code === 4404 || state.unknown) {
      markUnknown(name);
      return;
    }
    scheduleReconnect();
    startPoll();
  });
}

function handleMessage(name, message) {
  if (name !== state.selected) return;
  if (message.type === "snapshot" || message.type === "update") {
    live.attempt = 0;
    stopPoll();
    applySnapshot(message.run, message.leaderboard);
    renderConnection();
  } else if (message.type === "error") {
    if (message.error === "run_not_found") markUnknown(name);
  }
}

function scheduleReconnect() {
  clearTimeout(live.reconnectTimer);
  const base = Math.min(BACKOFF_MAX_MS, BACKOFF_BASE_MS * 2 ** live.attempt);
  const delay = Math.round(base * (0.8 + Math.random() * 0.4));
  live.attempt += 1;
  live.reconnectAt = Date.now() + delay;
  live.reconnectTimer = setTimeout(openSocket, delay);
  renderConnection();
}

function startPing(socket) {
  stopPing();
  live.pingTimer = setInterval(() => {
    if (socket.readyState === WebSocket.OPEN) socket.send("ping");
  }, PING_MS);
}

function stopPing() {
  clearInterval(live.pingTimer);
  live.pingTimer = 0;
}

function startPoll() {
  if (live.pollTimer) return;
  pollOnce();
  live.pollTimer = setInterval(pollOnce, POLL_MS);
}

function stopPoll() {
  clearInterval(live.pollTimer);
  live.pollTimer = 0;
}

async function pollOnce() {
  const name = live.run;
  if (!name) return;
  try {
    const [run, board] = await Promise.all([api(runPath(name)), api(`${runPath(name)}/leaderboard`)]);
    if (name !== state.selected || (live.socket && live.socket.readyState === WebSocket.OPEN)) return;
    applySnapshot(run, board.entries);
  } catch (error) {
    if (error instanceof ApiError && error.status === 404 && name === state.selected) {
      markUnknown(name);
    }
  }
  renderConnection();
}

function markUnknown(name) {
  if (name !== state.selected) return;
  state.unknown = true;
  state.run = null;
  state.leaderboard = null;
  clearTimeout(live.reconnectTimer);
  stopPoll();
  stopPing();
  showNotice(`No run named “${name}”. The link may be wrong or the run was removed; pick a run from the list.`);
  renderRun();
  renderConnection();
}

// ------------------------------------------------------------------------------------ state updates
function applySnapshot(run, leaderboard) {
  if (!run || run.name !== state.selected) return;
  state.unknown = false;
  state.run = run;
  state.leaderboard = Array.isArray(leaderboard) ? leaderboard : state.leaderboard || [];
  state.lastUpdate = Date.now();
  const index = state.runs.findIndex((r) => r.name === run.name);
  if (index >= 0) state.runs[index] = run;
  else if (state.runsLoaded) state.runs.push(run);
  recordHistory(run);
  renderRuns();
  renderRun();
}

function recordHistory(run) {
  const stats = run.stats || {};
  let points = state.history.get(run.name);
  if (!points) {
    points = [];
    state.history.set(run.name, points);
  }
  const point = { t: Date.now(), loss: stats.loss ?? null, sps: stats.samples_per_second ?? 0 };
  const last = points[points.length - 1];
  if (last && last.loss === point.loss && last.sps === point.sps && point.t - last.t < POLL_MS) return;
  points.push(point);
  if (points.length > HISTORY_LIMIT) points.splice(0, points.length - HISTORY_LIMIT);
}

// ------------------------------------------------------------------------------------ run view
function showNotice(text) {
  const notice = $("notice");
  notice.textContent = text;
  notice.hidden = !text;
}

function renderRun() {
  const run = state.run;
  const view = $("run-view");
  if (!state.unknown) showNotice("");
  if (!run) {
    view.hidden = true;
    if (!state.unknown && state.runsLoaded && !state.runs.length) {
      showNotice("There is nothing to show yet: no training runs exist on this coordinator.");
    }
    const idle = state.unknown || (state.runsLoaded && !state.selected);
    renderBoard($("leaderboard-body"), idle ? [] : state.leaderboard, "No run selected.");
    renderOrganizer();
    return;
  }
  view.hidden = false;
  const stats = run.stats || {};
  document.title = `${run.name} · Training dashboard`;
  setText("run-name", run.name);
  const badge = $("run-state");
  badge.className = `badge badge-${run.state}`;
  badge.textContent = run.state;
  const created = `created ${fmtAgo(run.created_at)}`;
  setText("run-meta", `task ${run.task} · ${run.visibility} · ${created}`);
  const description = $("run-description");
  description.textContent = run.description || "";
  description.hidden = !run.description;

  setText("stat-active-peers", fmtCount(stats.active_peers ?? 0), fmtExact(stats.active_peers));
  setText("stat-volunteers", `${plural(stats.volunteers ?? 0, "volunteer", "volunteers")} joined`);
  setText("stat-samples-per-second", fmtRate(stats.samples_per_second ?? 0), String(stats.samples_per_second ?? 0));
  setText("stat-samples-credited", fmtCount(stats.samples_credited ?? 0), fmtExact(stats.samples_credited));
  setText("stat-samples-total", fmtCount(stats.samples_total ?? 0), fmtExact(stats.samples_total));
  setText("stat-loss", fmtLoss(stats.loss), stats.loss == null ? "no loss reported yet" : String(stats.loss));
  setText("stat-global-epoch", fmtCount(stats.global_epoch ?? 0), fmtExact(stats.global_epoch));
  setText("stat-data-epoch", fmtCount(stats.data_epoch ?? 0), fmtExact(stats.data_epoch));
  setText("stat-data-epochs", `of ${plural(run.data_epochs ?? 1, "pass", "passes")} over the data`);

  const done = stats.shards_done ?? 0;
  const total = stats.shards_total ?? 0;
  const percent = total > 0 ? Math.min(100, (done / total) * 100) : 0;
  setText("stat-shards", `${fmtCount(done)} / ${fmtCount(total)}`);
  const bar = $("shards-progress");
  bar.setAttribute("aria-valuenow", percent.toFixed(0));
  bar.setAttribute("aria-valuetext", `${done} of ${total} shards done`);
  bar.style.setProperty("--progress", `${percent}%`);
  setText("shards-label", `${percent.toFixed(percent > 0 && percent < 10 ? 1 : 0)}% of shards done`);

  renderCharts();
  renderBoard($("leaderboard-body"), state.leaderboard, "No volunteers have joined this run yet.");
  renderUpdated();
  renderOrganizer();
}

function renderUpdated() {
  const text = state.lastUpdate ? `updated ${fmtAgo(state.lastUpdate / 1000)}` : "";
  setText("board-updated", state.tab === "run" ? text : state.overall ? `updated ${fmtAgo(state.overall.generated_at)}` : "");
}

// ------------------------------------------------------------------------------------ charts
function renderCharts() {
  const points = state.history.get(state.selected) || [];
  const losses = points.filter((p) => p.loss != null);
  drawSparkline($("loss-chart"), losses.map((p) => [p.t, p.loss]), "Waiting for loss reports…", fmtLoss);
  drawSparkline($("sps-chart"), points.map((p) => [p.t, p.sps]), "Waiting for throughput reports…", fmtRate, 0);

  setText("loss-chart-summary", summarize(losses.map((p) => p.loss), fmtLoss, losses));
  setText("sps-chart-summary", summarize(points.map((p) => p.sps), fmtRate, points));

  const trend = $("stat-loss-trend");
  const delta = losses.length >= 2 ? losses[losses.length - 1].loss - losses[0].loss : 0;
  if (Math.abs(delta) >= 5e-4) {
    trend.textContent = `${delta < 0 ? "▼" : "▲"} ${fmtLoss(Math.abs(delta))} since you opened this page`;
    trend.dataset.trend = delta < 0 ? "down" : "up";
  } else {
    trend.textContent = "mean of the active peers";
    delete trend.dataset.trend;
  }
}

function summarize(values, format, points) {
  if (!values.length) return "no data yet";
  const min = Math.min(...values);
  const max = Math.max(...values);
  const span = (points[points.length - 1].t - points[0].t) / 1000;
  const window = span >= 60 ? `${Math.round(span / 60)} min` : `${Math.round(span)} s`;
  return `min ${format(min)} · max ${format(max)} · ${plural(values.length, "point", "points")} over ${window}`;
}

/** Draw [time, value] pairs as a line + area in an inline SVG sized to its box (crisp at any width). */
function drawSparkline(node, data, emptyText, format, floor) {
  const width = Math.max(120, Math.round(node.clientWidth || node.getBoundingClientRect().width || 300));
  const height = Math.max(60, Math.round(node.clientHeight || 140));
  node.setAttribute("viewBox", `0 0 ${width} ${height}`);
  node.dataset.points = String(data.length);
  const pad = { top: 18, right: 10, bottom: 6, left: 10 };
  const innerW = width - pad.left - pad.right;
  const innerH = height - pad.top - pad.bottom;
  const grid = [0, 0.5, 1].map((f) => svg("line", {
    class: "grid",
    x1: pad.left,
    x2: width - pad.right,
    y1: pad.top + f * innerH,
    y2: pad.top + f * innerH,
  }));
  if (!data.length) {
    const label = svg("text", { x: width / 2, y: height / 2, class: "empty", "text-anchor": "middle", "dominant-baseline": "middle" });
    label.textContent = emptyText;
    node.replaceChildren(...grid, label);
    return;
  }
  const ts = data.map((d) => d[0]);
  const vs = data.map((d) => d[1]);
  let lo = Math.min(...vs);
  let hi = Math.max(...vs);
  if (floor !== undefined) lo = Math.min(lo, floor);
  if (hi - lo < 1e-9) {
    const margin = Math.abs(hi) * 0.1 || 1;
    hi += margin;
    lo = floor !== undefined ? Math.max(floor, lo - margin) : lo - margin;
  } else {
    hi += (hi - lo) * 0.08;
  }
  const t0 = ts[0];
  const tSpan = ts[ts.length - 1] - t0;
  const x = (t) => (data.length === 1 || tSpan <= 0 ? pad.left + innerW : pad.left + ((t - t0) / tSpan) * innerW);
  const y = (v) => pad.top + (1 - (v - lo) / (hi - lo)) * innerH;
  const coords = data.map(([t, v]) => [x(t), y(v)]);
  if (coords.length === 1) coords.unshift([pad.left, coords[0][1]]);
  const line = coords.map(([cx, cy], i) => `${i ? "L" : "M"}${cx.toFixed(1)},${cy.toFixed(1)}`).join(" ");
  const first = coords[0];
  const last = coords[coords.length - 1];
  const area = `${line} L${last[0].toFixed(1)},${(pad.top + innerH).toFixed(1)} L${first[0].toFixed(1)},${(pad.top + innerH).toFixed(1)} Z`;
  const axis = [
    [hi, pad.top],
    [lo, pad.top + innerH],
  ].map(([value, gy]) => {
    const label = svg("text", { class: "axis", x: pad.left, y: gy - 4 });
    label.textContent = format(value);
    return label;
  });
  node.replaceChildren(
    ...grid,
    svg("path", { class: "area", d: area }),
    svg("path", { class: "line", d: line }),
    svg("circle", { class: "marker", cx: last[0].toFixed(1), cy: last[1].toFixed(1), r: 4 }),
    ...axis,
  );
}

// ------------------------------------------------------------------------------------ leaderboards
function renderBoard(tbody, entries, emptyText) {
  if (!entries || !entries.length) {
    tbody.replaceChildren(
      el("tr", { class: "empty-row" }, el("td", { colspan: 7, text: entries ? emptyText : "Loading…" })),
    );
    return;
  }
  const rows = entries.map((entry) => {
    const devices = Array.isArray(entry.devices) ? entry.devices.join(", ") : "";
    const status = entry.online ? "online" : "offline";
    const flagged = Number(entry.flagged) || 0;
    return el(
      "tr",
      { "data-testid": "leaderboard-row", "data-volunteer": entry.volunteer, "data-online": String(Boolean(entry.online)) },
      [
        el("td", { class: "num rank" }, el("span", { class: `rank-pill rank-${Math.min(entry.rank, 4)}`, text: entry.rank })),
        el("td", { class: "volunteer" }, [
          el("span", { class: `presence presence-${status}`, title: status }),
          el("span", { class: "visually-hidden", text: `${status}: ` }),
          el("span", { class: "volunteer-name", "data-testid": "volunteer-name", text: entry.volunteer }),
        ]),
        el("td", { class: "num", title: `${fmtExact(entry.samples)} samples` }, [
          el("span", { "data-testid": "samples", text: fmtCount(entry.samples) }),
          flagged
            ? el("span", {
                class: "flag",
                "data-testid": "flagged",
                title: `${flagged} ledger ${flagged === 1 ? "entry was" : "entries were"} capped or could not be checked`,
                text: `⚑ ${flagged}`,
              })
            : null,
        ]),
        el("td", { class: "num", title: `${fmtExact(entry.verified_samples)} verified samples`, "data-testid": "verified", text: fmtCount(entry.verified_samples) }),
        el("td", { class: "num", "data-testid": "sps", text: fmtRate(entry.samples_per_second) }),
        el("td", { class: "devices", "data-testid": "devices", title: devices, text: devices || "–" }),
        el("td", { class: "seen" }, relativeTime(entry.last_seen)),
      ],
    );
  });
  tbody.replaceChildren(...rows);
}

async function loadOverall() {
  try {
    state.overall = await api("/leaderboard");
  } catch {
    renderConnection();
    return;
  }
  renderBoard($("overall-body"), state.overall.entries, "No volunteer has contributed yet.");
  renderUpdated();
}

function setupTabs() {
  const tabs = Array.from(document.querySelectorAll('[role="tab"]'));
  const activate = (tab, focus) => {
    for (const other of tabs) {
      const selected = other === tab;
      other.setAttribute("aria-selected", String(selected));
      other.tabIndex = selected ? 0 : -1;
      $(other.getAttribute("aria-controls")).hidden = !selected;
    }
    state.tab = tab.dataset.tab;
    if (focus) tab.focus();
    if (state.tab === "overall") loadOverall();
    renderUpdated();
  };
  tabs.forEach((tab, index) => {
    tab.addEventListener("click", () => activate(tab, false));
    tab.addEventListener("keydown", (event) => {
      let next = null;
      if (event.key === "ArrowRight") next = tabs[(index + 1) % tabs.length];
      else if (event.key === "ArrowLeft") next = tabs[(index - 1 + tabs.length) % tabs.length];
      else if (event.key === "Home") next = tabs[0];
      else if (event.key === "End") next = tabs[tabs.length - 1];
      if (next) {
        event.preventDefault();
        activate(next, true);
      }
    });
  });
}

// ------------------------------------------------------------------------------------ organizer panel
function readToken() {
  try {
    return sessionStorage.getItem(TOKEN_KEY) || "";
  } catch {
    return "";
  }
}

function writeToken(value) {
  try {
    if (value) sessionStorage.setItem(TOKEN_KEY, value);
    else sessionStorage.removeItem(TOKEN_KEY);
  } catch {
    // Storage can be disabled; the token then lives only in the input field.
  }
}

function setOrganizerMessage(text, kind) {
  const node = $("organizer-message");
  node.textContent = text;
  node.dataset.kind = kind || "";
}

function renderOrganizer() {
  const run = state.run;
  const runState = run ? run.state : null;
  const usable = Boolean(run) && !state.busy;
  $("action-pause").disabled = !usable || runState !== "active";
  $("action-resume").disabled = !usable || runState !== "paused";
  $("action-finish").disabled = !usable || runState === "finished";
  setText("organizer-target", run ? `run ${run.name}` : "no run selected");
}

function confirmFinish(name) {
  const dialog = $("finish-dialog");
  $("finish-text").textContent =
    `Finishing “${name}” stops it for good: volunteers are told to stop and no new work is handed out. ` +
    "This cannot be undone.";
  if (typeof dialog.showModal !== "function") {
    return Promise.resolve(window.confirm($("finish-text").textContent));
  }
  return new Promise((resolve) => {
    dialog.returnValue = "";
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "confirm"), { once: true });
    dialog.showModal();
  });
}

const PAST = { pause: "paused", resume: "resumed", finish: "finished" };

async function runAction(action) {
  const name = state.selected;
  if (!name || !state.run || state.busy) return;
  const input = $("organizer-token");
  const token = input.value.trim();
  if (!token) {
    setOrganizerMessage("Enter the organizer token first.", "error");
    input.focus();
    return;
  }
  writeToken(token);
  if (action === "finish" && !(await confirmFinish(name))) {
    setOrganizerMessage("Not finished.", "");
    return;
  }
  state.busy = true;
  renderOrganizer();
  setOrganizerMessage(`${action[0].toUpperCase()}${action.slice(1)}…`, "pending");
  try {
    const run = await api(`${runPath(name)}/${action}`, {
      method: "POST",
      headers: { Authorization: `Bearer ${token}` },
    });
    state.busy = false;
    if (name === state.selected) applySnapshot(run, state.leaderboard);
    setOrganizerMessage(`Run ${run.name} ${PAST[action]}.`, "ok");
  } catch (error) {
    state.busy = false;
    setOrganizerMessage(error.message || "the request failed", "error");
  }
  renderOrganizer();
}

function setupOrganizer() {
  const input = $("organizer-token");
  input.value = readToken();
  input.addEventListener("input", () => writeToken(input.value.trim()));
  $("token-form").addEventListener("submit", (event) => {
    event.preventDefault();
    writeToken(input.value.trim());
    setOrganizerMessage(input.value.trim() ? "Token kept for this tab." : "", "");
  });
  $("token-forget").addEventListener("click", () => {
    input.value = "";
    writeToken("");
    setOrganizerMessage("Token forgotten.", "");
    input.focus();
  });
  for (const button of document.querySelectorAll("[data-action]")) {
    button.addEventListener("click", () => runAction(button.dataset.action));
  }
  renderOrganizer();
}

// ------------------------------------------------------------------------------------ timers and start
function tick() {
  for (const node of document.querySelectorAll("time.ago[data-ts]")) {
    const text = fmtAgo(Number(node.dataset.ts));
    if (node.textContent !== text) node.textContent = text;
  }
  renderUpdated();
  if (state.run) setText("run-meta", `task ${state.run.task} · ${state.run.visibility} · created ${fmtAgo(state.run.created_at)}`);
}

function start() {
  setupTabs();
  setupOrganizer();
  renderConnection();
  renderRun();
  window.addEventListener("hashchange", onHashChange);
  window.addEventListener("online", () => {
    renderConnection();
    if (live.run && !live.socket && !state.unknown) {
      clearTimeout(live.reconnectTimer);
      openSocket();
    }
  });
  window.addEventListener("offline", renderConnection);
  let resizeFrame = 0;
  new ResizeObserver(() => {
    cancelAnimationFrame(resizeFrame);
    resizeFrame = requestAnimationFrame(() => {
      if (state.run) renderCharts();
    });
  }).observe($("loss-chart"));
  loadRuns();
  setInterval(loadRuns, RUNS_REFRESH_MS);
  setInterval(tick, TICK_MS);
}

start();
