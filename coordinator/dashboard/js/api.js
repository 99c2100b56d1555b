// HTTP to the coordinator, and the organizer's sign-in.
//
// The organizer token is sent once, to POST /auth/login, and never stored: the browser keeps an HttpOnly
// session cookie (SameSite=Strict) and this module keeps the sign-in's CSRF token in memory, sending it
// as X-CSRF-Token with every write. A reload asks GET /auth/session for it again.

import { emit, state } from "./store.js";

export const API = "/api/v1";
const SIGNED_OUT = new Set(["invalid_session", "session_expired", "missing_credential"]);

export const auth = { checked: false, signedIn: false, csrf: null, expiresAt: null };

export class ApiError extends Error {
  constructor(status, code, detail, fields) {
    super(detail);
    this.status = status;
    this.code = code;
    this.fields = fields || null;
  }
}

function markApi(reachable) {
  if (state.apiDown === !reachable) return;
  state.apiDown = !reachable;
  emit("connection");
}

/** fetch + JSON + the coordinator's error shape. `json` is sent as the body; writes carry the CSRF token. */
export async function request(path, { method = "GET", json, raw = false, headers = {} } = {}) {
  const options = { method, cache: "no-store", credentials: "same-origin", headers: { ...headers } };
  if (json !== undefined) {
    options.body = JSON.stringify(json);
    options.headers["Content-Type"] = "application/json";
  }
  if (method !== "GET" && auth.csrf) options.headers["X-CSRF-Token"] = auth.csrf;
  let response;
  try {
    response = await fetch(API + path, options);
  } catch {
    markApi(false);
    throw new ApiError(0, "network", "the coordinator cannot be reached");
  }
  markApi(true);
  if (response.ok && raw) return response;
  let body = null;
  try {
    body = await response.json();
  } catch {
    body = null;
  }
  if (!response.ok) {
    const detail = body && typeof body.detail === "string" ? body.detail : `${response.status} ${response.statusText}`;
    const error = new ApiError(response.status, body && body.error ? body.error : "http_error", detail, body && body.fields);
    if (response.status === 401 && SIGNED_OUT.has(error.code) && auth.signedIn) setSignedOut();
    throw error;
  }
  return body;
}

export const api = (path, options) => request(path, options);

export function runPath(name) {
  return `/runs/${encodeURIComponent(name)}`;
}

function setSignedOut() {
  auth.signedIn = false;
  auth.csrf = null;
  auth.expiresAt = null;
  emit("auth");
}

export async function refreshSession() {
  try {
    const session = await request("/auth/session");
    auth.signedIn = Boolean(session.signed_in);
    auth.csrf = session.csrf_token || null;
    auth.expiresAt = session.expires_at || null;
  } catch {
    auth.signedIn = false;
    auth.csrf = null;
  }
  auth.checked = true;
  emit("auth");
}

export async function signIn(token) {
  const session = await request("/auth/login", { method: "POST", json: { token } });
  auth.signedIn = true;
  auth.csrf = session.csrf_token;
  auth.expiresAt = session.expires_at;
  auth.checked = true;
  emit("auth");
}

export async function signOut() {
  try {
    await request("/auth/logout", { method: "POST" });
  } finally {
    setSignedOut();
  }
}
