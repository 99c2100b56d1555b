// The live feed of one run: WS /api/v1/runs/{name}/live sends a snapshot, then updates (run, leaderboard
// and the newest history point). While the socket is down it reconnects with jittered exponential backoff
// and polls GET /runs/{name} + /leaderboard so the page stays current.

import { API, ApiError, api, runPath } from "./api.js";

const PING_MS = 20_000;
const POLL_MS = 5_000;
const BACKOFF_BASE_MS = 1_000;
const BACKOFF_MAX_MS = 30_000;

export class LiveFeed {
  /**
   * @param {object} handlers
   * @param {(message: {run, leaderboard, point, resumed}) => void} handlers.onData  a snapshot, update or
   *   poll result; `resumed` when it is the first snapshot after the socket came back
   * @param {(name: string) => void} handlers.onUnknown  the run does not exist
   * @param {() => void} handlers.onState  the connection changed (see `mode`)
   */
  constructor({ onData, onUnknown, onState }) {
    this.onData = onData;
    this.onUnknown = onUnknown;
    this.onState = onState;
    this.socket = null;
    this.run = null;
    this.attempt = 0;
    this.received = false;
    this.reconnectTimer = 0;
    this.reconnectAt = 0;
    this.pingTimer = 0;
    this.pollTimer = 0;
    this.unknown = false;
  }

  get open() {
    return Boolean(this.socket && this.socket.readyState === WebSocket.OPEN);
  }

  /** "connecting", "live", "reconnecting" or "idle" (no run). */
  get mode() {
    if (!this.run || this.unknown) return "idle";
    if (this.open) return "live";
    return this.received || this.attempt > 0 ? "reconnecting" : "connecting";
  }

  get nextAttemptSeconds() {
    return Math.max(0, Math.round((this.reconnectAt - Date.now()) / 1000));
  }

  connect(name) {
    this.disconnect();
    this.run = name;
    this.attempt = 0;
    this.received = false;
    this.unknown = false;
    this.openSocket();
  }

  disconnect() {
    clearTimeout(this.reconnectTimer);
    this.stopPing();
    this.stopPoll();
    if (this.socket) retire(this.socket);
    this.socket = null;
    this.run = null;
  }

  /** Try again at once (the browser came back online). */
  retryNow() {
    if (this.run && !this.socket && !this.unknown) {
      clearTimeout(this.reconnectTimer);
      this.openSocket();
    }
  }

  openSocket() {
    const name = this.run;
    if (!name) return;
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    let socket;
    try {
      socket = new WebSocket(`${scheme}//${location.host}${API}${runPath(name)}/live`);
    } catch {
      this.scheduleReconnect();
      return;
    }
    this.socket = socket;
    this.onState();
    socket.addEventListener("open", () => {
      if (socket !== this.socket) return;
      this.onState();
      this.startPing(socket);
    });
    socket.addEventListener("message", (event) => {
      if (socket !== this.socket) return;
      let message;
      try {
        message = JSON.parse(event.data);
      } catch {
        return;
      }
      this.handle(name, message);
    });
    socket.addEventListener("close", (event) => {
      if (socket !== this.socket) return;
      this.socket = null;
      this.stopPing();
      if (event.code === 4404 || this.unknown) {
        this.markUnknown(name);
        return;
      }
      this.scheduleReconnect();
      this.startPoll();
    });
  }

  handle(name, message) {
    if (name !== this.run) return;
    if (message.type === "snapshot" || message.type === "update") {
      // a snapshot after a reconnect: points taken while the socket was down must be fetched
      const resumed = message.type === "snapshot" && this.received;
      this.attempt = 0;
      this.received = true;
      this.stopPoll();
      this.onData({ run: message.run, leaderboard: message.leaderboard, point: message.point || null, resumed });
      this.onState();
    } else if (message.type === "error" && message.error === "run_not_found") {
      this.markUnknown(name);
    }
  }

  markUnknown(name) {
    if (name !== this.run) return;
    this.unknown = true;
    clearTimeout(this.reconnectTimer);
    this.stopPoll();
    this.stopPing();
    this.onUnknown(name);
    this.onState();
  }

  scheduleReconnect() {
    clearTimeout(this.reconnectTimer);
    const base = Math.min(BACKOFF_MAX_MS, BACKOFF_BASE_MS * 2 ** this.attempt);
    const delay = Math.round(base * (0.8 + Math.random() * 0.4));
    this.attempt += 1;
    this.reconnectAt = Date.now() + delay;
    this.reconnectTimer = setTimeout(() => this.openSocket(), delay);
    this.onState();
  }

  startPing(socket) {
    this.stopPing();
    this.pingTimer = setInterval(() => {
      if (socket.readyState === WebSocket.OPEN) socket.send("ping");
    }, PING_MS);
  }

  stopPing() {
    clearInterval(this.pingTimer);
    this.pingTimer = 0;
  }

  startPoll() {
    if (this.pollTimer) return;
    this.pollOnce();
    this.pollTimer = setInterval(() => this.pollOnce(), POLL_MS);
  }

  stopPoll() {
    clearInterval(this.pollTimer);
    this.pollTimer = 0;
  }

  async pollOnce() {
    const name = this.run;
    if (!name) return;
    try {
      const [run, board] = await Promise.all([api(runPath(name)), api(`${runPath(name)}/leaderboard`)]);
      if (name !== this.run || this.open) return;
      this.onData({ run, leaderboard: board.entries, point: null });
    } catch (error) {
      if (error instanceof ApiError && error.status === 404 && name === this.run) this.markUnknown(name);
    }
    this.onState();
  }
}

/** Close a socket we no longer want without tripping the browser's "closed before established" error. */
function retire(socket) {
  if (socket.readyState === WebSocket.CONNECTING) {
    socket.addEventListener("open", () => socket.close(1000, "run switched"), { once: true });
  } else if (socket.readyState === WebSocket.OPEN) {
    socket.close(1000, "run switched");
  }
}
