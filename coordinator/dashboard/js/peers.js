// The organizers' peers table: who trains, on what, with which assignment, how fast, holding which
// lease, how healthy. A run's peers (its Peers tab) and a volunteer's sessions (its page) share it.

import { ApiError, api, auth, runPath } from "./api.js";
import { $, el, fill, fromTemplate, relativeTime, slot } from "./dom.js";
import { fmtAgo, fmtBytes, fmtRate } from "./format.js";
import { DataTable } from "./tables.js";

const FLAG_TEXT = {
  capped: "capped",
  unverified: "unverified",
  stale: "stale",
  nan_loss: "nan loss",
  isolated: "isolated",
};
const FLAG_HELP = {
  capped: "a heartbeat or claim was cut to what the coordinator can check",
  unverified: "the swarm has not confirmed this peer's work",
  stale: "its heartbeats are overdue",
  nan_loss: "training, but without a finite loss (its model diverged)",
  isolated: "it has averaged with nobody while the swarm moved on: its work has not reached the model",
};

export function peersTable() {
  return new DataTable("tpl-peers", {
    keys: {
      volunteer: (p) => p.volunteer.toLowerCase(),
      run: (p) => p.run,
      sps: (p) => p.samples_per_second,
      heartbeat: (p) => p.last_heartbeat_at,
      flags: (p) => p.flags.length * 1000 + p.flag_count,
    },
    sort: "heartbeat",
    descending: true,
  });
}

function hardware(peer) {
  const h = peer.hardware || {};
  const cores = h.cpu_cores ? ` (${h.cpu_cores} cores${h.cpu_threads && h.cpu_threads !== h.cpu_cores ? `, ${h.cpu_threads} threads` : ""})` : "";
  const memory = h.ram_bytes ? `${fmtBytes(h.ram_bytes)} RAM` : "";
  const gpus = (h.gpus || []).map((g) => `${g.name}${g.memory_bytes ? ` ${fmtBytes(g.memory_bytes)}` : ""}`).join(", ");
  return { cpu: `${h.cpu_model || "unknown CPU"}${cores}`, memory: [memory, h.os].filter(Boolean).join(" · "), gpus: gpus ? `GPU: ${gpus}` : "no GPU" };
}

export function peerRow(peer) {
  const tr = fromTemplate("tpl-peer-row");
  tr.dataset.volunteer = peer.volunteer;
  tr.dataset.session = peer.session_id;
  tr.dataset.flags = peer.flags.join(" ");
  const presence = slot(tr, "presence");
  presence.className = `presence presence-${peer.online ? "online" : "offline"}`;
  presence.title = peer.online ? "online" : peer.state;
  const link = slot(tr, "volunteer");
  link.textContent = peer.volunteer;
  link.href = `#volunteer=${encodeURIComponent(peer.volunteer)}`;
  slot(tr, "banned").hidden = !peer.volunteer_banned;
  const hw = hardware(peer);
  const a = peer.assignment || {};
  fill(tr, {
    run: peer.run,
    key: peer.peer_key,
    state: `${peer.state} · ${peer.worker_state} · agent ${peer.agent_version}`,
    cpu: hw.cpu,
    memory: hw.memory,
    gpus: hw.gpus,
    assignment: `batch ${a.micro_batch_size ?? "?"} · ${a.threads ?? "?"} thread${a.threads === 1 ? "" : "s"}`,
    mode: `${a.device || "cpu"} · ${a.reachability || (a.client_mode ? "client" : "direct")}`,
    sps: fmtRate(peer.samples_per_second),
    cap: `cap ${fmtRate(peer.throughput_cap)}`,
  });
  const lease = slot(tr, "lease");
  if (peer.lease) {
    lease.append(
      el("span", { text: `shard ${peer.lease.shard} (${peer.lease.samples} samples)` }),
      el("span", { class: "cell-sub", text: `due ${fmtAgo(peer.lease.deadline)}${peer.leases_held > 1 ? ` · ${peer.leases_held} held` : ""}` }),
    );
  } else {
    lease.textContent = "–";
  }
  slot(tr, "heartbeat").append(relativeTime(peer.last_heartbeat_at));
  slot(tr, "token").append("token expires ", relativeTime(peer.token_expires_at));
  const flags = slot(tr, "flags");
  for (const flag of peer.flags) {
    flags.append(el("span", { class: `chip chip-${flag}`, text: FLAG_TEXT[flag] || flag, title: FLAG_HELP[flag] || "" }));
  }
  if (peer.flag_count) flags.append(el("span", { class: "cell-sub", text: `${peer.flag_count} flag${peer.flag_count === 1 ? "" : "s"} recorded` }));
  if (!peer.flags.length && !peer.flag_count) flags.append(el("span", { class: "muted", text: "–" }));
  return tr;
}

// ------------------------------------------------------------------------------------ a run's Peers tab
const view = { table: null, run: null, loadedAt: 0, timer: 0, loading: false };

export function setupPeers() {
  view.table = peersTable();
  $("peers-table").append(view.table.table);
  $("peers-ended").addEventListener("change", () => loadPeers(view.run));
}

export async function loadPeers(name) {
  view.run = name;
  const locked = !auth.signedIn;
  $("peers-locked").hidden = !locked;
  $("peers-table").hidden = locked;
  if (locked || !name) return;
  view.loading = true;
  view.loadedAt = Date.now();
  try {
    const ended = $("peers-ended").checked ? "?include_ended=true" : "";
    const rows = await api(`${runPath(name)}/peers${ended}`);
    if (name !== view.run) return;
    view.table.render(rows, peerRow, "No peer is training in this run right now.");
  } catch (error) {
    if (error instanceof ApiError && error.status === 401) {
      $("peers-locked").hidden = false;
      $("peers-table").hidden = true;
    }
  } finally {
    view.loading = false;
  }
}

/** The run changed (a live update): reload the table, at most every 2 s. */
export function peersChanged(name) {
  if (name !== view.run || !auth.signedIn) return;
  const wait = 2000 - (Date.now() - view.loadedAt);
  clearTimeout(view.timer);
  if (wait <= 0 && !view.loading) loadPeers(name);
  else view.timer = setTimeout(() => loadPeers(name), Math.max(wait, 200));
}
