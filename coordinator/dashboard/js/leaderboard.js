// Leaderboards (a run's and all runs'): ranked by verified credit on the server, shown as they come.

import { fill, fromTemplate, relativeTime, slot } from "./dom.js";
import { fmtCount, fmtExact, fmtRate } from "./format.js";
import { DataTable } from "./tables.js";

export function leaderboardTable(testid, caption) {
  const table = new DataTable("tpl-leaderboard");
  table.table.dataset.testid = testid;
  table.table.setAttribute("data-testid", testid);
  table.table.querySelector("caption").textContent = caption;
  return table;
}

function row(entry) {
  const tr = fromTemplate("tpl-leaderboard-row");
  const status = entry.online ? "online" : "offline";
  tr.dataset.volunteer = entry.volunteer;
  tr.dataset.online = String(Boolean(entry.online));
  const rank = slot(tr, "rank");
  rank.textContent = String(entry.rank);
  rank.className = `rank-pill rank-${Math.min(entry.rank, 4)}`;
  slot(tr, "presence").className = `presence presence-${status}`;
  slot(tr, "presence").title = status;
  const devices = Array.isArray(entry.devices) ? entry.devices.join(", ") : "";
  fill(tr, {
    status: `${status}: `,
    name: entry.volunteer,
    samples: fmtCount(entry.samples),
    verified: fmtCount(entry.verified_samples),
    unverified: entry.unverified_samples ? `${fmtCount(entry.unverified_samples)} unverified` : "",
    sps: fmtRate(entry.samples_per_second),
    devices: devices || "–",
  });
  slot(tr, "samples-cell").title = `${fmtExact(entry.samples)} samples`;
  slot(tr, "verified").title = `${fmtExact(entry.verified_samples)} verified samples`;
  slot(tr, "devices").title = devices;
  const flagged = Number(entry.flagged) || 0;
  const flag = slot(tr, "flag");
  flag.hidden = !flagged;
  flag.textContent = flagged ? `⚑ ${flagged}` : "";
  flag.title = `${flagged} ledger ${flagged === 1 ? "entry was" : "entries were"} capped or could not be checked`;
  slot(tr, "seen").replaceChildren(relativeTime(entry.last_seen));
  return tr;
}

export function renderLeaderboard(table, entries, emptyText) {
  table.render(entries, row, emptyText);
}

