"""Token attacks: forged, tampered, expired, replayed, bound to another key, session or run, signed by a
stranger, revoked; and credentials forged, revoked or of the wrong kind. Each must be refused with the
documented 401/403 and a machine-readable code, and must never change anything."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from coordinator.settings import LimitSettings, TokenSettings
from tests.conftest import bearer
from tests.coordinator.conftest import Clocked, make_clocked
from volunteer_app.tokens import PeerToken, SigningKey, issue_peer_token


@pytest.fixture
def c(tmp_path: Path) -> Any:
    # refreshes are limited to a burst of 10 per credential; lifted so that every attack reaches the check
    limits = LimitSettings(refresh_per_minute=1e6, burst=1000)
    yield from make_clocked(tmp_path, tokens=TokenSettings(refresh_grace=60.0), limits=limits)


def _setup(c: Clocked) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    c.create_run()
    c.create_run("other")
    alice = c.register("alice")
    a = c.join(alice)
    a_other = c.join(alice, "other", peer_public_key=c.new_key()[1])
    return alice, a, a_other


def _refresh(c: Clocked, volunteer: Any, session_id: str, token: str) -> tuple[int, str]:
    answer = c.client.post(
        f"/api/v1/sessions/{session_id}/token", json={"peer_token": token}, headers=volunteer.headers
    )
    return answer.status_code, answer.json().get("error", "ok")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def test_forged_and_tampered_peer_tokens_are_refused(c: Clocked) -> None:
    alice, a, _ = _setup(c)
    genuine = PeerToken.decode(a["peer_token"])
    sid = a["session_id"]
    forged = PeerToken(genuine.claims_json, genuine.peer_public_key, bytes(64))
    assert _refresh(c, alice, sid, forged.encode()) == (401, "forged_token")
    longer = json.loads(genuine.claims_json)
    longer["expires_at"] += 10 * 365 * 86400  # a token that lives ten years
    tampered = PeerToken(json.dumps(longer, sort_keys=True, separators=(",", ":")).encode(),
                         genuine.peer_public_key, genuine.signature)  # fmt: skip
    assert _refresh(c, alice, sid, tampered.encode()) == (401, "forged_token")
    swapped_key = PeerToken(genuine.claims_json, c.new_key()[1].encode(), genuine.signature)
    assert _refresh(c, alice, sid, swapped_key.encode())[0] in (401, 403)
    stranger = issue_peer_token(SigningKey.generate(), run="shapes", volunteer=a["volunteer_id"], session=sid,
                                peer_public_key=alice.public_key.encode(), ttl=600)  # fmt: skip
    assert _refresh(c, alice, sid, stranger.encode()) == (401, "unknown_key")
    for junk in ("", "pt1", "pt1...", "pt1.a.b.c", "pt2." + a["peer_token"][4:], "pt1.!!!.@@@.###",
                 "pt1." + _b64(b"\xff\xfe") + ".x.y", "\u2603" * 100):  # fmt: skip
        assert _refresh(c, alice, sid, junk) == (401, "malformed_token"), junk
    too_long = c.client.post(
        f"/api/v1/sessions/{sid}/token", json={"peer_token": "x" * 9000}, headers=alice.headers
    )
    assert too_long.status_code == 422
    # none of that spent the genuine token
    assert _refresh(c, alice, sid, a["peer_token"]) == (200, "ok")


def test_expired_replayed_and_misbound_peer_tokens_are_refused(c: Clocked) -> None:
    alice, a, a_other = _setup(c)
    sid = a["session_id"]
    authority = c.client.app.state.resources.authority  # type: ignore[attr-defined]

    def signed(**overrides: Any) -> str:
        claims: dict[str, Any] = {"run": "shapes", "volunteer": a["volunteer_id"], "session": sid,
                                  "peer_public_key": alice.public_key.encode(), "ttl": 600}  # fmt: skip
        claims.update(overrides)
        return issue_peer_token(authority.signing_key, **claims).encode()

    import time

    assert _refresh(c, alice, sid, signed(ttl=10, now=time.time() - 3600)) == (401, "expired_token")
    assert _refresh(c, alice, sid, a_other["peer_token"]) == (403, "wrong_run")
    assert _refresh(c, alice, sid, signed(peer_public_key=c.new_key()[1].encode())) == (403, "wrong_key")
    bob = c.register("bob")
    b = c.join(bob)
    assert _refresh(c, alice, sid, b["peer_token"]) == (403, "wrong_key")  # bob's token, bob's key
    assert _refresh(c, bob, sid, b["peer_token"])[0] == 404  # alice's session is not bob's
    # a token that is ours, valid, for this session, but not the newest: exchanged once only
    assert _refresh(c, alice, sid, signed()) == (403, "token_superseded")
    assert _refresh(c, alice, sid, a["peer_token"]) == (200, "ok")
    assert _refresh(c, alice, sid, a["peer_token"]) == (403, "token_superseded")


def test_a_ban_revokes_the_credential_and_the_tokens(c: Clocked) -> None:
    alice, a, _ = _setup(c)
    c.client.post("/api/v1/volunteers/alice/ban", json={"reason": "test"}, headers=c.admin)
    assert _refresh(c, alice, a["session_id"], a["peer_token"]) == (403, "revoked_credential")
    assert c.heartbeat(alice, a["session_id"]).json()["error"] == "revoked_credential"


@pytest.mark.parametrize(
    ("header", "status", "code"),
    [
        (None, 401, "missing_credential"),
        ({"Authorization": "Bearer"}, 401, "missing_credential"),
        ({"Authorization": "Basic YWxpY2U6cGFzcw=="}, 401, "missing_credential"),
        ({"Authorization": "Bearer vc_forged"}, 401, "invalid_credential"),
        ({"Authorization": "Bearer " + "A" * 4000}, 401, "invalid_credential"),
        ({"Authorization": "Bearer ' OR 1=1 --"}, 401, "invalid_credential"),
    ],
)
def test_volunteer_endpoints_refuse_missing_and_forged_credentials(
    c: Clocked, header: dict[str, str] | None, status: int, code: str
) -> None:
    _, a, _ = _setup(c)
    answer = c.client.post(
        f"/api/v1/sessions/{a['session_id']}/heartbeat",
        json={"state": "training", "samples_total": 0, "samples_per_second": 1.0},
        headers=header or {},
    )
    assert (answer.status_code, answer.json()["error"]) == (status, code)


def test_the_organizer_token_is_no_volunteer_credential(c: Clocked) -> None:
    _setup(c)
    answer = c.client.post("/api/v1/runs/shapes/join", json={}, headers=c.admin)
    assert (answer.status_code, answer.json()["error"]) == (403, "volunteer_only")
    answer = c.client.post("/api/v1/volunteers/x/ban", json={}, headers=bearer("org_" + "x" * 43))
    assert (answer.status_code, answer.json()["error"]) == (401, "invalid_credential")
