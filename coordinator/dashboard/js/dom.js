// DOM helpers. Every string from the API goes in with textContent / setAttribute, never innerHTML:
// volunteer names, device names and run descriptions are chosen by strangers.

import { fmtAgo, fmtDate } from "./format.js";

export const $ = (id) => document.getElementById(id);

/** Build an element. Strings in `children` become text nodes, so API data is never parsed as HTML. */
export function el(tag, props = {}, children = []) {
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

/** Set an element's text (by id or node) only when it changed, and optionally its title. */
export function setText(target, text, title) {
  const node = typeof target === "string" ? $(target) : target;
  if (!node) return;
  if (node.textContent !== text) node.textContent = text;
  if (title !== undefined) node.title = title;
}

/** A <time> that keeps saying how long ago (or how soon) it is; `tick()` refreshes them all. */
export function relativeTime(epochSeconds) {
  const node = el("time", { class: "ago", text: fmtAgo(epochSeconds) });
  if (epochSeconds != null) {
    node.dataset.ts = String(epochSeconds);
    node.dateTime = new Date(Number(epochSeconds) * 1000).toISOString();
    node.title = fmtDate(epochSeconds);
  }
  return node;
}

export function refreshTimes(root = document) {
  for (const node of root.querySelectorAll("time.ago[data-ts]")) {
    const text = fmtAgo(Number(node.dataset.ts));
    if (node.textContent !== text) node.textContent = text;
  }
}

/** A copy of `<template id=...>`'s first element. */
export function fromTemplate(id) {
  const template = $(id);
  return template.content.firstElementChild.cloneNode(true);
}

/** The element marked `data-slot="name"` inside `root`. */
export function slot(root, name) {
  return root.querySelector(`[data-slot="${name}"]`);
}

/** Fill the slots of `root` with text: `{name: text}`. */
export function fill(root, values) {
  for (const [name, value] of Object.entries(values)) {
    const node = slot(root, name);
    if (node) node.textContent = value == null ? "" : String(value);
  }
  return root;
}

export function show(node, visible) {
  node.hidden = !visible;
}

/** Copy text to the clipboard; falls back to selecting it where the Clipboard API is unavailable (plain HTTP). */
export async function copyText(text, fallbackNode) {
  try {
    await navigator.clipboard.writeText(text);
    return true;
  } catch {
    if (fallbackNode) {
      const range = document.createRange();
      range.selectNodeContents(fallbackNode);
      const selection = window.getSelection();
      selection.removeAllRanges();
      selection.addRange(range);
    }
    return false;
  }
}
