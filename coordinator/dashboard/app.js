// The coordinator's dashboard: plain ES modules, no build step, no CDN (uPlot is vendored).
//
// This module routes between the pages (#run=NAME[&tab=gallery|peers|invites], #admin, #volunteer=NAME),
// keeps the selected run's live feed and wires the parts together:
//   js/format.js   numbers and times          js/dom.js        elements, templates (never innerHTML)
//   js/api.js      HTTP and the sign-in       js/live.js       the run's websocket state machine
//   js/charts.js   uPlot charts               js/history.js    the run's history, drawn and extended
//   js/runs.js     runs list, run overview    js/leaderboard.js, js/tables.js   tables from <template>s
//   js/peers.js    the peers table            js/invites.js    invite codes
//   js/gallery.js  checkpoints and "try it"   js/admin.js      sign-in, create a run, volunteers
//   js/volunteer.js a volunteer's page        js/dialogs.js    confirmations and status messages

import { auth, refreshSession } from "./js/api.js";
import { loadVolunteers, renderAdmin, setupAdmin } from "./js/admin.js";
import { $, refreshTimes, setText } from "./js/dom.js";
import { loadGallery, setupGallery } from "./js/gallery.js";
import { addPoint, catchUp, loadHistory, setupHistory } from "./js/history.js";
import { loadInvites, setupInvites } from "./js/invites.js";
import { LiveFeed } from "./js/live.js";
import { loadPeers, peersChanged, setupPeers } from "./js/peers.js";
import {
  loadRuns,
  refreshOverall,
  renderControls,
  renderLossTrend,
  renderMeta,
  renderRun,
  renderRuns,
  renderUpdated,
  setupRuns,
  setupTablist,
  showNotice,
} from "./js/runs.js";
import { on, state } from "./js/store.js";
import { currentVolunteer, loadVolunteer, setupVolunteer } from "./js/volunteer.js";

const RUNS_REFRESH_MS = 10_000;
const TICK_MS = 5_000;
const RUN_TABS = ["overview", "gallery", "peers", "invites"];

const live = new LiveFeed({
  onData: ({ run, leaderboard, point, resumed }) => {
    // after a reconnect, the points missed while the feed was down come in order from the API instead
    applyRun(run, leaderboard, resumed ? null : point);
    if (resumed && run) catchUp(run.name);
  },
  onUnknown: (name) => markUnknown(name),
  onState: () => renderConnection(),
});
let showRunTab = () => {};

// ------------------------------------------------------------------------------------ routing
function parseRoute() {
  const hash = location.hash.replace(/^#/, "");
  const params = new URLSearchParams(hash);
  if (params.has("admin")) return { view: "admin" };
  const volunteer = params.get("volunteer");
  if (volunteer && volunteer.trim()) return { view: "volunteer", volunteer: volunteer.trim() };
  const run = params.get("run");
  const tab = RUN_TABS.includes(params.get("tab")) ? params.get("tab") : "overview";
  return { view: "run", run: run && run.trim() ? run.trim() : null, tab };
}

function runHash(name, tab) {
  return `#run=${encodeURIComponent(name)}${tab && tab !== "overview" ? `&tab=${tab}` : ""}`;
}

function applyRoute() {
  const route = parseRoute();
  state.route = route;
  $("run-view").hidden = route.view !== "run" || !state.run;
  $("admin-view").hidden = route.view !== "admin";
  $("volunteer-view").hidden = route.view !== "volunteer";
  $("nav-runs").setAttribute("aria-current", route.view === "run" ? "page" : "false");
  $("nav-admin").setAttribute("aria-current", route.view === "admin" ? "page" : "false");
  if (route.view !== "run") showNotice("");
  if (route.view === "admin") {
    document.title = "Organizers · Training dashboard";
    renderAdmin();
  } else if (route.view === "volunteer") {
    loadVolunteer(route.volunteer);
  } else {
    const name = route.run || (state.runsLoaded ? defaultRun() : null);
    if (name) {
      if (!route.run) history.replaceState(null, "", runHash(name, route.tab));
      selectRun(name);
      const tab = organizerTab(route.tab) && !auth.signedIn ? "overview" : route.tab;
      showRunTab(tab);
    } else if (state.runsLoaded && !state.runs.length) {
      renderRun();
    }
  }
  renderRuns();
}

function organizerTab(tab) {
  return tab === "peers" || tab === "invites";
}

function defaultRun() {
  const active = state.runs.find((r) => r.state === "active");
  return (active || state.runs[0] || {}).name || null;
}

function onRunTab(tab) {
  if (state.route.view !== "run" || !state.selected) return;
  state.route.tab = tab;
  if (parseRoute().tab !== tab) history.replaceState(null, "", runHash(state.selected, tab));
  loadTab();
}

function loadTab() {
  const name = state.selected;
  if (!name || state.unknown || !state.run) return;
  const tab = state.route.tab;
  if (tab === "gallery") loadGallery(name);
  else if (tab === "peers") loadPeers(name);
  else if (tab === "invites") loadInvites(name);
}

// ------------------------------------------------------------------------------------ the selected run
function selectRun(name) {
  if (name === state.selected && live.run === name && !state.unknown) return;
  state.selected = name;
  state.unknown = false;
  state.lastUpdate = 0;
  state.leaderboard = null;
  state.run = state.runs.find((r) => r.name === name) || null;
  setText("run-message", "");
  renderRuns();
  renderRun();
  $("run-view").hidden = state.route.view !== "run" || !state.run;
  live.connect(name);
  loadedFor = null;
  if (state.run) loadRunData(name);
}

/** The selected run's history and open tab, fetched once the run is known to exist (no 404s to log). */
let loadedFor = null;

function loadRunData(name) {
  if (loadedFor === name) return;
  loadedFor = name;
  loadHistory(name).then(() => renderLossTrend());
  loadTab();
}

function applyRun(run, leaderboard, point) {
  if (!run || run.name !== state.selected) return;
  state.unknown = false;
  state.run = run;
  if (Array.isArray(leaderboard)) state.leaderboard = leaderboard;
  else if (!state.leaderboard) state.leaderboard = [];
  state.lastUpdate = Date.now();
  const index = state.runs.findIndex((r) => r.name === run.name);
  if (index >= 0) state.runs[index] = run;
  else if (state.runsLoaded) state.runs.push(run);
  if (loadedFor !== run.name) loadRunData(run.name);
  else if (point) addPoint(run.name, point);
  renderRuns();
  renderRun();
  $("run-view").hidden = state.route.view !== "run";
  if (state.route.view === "run" && state.route.tab === "peers") peersChanged(run.name);
}

function markUnknown(name) {
  if (name !== state.selected) return;
  state.unknown = true;
  state.run = null;
  state.leaderboard = null;
  if (state.route.view === "run") {
    showNotice(`No run named “${name}”. The link may be wrong or the run was removed; pick a run from the list.`);
  }
  renderRun();
  renderControls();
}

// ------------------------------------------------------------------------------------ connection and sign-in
function renderConnection() {
  const node = $("connection");
  let mode;
  let label;
  let title = "";
  const feed = live.mode;
  if (!navigator.onLine || state.apiDown) {
    mode = "offline";
    label = "Offline";
    title = "The coordinator cannot be reached; retrying.";
  } else if (feed === "connecting" || feed === "reconnecting") {
    mode = feed;
    label = feed === "connecting" ? "Connecting…" : "Reconnecting…";
    if (feed === "reconnecting") title = `The live feed is down; polling. Next attempt in ${live.nextAttemptSeconds} s.`;
  } else if (!state.runsLoaded) {
    mode = "connecting";
    label = "Connecting…";
  } else {
    mode = "live";
    label = "Live";
    title = feed === "live" ? "Receiving live updates." : "Connected to the coordinator.";
  }
  node.dataset.state = mode;
  setText("connection-label", label);
  node.title = title;
}

function renderAuth() {
  $("auth-status").hidden = !auth.signedIn;
  for (const tab of document.querySelectorAll("#run-tabs [data-organizer]")) tab.hidden = !auth.signedIn;
  if (!auth.signedIn && organizerTab(state.route.tab) && state.route.view === "run") showRunTab("overview");
  renderControls();
  if (state.route.view === "admin") renderAdmin();
  else if (state.route.view === "volunteer") loadVolunteer(state.route.volunteer);
  else loadTab();
}

async function refreshRuns() {
  const wasLoaded = state.runsLoaded;
  const ok = await loadRuns();
  if (!ok) return;
  if (state.unknown && state.runs.some((r) => r.name === state.selected)) {
    // A run that did not exist when it was asked for has been created since: subscribe now.
    const name = state.selected;
    state.selected = null;
    selectRun(name);
  }
  if (!wasLoaded || (state.route.view === "run" && !state.selected)) applyRoute();
  else renderRuns();
  if (!state.run && state.route.view === "run") renderRun();
  renderConnection();
  refreshOverall();
}

function tick() {
  refreshTimes();
  renderUpdated();
  renderMeta();
  renderConnection();
}

function start() {
  setupHistory();
  setupRuns();
  setupPeers();
  setupInvites();
  setupGallery();
  setupAdmin();
  setupVolunteer();
  showRunTab = setupTablist($("run-tabs"), onRunTab);
  on("auth", renderAuth);
  on("connection", renderConnection);
  on("runs", renderRuns);
  on("run-changed", (run) => applyRun(run, null, null));
  on("run-created", () => refreshRuns());
  on("volunteers-changed", (name) => {
    if (state.route.view === "admin") loadVolunteers();
    if (state.route.view === "volunteer" && currentVolunteer() !== name) loadVolunteer(currentVolunteer());
    if (state.route.tab === "peers" && state.selected) loadPeers(state.selected);
  });
  window.addEventListener("hashchange", applyRoute);
  window.addEventListener("online", () => {
    renderConnection();
    live.retryNow();
  });
  window.addEventListener("offline", renderConnection);
  renderConnection();
  applyRoute();
  refreshSession();
  refreshRuns();
  setInterval(refreshRuns, RUNS_REFRESH_MS);
  setInterval(tick, TICK_MS);
  setInterval(() => {
    if (state.route.view === "admin") loadVolunteers();
    else if (state.route.view === "run" && state.route.tab === "peers" && state.selected) loadPeers(state.selected);
  }, 15_000);
}

start();
