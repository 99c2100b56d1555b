// A run's invite codes (organizers): create one (shown once), see their use, revoke.

import { ApiError, api, auth, runPath } from "./api.js";
import { confirmAction, toast } from "./dialogs.js";
import { $, fill, fromTemplate, relativeTime, slot } from "./dom.js";
import { DataTable } from "./tables.js";
import { state } from "./store.js";

const view = { table: null, run: null };

export function setupInvites() {
  view.table = new DataTable("tpl-invites");
  $("invites-table").append(view.table.table);
  $("invite-form").addEventListener("submit", (event) => {
    event.preventDefault();
    createInvite();
  });
}

function clearErrors() {
  for (const node of $("invite-form").querySelectorAll("[data-error-for]")) node.textContent = "";
}

async function createInvite() {
  clearErrors();
  const label = $("invite-label").value.trim();
  const raw = $("invite-max").value.trim();
  const body = { label };
  if (raw) {
    const uses = Number(raw);
    if (!Number.isInteger(uses)) {
      $("invite-form").querySelector('[data-error-for="max_uses"]').textContent = "a whole number, or empty for no limit";
      return;
    }
    body.max_uses = uses;
  }
  try {
    const created = await api(`${runPath(view.run)}/invites`, { method: "POST", json: body });
    $("invite-code").textContent = created.code;
    $("invite-created").hidden = false;
    $("invite-label").value = "";
    $("invite-max").value = "";
    toast(`Invite code ${created.hint}… created for run ${view.run}.`);
    loadInvites(view.run);
  } catch (error) {
    showErrors(error);
  }
}

function showErrors(error) {
  const fields = (error instanceof ApiError && error.fields) || {};
  let placed = false;
  for (const [name, why] of Object.entries(fields)) {
    const node = $("invite-form").querySelector(`[data-error-for="${name}"]`);
    if (node) {
      node.textContent = why;
      placed = true;
    }
  }
  if (!placed) toast(error.message || "the request failed", "error");
}

function row(invite) {
  const tr = fromTemplate("tpl-invite-row");
  tr.dataset.invite = invite.invite_id;
  const status = invite.revoked ? "revoked" : invite.usable ? "usable" : "used up";
  fill(tr, {
    hint: invite.hint ? `${invite.hint}…` : "(the run's own code)",
    label: invite.label || "–",
    uses: invite.max_uses ? `${invite.uses} / ${invite.max_uses}` : String(invite.uses),
    status,
  });
  slot(tr, "status").className = `badge badge-${invite.revoked ? "finished" : invite.usable ? "active" : "paused"}`;
  slot(tr, "created").append(relativeTime(invite.created_at));
  slot(tr, "used").append(invite.last_used_at ? relativeTime(invite.last_used_at) : "never");
  const revoke = slot(tr, "revoke");
  revoke.hidden = invite.revoked;
  revoke.addEventListener("click", () => revokeInvite(invite));
  return tr;
}

async function revokeInvite(invite) {
  const answer = await confirmAction({
    title: "Revoke this invite code?",
    text: `Nobody new can join run “${view.run}” with ${invite.hint ? `the code ${invite.hint}…` : "the run's own code"}. Volunteers it already admitted stay.`,
    confirm: "Revoke code",
    danger: true,
  });
  if (!answer.confirmed) return;
  try {
    await api(`${runPath(view.run)}/invites/${encodeURIComponent(invite.invite_id)}/revoke`, { method: "POST" });
    toast(`Invite code ${invite.hint || "of the run"} revoked.`);
  } catch (error) {
    toast(error.message || "the request failed", "error");
  }
  loadInvites(view.run);
}

export async function loadInvites(name) {
  if (view.run !== name) $("invite-created").hidden = true;
  view.run = name;
  const locked = !auth.signedIn;
  $("invites-locked").hidden = !locked;
  $("invites-body").hidden = locked;
  if (locked || !name) return;
  $("invites-open-note").hidden = !state.run || state.run.visibility !== "open";
  try {
    const rows = await api(`${runPath(name)}/invites`);
    if (name === view.run) view.table.render(rows, row, "No invite codes yet.");
  } catch (error) {
    if (error instanceof ApiError && error.status === 401) {
      $("invites-locked").hidden = false;
      $("invites-body").hidden = true;
    }
  }
}
