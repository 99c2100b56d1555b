// The gallery: each checkpoint's drawings and metric (newest first), the metric over the whole run, a
// download link for checkpoints the organizers made public, and "try it", which asks the coordinator to
// draw a caption with the newest checkpoint.

import { ApiError, api, auth, request, runPath } from "./api.js";
import { SeriesChart } from "./charts.js";
import { confirmAction, toast } from "./dialogs.js";
import { $, el, fill, fromTemplate, relativeTime, slot } from "./dom.js";
import { fmtBytes, fmtCount, fmtMetric } from "./format.js";

const view = { run: null, chart: null, imageUrl: null, metricName: null, busy: false };

export function setupGallery() {
  view.chart = new SeriesChart({
    id: "gallery-metric",
    title: "Held-out metric over the run",
    lines: [{ label: "metric", color: "--chart-warm", fill: "--chart-warm-fill", dots: true }],
    format: (v) => fmtMetric(v, view.metricName),
    emptyText: "Each checkpoint adds a point: the coordinator evaluates the swarm's model every few minutes.",
    height: 190,
    range: () => (view.metricName && /accuracy|rate|fraction/.test(view.metricName) ? [0, 1] : null),
  });
  $("gallery-chart").append(view.chart.figure);
  $("try-form").addEventListener("submit", (event) => {
    event.preventDefault();
    tryIt();
  });
}

export async function loadGallery(name) {
  view.run = name;
  const [checkpoints, releases, series] = await Promise.all([
    api(`${runPath(name)}/checkpoints`).catch(() => []),
    api(`${runPath(name)}/releases`).catch(() => []),
    api(`${runPath(name)}/series`).catch(() => null),
  ]);
  if (name !== view.run) return;
  if (series) {
    view.metricName = series.metric_name;
    const title = series.metric_name ? `Held-out ${series.metric_name.replaceAll("_", " ")} over the run` : "Held-out metric over the run";
    slot(view.chart.figure, "title").textContent = title;
    view.chart.set(series.t, [series.metric]);
  }
  const published = new Map(releases.map((r) => [r.epoch, r]));
  $("gallery-empty").hidden = checkpoints.length > 0;
  $("checkpoints-count").textContent = checkpoints.length ? `${checkpoints.length} kept, newest first` : "";
  $("checkpoints").replaceChildren(...checkpoints.map((c) => card(c, published.get(c.epoch))));
}

function card(checkpoint, release) {
  const node = fromTemplate("tpl-checkpoint");
  node.dataset.epoch = String(checkpoint.epoch);
  const value = checkpoint.metric ? checkpoint.metrics[checkpoint.metric] : null;
  fill(node, {
    epoch: fmtCount(checkpoint.epoch),
    metric: checkpoint.metric ? `${checkpoint.metric.replaceAll("_", " ")} ${fmtMetric(value, checkpoint.metric)}` : "",
    samples: checkpoint.samples != null ? `after ${fmtCount(checkpoint.samples)} samples` : "",
  });
  if (checkpoint.saved_at) slot(node, "saved").append("saved ", relativeTime(checkpoint.saved_at));
  const grid = slot(node, "grid");
  if (checkpoint.samples_png) {
    grid.src = checkpoint.samples_png;
    grid.alt = `The model's drawings of the showcase prompts at epoch ${checkpoint.epoch}`;
  } else {
    grid.remove();
  }
  const prompts = slot(node, "prompts");
  for (const prompt of checkpoint.prompts || []) {
    const mark = prompt.correct === true ? "✓" : prompt.correct === false ? "✗" : "·";
    const kind = prompt.correct === true ? "ok" : prompt.correct === false ? "wrong" : "";
    prompts.append(
      el("li", { class: kind, title: prompt.error || "" }, [
        el("span", { class: "mark", "aria-hidden": "true", text: mark }),
        el("span", { class: "visually-hidden", text: prompt.correct === true ? "drawn right: " : prompt.correct === false ? "drawn wrong: " : "" }),
        prompt.text ? `${prompt.prompt} → ${prompt.text}` : prompt.prompt,
      ]),
    );
  }
  const download = slot(node, "download");
  if (release && release.download) {
    download.href = release.download;
    download.hidden = false;
    download.setAttribute("download", "");
    download.textContent = `Download (zip, ${fmtBytes(checkpoint.bytes)})`;
  }
  const publish = slot(node, "publish");
  if (auth.signedIn) {
    publish.hidden = false;
    publish.textContent = release ? "Make private…" : "Make public…";
    publish.addEventListener("click", () => togglePublic(checkpoint.epoch, !release));
  }
  return node;
}

async function togglePublic(epoch, makePublic) {
  const answer = await confirmAction({
    title: makePublic ? `Publish the checkpoint of epoch ${epoch}?` : `Take down epoch ${epoch}'s download?`,
    text: makePublic
      ? "Anyone who opens this gallery can then download the model's weights (a zip that loads with workers.export.load_model)."
      : "Its download link disappears; the checkpoint itself stays on the server.",
    confirm: makePublic ? "Publish" : "Make private",
    danger: !makePublic,
  });
  if (!answer.confirmed) return;
  try {
    await api(`${runPath(view.run)}/checkpoints/${epoch}/${makePublic ? "publish" : "unpublish"}`, { method: "POST" });
    toast(makePublic ? `Epoch ${epoch} can be downloaded by anyone.` : `Epoch ${epoch}'s download was taken down.`);
  } catch (error) {
    toast(error.message || "the request failed", "error");
  }
  loadGallery(view.run);
}

async function tryIt() {
  const input = $("try-prompt");
  const prompt = input.value.trim();
  const error = $("try-error");
  error.textContent = "";
  if (!prompt) {
    error.textContent = "Type a caption first.";
    input.focus();
    return;
  }
  if (view.busy) return;
  view.busy = true;
  const button = $("try-form").querySelector("button");
  button.disabled = true;
  button.textContent = "Drawing…";
  try {
    const response = await request(`${runPath(view.run)}/generate`, { method: "POST", json: { prompt }, raw: true });
    const type = response.headers.get("content-type") || "";
    const epoch = response.headers.get("x-checkpoint-epoch");
    const correct = response.headers.get("x-prompt-correct");
    const figure = $("try-result");
    const image = $("try-image");
    if (type.startsWith("image/")) {
      const blob = await response.blob();
      if (view.imageUrl) URL.revokeObjectURL(view.imageUrl);
      view.imageUrl = URL.createObjectURL(blob);
      image.src = view.imageUrl;
      image.alt = `The model's drawing of “${prompt}”`;
      image.hidden = false;
      const verdict = correct === "true" ? " · drawn right ✓" : correct === "false" ? " · not quite right ✗" : "";
      $("try-caption").textContent = `“${prompt}”, drawn by the checkpoint of epoch ${epoch}${verdict}`;
    } else {
      const body = await response.json();
      image.hidden = true;
      $("try-caption").textContent = `${body.prompt} → ${body.text} (epoch ${body.epoch})`;
    }
    figure.hidden = false;
  } catch (failure) {
    if (failure instanceof ApiError && failure.status === 422) error.textContent = `The task cannot read that caption: ${failure.message}`;
    else if (failure instanceof ApiError && failure.status === 429) error.textContent = `Too many drawings at once: ${failure.message}`;
    else error.textContent = failure.message || "drawing failed";
  } finally {
    view.busy = false;
    button.disabled = false;
    button.textContent = "Draw";
  }
}
