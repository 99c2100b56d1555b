"""The live feed: websockets that receive a run's stats and leaderboard whenever they change.

Writes mark a run dirty; one loop per app sends each subscribed run's new state at most once per
``live_interval`` (so a thousand heartbeats a second cost one query, not a thousand pushes), and only
when the payload actually changed. Runs are also re-read every few intervals so that changes made by
another process (``volunteer-coordinator runs pause`` while ``serve`` runs) reach the dashboard.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from starlette.websockets import WebSocket, WebSocketState

logger = logging.getLogger(__name__)

Snapshot = Callable[[str], dict[str, Any] | None]


class LiveHub:
    def __init__(self, *, snapshot: Snapshot, interval: float, refresh_every: int = 5):
        self._snapshot = snapshot
        self.interval = interval
        self.refresh_every = refresh_every
        self._subscribers: dict[str, set[WebSocket]] = {}
        self._last_sent: dict[str, str] = {}
        self._dirty: set[str] = set()
        self._touched: set[str] = set()
        self._lock = threading.Lock()
        self._connections: dict[str, int] = {}

    def admit(self, address: str, *, limit: int) -> bool:
        """Count a new live-feed connection from ``address``; False when it already holds ``limit``."""
        with self._lock:
            held = self._connections.get(address, 0)
            if held >= limit:
                return False
            self._connections[address] = held + 1
            return True

    def release(self, address: str) -> None:
        with self._lock:
            held = self._connections.get(address, 0) - 1
            if held > 0:
                self._connections[address] = held
            else:
                self._connections.pop(address, None)

    def mark_dirty(self, run_name: str, *, touched: bool = True) -> None:
        """Thread-safe: called from request handlers after a write that changes what a run shows.

        ``touched`` also tells the series recorder (``coordinator.monitoring.series``) that the run changed;
        the recorder itself passes False when it pushes the point it just took."""
        with self._lock:
            self._dirty.add(run_name)
            if touched:
                self._touched.add(run_name)

    def take_touched(self) -> set[str]:
        """The runs marked since the last call (for the series recorder), and forget them."""
        with self._lock:
            touched, self._touched = self._touched, set()
        return touched

    def subscriber_count(self, run_name: str) -> int:
        return len(self._subscribers.get(run_name, ()))

    async def subscribe(self, run_name: str, websocket: WebSocket) -> bool:
        """Send the current state, then keep the socket for updates. False if the run does not exist."""
        payload = await asyncio.to_thread(self._snapshot, run_name)
        if payload is None:
            return False
        text = json.dumps({"type": "snapshot", **payload})
        await websocket.send_text(text)
        self._subscribers.setdefault(run_name, set()).add(websocket)
        self._last_sent.setdefault(run_name, json.dumps(payload, sort_keys=True))
        return True

    def unsubscribe(self, run_name: str, websocket: WebSocket) -> None:
        sockets = self._subscribers.get(run_name)
        if sockets is not None:
            sockets.discard(websocket)
            if not sockets:
                self._subscribers.pop(run_name, None)
                self._last_sent.pop(run_name, None)

    async def run_forever(self) -> None:
        tick = 0
        while True:
            await asyncio.sleep(self.interval)
            tick += 1
            try:
                await self.publish(force=tick % self.refresh_every == 0)
            except Exception:  # a failed push must not end the feed for everyone
                logger.exception("live feed update failed")

    async def publish(self, *, force: bool = False) -> None:
        with self._lock:
            dirty, self._dirty = self._dirty, set()
        for run_name in list(self._subscribers):
            if not force and run_name not in dirty:
                continue
            payload = await asyncio.to_thread(self._snapshot, run_name)
            if payload is None:
                continue
            key = json.dumps(payload, sort_keys=True)
            if key == self._last_sent.get(run_name):
                continue
            self._last_sent[run_name] = key
            text = json.dumps({"type": "update", **payload})
            for websocket in list(self._subscribers.get(run_name, ())):
                try:
                    if websocket.application_state == WebSocketState.CONNECTED:
                        await websocket.send_text(text)
                except Exception:
                    self.unsubscribe(run_name, websocket)
