// One confirmation dialog for every action that changes something for others (finish a run, ban a
// volunteer, revoke an invite code, publish a checkpoint). Falls back to window.confirm without <dialog>.

import { $ } from "./dom.js";

/**
 * Ask before acting.
 * @param {object} options
 * @param {string} options.title
 * @param {string} options.text
 * @param {string} options.confirm   the confirm button's label
 * @param {boolean} [options.danger]
 * @param {string} [options.input]   a label for a free-text answer (e.g. a ban's reason)
 * @param {string} [options.value]   its initial value
 * @returns {Promise<{confirmed: boolean, value: string}>}
 */
export function confirmAction({ title, text, confirm, danger = false, input = null, value = "" }) {
  const dialog = $("confirm-dialog");
  $("confirm-title").textContent = title;
  $("confirm-text").textContent = text;
  const button = $("confirm-ok");
  button.textContent = confirm;
  button.className = danger ? "danger solid" : "primary";
  const field = $("confirm-field");
  const box = $("confirm-input");
  field.hidden = !input;
  $("confirm-input-label").textContent = input || "";
  box.value = value;
  if (typeof dialog.showModal !== "function") {
    return Promise.resolve({ confirmed: window.confirm(`${title}\n\n${text}`), value });
  }
  return new Promise((resolve) => {
    dialog.returnValue = "";
    dialog.addEventListener(
      "close",
      () => resolve({ confirmed: dialog.returnValue === "confirm", value: box.value.trim() }),
      { once: true },
    );
    dialog.showModal();
    if (input) box.focus();
  });
}

/** A short message in the page's status line (and for screen readers), e.g. "Banned ada." */
export function toast(text, kind = "ok") {
  const node = $("toast");
  node.textContent = text;
  node.dataset.kind = kind;
  node.hidden = !text;
  clearTimeout(toast.timer);
  if (text && kind !== "error") toast.timer = setTimeout(() => (node.hidden = true), 8000);
}
