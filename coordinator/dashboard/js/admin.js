// The organizers' page: sign in, create a run (the server's validation messages beside each field), and
// every volunteer with ban / unban.

import { ApiError, api, auth, signIn, signOut } from "./api.js";
import { confirmAction, toast } from "./dialogs.js";
import { $, fill, fromTemplate, relativeTime, setText, slot } from "./dom.js";
import { fmtCount, fmtDate, plural } from "./format.js";
import { emit } from "./store.js";
import { DataTable } from "./tables.js";

const view = { catalog: null, volunteers: null, table: null };

export function setupAdmin() {
  $("signin-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    const input = $("organizer-token");
    const token = input.value.trim();
    setText("signin-error", "");
    if (!token) {
      setText("signin-error", "Paste the organizer token first.");
      input.focus();
      return;
    }
    try {
      await signIn(token);
      input.value = "";
      toast("Signed in as an organizer.");
    } catch (error) {
      input.value = "";
      setText("signin-error", error.message || "sign-in failed");
    }
  });
  $("sign-out").addEventListener("click", async () => {
    await signOut().catch(() => null);
    toast("Signed out.");
  });
  $("create-run-form").addEventListener("submit", (event) => {
    event.preventDefault();
    createRun();
  });
  $("cr-task").addEventListener("change", () => fillTask());
  $("cr-preset").addEventListener("change", () => fillPreset());
  view.table = new DataTable("tpl-volunteers", {
    keys: {
      name: (v) => v.name.toLowerCase(),
      status: (v) => (v.banned ? 0 : v.online ? 2 : 1),
      runs: (v) => v.runs,
      samples: (v) => v.samples,
      verified: (v) => v.verified_samples,
      flags: (v) => v.flags,
      seen: (v) => v.last_seen,
    },
    sort: "name",
  });
  $("volunteers-table").append(view.table.table);
}

export function renderAdmin() {
  const signedIn = auth.signedIn;
  $("signin-panel").hidden = signedIn;
  $("signed-in-panel").hidden = !signedIn;
  $("create-run-panel").hidden = !signedIn;
  $("volunteers-panel").hidden = !signedIn;
  if (signedIn) {
    setText("signed-in-until", auth.expiresAt ? `until ${fmtDate(auth.expiresAt)}` : "");
    loadCatalog();
    loadVolunteers();
  }
}

// ------------------------------------------------------------------------------------ create a run
async function loadCatalog() {
  if (view.catalog) return;
  try {
    view.catalog = await api("/tasks");
  } catch {
    return;
  }
  const select = $("cr-task");
  select.replaceChildren(
    ...view.catalog.tasks.map((task) => {
      const option = document.createElement("option");
      option.value = task.name;
      option.textContent = task.name;
      return option;
    }),
  );
  fillTask();
  const defaults = view.catalog.optimizer_defaults;
  $("cr-update-mode").value = defaults.update_mode;
  $("cr-target-batch").value = defaults.target_batch_size;
  $("cr-matchmaking").value = defaults.matchmaking_time;
  $("cr-averaging-timeout").value = defaults.averaging_timeout;
  $("cr-compression").value = defaults.grad_compression;
  $("cr-average-every").value = defaults.average_state_every;
}

function selectedTask() {
  return (view.catalog?.tasks || []).find((t) => t.name === $("cr-task").value) || null;
}

function fillTask() {
  const task = selectedTask();
  if (!task) return;
  setText("cr-task-summary", `${task.summary} Metric: ${task.metric.replaceAll("_", " ")}.`);
  const presets = Object.keys(task.presets);
  const select = $("cr-preset");
  select.replaceChildren(
    ...presets.map((name) => {
      const option = document.createElement("option");
      option.value = name;
      option.textContent = name;
      return option;
    }),
  );
  select.disabled = presets.length === 0;
  if (task.default_preset) select.value = task.default_preset;
  fillPreset();
}

function fillPreset() {
  const task = selectedTask();
  if (!task) return;
  const preset = task.presets[$("cr-preset").value] || {};
  const fieldDefault = (name) => (name in preset ? preset[name] : (task.fields.find((f) => f.name === name) || {}).default);
  $("cr-num-shards").placeholder = String(fieldDefault("num_shards") ?? "");
  $("cr-samples-per-shard").placeholder = String(fieldDefault("samples_per_shard") ?? "");
}

function clearErrors(form) {
  for (const node of form.querySelectorAll("[data-error-for]")) node.textContent = "";
  for (const node of form.querySelectorAll("[aria-invalid]")) node.removeAttribute("aria-invalid");
  setText("create-run-error", "");
}

function numberField(id, name, errors, { integer = true } = {}) {
  const raw = $(id).value.trim();
  if (!raw) return undefined;
  const value = Number(raw);
  if (!Number.isFinite(value) || (integer && !Number.isInteger(value))) {
    errors[name] = integer ? "must be a whole number" : "must be a number";
    return undefined;
  }
  return value;
}

/** The request body from the form; problems the browser can see itself go into `errors`. */
function runRequest(errors) {
  const taskConfig = {};
  const extra = $("cr-config").value.trim();
  if (extra) {
    try {
      const parsed = JSON.parse(extra);
      if (!parsed || typeof parsed !== "object" || Array.isArray(parsed)) throw new Error("not an object");
      Object.assign(taskConfig, parsed);
    } catch {
      errors.task_config = 'must be a JSON object, e.g. {"lr": 0.001}';
    }
  }
  if ($("cr-preset").value) taskConfig.preset = $("cr-preset").value;
  const shards = numberField("cr-num-shards", "task_config.num_shards", errors);
  if (shards !== undefined) taskConfig.num_shards = shards;
  const perShard = numberField("cr-samples-per-shard", "task_config.samples_per_shard", errors);
  if (perShard !== undefined) taskConfig.samples_per_shard = perShard;
  const compression = $("cr-compression").value;
  const optimizer = { update_mode: $("cr-update-mode").value, grad_compression: compression, state_compression: compression };
  for (const [id, name, integer] of [
    ["cr-target-batch", "target_batch_size", true],
    ["cr-matchmaking", "matchmaking_time", false],
    ["cr-averaging-timeout", "averaging_timeout", false],
    ["cr-average-every", "average_state_every", true],
  ]) {
    const value = numberField(id, `optimizer.${name}`, errors, { integer });
    if (value !== undefined) optimizer[name] = value;
  }
  const body = {
    name: $("cr-name").value.trim(),
    task: $("cr-task").value,
    task_config: taskConfig,
    optimizer,
    visibility: $("cr-visibility").value,
    description: $("cr-description").value,
  };
  const epochs = numberField("cr-data-epochs", "data_epochs", errors);
  if (epochs !== undefined) body.data_epochs = epochs;
  const code = $("cr-invite-code").value.trim();
  if (code) body.invite_code = code;
  return body;
}

function showErrors(form, fields) {
  const unplaced = [];
  for (const [name, why] of Object.entries(fields)) {
    let node = form.querySelector(`[data-error-for="${CSS.escape(name)}"]`);
    let text = why;
    if (!node && name.startsWith("task_config.")) {
      node = form.querySelector('[data-error-for="task_config"]');
      text = `${name.slice("task_config.".length)}: ${why}`;
    }
    if (!node) {
      unplaced.push(`${name}: ${why}`);
      continue;
    }
    node.textContent = node.textContent ? `${node.textContent}; ${text}` : text;
    node.closest(".field")?.querySelector("input, select, textarea")?.setAttribute("aria-invalid", "true");
  }
  setText("create-run-error", unplaced.join("; "));
}

async function createRun() {
  const form = $("create-run-form");
  clearErrors(form);
  const errors = {};
  const body = runRequest(errors);
  if (!body.name) errors.name = "give the run a name (letters, digits, _ . -)";
  if (Object.keys(errors).length) {
    showErrors(form, errors);
    form.querySelector("[aria-invalid]")?.focus();
    return;
  }
  const button = form.querySelector('button[type="submit"]');
  button.disabled = true;
  try {
    const run = await api("/runs", { method: "POST", json: body });
    form.reset();
    fillTask();
    loadCatalogDefaults();
    const code = run.invite_code ? ` Its invite code, shown once: ${run.invite_code}` : "";
    toast(`Created run ${run.name}.${code}`);
    emit("run-created", run);
    location.hash = `#run=${encodeURIComponent(run.name)}`;
  } catch (error) {
    if (error instanceof ApiError && error.fields) showErrors(form, error.fields);
    else if (error instanceof ApiError && error.code === "run_exists") showErrors(form, { name: error.message });
    else setText("create-run-error", error.message || "the run could not be created");
    form.querySelector("[aria-invalid]")?.focus();
  } finally {
    button.disabled = false;
  }
}

function loadCatalogDefaults() {
  if (!view.catalog) return;
  const defaults = view.catalog.optimizer_defaults;
  $("cr-target-batch").value = defaults.target_batch_size;
  $("cr-matchmaking").value = defaults.matchmaking_time;
  $("cr-averaging-timeout").value = defaults.averaging_timeout;
  $("cr-average-every").value = defaults.average_state_every;
  $("cr-data-epochs").value = "1";
}

// ------------------------------------------------------------------------------------ volunteers
export async function loadVolunteers() {
  if (!auth.signedIn) return;
  try {
    view.volunteers = await api("/volunteers");
  } catch {
    return;
  }
  setText("volunteers-count", plural(view.volunteers.length, "volunteer", "volunteers"));
  view.table.render(view.volunteers, volunteerRow, "Nobody has registered yet.");
}

function volunteerRow(volunteer) {
  const tr = fromTemplate("tpl-volunteer-row");
  tr.dataset.volunteer = volunteer.name;
  const presence = slot(tr, "presence");
  presence.className = `presence presence-${volunteer.online ? "online" : "offline"}`;
  const link = slot(tr, "name");
  link.textContent = volunteer.name;
  link.href = `#volunteer=${encodeURIComponent(volunteer.name)}`;
  const status = volunteer.banned ? "banned" : volunteer.online ? "online" : "offline";
  fill(tr, {
    status,
    runs: fmtCount(volunteer.runs),
    samples: fmtCount(volunteer.samples),
    verified: fmtCount(volunteer.verified_samples),
    flags: volunteer.flags ? fmtCount(volunteer.flags) : "–",
  });
  slot(tr, "status").className = `badge badge-${volunteer.banned ? "banned" : volunteer.online ? "active" : "finished"}`;
  if (volunteer.banned && volunteer.ban_reason) slot(tr, "status").title = volunteer.ban_reason;
  slot(tr, "seen").append(relativeTime(volunteer.last_seen));
  const action = slot(tr, "action");
  action.textContent = volunteer.banned ? "Unban…" : "Ban…";
  action.classList.toggle("danger", !volunteer.banned);
  action.addEventListener("click", () => (volunteer.banned ? unbanVolunteer(volunteer.name) : banVolunteer(volunteer.name)));
  return tr;
}

/** Ban a volunteer after asking why; their next heartbeat is refused and they leave the leaderboards. */
export async function banVolunteer(name) {
  const answer = await confirmAction({
    title: `Ban ${name}?`,
    text: `${name}'s credential stops working at once: their next heartbeat is refused, their sessions stop, and their peer tokens are revoked in the swarm. Their credit leaves the leaderboards. You can unban them later.`,
    confirm: "Ban volunteer",
    danger: true,
    input: "Reason (kept for the organizers)",
    value: "banned by the organizers",
  });
  if (!answer.confirmed) return false;
  try {
    const out = await api(`/volunteers/${encodeURIComponent(name)}/ban`, {
      method: "POST",
      json: { reason: answer.value || "banned by the organizers" },
    });
    toast(`Banned ${out.name}: ${plural(out.sessions_revoked, "session", "sessions")} revoked.`);
  } catch (error) {
    toast(error.message || "the ban failed", "error");
    return false;
  }
  emit("volunteers-changed", name);
  return true;
}

export async function unbanVolunteer(name) {
  const answer = await confirmAction({
    title: `Unban ${name}?`,
    text: `${name}'s credential and peer keys work again; their agent rejoins on its own. Sessions stopped by the ban stay stopped.`,
    confirm: "Unban volunteer",
  });
  if (!answer.confirmed) return false;
  try {
    await api(`/volunteers/${encodeURIComponent(name)}/unban`, { method: "POST" });
    toast(`Unbanned ${name}.`);
  } catch (error) {
    toast(error.message || "the unban failed", "error");
    return false;
  }
  emit("volunteers-changed", name);
  return true;
}
