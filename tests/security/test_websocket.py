"""Junk on the live feed: binary frames, huge frames, text that is not UTF-8, chatter that is not "ping",
and too many sockets from one address. Each gets a close code or an error message, never a traceback,
and the feed keeps serving everyone else."""

from __future__ import annotations

import base64
import json
import os
import socket
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
from starlette.websockets import WebSocketDisconnect
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from coordinator.settings import LimitSettings
from tests.coordinator.conftest import Clocked, make_clocked
from tests.security.conftest import Target, lifted_limits, serve_target


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    env = lifted_limits(VOLUNTEER_COORDINATOR_LIMITS__LIVE_PER_MINUTE="1000000")
    yield from serve_target(tmp_path_factory.mktemp("websocket"), env)


def _ws_url(server: Target) -> str:
    return server.url.replace("http://", "ws://") + "/api/v1/runs/shapes/live"


def _close_code(sock: Any) -> int:
    with pytest.raises(ConnectionClosed) as closed:
        while True:
            sock.recv(timeout=10)
    assert closed.value.rcvd is not None, "the server dropped the socket without a close frame"
    return closed.value.rcvd.code


def test_binary_and_oversized_frames_are_closed_with_their_codes(server: Target) -> None:
    with connect(_ws_url(server), open_timeout=10) as sock:
        assert json.loads(sock.recv(timeout=10))["type"] == "snapshot"
        sock.send(b"\x00" * 64)
        assert _close_code(sock) == 1003  # unsupported data
    with connect(_ws_url(server), open_timeout=10, max_size=None) as sock:
        sock.recv(timeout=10)
        sock.send("x" * 200_000)
        assert _close_code(sock) == 1009  # message too big


def test_chatter_gets_errors_then_a_close_and_ping_still_works(server: Target) -> None:
    with connect(_ws_url(server), open_timeout=10) as sock:
        sock.recv(timeout=10)
        sock.send("ping")
        assert json.loads(sock.recv(timeout=10))["type"] == "pong"
        for junk in ('{"type": "subscribe", "run": "../../etc"}', "\u0000", "PING", "{" * 500):
            sock.send(junk)
            answer = json.loads(sock.recv(timeout=10))
            assert answer["type"] == "error" and answer["error"] == "unknown_message"
        for _ in range(6):
            sock.send("junk")
        assert _close_code(sock) == 1008  # policy violation after ten unknown messages


def _raw_text_frame(url: str, payload: bytes) -> tuple[int, bytes]:
    """Open a websocket by hand and send one text frame whose payload is not UTF-8 (no client library
    will). Returns the close frame's code and reason."""
    parsed = urlparse(url)
    sock = socket.create_connection((parsed.hostname, parsed.port), timeout=10)
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(
        f"GET {parsed.path} HTTP/1.1\r\nHost: {parsed.hostname}:{parsed.port}\r\nUpgrade: websocket\r\n"
        f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
    )
    handshake = b""
    while b"\r\n\r\n" not in handshake:
        handshake += sock.recv(4096)
    assert handshake.startswith(b"HTTP/1.1 101"), handshake[:200]
    pending = handshake.split(b"\r\n\r\n", 1)[1]
    mask = os.urandom(4)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    sock.sendall(bytes([0x81, 0x80 | len(payload)]) + mask + masked)
    frames = pending
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            frames += chunk
    except TimeoutError:
        pass
    finally:
        sock.close()
    position = 0
    while position + 2 <= len(frames):  # skip the snapshot, find the close frame
        opcode, length = frames[position] & 0x0F, frames[position + 1] & 0x7F
        position += 2
        if length == 126:
            (length,) = struct.unpack(">H", frames[position : position + 2])
            position += 2
        elif length == 127:
            (length,) = struct.unpack(">Q", frames[position : position + 8])
            position += 8
        body = frames[position : position + length]
        position += length
        if opcode == 0x8:
            return struct.unpack(">H", body[:2])[0], body[2:]
    raise AssertionError("no close frame came back")


def test_a_text_frame_that_is_not_utf8_is_closed_1007(server: Target) -> None:
    code, _reason = _raw_text_frame(_ws_url(server), b"\xff\xfe\xfd")
    assert code == 1007


def test_after_all_that_the_feed_serves_others_and_logged_no_traceback(server: Target) -> None:
    with connect(_ws_url(server), open_timeout=10) as sock:
        assert json.loads(sock.recv(timeout=10))["type"] == "snapshot"
        sock.send("ping")
        assert json.loads(sock.recv(timeout=10))["type"] == "pong"
    assert "Traceback" not in server.log() and "KeyError" not in server.log()


@pytest.fixture
def capped(tmp_path: Path) -> Iterator[Clocked]:
    limits = LimitSettings(live_connections_per_address=3, live_per_minute=1e6, burst=1000)
    yield from make_clocked(tmp_path, limits=limits)


def test_one_address_holds_at_most_live_connections_per_address(capped: Clocked) -> None:
    c = capped
    c.create_run()
    url = "/api/v1/runs/shapes/live"
    with c.client.websocket_connect(url) as a, c.client.websocket_connect(url) as b:
        with c.client.websocket_connect(url) as third:
            for ws in (a, b, third):
                assert ws.receive_json()["type"] == "snapshot"
            with c.client.websocket_connect(url) as fourth:
                assert fourth.receive_json()["error"] == "too_many_connections"
                with pytest.raises(WebSocketDisconnect) as closed:
                    fourth.receive_json()
                assert closed.value.code == 4429
        with c.client.websocket_connect(url) as again:  # one left: there is room again
            assert again.receive_json()["type"] == "snapshot"
