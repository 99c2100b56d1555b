"""Floods against a real ``serve`` with its default limits: whatever one caller sends, the answers are
2xx or a documented 4xx (429 with Retry-After), never a 5xx, other callers are served, and the server
stays responsive. Request loops are bounded in count; everything goes to loopback."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from coordinator.settings import LimitSettings
from tests.conftest import PROFILE, bearer, python_env, register_and_join
from tests.security.conftest import Target, serve_target

LIMITS = LimitSettings()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    # default limits, except registrations: the fixture itself registers a handful of volunteers
    env = python_env(VOLUNTEER_COORDINATOR_LIMITS__REGISTER_PER_MINUTE="600")
    yield from serve_target(tmp_path_factory.mktemp("floods"), env)


def _flood(
    count: int, call: Callable[[httpx.Client], httpx.Response], url: str, workers: int = 16
) -> tuple[Counter[int], float]:
    """``count`` calls from ``workers`` threads (one connection each). Returns the statuses and seconds."""
    statuses: Counter[int] = Counter()
    lock = threading.Lock()
    local = threading.local()
    clients: list[httpx.Client] = []
    retry_after_missing = 0

    def one(_: int) -> None:
        nonlocal retry_after_missing
        if not hasattr(local, "http"):
            local.http = httpx.Client(base_url=url, timeout=30)
            with lock:
                clients.append(local.http)
        answer = call(local.http)
        with lock:
            statuses[answer.status_code] += 1
            if answer.status_code == 429 and not answer.headers.get("retry-after", "").isdigit():
                retry_after_missing += 1

    start = time.perf_counter()
    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(one, range(count)))
    finally:
        for client in clients:
            client.close()
    assert retry_after_missing == 0
    return statuses, time.perf_counter() - start


def _allowed(per_minute: float, seconds: float, burst: int = LIMITS.burst) -> float:
    """The most a token bucket lets through in ``seconds`` (plus one for the edges)."""
    return burst + per_minute / 60.0 * seconds + 1


def _healthy(url: str) -> float:
    start = time.perf_counter()
    assert httpx.get(f"{url}/api/v1/time", timeout=10).status_code == 200
    return time.perf_counter() - start


def _new_volunteer(server: Target, name: str, tmp_path: Path) -> tuple[str, str]:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        credential, _, joined = register_and_join(http, name, tmp_path / f"{name}.rsa")
    return credential, joined.json()["session_id"]


def test_a_heartbeat_flood_from_one_volunteer_is_limited_and_harms_nobody_else(
    server: Target, tmp_path: Path
) -> None:
    credential, session = _new_volunteer(server, "flooder", tmp_path)
    body = {"state": "training", "samples_total": 0, "samples_per_second": 1.0}
    statuses, seconds = _flood(
        300,
        lambda http: http.post(
            f"/api/v1/sessions/{session}/heartbeat", json=body, headers=bearer(credential)
        ),
        server.url,
    )
    assert set(statuses) <= {200, 429}, statuses
    assert LIMITS.burst <= statuses[200] <= _allowed(LIMITS.heartbeat_per_minute, seconds), (
        statuses,
        seconds,
    )
    honest = httpx.post(
        f"{server.url}/api/v1/sessions/{server.session_id}/heartbeat", json=body, headers=bearer(server.volunteer),
        timeout=10,
    )  # fmt: skip
    assert honest.status_code == 200
    assert _healthy(server.url) < 5.0


def test_floods_of_every_limited_action_get_429s_never_5xxs(server: Target, tmp_path: Path) -> None:
    credential, session = _new_volunteer(server, "flooder2", tmp_path)
    floods: dict[str, Callable[[httpx.Client], httpx.Response]] = {
        "register": lambda http: http.post("/api/v1/volunteers", json={"name": f"s{time.perf_counter_ns()}"}),
        "lease take": lambda http: http.post(
            f"/api/v1/sessions/{session}/leases", headers=bearer(credential)
        ),
        "lease complete": lambda http: http.post(
            f"/api/v1/sessions/{session}/leases/nope/complete",
            json={"samples": 1, "compute_seconds": 1.0},
            headers=bearer(credential),
        ),
        "refresh": lambda http: http.post(
            f"/api/v1/sessions/{session}/token", json={"peer_token": "pt1.a.b.c"}, headers=bearer(credential)
        ),
        "join": lambda http: http.post(
            "/api/v1/runs/shapes/join",
            json={"profile": PROFILE, "agent_version": "t", "peer_public_key": "ssh-rsa " + "A" * 200},
            headers=bearer(credential),
        ),
        "leaderboard": lambda http: http.get("/api/v1/runs/shapes/leaderboard"),
        "run list": lambda http: http.get("/api/v1/runs"),
    }
    for action, call in floods.items():
        statuses, _seconds = _flood(120, call, server.url)
        assert statuses[429] > 0, (action, statuses)
        assert all(status < 500 for status in statuses), (action, statuses)
    assert _healthy(server.url) < 5.0
    assert "Traceback" not in server.log()


def test_many_volunteers_writing_at_once_within_their_limits_all_succeed(
    server: Target, tmp_path: Path
) -> None:
    volunteers = [_new_volunteer(server, f"crowd{i}", tmp_path) for i in range(8)]
    body = {"state": "training", "samples_total": 0, "samples_per_second": 1.0}
    barrier = threading.Barrier(len(volunteers))
    statuses: Counter[int] = Counter()
    lock = threading.Lock()

    def beat(volunteer: tuple[str, str]) -> None:
        credential, session = volunteer
        barrier.wait()
        with httpx.Client(base_url=server.url, timeout=30) as http:
            for _ in range(LIMITS.burst):
                code = http.post(
                    f"/api/v1/sessions/{session}/heartbeat", json=body, headers=bearer(credential)
                ).status_code
                with lock:
                    statuses[code] += 1

    with ThreadPoolExecutor(max_workers=len(volunteers)) as pool:
        list(pool.map(beat, volunteers))
    assert statuses == Counter({200: len(volunteers) * LIMITS.burst})


def test_a_websocket_flood_from_one_address_is_capped(server: Target) -> None:
    """Connections opened faster than ``live_per_minute`` (after a burst) are closed with 4429; the cap on
    connections held at once is tested in test_websocket.py."""
    ws_url = server.url.replace("http://", "ws://") + "/api/v1/runs/shapes/live"
    held = []
    refused = 0
    try:
        for _ in range(LIMITS.burst + 8):
            socket = connect(ws_url, open_timeout=10)
            first = str(socket.recv(timeout=10))
            if '"rate_limited"' in first or '"too_many_connections"' in first:
                with pytest.raises(ConnectionClosed) as closed:
                    socket.recv(timeout=10)
                assert closed.value.rcvd is not None and closed.value.rcvd.code == 4429
                refused += 1
                socket.close()
            else:
                assert '"snapshot"' in first
                held.append(socket)
        assert LIMITS.burst <= len(held) <= LIMITS.burst + 2 and refused >= 6, (len(held), refused)
        assert _healthy(server.url) < 5.0
    finally:
        for socket in held:
            socket.close()
