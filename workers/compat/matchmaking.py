"""The pace of matchmaking's DHT reads and of the state-download records, installed process-wide
(:func:`workers.compat.install`).

Mirrors ``hivemind/averaging/key_manager.py`` and ``DecentralizedAverager._declare_for_download_periodically``
of ``hivemind/averaging/averager.py``. :func:`install_calm_matchmaking` replaces, on the classes (so in this
process and in the averager processes it forks afterwards):

* ``GroupKeyManager.get_averagers`` by a wrapper that waits until ``_va_query_interval`` has passed since this
  manager's previous read, then calls upstream's;
* ``DecentralizedAverager._declare_for_download_periodically`` by a re-written copy of hivemind 1.1.12's loop.
  What differs, for a diff against upstream: ``self._state_updated`` is cleared before the store instead of
  after it, the loop sleeps ``_va_declare_interval`` after each store, and each store's task is referenced
  until it is done (upstream drops it). The key, the value, the expiration and which changes lead to a record
  are upstream's.

:func:`matchmaking_query_interval` derives the pace of reads from the matchmaking time; the averager's process
applies it when the matchmaking time changes
(:meth:`workers.compat.state_averager.GuardedStateAverager.set_matchmaking_time`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from hivemind.averaging.averager import DecentralizedAverager

from workers.compat.version import require

MATCHMAKING_QUERY_INTERVAL = 0.5
"""Seconds at least between two reads of an averaging group's key by one averager while it looks for a
group. hivemind reads it again as soon as the previous read ends whenever no leader is in view, which
in a 2-peer ``volunteer-app demo`` was 10-60 signed DHT requests a second for as long as a partner was
late (one peer made 8,015 in 2 minutes), each answered by the other peers' DHTs too: the workers' DHT and
averager processes took 0.34 of the 2 cores and p2pd 0.17 (0.06 and 0.03 with this pacing and the state
record's; ``tests/perf/bench_demo.py``). Half a second still finds a partner well within the runs'
``matchmaking_time`` of several seconds. A shorter ``matchmaking_time`` reads proportionally more often
(:func:`matchmaking_query_interval`)."""

STATE_DECLARE_INTERVAL = 2.0
"""Seconds at least between two records of this averager's state-download priority. hivemind stores the
record again whenever its state changes, and an averaging round marks the state changed once per tensor,
so each round sent dozens of signed DHT stores in a burst; the priority is the local epoch, which a
record every few seconds keeps current."""


def matchmaking_query_interval(matchmaking_time: float) -> float:
    """Seconds between two reads of a group's key for averagers whose ``matchmaking_time`` is this.

    An averager declares itself a leader for ``matchmaking_time`` and others see it only if they read the
    key within that window. Two peers that look for a group at the same moment both find none at first, and
    with reads ``matchmaking_time`` apart each later read came after the other's declaration had expired:
    with 0.5 s of matchmaking, rounds of a demo took 2-3.5 s to match, longer than an epoch, and 15 of 116
    epochs went without a round. A quarter of the window gives every declaration three reads."""
    return min(MATCHMAKING_QUERY_INTERVAL, max(0.02, matchmaking_time / 4))


def install_calm_matchmaking(
    *, query_interval: float = MATCHMAKING_QUERY_INTERVAL, declare_interval: float = STATE_DECLARE_INTERVAL
) -> None:
    """Pace the averagers' DHT traffic of this process and of the averager processes it starts later:
    ``GroupKeyManager.get_averagers`` waits until ``query_interval`` has passed since its previous read,
    and ``DecentralizedAverager._declare_for_download_periodically`` waits ``declare_interval`` after each
    record before it stores a newer one (the latest priority is always the one stored). Installed once;
    a later call sets the intervals for averager processes started after it."""
    from hivemind.averaging import key_manager
    from hivemind.utils.timed_storage import get_dht_time

    require(key_manager.GroupKeyManager, "get_averagers", "current_key")
    require(
        DecentralizedAverager,
        "_declare_for_download_periodically",
        "_trigger_declare_load_state",
        "allow_state_sharing",
        "state_sharing_priority",
    )
    manager_class = key_manager.GroupKeyManager
    manager_class._va_query_interval = query_interval
    DecentralizedAverager._va_declare_interval = declare_interval
    if getattr(manager_class, "_va_calm", False):
        return
    original_get_averagers = manager_class.get_averagers

    async def get_averagers(self: Any, group_key: str, only_active: bool) -> Any:
        wait = getattr(self, "_va_last_query", float("-inf")) + self._va_query_interval - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        self._va_last_query = time.monotonic()
        return await original_get_averagers(self, group_key, only_active)

    async def declare_for_download_periodically(self: Any) -> None:
        # hivemind 1.1.12's loop, with a pause of declare_interval after each record
        download_key = f"{self._matchmaking.group_key_manager.prefix}.all_averagers"
        sharing_was_allowed = self.allow_state_sharing
        stores: set[asyncio.Task[Any]] = set()  # referenced until done, so that none is collected early
        while True:
            expiration_time = get_dht_time() + self.declare_state_period
            self._state_updated.clear()  # a change from now on is stored after the pause
            if self.allow_state_sharing or sharing_was_allowed:
                task = asyncio.create_task(
                    asyncio.wait_for(
                        self.dht.store(
                            download_key,
                            subkey=self.peer_id.to_bytes(),
                            value=self.state_sharing_priority if self.allow_state_sharing else None,
                            expiration_time=expiration_time,
                            return_future=True,
                        ),
                        timeout=expiration_time - get_dht_time(),
                    )
                )
                stores.add(task)
                task.add_done_callback(stores.discard)
                sharing_was_allowed = self.allow_state_sharing
            await asyncio.sleep(self._va_declare_interval)
            try:
                remaining = max(0.0, expiration_time - get_dht_time())
                await asyncio.wait_for(self._state_updated.wait(), timeout=remaining)
            except asyncio.TimeoutError:
                pass

    manager_class.get_averagers = get_averagers
    DecentralizedAverager._declare_for_download_periodically = declare_for_download_periodically
    manager_class._va_calm = True
