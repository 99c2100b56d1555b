"""Attacks on the dashboard's sign-in: the organizer token traded for a session cookie must not open a new
door. Forged, replayed, expired and logged-out cookies, cookies after the organizer token was rotated,
writes without the CSRF token or from another site, a volunteer credential at the sign-in, sign-in CSRF,
and guessing the token (the sign-in is rate-limited). Every organizer endpoint is taken from the served
OpenAPI document, as in ``test_organizer_endpoints``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from coordinator.accounts import logins
from tests.conftest import bearer
from tests.coordinator.conftest import Clocked, make_clocked
from tests.security.test_organizer_endpoints import organizer_operations

SAFE = {"GET", "HEAD", "OPTIONS"}


@pytest.fixture
def c(tmp_path: Path) -> Any:
    yield from make_clocked(tmp_path)


def sign_in(c: Clocked) -> str:
    """Sign the test client in; returns the CSRF token (the cookie stays in the client)."""
    answer = c.client.post("/api/v1/auth/login", json={"token": c.admin_token})
    assert answer.status_code == 200, answer.text
    return str(answer.json()["csrf_token"])


def state_of(c: Clocked) -> tuple[Any, Any]:
    runs = [(r["name"], r["state"]) for r in c.client.get("/api/v1/runs").json()]
    people = [(v["name"], v["banned"]) for v in c.client.get("/api/v1/volunteers", headers=c.admin).json()]
    return runs, people


def test_the_cookie_is_httponly_samesite_strict_and_secure_over_tls(c: Clocked) -> None:
    answer = c.client.post("/api/v1/auth/login", json={"token": c.admin_token})
    cookie = answer.headers["set-cookie"]
    assert cookie.startswith(f"{logins.COOKIE}=") and c.admin_token not in cookie
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/" in cookie
    assert "Secure" not in cookie  # plain HTTP (loopback): a Secure cookie would never come back
    assert answer.headers["cache-control"] == "no-store"
    # over TLS (or behind a trusted TLS proxy) the cookie is Secure and __Host- prefixed
    c.client.base_url = c.client.base_url.copy_with(scheme="https")
    secure = c.client.post("/api/v1/auth/login", json={"token": c.admin_token})
    cookie = secure.headers["set-cookie"]
    assert cookie.startswith(f"{logins.SECURE_COOKIE}=") and "Secure" in cookie and "HttpOnly" in cookie
    assert "strict-transport-security" in {k.lower() for k in secure.headers}


def test_a_volunteer_credential_or_a_wrong_token_never_signs_in(c: Clocked) -> None:
    c.create_run()
    alice = c.register("alice")
    for token, status, code in (
        (alice.credential, 403, "organizer_only"),
        ("org_guess", 401, "invalid_credential"),
        (c.admin_token + "x", 401, "invalid_credential"),
    ):
        answer = c.client.post("/api/v1/auth/login", json={"token": token})
        assert (answer.status_code, answer.json()["error"]) == (status, code)
        assert "set-cookie" not in answer.headers
    assert c.client.get("/api/v1/auth/session").json() == {
        "signed_in": False,
        "csrf_token": None,
        "expires_at": None,
    }
    # a volunteer's credential used as the cookie itself opens nothing either
    c.client.cookies.set(logins.COOKIE, alice.credential)
    answer = c.client.get("/api/v1/runs/shapes/peers")
    assert (answer.status_code, answer.json()["error"]) == (401, "invalid_session")


def test_every_organizer_endpoint_refuses_forged_cookies_and_cookie_writes_without_csrf(c: Clocked) -> None:
    c.create_run()
    alice = c.register("alice")
    c.join(alice)
    operations = organizer_operations(c)
    assert len(operations) >= 15, operations
    before = state_of(c)
    # a cookie the coordinator never issued
    c.client.cookies.set(logins.COOKIE, "forged-" + "A" * 43)
    for method, path in operations:
        answer = c.client.request(method, path, json={})
        assert (answer.status_code, answer.json()["error"]) == (401, "invalid_session"), (method, path)
    c.client.cookies.clear()
    csrf = sign_in(c)
    host = "http://testserver"
    for method, path in operations:
        if method in SAFE:
            continue
        attempts: list[tuple[dict[str, str], str]] = [
            ({}, "csrf_failed"),
            ({"X-CSRF-Token": "0" * 64}, "csrf_failed"),
            ({"X-CSRF-Token": csrf, "Origin": "https://evil.example"}, "cross_site_request"),
            ({"X-CSRF-Token": csrf, "Origin": "http://testserver:8080"}, "cross_site_request"),
            ({"X-CSRF-Token": csrf, "Origin": "null"}, "cross_site_request"),
            ({"X-CSRF-Token": csrf, "Origin": host, "Sec-Fetch-Site": "cross-site"}, "cross_site_request"),
            ({"X-CSRF-Token": csrf, "Origin": host, "Sec-Fetch-Site": "same-site"}, "cross_site_request"),
        ]
        for headers, code in attempts:
            answer = c.client.request(method, path, json={}, headers=headers)
            assert (answer.status_code, answer.json()["error"]) == (403, code), (method, path, headers)
    assert state_of(c) == before  # nothing was paused, finished, created or banned
    # with its CSRF token, from its own origin, the cookie does what the organizer token does
    paused = c.client.post("/api/v1/runs/shapes/pause", headers={"X-CSRF-Token": csrf, "Origin": host})
    assert paused.status_code == 200 and paused.json()["state"] == "paused"
    # and reads need no CSRF token
    assert c.client.get("/api/v1/runs/shapes/peers").status_code == 200


def test_a_csrf_token_belongs_to_its_own_sign_in(c: Clocked) -> None:
    c.create_run()
    first = sign_in(c)
    first_cookie = c.client.cookies.get(logins.COOKIE)
    c.client.cookies.clear()
    second = sign_in(c)
    assert first != second
    refused = c.client.post("/api/v1/runs/shapes/pause", headers={"X-CSRF-Token": first})
    assert (refused.status_code, refused.json()["error"]) == (403, "csrf_failed")
    c.client.cookies.clear()
    c.client.cookies.set(logins.COOKIE, str(first_cookie))
    assert c.client.post("/api/v1/runs/shapes/pause", headers={"X-CSRF-Token": first}).status_code == 200


def test_logged_out_expired_idle_and_rotated_sign_ins_are_refused(c: Clocked) -> None:
    c.create_run()

    def refused(code: str) -> None:
        answer = c.client.get("/api/v1/runs/shapes/peers")
        assert (answer.status_code, answer.json()["error"]) == (401, code)
        assert c.client.get("/api/v1/auth/session").json()["signed_in"] is False

    # logged out: the same cookie, replayed, is dead
    csrf = sign_in(c)
    cookie = str(c.client.cookies.get(logins.COOKIE))
    out = c.client.post("/api/v1/auth/logout", headers={"X-CSRF-Token": csrf})
    assert out.status_code == 200 and out.json()["signed_in"] is False
    c.client.cookies.set(logins.COOKIE, cookie)
    refused("session_expired")
    # logging out needs the CSRF token too (no cross-site sign-out)
    c.client.cookies.clear()
    csrf = sign_in(c)
    assert c.client.post("/api/v1/auth/logout").status_code == 403
    assert c.client.get("/api/v1/runs/shapes/peers").status_code == 200
    # idle for longer than the idle timeout
    c.clock.advance(c.settings.dashboard.session_idle_timeout + 1)
    refused("session_expired")
    # used now and then, but past its lifetime
    c.client.cookies.clear()
    sign_in(c)
    for _ in range(int(c.settings.dashboard.session_ttl // 3000) + 1):
        c.clock.advance(3000)
        if c.client.get("/api/v1/runs/shapes/peers").status_code != 200:
            break
    refused("session_expired")
    # rotating the organizer token signs every browser out
    c.client.cookies.clear()
    sign_in(c)
    assert c.client.get("/api/v1/runs/shapes/peers").status_code == 200
    from coordinator.bootstrap import open_data_dir

    open_data_dir(c.settings, rotate_admin_token=True).store.close()
    refused("session_expired")


def test_sign_in_from_another_site_is_refused(c: Clocked) -> None:
    for headers in ({"Origin": "https://evil.example"}, {"Sec-Fetch-Site": "cross-site"}):
        answer = c.client.post("/api/v1/auth/login", json={"token": c.admin_token}, headers=headers)
        assert (answer.status_code, answer.json()["error"]) == (403, "cross_site_request")
        assert "set-cookie" not in answer.headers
    # the API never answers cross-origin reads, so another site cannot read the CSRF token
    sign_in(c)
    answer = c.client.get("/api/v1/auth/session", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in {k.lower() for k in answer.headers}
    preflight = c.client.options(
        "/api/v1/runs/shapes/pause",
        headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert preflight.status_code >= 400 and "access-control-allow-origin" not in preflight.headers


def test_guessing_the_organizer_token_is_rate_limited(c: Clocked) -> None:
    answers = [c.client.post("/api/v1/auth/login", json={"token": f"org_guess{i}"}) for i in range(12)]
    statuses = [a.status_code for a in answers]
    assert statuses[:5] == [401] * 5  # the burst
    limited = [a for a in answers if a.status_code == 429]
    assert len(limited) >= 6, statuses
    assert int(limited[0].headers["retry-after"]) >= 1
    # while limited, even the right token gets no answer about itself
    right = c.client.post("/api/v1/auth/login", json={"token": c.admin_token})
    assert right.status_code == 429 and "set-cookie" not in right.headers
    metrics = c.client.get("/metrics").text
    assert re.search(
        r'volunteer_coordinator_rate_limited_requests_total\{action="login"\} ([0-9.]+)', metrics
    )
    refused = re.search(
        r'volunteer_coordinator_auth_failures_total\{reason="invalid_credential"\} ([0-9.]+)', metrics
    )
    assert refused is not None and float(refused.group(1)) >= 5


def test_the_bearer_token_still_works_and_needs_no_csrf(c: Clocked) -> None:
    """Scripts keep using the organizer token; browsers never attach it by themselves, so it needs no CSRF
    token, and a bearer header beats a cookie (a forged cookie beside a good token is ignored)."""
    c.create_run()
    c.client.cookies.set(logins.COOKIE, "forged")
    answer = c.client.post("/api/v1/runs/shapes/pause", headers={**c.admin, "Origin": "https://evil.example"})
    assert answer.status_code == 200
    answer = c.client.post("/api/v1/runs/shapes/resume", headers=bearer("org_wrong"))
    assert (answer.status_code, answer.json()["error"]) == (401, "invalid_credential")
