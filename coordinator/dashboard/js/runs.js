// The runs list (sidebar) and a run's overview: header, organizer controls, how to join, the numbers,
// and the leaderboards.

import { ApiError, api, auth, runPath } from "./api.js";
import { confirmAction, toast } from "./dialogs.js";
import { $, copyText, el, setText } from "./dom.js";
import { fmtAgo, fmtCount, fmtExact, fmtLoss, fmtRate, plural } from "./format.js";
import { lossTrend } from "./history.js";
import { leaderboardTable, renderLeaderboard } from "./leaderboard.js";
import { emit, state } from "./store.js";

let runBoard;
let overallBoard;
let boardTab = "run";
let busy = false;

export function setupRuns() {
  runBoard = leaderboardTable("leaderboard", "Volunteers of the selected run, ranked by verified samples");
  overallBoard = leaderboardTable("overall-leaderboard", "Volunteers of all runs, ranked by verified samples");
  $("panel-board-run").append(runBoard.table);
  $("panel-board-overall").append(overallBoard.table);
  setupTablist($("board-tabs"), (tab) => {
    boardTab = tab;
    if (tab === "overall") loadOverall();
    renderUpdated();
  });
  for (const button of document.querySelectorAll("[data-run-action]")) {
    button.addEventListener("click", () => runAction(button.dataset.runAction));
  }
  for (const button of document.querySelectorAll("[data-copy]")) {
    button.addEventListener("click", async () => {
      const source = $(button.dataset.copy);
      const copied = await copyText(source.textContent, source);
      button.textContent = copied ? "Copied" : "Selected: press Ctrl+C";
      setTimeout(() => (button.textContent = "Copy"), 2500);
    });
  }
}

/** Keyboard-friendly tabs: a role=tablist whose tabs name their panels with aria-controls. */
export function setupTablist(list, onChange) {
  const tabs = Array.from(list.querySelectorAll('[role="tab"]'));
  const activate = (tab, focus) => {
    for (const other of tabs) {
      const selected = other === tab;
      other.setAttribute("aria-selected", String(selected));
      other.tabIndex = selected ? 0 : -1;
      $(other.getAttribute("aria-controls")).hidden = !selected;
    }
    if (focus) tab.focus();
    onChange(tab.dataset.tab);
  };
  tabs.forEach((tab, index) => {
    tab.addEventListener("click", () => activate(tab, false));
    tab.addEventListener("keydown", (event) => {
      const visible = tabs.filter((t) => !t.hidden);
      const at = visible.indexOf(tab);
      let next = null;
      if (event.key === "ArrowRight") next = visible[(at + 1) % visible.length];
      else if (event.key === "ArrowLeft") next = visible[(at - 1 + visible.length) % visible.length];
      else if (event.key === "Home") next = visible[0];
      else if (event.key === "End") next = visible[visible.length - 1];
      if (next) {
        event.preventDefault();
        activate(next, true);
      }
    });
    void index;
  });
  return (name) => {
    const tab = tabs.find((t) => t.dataset.tab === name);
    if (tab) activate(tab, false);
  };
}

// ------------------------------------------------------------------------------------ runs list
export async function loadRuns() {
  try {
    const runs = await api("/runs");
    state.runs = Array.isArray(runs) ? runs : [];
    state.runsLoaded = true;
  } catch {
    emit("connection");
    return false;
  }
  // The list can be staler than the live feed; the feed wins for the selected run.
  if (state.run) {
    const index = state.runs.findIndex((r) => r.name === state.run.name);
    if (index >= 0 && state.lastUpdate && Date.now() - state.lastUpdate < 10_000) state.runs[index] = state.run;
  }
  emit("runs");
  return true;
}

export function renderRuns() {
  $("runs-empty").hidden = !state.runsLoaded || state.runs.length > 0;
  setText("runs-count", state.runsLoaded ? plural(state.runs.length, "run", "runs") : "");
  const items = state.runs.map((run) => {
    const stats = run.stats || {};
    const selected = state.route.view === "run" && run.name === state.selected;
    return el(
      "li",
      {},
      el(
        "a",
        {
          class: "run-link",
          href: `#run=${encodeURIComponent(run.name)}`,
          "aria-current": selected ? "page" : null,
          "data-testid": "run-item",
          "data-run": run.name,
        },
        [
          el("span", { class: "run-link-top" }, [el("span", { class: "run-link-name", text: run.name }), stateBadge(run.state)]),
          el("span", { class: "run-link-meta" }, [
            el("span", { class: "run-link-task", text: run.task }),
            el("span", { text: plural(stats.active_peers || 0, "peer", "peers"), "data-testid": "run-item-peers" }),
            el("span", { text: `${fmtRate(stats.samples_per_second || 0)} samples/s`, "data-testid": "run-item-sps" }),
          ]),
        ],
      ),
    );
  });
  $("runs-list").replaceChildren(...items);
}

export function stateBadge(runState) {
  const known = ["active", "paused", "finished"].includes(runState) ? runState : "unknown";
  return el("span", { class: `badge badge-${known}`, text: runState || "unknown" });
}

// ------------------------------------------------------------------------------------ the run
export function showNotice(text) {
  const notice = $("notice");
  notice.textContent = text;
  notice.hidden = !text;
}

export function renderRun() {
  const run = state.run;
  const view = $("run-view");
  if (!run) {
    view.hidden = true;
    if (!state.unknown && state.runsLoaded && !state.runs.length) {
      showNotice("There is nothing to show yet: no training runs exist on this coordinator.");
    }
    return;
  }
  if (!state.unknown) showNotice("");
  view.hidden = false;
  const stats = run.stats || {};
  document.title = `${run.name} · Training dashboard`;
  setText("run-name", run.name);
  const badge = $("run-state");
  badge.className = `badge badge-${run.state}`;
  badge.textContent = run.state;
  renderMeta();
  const description = $("run-description");
  description.textContent = run.description || "";
  description.hidden = !run.description;

  setText("stat-active-peers", fmtCount(stats.active_peers ?? 0), fmtExact(stats.active_peers));
  setText("stat-volunteers", `${plural(stats.volunteers ?? 0, "volunteer", "volunteers")} joined`);
  setText("stat-samples-per-second", fmtRate(stats.samples_per_second ?? 0), String(stats.samples_per_second ?? 0));
  setText("stat-samples-credited", fmtCount(stats.samples_credited ?? 0), fmtExact(stats.samples_credited));
  setText("stat-samples-verified", `${fmtCount(stats.samples_verified ?? 0)} confirmed by the swarm`);
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
  renderLossTrend();
  renderJoin(run);
  renderLeaderboard(runBoard, state.leaderboard, "No volunteers have joined this run yet.");
  renderUpdated();
  renderControls();
}

export function renderMeta() {
  const run = state.run;
  if (run) setText("run-meta", `task ${run.task} · ${run.visibility === "invite" ? "invite-only" : "open to all"} · created ${fmtAgo(run.created_at)}`);
}

export function renderLossTrend() {
  const trend = $("stat-loss-trend");
  const change = lossTrend();
  if (change && Math.abs(change.delta) >= 5e-4) {
    trend.textContent = `${change.delta < 0 ? "▼" : "▲"} ${fmtLoss(Math.abs(change.delta))} since ${fmtAgo(change.since)}`;
    trend.dataset.trend = change.delta < 0 ? "down" : "up";
  } else {
    trend.textContent = "mean of the active peers";
    delete trend.dataset.trend;
  }
}

function renderJoin(run) {
  const origin = location.origin;
  const invite = run.visibility === "invite" ? " --invite-code YOUR-CODE" : "";
  setText("join-install", "pipx install volunteer-app");
  setText("join-command", `volunteer-app join --coordinator ${origin} --run ${run.name}${invite}`);
  $("join-invite-note").hidden = run.visibility !== "invite";
  $("join-finished-note").hidden = run.state !== "finished";
}

export function renderUpdated() {
  let text = "";
  if (boardTab === "run") text = state.lastUpdate ? `updated ${fmtAgo(state.lastUpdate / 1000)}` : "";
  else if (state.overall) text = `updated ${fmtAgo(state.overall.generated_at)}`;
  setText("board-updated", text);
}

export async function loadOverall() {
  try {
    state.overall = await api("/leaderboard");
  } catch {
    return;
  }
  renderLeaderboard(overallBoard, state.overall.entries, "No volunteer has contributed yet.");
  renderUpdated();
}

export function refreshOverall() {
  if (boardTab === "overall") loadOverall();
}

// ------------------------------------------------------------------------------------ organizer controls
export function renderControls() {
  const run = state.run;
  const signedIn = auth.signedIn;
  $("run-controls").hidden = !signedIn || !run;
  if (!run) return;
  $("action-pause").disabled = busy || run.state !== "active";
  $("action-resume").disabled = busy || run.state !== "paused";
  $("action-finish").disabled = busy || run.state === "finished";
}

function setControlMessage(text, kind) {
  const node = $("run-message");
  node.textContent = text;
  node.dataset.kind = kind || "";
}

const PAST = { pause: "paused", resume: "resumed", finish: "finished" };

async function runAction(action) {
  const name = state.selected;
  if (!name || !state.run || busy) return;
  if (action === "finish") {
    const answer = await confirmAction({
      title: "Finish this run?",
      text:
        `Finishing “${name}” stops it for good: volunteers are told to stop and no new work is handed out. ` +
        "This cannot be undone.",
      confirm: "Finish run",
      danger: true,
    });
    if (!answer.confirmed) {
      setControlMessage("Not finished.", "");
      return;
    }
  }
  busy = true;
  renderControls();
  setControlMessage(`${action[0].toUpperCase()}${action.slice(1)}…`, "pending");
  try {
    const run = await api(`${runPath(name)}/${action}`, { method: "POST" });
    setControlMessage(`Run ${run.name} ${PAST[action]}.`, "ok");
    toast(`Run ${run.name} ${PAST[action]}.`);
    emit("run-changed", run);
  } catch (error) {
    setControlMessage(error instanceof ApiError ? error.message : "the request failed", "error");
  } finally {
    busy = false;
    renderControls();
  }
}
