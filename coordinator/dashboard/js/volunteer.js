// A volunteer's page (organizers): who, the runs they took part in, their sessions with hardware, their
// flags, and ban / unban.

import { ApiError, api, auth } from "./api.js";
import { banVolunteer, unbanVolunteer } from "./admin.js";
import { $, fill, fromTemplate, relativeTime, setText, slot } from "./dom.js";
import { fmtAgo, fmtCount, fmtDuration } from "./format.js";
import { peerRow, peersTable } from "./peers.js";
import { DataTable } from "./tables.js";

const view = { name: null, history: null, sessions: null, flags: null, detail: null };

export function setupVolunteer() {
  view.history = new DataTable("tpl-history");
  view.sessions = peersTable();
  view.flags = new DataTable("tpl-flags");
  $("volunteer-history").append(view.history.table);
  $("volunteer-sessions").append(view.sessions.table);
  $("volunteer-flags-table").append(view.flags.table);
  $("volunteer-ban").addEventListener("click", async () => {
    if (view.name && (await banVolunteer(view.name))) loadVolunteer(view.name);
  });
  $("volunteer-unban").addEventListener("click", async () => {
    if (view.name && (await unbanVolunteer(view.name))) loadVolunteer(view.name);
  });
}

export async function loadVolunteer(name) {
  view.name = name;
  const locked = !auth.signedIn;
  $("volunteer-locked").hidden = !locked;
  $("volunteer-body").hidden = locked;
  if (locked) return;
  let detail;
  try {
    detail = await api(`/volunteers/${encodeURIComponent(name)}`);
  } catch (error) {
    if (error instanceof ApiError && error.status === 401) {
      $("volunteer-locked").hidden = false;
      $("volunteer-body").hidden = true;
    } else {
      $("volunteer-body").hidden = true;
      $("notice").textContent = error.message;
      $("notice").hidden = false;
    }
    return;
  }
  if (name !== view.name) return;
  view.detail = detail;
  document.title = `${detail.name} · Training dashboard`;
  setText("volunteer-name", detail.name);
  const status = $("volunteer-status");
  status.textContent = detail.banned ? "banned" : detail.online ? "online" : "offline";
  status.className = `badge badge-${detail.banned ? "banned" : detail.online ? "active" : "finished"}`;
  setText("volunteer-meta", `registered ${fmtAgo(detail.created_at)} · last seen ${fmtAgo(detail.last_seen)}`);
  const reason = $("volunteer-ban-reason");
  reason.hidden = !detail.banned;
  reason.textContent = detail.banned ? `Ban reason: ${detail.ban_reason || "none given"}` : "";
  $("volunteer-ban").hidden = detail.banned;
  $("volunteer-unban").hidden = !detail.banned;
  setText("volunteer-runs", fmtCount(detail.runs));
  setText("volunteer-samples", fmtCount(detail.samples));
  setText("volunteer-verified", `${fmtCount(detail.verified_samples)} confirmed by the swarm`);
  setText("volunteer-flags", fmtCount(detail.flags));
  view.history.render(detail.history, historyRow, "This volunteer has not joined a run yet.");
  view.sessions.render(detail.sessions, peerRow, "No sessions yet.");
  view.flags.render(detail.recent_flags, flagRow, "Nothing flagged: every report added up.");
}

function historyRow(part) {
  const tr = fromTemplate("tpl-history-row");
  const link = slot(tr, "run");
  link.textContent = part.run;
  link.href = `#run=${encodeURIComponent(part.run)}`;
  fill(tr, {
    state: part.run_state,
    sessions: `${part.sessions}${part.active_sessions ? ` (${part.active_sessions} online)` : ""}`,
    samples: fmtCount(part.samples),
    verified: fmtCount(part.verified_samples),
    compute: fmtDuration(part.compute_seconds),
    flags: part.flags ? fmtCount(part.flags) : "–",
  });
  slot(tr, "state").className = `badge badge-${part.run_state}`;
  slot(tr, "first").append(relativeTime(part.first_joined));
  slot(tr, "last").append(relativeTime(part.last_heartbeat));
  return tr;
}

function flagRow(flag) {
  const tr = fromTemplate("tpl-flag-row");
  fill(tr, { run: flag.run, kind: flag.kind, count: fmtCount(flag.count), detail: flag.detail });
  slot(tr, "when").append(relativeTime(flag.last_at));
  return tr;
}

export function currentVolunteer() {
  return view.name;
}
